#include <ATen/ATen.h>

#include <stdexcept>

#include "mfsdp/models/llama.h"

namespace mfsdp {

RotaryTables rotary_tables(const at::Tensor& positions, int64_t head_dim, double theta) {
  if (positions.dim() != 1 && positions.dim() != 2)
    throw std::invalid_argument("rotary_tables: expected positions [T] or [B, T], found " +
                                std::to_string(positions.dim()) + "-D");
  if (head_dim <= 0 || head_dim % 2 != 0)
    throw std::invalid_argument("rotary_tables: expected an even positive head_dim, found " +
                                std::to_string(head_dim));
  auto fp32 = positions.options().dtype(at::kFloat);
  // As transformers: 1.0 / (theta ** (arange(0, d, 2).float() / d)), all in fp32.
  at::Tensor exponent = at::arange(0, head_dim, 2, positions.options().dtype(at::kLong))
                            .to(at::kFloat) / static_cast<double>(head_dim);
  at::Tensor inv_freq = at::reciprocal(at::pow(theta, exponent));             // [d/2]
  at::Tensor freqs = positions.to(fp32).unsqueeze(-1) * inv_freq;  // [(B,) T, d/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);                     // [(B,) T, d]
  return {emb.cos(), emb.sin()};
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, x.size(-1) - half);
  return at::cat({-x2, x1}, -1);
}

at::Tensor apply_rotary(const at::Tensor& x, const RotaryTables& rope) {
  at::Tensor cos = rope.cos.to(x.dtype()), sin = rope.sin.to(x.dtype());
  if (cos.dim() == 3) {  // per-row tables [B, T, d] against x [B, heads, T, d]
    cos = cos.unsqueeze(1);
    sin = sin.unsqueeze(1);
  }
  return x * cos + rotate_half(x) * sin;
}

at::Tensor SequenceLayout::allowed_keys(int64_t batch, int64_t length, const at::Device& device, int64_t past) const {
  if (past < 0) throw std::invalid_argument("SequenceLayout: negative cached length " + std::to_string(past));
  const int64_t keys = past + length;
  auto check = [&](const at::Tensor& t, const char* name, int64_t columns) {
    if (t.defined() && (t.dim() != 2 || t.size(0) != batch || t.size(1) != columns))
      throw std::invalid_argument(std::string("SequenceLayout: ") + name + " has shape " + c10::str(t.sizes()) +
                                  ", expected [" + std::to_string(batch) + ", " + std::to_string(columns) + "]" +
                                  (past > 0 ? " (" + std::to_string(past) + " cached keys and " +
                                                  std::to_string(length) + " new tokens)"
                                            : std::string()));
  };
  check(position_ids, "position_ids", length);
  check(attention_mask, "attention_mask", keys);  // every key: the cached ones, then the new
  check(segment_ids, "segment_ids", length);
  if (segment_ids.defined() && past > 0)
    throw std::invalid_argument("SequenceLayout: segment_ids (packed samples) cannot be used with a KV cache");
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  // Query i is key past + i: it sees keys 0 .. past + i.
  at::Tensor query_key = at::arange(length, longs) + past;
  at::Tensor key = at::arange(keys, longs);
  at::Tensor allowed = (key.unsqueeze(0) <= query_key.unsqueeze(1)).expand({batch, length, keys});  // causal
  if (attention_mask.defined()) allowed = allowed & attention_mask.to(device).ne(0).unsqueeze(1);
  if (segment_ids.defined()) {
    at::Tensor seg = segment_ids.to(device);
    allowed = allowed & seg.unsqueeze(2).eq(seg.unsqueeze(1));
  }
  allowed = allowed | key.unsqueeze(0).eq(query_key.unsqueeze(1)).unsqueeze(0);  // itself
  return allowed.unsqueeze(1);
}

}  // namespace mfsdp
