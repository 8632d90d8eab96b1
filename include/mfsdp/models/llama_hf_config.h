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

#include "mfsdp/models/llama.h"
#include "mfsdp/models/model_spec.h"

namespace mfsdp {

// A config.json that transformers loads as LlamaForCausalLM, or as Qwen2ForCausalLM when
// cfg.attention_bias (q/k/v biases): architectures, model_type "llama" / "qwen2", the sizes,
// rope_theta, rms_norm_eps, initializer_range, tie_word_embeddings, hidden_act "silu", head_dim,
// (for a model without cfg.swiglu: hidden_act "gelu" and gated_mlp false, a checkpoint's
// model_config only: hf_refusal refuses it for an HF folder),
// attention_bias, rope_scaling null, torch_dtype ("float32", "bfloat16" or "float16"; anything
// else throws std::invalid_argument); Llama: mlp_bias false; Qwen2: use_sliding_window false,
// sliding_window null, max_window_layers. No bos/eos token ids: the model has no tokenizer
// attached. Validates `cfg` first (LlamaConfig::validate).
nlohmann::json llama_hf_config(const LlamaConfig& cfg, at::ScalarType torch_dtype);

// Reads a transformers config.json. Accepted model_type values:
//   "llama";
//   "mistral" only without a sliding window (sliding_window null/absent);
//   "qwen2" only without sliding window (use_sliding_window false/absent; sliding_window is then
//     ignored): attention_bias is true (Qwen2's q/k/v biases), whatever the file says.
// Required: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
// max_position_embeddings. Optional with transformers' defaults: num_key_value_heads
// (= num_attention_heads), rope_theta (10000), rms_norm_eps (1e-6), initializer_range (0.02),
// tie_word_embeddings (false), gated_mlp (true; false, as llama_hf_config writes it for
// Megatron's GeLU MLP, with hidden_act "gelu"). Rejected: hidden_act other than "silu" (or
// "gelu" with gated_mlp false), rope_scaling other than
// null, attention_bias true on llama/mistral (it would also bias o_proj), mlp_bias true,
// layer_types other than all "full_attention", head_dim != hidden_size / num_attention_heads.
// "deepseek_v3" (DeepseekV3ForCausalLM): multi-head latent attention (q_lora_rank, null for a
// plain q_proj; kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave),
// rope_parameters or rope_scaling of type "default" or "yarn"; MoE layers after the first
// first_k_dense_replace (n_routed_experts, num_experts_per_tok, moe_intermediate_size,
// n_shared_experts as one ungated "shared_experts" MLP, n_group, topk_group,
// routed_scaling_factor, norm_topk_prob; sigmoid scores with e_score_correction_bias). Refused:
// quantization_config, scoring_func other than "sigmoid", topk_method other than "noaux_tc",
// moe_layer_freq other than 1, attention_bias true, other rope types. num_nextn_predict_layers
// is accepted (transformers builds no MTP layer either); MTP tensors in a folder are refused
// (refuse_hf_mtp_tensors).
// Errors are std::invalid_argument naming the missing or invalid field; the result is validated.
LlamaConfig llama_config_from_hf(const nlohmann::json& config);

// The config.json model_type of `cfg`: "deepseek_v3" (multi-head latent attention), "llama", "qwen2" (q/k/v biases), "qwen3" (q/k norms),
// "qwen3_moe" (experts and q/k norms), "mixtral" (experts, Mixtral's names), "qwen2_moe"
// (experts with Qwen's names, no q/k norms).
std::string hf_model_type(const LlamaConfig& cfg);
// Empty when a Hugging Face folder of hf_model_type(cfg) can hold the model; else why not
// (Megatron's GeLU MLP; a sigmoid or scaled router; a shared expert, dense layers or biases the
// type does not have).
std::string hf_refusal(const LlamaConfig& cfg);

// The names among `tensor_names` that are bias tensors ("...bias").
std::vector<std::string> hf_bias_tensors(const std::vector<std::string>& tensor_names);

// Reconciles cfg.attention_bias (from a Hugging Face folder's config.json) with the tensors the
// folder holds (`tensor_names`, HF names), for import_hf and load_model:
//   - a Qwen2 config whose folder has no bias tensors at all becomes attention_bias false:
//     transformers would initialise the missing biases to zero, which is the same model;
//   - a Qwen2 folder with only some of its q/k/v biases, or bias tensors in a folder whose
//     config has none, throws std::invalid_argument starting with `where`, naming the bias
//     tensors present (and, for Qwen2, the first missing ones).
// Anything else (all of Qwen2's biases, or none for a Llama) is left to check_model_tensors.
void reconcile_hf_biases(LlamaConfig& cfg, const std::vector<std::string>& tensor_names, const std::string& where);

// DeepSeek-V3 folders may hold multi-token prediction layers (num_nextn_predict_layers: tensors
// "model.layers.{i}." with i >= num_hidden_layers), which transformers' DeepseekV3ForCausalLM
// does not build either: throws std::invalid_argument starting with `where`, naming them, as
// mfsdp has no such layers to load them into.
void refuse_hf_mtp_tensors(const LlamaConfig& cfg, const std::vector<std::string>& tensor_names, const std::string& where);

// The Llama family's config as a ModelConfig (model_spec.h), and back: llama_config_of throws
// std::logic_error for a config of another family.
ModelConfig llama_model_config(const LlamaConfig& cfg);
LlamaConfig llama_config_of(const ModelConfig& config);

}  // namespace mfsdp
