// Multi-head latent attention (include/mfsdp/models/mla_attention.h), in the order of
// transformers' DeepseekV3Attention.forward.
#include <ATen/ATen.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "mfsdp/models/mla_attention.h"

#include "mfsdp/fsdp/recompute.h"

namespace mfsdp {

namespace {
// transformers' DeepseekV3RMSNorm default, which MLA's two norms use whatever rms_norm_eps is.
constexpr double kLatentNormEps = 1e-6;
}  // namespace

double MlaConfig::softmax_scale() const {
  const double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  return yarn ? yarn_softmax_scale(scale, *yarn) : scale;
}

void MlaConfig::validate() const {
  auto bad = [](const std::string& field, const std::string& what) {
    throw std::invalid_argument("MlaConfig." + field + ": " + what);
  };
  for (auto [field, v] : {std::pair{"hidden_size", hidden_size}, std::pair{"num_heads", num_heads},
                          std::pair{"kv_lora_rank", kv_lora_rank}, std::pair{"qk_rope_head_dim", qk_rope_head_dim},
                          std::pair{"v_head_dim", v_head_dim}})
    if (v <= 0) bad(field, "expected a positive value, found " + std::to_string(v));
  for (auto [field, v] : {std::pair{"q_lora_rank", q_lora_rank}, std::pair{"qk_nope_head_dim", qk_nope_head_dim}})
    if (v < 0) bad(field, "expected >= 0, found " + std::to_string(v));
  if (qk_rope_head_dim % 2 != 0)
    bad("qk_rope_head_dim", "expected an even value (RoPE rotates pairs), found " + std::to_string(qk_rope_head_dim));
  if (!(rope_theta > 0)) bad("rope_theta", "expected a positive value, found " + std::to_string(rope_theta));
  if (yarn) yarn->validate();
}

RotaryTables mla_rotary_tables(const at::Tensor& positions, const MlaConfig& config) {
  return config.yarn ? rotary_tables(positions, config.qk_rope_head_dim, config.rope_theta, *config.yarn)
                     : rotary_tables(positions, config.qk_rope_head_dim, config.rope_theta);
}

at::Tensor apply_rotary_interleaved(const at::Tensor& x, const RotaryTables& rope) {
  const int64_t half = x.size(-1) / 2;
  // The tables are cat(freqs, freqs): the first half holds each pair's angle.
  at::Tensor cos = rope.cos.narrow(-1, 0, half).to(x.dtype()), sin = rope.sin.narrow(-1, 0, half).to(x.dtype());
  if (cos.dim() == 3) {  // per-row tables [B, T, d] against x [B, heads, T, d]
    cos = cos.unsqueeze(1);
    sin = sin.unsqueeze(1);
  }
  at::Tensor even = x.slice(-1, 0, c10::nullopt, 2), odd = x.slice(-1, 1, c10::nullopt, 2);
  return at::cat({even * cos - odd * sin, odd * cos + even * sin}, -1);
}

MlaAttentionImpl::MlaAttentionImpl(const MlaConfig& c, bool deferred, int64_t layer_idx)
    : config_(c), layer_idx_(layer_idx) {
  c.validate();
  const int64_t heads = c.num_heads;
  // Registered in transformers' order, so the state dicts list them alike.
  if (c.q_lora_rank == 0) {
    q_proj = register_module("q_proj", LlamaLinear(c.hidden_size, heads * c.qk_head_dim(), deferred));
  } else {
    q_a_proj = register_module("q_a_proj", LlamaLinear(c.hidden_size, c.q_lora_rank, deferred, c.attention_bias));
    q_a_layernorm = register_module("q_a_layernorm", LlamaRMSNorm(c.q_lora_rank, kLatentNormEps, deferred));
    q_b_proj = register_module("q_b_proj", LlamaLinear(c.q_lora_rank, heads * c.qk_head_dim(), deferred));
  }
  kv_a_proj_with_mqa = register_module(
      "kv_a_proj_with_mqa", LlamaLinear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, deferred, c.attention_bias));
  kv_a_layernorm = register_module("kv_a_layernorm", LlamaRMSNorm(c.kv_lora_rank, kLatentNormEps, deferred));
  kv_b_proj = register_module("kv_b_proj",
                              LlamaLinear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), deferred));
  o_proj = register_module("o_proj", LlamaLinear(heads * c.v_head_dim, c.hidden_size, deferred, c.attention_bias));
}

