// YaRN rotary scaling (include/mfsdp/models/rope_scaling.h), step for step as transformers'
// _compute_yarn_parameters so the tables match it to the last bits fp32 allows.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "mfsdp/models/rope_scaling.h"

namespace mfsdp {

void YarnRopeScaling::validate() const {
  auto bad = [](const std::string& field, const std::string& what) {
    throw std::invalid_argument("rope_scaling." + field + ": " + what);
  };
  if (!(factor > 0) || !std::isfinite(factor)) bad("factor", "expected a positive number, found " + std::to_string(factor));
  if (original_max_position_embeddings <= 0)
    bad("original_max_position_embeddings",
        "expected a positive number, found " + std::to_string(original_max_position_embeddings));
  for (auto [field, v] : {std::pair{"beta_fast", beta_fast}, std::pair{"beta_slow", beta_slow},
                          std::pair{"mscale", mscale}, std::pair{"mscale_all_dim", mscale_all_dim}})
    if (!(v >= 0) || !std::isfinite(v)) bad(field, "expected a finite number >= 0, found " + std::to_string(v));
}

double yarn_mscale(double scale, double mscale) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double yarn_attention_factor(const YarnRopeScaling& yarn) {
  if (yarn.mscale != 0 && yarn.mscale_all_dim != 0)
    return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim);
  return yarn_mscale(yarn.factor, 1.0);
}

double yarn_softmax_scale(double scale, const YarnRopeScaling& yarn) {
  if (yarn.mscale_all_dim == 0) return scale;
  const double m = yarn_mscale(yarn.factor, yarn.mscale_all_dim);
  return scale * m * m;
}

at::Tensor yarn_inv_freq(int64_t head_dim, double theta, const YarnRopeScaling& yarn, const at::Device& device) {
  yarn.validate();
  if (head_dim <= 0 || head_dim % 2 != 0)
    throw std::invalid_argument("rotary_tables: expected an even positive head_dim, found " + std::to_string(head_dim));
  const double dim = static_cast<double>(head_dim);
  const double beta_fast = yarn.beta_fast != 0 ? yarn.beta_fast : 32, beta_slow = yarn.beta_slow != 0 ? yarn.beta_slow : 1;
  // The dimension whose wavelength turns `rotations` times over the original context.
  auto correction_dim = [&](double rotations) {
    return dim * std::log(static_cast<double>(yarn.original_max_position_embeddings) / (rotations * 2 * M_PI)) /
           (2 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (yarn.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // as transformers: no division by zero

  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor pos_freqs = at::pow(theta, at::arange(0, head_dim, 2, fp32.dtype(at::kLong)).to(at::kFloat) / dim);
  at::Tensor extrapolation = at::reciprocal(pos_freqs);
  at::Tensor interpolation = at::reciprocal(pos_freqs * yarn.factor);
  at::Tensor ramp = ((at::arange(head_dim / 2, fp32) - low) / (high - low)).clamp(0, 1);
  at::Tensor extrapolation_factor = 1 - ramp;
  return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
}

RotaryTables rotary_tables(const at::Tensor& positions, int64_t head_dim, double theta, const YarnRopeScaling& yarn) {
  if (positions.dim() != 1 && positions.dim() != 2)
    throw std::invalid_argument("rotary_tables: expected positions [T] or [B, T], found " +
                                std::to_string(positions.dim()) + "-D");
  at::Tensor inv_freq = yarn_inv_freq(head_dim, theta, yarn, positions.device());
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  const double attention_factor = yarn_attention_factor(yarn);
  return {emb.cos() * attention_factor, emb.sin() * attention_factor};
}

}  // namespace mfsdp
