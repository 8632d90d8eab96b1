// YaRN rotary scaling (rope_scaling {"rope_type": "yarn", ...}), as transformers computes it
// (_compute_yarn_parameters in modeling_rope_utils.py) for DeepSeek-V3, Moonlight and Kimi-K2:
//
//   pos_freqs   = theta^(arange(0, d, 2) / d)                       (fp32, as rotary_tables)
//   extrapolate = 1 / pos_freqs,  interpolate = 1 / (factor x pos_freqs)
//   [low, high] = the dimensions where beta_fast and beta_slow rotations fit in
//                 original_max_position_embeddings (floor / ceil unless truncate is false),
//                 clamped to [0, d - 1]
//   ramp        = clamp((arange(d / 2) - low) / (high - low), 0, 1)
//   inv_freq    = interpolate x ramp + extrapolate x (1 - ramp)
//   cos, sin    = the usual tables times attention_factor, which is
//                 mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set,
//                 else mscale(factor, 1);  mscale(s, m) = 1 + 0.1 m ln s  (1 when s <= 1)
//
// DeepSeek-V3's attention also multiplies its softmax scale by mscale(factor, mscale_all_dim)^2
// when mscale_all_dim is set (transformers' DeepseekV3Attention, yarn_apply_mscale):
// yarn_softmax_scale. Implemented in src/models/rope_scaling.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "mfsdp/models/llama.h"
#include "mfsdp/models/yarn_config.h"

namespace mfsdp {

// 1 + 0.1 x mscale x ln(scale), or 1 when scale <= 1 (transformers' yarn_get_mscale).
double yarn_mscale(double scale, double mscale);
// The [head_dim / 2] fp32 inverse frequencies (see above), on `device`.
at::Tensor yarn_inv_freq(int64_t head_dim, double theta, const YarnRopeScaling& yarn, const at::Device& device);
// The factor the cos / sin tables are multiplied by.
double yarn_attention_factor(const YarnRopeScaling& yarn);
// `scale` x mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set, else `scale`.
double yarn_softmax_scale(double scale, const YarnRopeScaling& yarn);
// rotary_tables (llama.h) with YaRN's frequencies and attention factor.
RotaryTables rotary_tables(const at::Tensor& positions, int64_t head_dim, double theta, const YarnRopeScaling& yarn);

}  // namespace mfsdp
