// Internal to src/checkpoint: Megatron-Core GPTModel parameter names (Transformer Engine layer
// spec, as Megatron-FSDP's fsdp_dtensor checkpoints and converted torch_dist checkpoints hold
// them) read as the Llama names of mfsdp's model (transformers' names, include/mfsdp/models/llama.h):
//
//   embedding.word_embeddings.weight                    model.embed_tokens.weight
//   decoder.layers.<i>.self_attention.linear_qkv.layer_norm_weight   model.layers.<i>.input_layernorm.weight
//   decoder.layers.<i>.self_attention.linear_qkv.weight (and .bias)   q_proj, k_proj, v_proj: for each
//       query group g the fused rows are [g's q heads; g's k head; g's v head]
//   decoder.layers.<i>.self_attention.linear_proj.weight             o_proj.weight
//   decoder.layers.<i>.mlp.linear_fc1.layer_norm_weight             post_attention_layernorm.weight
//   decoder.layers.<i>.mlp.linear_fc1.weight_w / _v                  gate_proj.weight / up_proj.weight
//       (unsplit linear_fc1.weight: the first half of its rows is gate, the second up)
//   decoder.layers.<i>.mlp.linear_fc2.weight                         down_proj.weight
//   decoder.final_layernorm.weight                      model.norm.weight
//   output_layer.weight                                 lm_head.weight
//
// Nothing is copied: each Llama tensor is a RowSource over the stored tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/dcp_checkpoint.h"

namespace mfsdp::checkpoint {

struct MappedTensor {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  RowSource source;
};

// True when some "model.<fqn>" of `tensors` is a Megatron GPT name.
bool has_megatron_gpt_names(const std::map<std::string, MappedTensor>& tensors);

// Renames (and splits) every "model.<fqn>" and "optimizer.state.<fqn>.<key>" whose fqn is a
// Megatron GPT name; other entries stay. `heads` (query heads and key/value groups) split
// linear_qkv; without them linear_qkv keeps its name (a Llama then misses q/k/v_proj, named).
// Throws std::invalid_argument naming the tensor whose shape does not fit them.
std::map<std::string, MappedTensor> megatron_gpt_to_llama(const std::map<std::string, MappedTensor>& tensors,
                                                          std::optional<std::pair<int64_t, int64_t>> heads);

}  // namespace mfsdp::checkpoint
