// load_model: an unsharded model for inference (mfsdp-generate, GRPO's rollouts, --hf-load)
// from a sharded checkpoint of any world size or a Hugging Face folder of a registered model family.
#pragma once

#include <string>

#include <memory>

#include "mfsdp/models/model_spec.h"

namespace mfsdp {

struct LoadedModel {
  std::shared_ptr<CausalLM> model;  // fp32, on CPU
  ModelConfig config;               // its family and configuration
  std::string tokenizer_type;       // "" when the source does not say (HF folders, imports)
};

// What mfsdp-generate --model accepts:
//   a sharded checkpoint (locate_checkpoint, checkpoint.h: a save folder, read at its latest
//     iteration, or an iteration folder of either format, a bare PyTorch dcp.save folder
//     included): its metadata's model_config (or `model_config_file`) and its "model." tensors; the
//     tokenizer is the checkpoint's "--tokenizer-type" argument, if any;
//   a Hugging Face folder (is_hf_folder: config.json + model.safetensors or an
//     index with shards), as import_hf accepts it: "rotary_emb.inv_freq" buffers are ignored, a
//     tied model's "lm_head.weight" must equal the embedding, tensors the family may leave out are
//     reconciled with its config (ModelSpec::with_hf_tensors: Qwen2's q/k/v biases, all or none).
// Tensors are read through TensorSource (tensor_source.h) and cast to fp32; the set of tensors is
// checked with check_model_tensors (hf_interop.h) before any is read. Errors
// (std::invalid_argument) name `path` and what was wrong: not one of these, a config that no
// model family reads, missing / unexpected / misshapen / non-floating-point tensors.
// `model_config_file`: the model as a Hugging Face config.json, for a checkpoint that records no
// model_config (PyTorch's dcp.save; checkpoint_model_config in tensor_source.h).
LoadedModel load_model(const std::string& path, const std::string& model_config_file = "");

}  // namespace mfsdp
