#include <ATen/ATen.h>

#include <stdexcept>

#include "mfsdp/llama.h"

namespace mfsdp {

RotaryTables rotary_tables(const at::Tensor& positions, int64_t head_dim, double theta) {
  if (positions.dim() != 1)
    throw std::invalid_argument("rotary_tables: expected 1-D positions, found " +
                                std::to_string(positions.dim()) + "-D");
  if (head_dim <= 0 || head_dim % 2 != 0)
    throw std::invalid_argument("rotary_tables: expected an even positive head_dim, found " +
                                std::to_string(head_dim));
  auto fp32 = positions.options().dtype(at::kFloat);
  // As transformers: 1.0 / (theta ** (arange(0, d, 2).float() / d)), all in fp32.
  at::Tensor exponent = at::arange(0, head_dim, 2, positions.options().dtype(at::kLong))
                            .to(at::kFloat) / static_cast<double>(head_dim);
  at::Tensor inv_freq = at::reciprocal(at::pow(theta, exponent));             // [d/2]
  at::Tensor freqs = positions.to(fp32).unsqueeze(1) * inv_freq.unsqueeze(0);  // [T, d/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);                                // [T, d]
  return {emb.cos(), emb.sin()};
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, x.size(-1) - half);
  return at::cat({-x2, x1}, -1);
}

at::Tensor apply_rotary(const at::Tensor& x, const RotaryTables& rope) {
  at::Tensor cos = rope.cos.to(x.dtype()), sin = rope.sin.to(x.dtype());
  return x * cos + rotate_half(x) * sin;
}

}  // namespace mfsdp
