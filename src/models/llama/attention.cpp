// Causal grouped-query self-attention with RoPE, optional q/k/v biases (Qwen2), optional per-head
// q/k RMSNorm (Qwen3) and an optional KV cache (HF eager attention).
#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "mfsdp/fsdp/recompute.h"
#include "mfsdp/models/llama.h"

namespace mfsdp {

at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t b = x.size(0), nkv = x.size(1), s = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, nkv, n_rep, s, d}).reshape({b, nkv * n_rep, s, d});
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c, int64_t layer_idx, bool deferred)
    : head_dim_(c.head_dim()), layer_idx_(layer_idx) {
  const int64_t h = c.hidden_size, heads = c.num_attention_heads, kv_heads = c.num_key_value_heads;
  // Qwen2 (attention_bias): biases on q, k and v only, as transformers' Qwen2Attention.
  const bool bias = c.attention_bias;
  q_proj = register_module("q_proj", LlamaLinear(h, heads * head_dim_, deferred, bias));
  k_proj = register_module("k_proj", LlamaLinear(h, kv_heads * head_dim_, deferred, bias));
  v_proj = register_module("v_proj", LlamaLinear(h, kv_heads * head_dim_, deferred, bias));
  o_proj = register_module("o_proj", LlamaLinear(heads * head_dim_, h, deferred));
  if (c.qk_norm) {  // Qwen3: per head, over head_dim
    q_norm = register_module("q_norm", LlamaRMSNorm(head_dim_, c.rms_norm_eps, deferred));
    k_norm = register_module("k_norm", LlamaRMSNorm(head_dim_, c.rms_norm_eps, deferred));
  }
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& input, const RotaryTables& rope,
                                       LlamaKVCache* cache, const at::Tensor& allowed_keys,
                                       const ContextParallelKeys& cp) {
  // q, k and v read one input: the region is entered once (one all-reduce of its gradient).
  const at::Tensor x = parallel_boundary.enter(input);
  const int64_t b = x.size(0), t = x.size(1);
  // This rank's heads: all of them, or the plan's tensor-parallel share.
  const int64_t num_heads_ = q_proj->weight.size(0) / head_dim_, num_kv_heads_ = k_proj->weight.size(0) / head_dim_;
  at::Tensor q = q_proj(x).view({b, t, num_heads_, head_dim_});
  at::Tensor k = k_proj(x).view({b, t, num_kv_heads_, head_dim_});
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  at::Tensor v = v_proj(x).view({b, t, num_kv_heads_, head_dim_}).transpose(1, 2);
  q = apply_rotary(q, rope);
  k = apply_rotary(k, rope);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  if (cache != nullptr) std::tie(k, v) = cache->append(layer_idx_, k, v);
  // Core attention: q, k, v -> [B, heads, T, hd]. No parameter is read here (selective
  // recompute's core_attn reruns it in backward without its FSDP unit's weights).
  const int64_t n_rep = num_heads_ / num_kv_heads_;
  const bool sdpa = use_sdpa;
  const at::Tensor allowed_in = allowed_keys;
  auto core = [this, cp, scale, n_rep, sdpa, allowed_in](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    const at::Tensor &q = in[0], &k_in = in[1], &v_in = in[2];
    if (cp.global_positions.defined())
      // This rank's queries against the whole sequence's keys, exchanged over the group; grouped
      // query heads are matched inside.
      return {context_parallelism.attend(q, k_in, v_in, cp.global_positions, cp.key_padding_mask, cp.segment_ids,
                                         scale)};
    const int64_t t = q.size(2), s = k_in.size(2), past = s - t;  // keys: past positions, then the t new ones
    // Query i sits at position past + i and may see keys 0 .. past + i.
    auto pos = at::TensorOptions().dtype(at::kLong).device(q.device());
    if (sdpa) {
      // Without cached keys this is SDPA's own causal mask; with them the diagonal moves by
      // `past`, which SDPA's is_causal (aligned top-left) does not do: an explicit mask then.
      at::Tensor allowed = allowed_in;
      if (!allowed.defined() && past > 0)
        allowed = at::arange(s, pos).unsqueeze(0) <= (at::arange(t, pos) + past).unsqueeze(1);
      const std::optional<at::Tensor> mask = allowed.defined() ? std::optional<at::Tensor>(allowed) : std::nullopt;
      // Causal without a mask (pretraining): SDPA matches the query heads to their key/value
      // group itself (enable_gqa: flash attention on CUDA and the CPU), so no copy of k and v per
      // query head is made or kept for backward. With a mask CUDA's flash kernel does not apply
      // and the memory-efficient one has no grouped heads (SDPA would fall back to its math
      // path), so the keys and values are expanded as before.
      if (!mask && n_rep > 1)
        return {at::scaled_dot_product_attention(q, k_in, v_in, std::nullopt, /*dropout_p=*/0.0, /*is_causal=*/true,
                                                 scale, /*enable_gqa=*/true)};
      return {at::scaled_dot_product_attention(q, repeat_kv(k_in, n_rep), repeat_kv(v_in, n_rep), mask,
                                               /*dropout_p=*/0.0, /*is_causal=*/!mask, scale)};
    }
    const at::Tensor k = repeat_kv(k_in, n_rep), v = repeat_kv(v_in, n_rep);
    at::Tensor scores = at::matmul(q, k.transpose(2, 3)) * scale;
    at::Tensor future = allowed_in.defined()
                            ? allowed_in.logical_not()
                            : at::arange(s, pos).unsqueeze(0) > (at::arange(t, pos) + past).unsqueeze(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
    return {at::matmul(probs, v)};
  };
  // No dropout here (dropout_p 0), so the rerun needs no RNG state (Megatron replays it).
  at::Tensor out = recompute_core_attn && cache == nullptr ? recompute(core, {q, k, v})[0] : core({q, k, v})[0];
  out = out.transpose(1, 2).reshape({b, t, num_heads_ * head_dim_});
  return parallel_boundary.leave(o_proj(out));
}

}  // namespace mfsdp
