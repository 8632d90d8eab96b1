// Internal to src/checkpoint: Megatron-Core GPT parameter names (Transformer Engine layer spec,
// as Megatron-FSDP's fsdp_dtensor checkpoints and converted torch_dist checkpoints hold them)
// read as the names of a model family's parameters. The family says which rows of which
// Megatron tensor make each of its parameters (ModelSpec::from_megatron_name; the Llama
// family's table: src/models/llama/llama_spec.cpp); this file applies that to stored tensors.
// Nothing is copied: each parameter is a RowSource over the stored tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/dcp_checkpoint.h"
#include "mfsdp/models/model_spec.h"

namespace mfsdp::checkpoint {

struct MappedTensor {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  RowSource source;
};

// True when some "model.<fqn>" of `tensors` is a Megatron GPT name.
bool has_megatron_gpt_names(const std::map<std::string, MappedTensor>& tensors);

// Renames (and splits) every "model.<fqn>" and "optimizer.state.<fqn>.<key>" whose fqn is one of
// `spec`'s Megatron names; other entries stay. `config` (null when the checkpoint describes no
// model) gives what splitting needs: without it a fused linear_qkv keeps its name (a model then
// misses q/k/v_proj, named). Throws std::invalid_argument naming the tensor whose rows do not
// split as the config says.
std::map<std::string, MappedTensor> megatron_gpt_to_model(const std::map<std::string, MappedTensor>& tensors,
                                                          const ModelSpec& spec, const ModelConfig* config);

}  // namespace mfsdp::checkpoint
