// Hugging Face config.json <-> LlamaConfig (docs/checkpoints.md, HF interop). Tensor names need
// no mapping: LlamaForCausalLM's parameters already carry transformers' names (llama.h).
//
//   nlohmann::json cfg = mfsdp::llama_hf_config(model_cfg, at::kBFloat16);   // config.json
//   mfsdp::LlamaConfig back = mfsdp::llama_config_from_hf(cfg);
#pragma once

#include <c10/core/ScalarType.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mfsdp/llama.h"

namespace mfsdp {

// A config.json that transformers loads as LlamaForCausalLM: architectures, model_type "llama",
// the sizes, rope_theta, rms_norm_eps, initializer_range, tie_word_embeddings, hidden_act "silu",
// head_dim, attention_bias/mlp_bias false, rope_scaling null, torch_dtype ("float32", "bfloat16"
// or "float16"; anything else throws std::invalid_argument). No bos/eos token ids: the model has
// no tokenizer attached. Validates `cfg` first (LlamaConfig::validate).
nlohmann::json llama_hf_config(const LlamaConfig& cfg, at::ScalarType torch_dtype);

// Reads a transformers config.json. Accepted model_type values:
//   "llama";
//   "mistral" only without a sliding window (sliding_window null/absent);
//   "qwen2" only without sliding window (use_sliding_window false/absent). Qwen2 models have
//     q/k/v biases, which this model does not: the caller must check the weights with
//     hf_bias_tensors() and reject the folder if any are present (a Qwen2-shaped checkpoint
//     without bias tensors is accepted).
// Required: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
// max_position_embeddings. Optional with transformers' defaults: num_key_value_heads
// (= num_attention_heads), rope_theta (10000), rms_norm_eps (1e-6), initializer_range (0.02),
// tie_word_embeddings (false). Rejected: hidden_act other than "silu", rope_scaling other than
// null, attention_bias or mlp_bias true, head_dim != hidden_size / num_attention_heads.
// Errors are std::invalid_argument naming the missing or invalid field; the result is validated.
LlamaConfig llama_config_from_hf(const nlohmann::json& config);

// The names among `tensor_names` that are bias tensors ("...bias"), which LlamaForCausalLM
// cannot hold; an importer throws if this is not empty.
std::vector<std::string> hf_bias_tensors(const std::vector<std::string>& tensor_names);

}  // namespace mfsdp
