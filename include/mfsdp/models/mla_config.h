// MlaConfig: multi-head latent attention's fields (mla_attention.h), apart from the module, so
// that LlamaConfig (llama.h) can hold one. validate() and softmax_scale() are implemented in
// src/models/llama/mla_attention.cpp.
#pragma once

#include <cstdint>
#include <optional>

#include "mfsdp/models/yarn_config.h"

namespace mfsdp {

// transformers' DeepseekV3Config attention fields.
struct MlaConfig {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t q_lora_rank = 0;  // 0 (HF None): a plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool attention_bias = false;
  double rope_theta = 10000;
  std::optional<YarnRopeScaling> yarn;  // rope_scaling of type "yarn"; none: plain RoPE
  bool rope_interleave = true;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // (qk_nope_head_dim + qk_rope_head_dim)^-0.5, with YaRN times mscale(factor, mscale_all_dim)^2.
  double softmax_scale() const;
  // Throws std::invalid_argument naming the field: positive sizes (q_lora_rank and
  // qk_nope_head_dim may be 0), an even qk_rope_head_dim, rope_theta > 0, a valid yarn.
  void validate() const;
};

}  // namespace mfsdp
