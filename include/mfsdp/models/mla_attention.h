// Multi-head latent attention (MLA) of DeepSeek-V2/V3, Moonlight and Kimi-K2, with transformers'
// DeepseekV3Attention parameter names:
//   q_proj.weight                 [nh*(dn+dr), H]          (q_lora_rank 0)
//   q_a_proj.weight (.bias)       [q_lora_rank, H]         (q_lora_rank > 0; bias: attention_bias)
//   q_a_layernorm.weight          [q_lora_rank]
//   q_b_proj.weight               [nh*(dn+dr), q_lora_rank]
//   kv_a_proj_with_mqa.weight (.bias) [kv_lora_rank + dr, H]
//   kv_a_layernorm.weight         [kv_lora_rank]
//   kv_b_proj.weight              [nh*(dn+dv), kv_lora_rank]
//   o_proj.weight (.bias)         [H, nh*dv]
// (dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim.) The queries come from x directly or
// through a low-rank bottleneck (q_a_proj, RMSNorm, q_b_proj); keys and values from one latent
// of kv_lora_rank features (kv_a_proj_with_mqa, RMSNorm, kv_b_proj), plus a single rotary key
// part of dr features shared by every head. Each head's query and key are [no-RoPE dn | RoPE dr];
// RoPE (decoupled) acts on the dr part only, with the pairs interleaved (x0, x1), (x2, x3), ...
// as DeepSeek's weights lay them out (rope_interleave, transformers'
// apply_rotary_pos_emb_interleave), or in halves as Llama. Causal attention through
// at::scaled_dot_product_attention with scale (dn + dr)^-0.5, times YaRN's mscale^2
// (rope_scaling.h, yarn_softmax_scale). The two RMSNorms use eps 1e-6, as transformers' (not
// rms_norm_eps). A KV cache holds the expanded keys and values. Tensor and context parallelism
// are a plan's (llama_parallel_plan): this rank's heads are as many as its q and kv_b weights
// hold, inside the boundary's region; under context parallelism the queries, keys and values are
// this rank's chunks and attention runs over the whole sequence's keys
// (context_parallel::cp_attention, with the values' own width).
// Implemented in src/models/llama/mla_attention.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

#include "mfsdp/models/linear.h"
#include "mfsdp/models/mla_config.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/models/rope_scaling.h"

namespace mfsdp {

// The rotary tables of the qk_rope_head_dim part for `positions` ([T] or [B, T]): plain or YaRN.
RotaryTables mla_rotary_tables(const at::Tensor& positions, const MlaConfig& config);
// RoPE on pairs (x0, x1), (x2, x3), ... of the last dimension, each by the angle of its pair
// (the first half of the tables), the rotated evens then the rotated odds (transformers'
// apply_rotary_pos_emb_interleave: dot products between queries and keys are those of the
// interleaved rotation). x [B, heads, T, d]; tables [T, d] or [B, T, d], cast to x's dtype.
at::Tensor apply_rotary_interleaved(const at::Tensor& x, const RotaryTables& rope);

class MlaAttentionImpl : public torch::nn::Module, public WithParallelBoundary, public WithContextParallelism {
 public:
  // `deferred`: parameters without storage until materialised (llama.h, "Initialisation");
  // otherwise allocated and left for the caller to initialise or load. `layer_idx`: the layer
  // whose keys and values a KV cache holds.
  MlaAttentionImpl(const MlaConfig& config, bool deferred, int64_t layer_idx = 0);
  // x [B, T, H], `rope` the tables of the T positions (mla_rotary_tables) -> [B, T, H]. Query t
  // attends to keys 0 .. t (after the cached ones). `cache`: each head's whole key [dn + dr] and
  // value [dv] are appended (the latent is not cached: no absorbed-weight decoding). `allowed`
  // [B, 1, T, S] bool (SequenceLayout::allowed_keys) replaces the causal mask. With `cp`
  // (context parallelism) `allowed` is unused and the rotary tables are of the chunks' global
  // positions.
  at::Tensor forward(const at::Tensor& x, const RotaryTables& rope, KVCache* cache = nullptr,
                     const at::Tensor& allowed = {}, const ContextParallelKeys& cp = {});

  LlamaLinear q_proj{nullptr};                                 // without q_lora_rank
  LlamaLinear q_a_proj{nullptr}, q_b_proj{nullptr};            // with q_lora_rank
  LlamaRMSNorm q_a_layernorm{nullptr};                         // with q_lora_rank
  LlamaLinear kv_a_proj_with_mqa{nullptr}, kv_b_proj{nullptr}, o_proj{nullptr};
  LlamaRMSNorm kv_a_layernorm{nullptr};
  // Selective recompute (recompute.h): "core_attn", the attention of q, k, v (reads no
  // parameter); "mla_up_proj", from the query's input (x, or the normed q_a_proj output) and the
  // normed key/value latent to q, k, v: the up projections q_proj / q_b_proj and kv_b_proj and
  // RoPE, as Megatron's qkv_up_proj_and_rope_apply.
  bool recompute_core_attn = false;
  bool recompute_up_proj = false;

 private:
  MlaConfig config_;
  int64_t layer_idx_;
};
TORCH_MODULE(MlaAttention);

}  // namespace mfsdp