at::Tensor MlaAttentionImpl::forward(const at::Tensor& input, const RotaryTables& rope, KVCache* cache,
                                     const at::Tensor& allowed_keys, const ContextParallelKeys& cp) {
  const MlaConfig& c = config_;
  if (input.dim() != 3 || input.size(2) != c.hidden_size)
    throw std::invalid_argument("MlaAttention: expected x [B, T, " + std::to_string(c.hidden_size) + "], found " +
                                c10::str(input.sizes()));
  // Every projection reads one input: the region is entered once.
  const at::Tensor x = parallel_boundary.enter(input);
  const int64_t batch = x.size(0), length = x.size(1);
  const int64_t rot = c.qk_rope_head_dim;
  // This rank's heads: all of them, or the plan's tensor-parallel share.
  const int64_t heads = (c.q_lora_rank == 0 ? q_proj : q_b_proj)->weight.size(0) / c.qk_head_dim();

  // Down projections and their norms (kept), then the up projections and RoPE (Megatron's
  // qkv_up_proj_and_rope_apply; selective recompute's mla_up_proj checkpoints them).
  const at::Tensor q_in = c.q_lora_rank == 0 ? x : q_a_layernorm(q_a_proj(x));
  const at::Tensor compressed = kv_a_proj_with_mqa(x);  // [B, T, kv_lora_rank + dr]
  const at::Tensor latent = kv_a_layernorm(compressed.narrow(-1, 0, c.kv_lora_rank));
  const at::Tensor k_rot_in = compressed.narrow(-1, c.kv_lora_rank, rot);
  auto up = [this, rope, batch, length, heads](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    const MlaConfig& c = config_;
    const int64_t nope = c.qk_nope_head_dim, rot = c.qk_rope_head_dim;
    at::Tensor q = (c.q_lora_rank == 0 ? q_proj : q_b_proj)(in[0]);
    q = q.view({batch, length, heads, c.qk_head_dim()}).transpose(1, 2);  // [B, nh, T, dn + dr]
    at::Tensor q_pass = q.narrow(-1, 0, nope), q_rot = q.narrow(-1, nope, rot);
    at::Tensor k_rot = in[2].unsqueeze(1);  // [B, 1, T, dr]: every head's
    if (c.rope_interleave) {
      q_rot = apply_rotary_interleaved(q_rot, rope);
      k_rot = apply_rotary_interleaved(k_rot, rope);
    } else {
      q_rot = apply_rotary(q_rot, rope);
      k_rot = apply_rotary(k_rot, rope);
    }
    at::Tensor kv = kv_b_proj(in[1]).view({batch, length, heads, nope + c.v_head_dim}).transpose(1, 2);
    at::Tensor k_nope = kv.narrow(-1, 0, nope), v = kv.narrow(-1, nope, c.v_head_dim);
    return {at::cat({q_pass, q_rot}, -1), at::cat({k_nope, k_rot.expand({batch, heads, length, rot})}, -1), v};
  };
  const bool training = cache == nullptr;  // recompute() itself skips when no backward follows
  // Core attention (reads no parameter; selective recompute's core_attn checkpoints it). No
  // dropout, so the rerun needs no RNG state.
  const at::Tensor allowed_in = allowed_keys;
  const double scale = c.softmax_scale();
  auto core = [this, cp, allowed_in, scale](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    const at::Tensor &q = in[0], &k = in[1], &v = in[2];
    if (cp.global_positions.defined())
      // This rank's queries against the whole sequence's keys and values, exchanged over the group.
      return {context_parallelism.attend(q, k, v.contiguous(), cp.global_positions, cp.key_padding_mask,
                                         cp.segment_ids, scale)};
    // Query i sits at key past + i; SDPA's is_causal aligns top-left, so cached keys need a mask.
    const int64_t keys = k.size(2), length = q.size(2), past = keys - length;
    at::Tensor allowed = allowed_in;
    if (!allowed.defined() && past > 0) {
      auto pos = at::TensorOptions().dtype(at::kLong).device(q.device());
      allowed = at::arange(keys, pos).unsqueeze(0) <= (at::arange(length, pos) + past).unsqueeze(1);
    }
    return {at::scaled_dot_product_attention(q, k, v,
                                             allowed.defined() ? std::optional<at::Tensor>(allowed) : std::nullopt,
                                             /*dropout_p=*/0.0, /*is_causal=*/!allowed.defined(), scale)};
  };
  at::Tensor out;
  if (recompute_up_proj && training) {
    // mla_up_proj: Megatron discards q, k and v once the core attention has read them and
    // recomputes them for its backward (CheckpointWithoutOutput). recompute() keeps a
    // checkpoint's outputs, and q, k, v are what the core attention saves, so the piece reaches
    // through the core attention: neither q, k, v nor the attention's own tensors are kept.
    out = recompute(
        [up, core](const std::vector<at::Tensor>& in) { return core(up(in)); }, {q_in, latent, k_rot_in})[0];
  } else {
    std::vector<at::Tensor> qkv = up({q_in, latent, k_rot_in});
    at::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
    if (cache != nullptr) std::tie(k, v) = cache->append(layer_idx_, k, v);
    out = recompute_core_attn && training ? recompute(core, {q, k, v})[0] : core({q, k, v})[0];
  }
  out = out.transpose(1, 2).reshape({batch, length, heads * c.v_head_dim});
  // o_proj is row-parallel under tensor parallelism: its bias (attention_bias) is added once,
  // after the ranks' partial outputs are summed.
  if (o_proj->bias.defined() && parallel_boundary.active())
    return parallel_boundary.leave(at::linear(out, o_proj->weight)) + o_proj->bias;
  return parallel_boundary.leave(o_proj(out));
}

}  // namespace mfsdp
