// Llama-family decoder (docs/model.md) with Hugging Face parameter names.
//
//   mfsdp::LlamaConfig cfg{32000, 4096, 11008, 32, 32, 8, 4096};
//   torch::manual_seed(1234);                       // same seed on every rank: same weights
//   mfsdp::LlamaForCausalLM model(cfg);
//   mfsdp::FsdpHandle root = mfsdp::shard_llama(model, options);   // layers, then the root
//   at::Tensor logits = model->call(input_ids);     // [B, T, V], through the root unit
//   at::Tensor loss = mfsdp::lm_loss(logits, labels);
//
// Module tree and names (1:1 with transformers' LlamaForCausalLM state dict):
//   model.embed_tokens.weight                     [V, H]
//   model.layers.{i}.input_layernorm.weight       [H]
//   model.layers.{i}.self_attn.{q,o}_proj.weight  [nh*hd, H] / [H, nh*hd]
//   model.layers.{i}.self_attn.{k,v}_proj.weight  [nkv*hd, H]
//   model.layers.{i}.self_attn.q_proj.bias        [nh*hd]   (only with attention_bias: Qwen2)
//   model.layers.{i}.self_attn.{k,v}_proj.bias    [nkv*hd]  (only with attention_bias: Qwen2)
//   model.layers.{i}.post_attention_layernorm.weight [H]
//   model.layers.{i}.mlp.{gate,up}_proj.weight    [I, H]   (gate_proj only with swiglu)
//   model.layers.{i}.mlp.down_proj.weight         [H, I]
//   model.norm.weight                             [H]
//   lm_head.weight                                [V, H]   (absent when tie_word_embeddings:
//                                                           the output uses embed_tokens.weight)
// With LlamaConfig::mla (DeepSeek-V3) self_attn holds MlaAttention's parameters instead
// (q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
// o_proj; mla_attention.h), and an MoE layer's shared expert is "mlp.shared_experts".
// No other biases (o_proj and the MLP have none). Buffers: none (RoPE tables are computed per
// forward from the positions). Within a module the weight comes before the bias, as in
// transformers' nn.Linear.
//
// Initialisation: normal(0, init_std) for projection and embedding weights, ones for norms,
// zeros for biases (transformers' _init_weights). Each
// parameter draws from its own generator seeded by (init seed, parameter name), and the init seed
// is drawn once from the default CPU generator when the model is built, so the weights depend
// only on torch::manual_seed (or LlamaOptions::init_seed) and never on the order in which
// parameters are initialised. That makes deferred initialisation (--init-model-with-meta-device)
// bit-identical to eager initialisation, whatever order the layers are materialised in.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/models/causal_lm.h"
#include "mfsdp/models/linear.h"
#include "mfsdp/models/mla_config.h"
#include "mfsdp/models/moe.h"
#include "mfsdp/models/lm_loss.h"

namespace mfsdp {

// Hugging Face LlamaConfig's fields (num_layers = num_hidden_layers).
struct LlamaConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;   // < num_attention_heads: grouped-query attention
  int64_t max_position_embeddings = 0;
  double rope_theta = 10000;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  double init_std = 0.02;             // HF initializer_range, Megatron --init-method-std
  // Biases on q_proj, k_proj and v_proj (Qwen2; HF config.json: model_type "qwen2"). Not
  // transformers' LlamaConfig.attention_bias, which also puts one on o_proj: llama_hf_config.h refuses
  // that.
  bool attention_bias = false;
  // The MLP: true, Llama's SwiGLU, down_proj(silu(gate_proj(x)) * up_proj(x)); false, the MLP
  // Megatron builds without --swiglu, down_proj(gelu(up_proj(x))) with the exact (erf) GeLU, no
  // gate_proj (HF names as in Nemotron's non-gated MLP). Only SwiGLU models are Hugging Face
  // Llama/Qwen2 models: llama_hf_config.h writes the other with hidden_act "gelu" and gated_mlp false
  // for checkpoints and refuses it in an HF folder.
  bool swiglu = true;
  // Each head's width when it is not hidden_size / num_attention_heads (Qwen3's head_dim,
  // Megatron's --kv-channels); 0: hidden_size / num_attention_heads.
  int64_t explicit_head_dim = 0;
  // RMSNorm over each query and key head before RoPE (Qwen3's q_norm / k_norm, Megatron's
  // --qk-layernorm).
  bool qk_norm = false;
  // Mixture of experts (moe.h); num_experts 0: every layer has the dense MLP.
  MoeConfig moe;
  // Multi-head latent attention (DeepSeek-V3; mla_attention.h) instead of grouped-query
  // attention in every layer; its hidden_size, num_heads and rope_theta must be this config's.
  // Its rotary tables (mla->yarn: YaRN) replace the model's. num_key_value_heads and head_dim()
  // are then unused. None: LlamaAttention.
  std::optional<MlaConfig> mla;

  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : hidden_size / num_attention_heads; }
  // What tensor parallelism splits (Megatron's divide() of each layer), by config.json field:
  // heads, key/value heads (not with multi-head latent attention, whose keys and values are
  // per query head), MLP width and vocabulary, and an MoE layer's shared expert.
  std::vector<std::pair<std::string, int64_t>> tensor_parallel_splits() const {
    std::vector<std::pair<std::string, int64_t>> s = {{"num_attention_heads", num_attention_heads},
                                                      {"intermediate_size", intermediate_size},
                                                      {"vocab_size", vocab_size}};
    if (!mla) s.insert(s.begin() + 1, {"num_key_value_heads", num_key_value_heads});
    if (moe.num_experts > 0 && moe.shared_expert_intermediate_size > 0)
      s.emplace_back("shared_expert_intermediate_size", moe.shared_expert_intermediate_size);
    return s;
  }
  // Throws std::invalid_argument naming the field: every size positive, heads divide
  // hidden_size (unless explicit_head_dim), key/value heads divide heads, a valid moe, an even head_dim (RoPE rotates pairs),
  // rope_theta > 0, rms_norm_eps >= 0, init_std >= 0, a valid mla agreeing with the config.
  void validate() const;
};


// How the model is built: causal_lm.h.
using LlamaOptions = ModelBuildOptions;

// ---- Rotary position embedding (HF convention) -------------------------------------------

// cos and sin tables for the given positions: inv_freq = 1 / theta^(arange(0, d, 2) / d),
// freqs = positions x inv_freq, emb = cat(freqs, freqs); computed in fp32. Positions [T] (every
// row alike) or [B, T] (per row).
struct RotaryTables {
  at::Tensor cos;  // [T, head_dim] or [B, T, head_dim] fp32
  at::Tensor sin;  // same
};
RotaryTables rotary_tables(const at::Tensor& positions, int64_t head_dim, double theta);
// cat(-x2, x1) where x1, x2 are the first and second halves of the last dimension.
at::Tensor rotate_half(const at::Tensor& x);
// x * cos + rotate_half(x) * sin; x: [..., T, head_dim]; the tables are cast to x's dtype.
at::Tensor apply_rotary(const at::Tensor& x, const RotaryTables& rope);

// [B, nkv, S, hd] -> [B, nkv * n_rep, S, hd]: kv head j serves query heads j*n_rep .. +n_rep-1.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep);

// Padded and packed batches (SequenceLayout) and the KV cache: causal_lm.h.
using LlamaKVCache = KVCache;

// ---- Modules ----------------------------------------------------------------------------

class MlaAttentionImpl;  // mla_attention.h

// The groups of ModelBuildOptions (causal_lm.h) as the Llama family's plan applies them
// (llama_parallel_plan, parallel_plan.h): the modules are built whole and the plan cuts each
// rank's slice (1/tp of the attention heads, query and key/value heads alike as Megatron splits
// its query groups, of the MLP's intermediate features and of the vocabulary; the HF names
// stay), gives the model body and each attention the context-parallel group, and each MoE block
// its groups (keeping its rank's experts). `tensor` and `sequence` also tell the model which
// slice of the sequence its layers hold, for the MoE blocks' token counts.
struct LlamaParallel {
  std::shared_ptr<Communicator> tensor;  // null: one rank
  bool sequence = false;                 // sequence parallelism (only with tensor)
  ExpertParallelism moe;                 // each MoE block's groups
  int tp_size() const;
  int tp_rank() const;
};

// One forward's context-parallel inputs (undefined without context parallelism): the local
// tokens' indices in the whole sequence (context_parallel::cp_positions; what the causal mask
// compares) and this rank's part of the padding mask and packed-segment ids, each [B, T_local]
// or undefined.
struct ContextParallelKeys {
  at::Tensor global_positions;
  at::Tensor key_padding_mask;
  at::Tensor segment_ids;
};


// Token embedding; its boundary may make it vocabulary-parallel (weight [V/tp, H], this rank's
// ids; output [B, T, H], or [B, T/tp, H] with sequence parallelism).
class LlamaEmbeddingImpl : public torch::nn::Module, public WithParallelBoundary {
 public:
  LlamaEmbeddingImpl(int64_t num_embeddings, int64_t dim, bool deferred);
  at::Tensor forward(const at::Tensor& ids);
  at::Tensor weight;  // [V, H] ([V/tp, H])
  // The last pipeline stage's copy of a tied embedding: forward(hidden) is the output projection
  // hidden x weight^T (logits [B, T, V], or this rank's vocabulary slice), so that the copy is a
  // unit of its own whose gradient matches the first stage's shard for shard.
  bool as_output = false;
};
TORCH_MODULE(LlamaEmbedding);

// y = weight * (x * rsqrt(mean(x^2, -1) + eps)), the normalisation in fp32, then cast back to
// x's dtype before the weight multiplies (HF LlamaRMSNorm).
class LlamaRMSNormImpl : public torch::nn::Module {
 public:
  LlamaRMSNormImpl(int64_t dim, double eps, bool deferred);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;  // [H]
  double eps;
};
TORCH_MODULE(LlamaRMSNorm);

// Causal grouped-query self-attention with RoPE, through at::scaled_dot_product_attention (the
// fused kernels of the device: flash/memory-efficient on CUDA, flash on the CPU).
class LlamaAttentionImpl : public torch::nn::Module, public WithParallelBoundary, public WithContextParallelism {
 public:
  LlamaAttentionImpl(const LlamaConfig& config, int64_t layer_idx, bool deferred);
  // Its heads are as many as its q/k/v weights hold: under tensor parallelism (the plan's
  // column-parallel q/k/v and row-parallel o_proj, inside the boundary's region) this rank's,
  // and x and the result are [B, T, H] replicated, or [B, T/tp, H] with sequence parallelism
  // (rope, cache and `allowed` still cover all T positions).
  // x: [B, T, H]; rope: tables for the T new positions; cache: null in training. Query t (at
  // key index start + t, start = keys cached before this call) attends to keys 0 .. start + t.
  // `allowed` [B, 1, T, S] bool (SequenceLayout::allowed_keys; S = cached + T) replaces that
  // causal mask.
  // With `cp` (context parallelism, the plan's group) the queries and keys are this rank's
  // chunks and attention runs over the whole sequence's keys (context_parallel::cp_attention);
  // `allowed` is unused.
  at::Tensor forward(const at::Tensor& x, const RotaryTables& rope, LlamaKVCache* cache,
                     const at::Tensor& allowed = {}, const ContextParallelKeys& cp = {});
  LlamaLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  LlamaRMSNorm q_norm{nullptr}, k_norm{nullptr};  // only with config.qk_norm
  // false: the explicit math path (matmul, causal mask, fp32 softmax, matmul), Hugging Face's
  // eager attention; the reference SDPA is checked against (tests/unit/llama_test.cpp).
  bool use_sdpa = true;
  // Selective recompute's "core_attn" (recompute.h): the attention of q, k, v after the
  // projections and RoPE (GQA's key/value expansion, the mask, softmax, the product with v) is
  // checkpointed; it reads no parameter, so it needs nothing from the FSDP unit in backward.
  bool recompute_core_attn = false;

 private:
  int64_t head_dim_, layer_idx_;
};
TORCH_MODULE(LlamaAttention);

// SwiGLU: down(silu(gate(x)) * up(x)); without config.swiglu: down(gelu(up(x))), no gate.
// Under tensor parallelism (the plan's) gate/up are column-parallel and down row-parallel, inside
// the boundary's region (as attention).
class LlamaMLPImpl : public torch::nn::Module, public WithParallelBoundary {
 public:
  LlamaMLPImpl(const LlamaConfig& config, bool deferred);
  at::Tensor forward(const at::Tensor& x);
  LlamaLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

// Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)), the MLP dense or an MoE block (moe.h;
// registered as "mlp", or Mixtral's "block_sparse_moe"). A fully_shard unit: call it as
// `layer->call(hidden, rope, cache)`. `tokens` [B x T] bool, false at padding: what an MoE
// block's counts and balancing losses take in (undefined: every position).
class LlamaDecoderLayerImpl : public ShardedModule<LlamaDecoderLayerImpl> {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& config, int64_t layer_idx, bool deferred);
  at::Tensor forward(const at::Tensor& hidden, const RotaryTables& rope, LlamaKVCache* cache,
                     const at::Tensor& allowed = {}, const at::Tensor& tokens = {},
                     const ContextParallelKeys& cp = {});
  LlamaAttention self_attn{nullptr};   // null with config.mla
  // With config.mla, registered as "self_attn" (mla_attention.h; a pointer, as that header
  // includes this one).
  std::shared_ptr<MlaAttentionImpl> mla_attn;
  LlamaMLP mlp{nullptr};  // null in an MoE layer
  MoeBlock moe{nullptr};  // null in a dense layer
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  // Selective recompute (recompute.h): this layer's layernorm / mlp / moe pieces; the
  // attention's and the MoE block's own pieces are flags on those modules (LlamaModel::set_recompute).
  RecomputeOptions recompute;
};
TORCH_MODULE(LlamaDecoderLayer);

// Embedding, the decoder layers, the final norm (HF LlamaModel). Under the plan's context
// parallelism it takes each rank's chunks of the sequences (context_parallel::shard_sequence)
// and gives its layers their global positions.
class LlamaModelImpl : public torch::nn::Module, public WithContextParallelism {
 public:
  LlamaModelImpl(const LlamaConfig& config, bool deferred, const LlamaParallel& parallel = {});
  // input_ids [B, T] (int64) -> final-normed hidden states [B, T, H]. Positions are
  // start_pos .. start_pos + T - 1; start_pos < 0 means the cache's length (0 without cache),
  // and with a cache it must equal the cache's length.
  at::Tensor forward(const at::Tensor& input_ids, LlamaKVCache* cache = nullptr,
                     int64_t start_pos = -1);
  // A padded or packed batch: positions and visible keys from `layout`. With a cache (batched
  // generation) the new tokens follow the cache's keys and layout.attention_mask covers both
  // (SequenceLayout); left-padded rows need their own position_ids.
  at::Tensor forward(const at::Tensor& input_ids, const SequenceLayout& layout, LlamaKVCache* cache = nullptr);
  int64_t num_layers() const { return static_cast<int64_t>(layers->size()); }
  LlamaDecoderLayerImpl& layer(int64_t i);
  // The decoder layers the forward runs: [first_layer, end_layer), all of them unless a pipeline
  // chunk was chosen (run_chunk).
  int64_t first_layer() const { return first_layer_; }
  int64_t end_layer() const { return end_layer_; }
  // Every decoder layer this model holds (a pipeline stage's chunks' layers), ascending.
  const std::vector<int64_t>& kept_layers() const { return kept_layers_; }
  // Pipeline parallelism: drops (unregisters) every module outside `chunks` (the layers of other
  // stages' chunks, the embedding unless a chunk holds it or its tied copy, the final norm unless
  // one holds the output). The dropped modules keep their 0-byte deferred parameters.
  void keep_pipeline_chunks(const std::vector<PipelineChunk>& chunks, bool tied_embedding);
  // The chunk the next forwards run: its layers; from hidden states [B, T, H] ([B, T/tp, H]
  // under sequence parallelism) when it has no embedding, to the last layer's output un-normed
  // when it has no output.
  void run_chunk(const PipelineChunk& chunk);

  LlamaEmbedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};  // LlamaDecoderLayerImpl, registered as "layers"
  LlamaRMSNorm norm{nullptr};
  // Activation recompute (recompute.h): full granularity checkpoints whole layers in
  // run_layers; selective sets each layer's and module's flags.
  void set_recompute(const RecomputeOptions& options);
  const RecomputeOptions& recompute_options() const { return recompute_; }

 private:
  at::Tensor run_layers(const at::Tensor& input_ids, const RotaryTables& rope, LlamaKVCache* cache,
                        const at::Tensor& allowed, const at::Tensor& tokens, const ContextParallelKeys& cp = {});
  // Context parallelism: the whole sequence's length from this rank's part, after checking
  // that no KV cache is used.
  int64_t context_parallel_length(int64_t local_length, const LlamaKVCache* cache) const;
  // The rotary tables of `positions`: the decoder's, or with config.mla its rope part's.
  RotaryTables rope_tables(const at::Tensor& positions) const;
  // Token positions in one row of `input` (ids, or a previous pipeline chunk's hidden states).
  int64_t row_length(const at::Tensor& input) const;
  LlamaConfig config_;
  LlamaParallel parallel_;
  int64_t first_layer_ = 0, end_layer_ = 0;
  bool chunk_embeds_ = true, chunk_outputs_ = true;  // the running chunk's ends
  std::vector<int64_t> kept_layers_;
  RecomputeOptions recompute_;
};
TORCH_MODULE(LlamaModel);

// The Llama family's parallel plan (parallel_plan.h) for `config`: Megatron's column-
// and row-parallel projections, the vocabulary-parallel embedding and output layer, the experts'
// splits under expert tensor parallelism, the norms' and routers' partial gradients, and the
// regions: each attention, dense MLP and shared expert; the root's boundary is the output
// layer's input; context parallelism reaches the model body and each attention, expert
// parallelism each MoE block. The FSDP units: each decoder layer (and, with `experts_apart`,
// each MoE layer's experts, over their expert-data-parallel group); then, untied, embed_tokens
// (not gathered for its backward) and lm_head, so the two vocabulary-sized weights are never
// unsharded together; and the root. Multi-head
// latent attention splits by heads as Megatron's MLA: q_proj / q_b_proj and kv_b_proj
// column-parallel, o_proj row-parallel, the low-rank down-projections and their norms replicated
// with partial gradients (each rank's heads read them).
// A pipeline stage's plan has only the units of what its chunks hold (its layers; the embedding and
// lm_head where it holds them; a tied embedding split over stages is a unit at each end).
ParallelPlan llama_parallel_plan(const LlamaConfig& config, bool experts_apart = false,
                                 const std::vector<PipelineChunk>& chunks = {});

// The causal LM: LlamaModel plus the output projection (HF LlamaForCausalLM); the Llama family's
// CausalLM (causal_lm.h documents the interface). Call it as `model->call(ids)` once sharded.
// Its boundary (the plan's) is the output layer's input.
class LlamaForCausalLMImpl : public CausalLM, public WithParallelBoundary {
 public:
  explicit LlamaForCausalLMImpl(const LlamaConfig& config, const LlamaOptions& options = {});
  at::Tensor forward(const at::Tensor& input_ids, LlamaKVCache* cache = nullptr, int64_t start_pos = -1) override;
  at::Tensor forward(const at::Tensor& input_ids, const SequenceLayout& layout,
                     LlamaKVCache* cache = nullptr) override;
  TokenStats forward_token_stats(const at::Tensor& input, const SequenceLayout& layout, const at::Tensor& targets,
                                 const ChunkedOutputOptions& options) override;

  const LlamaConfig& config() const { return config_; }
  uint64_t init_seed() const { return init_seed_; }
  int64_t num_layers() const override { return config_.num_layers; }
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t max_positions() const override { return config_.max_position_embeddings; }
  void set_use_sdpa(bool on) override;
  void set_recompute(const RecomputeOptions& options) override { model->set_recompute(options); }
  std::vector<std::pair<int64_t, RouterStats>> take_router_stats() override;
  void set_aux_loss_scale(double scale) override;
  void update_expert_bias(int64_t layer, const std::vector<int64_t>& tokens_per_expert) override;

  // Parameter names are HF names; norms start at one, biases at zero, the rest normal(0,
  // init_std), each from its own (init seed, name) generator. A tensor-parallel slice gets its
  // rows or columns of the full parameter's values, so any split starts from the weights of one
  // rank.
  void init_values(const std::string& name, const at::Tensor& out) const override;
  // Re-initialises every parameter in place (what the constructor does in eager mode).
  void reset_parameters();

  // Deferred init: gives every parameter of layer i (resp. the embedding, final norm and
  // lm_head) its storage, growing the existing 0-byte storage in place (the parameter keeps its
  // TensorImpl), and initialises it. Also valid on an eager model (re-initialises). Call before
  // fully_shard: on a module that is already a unit they throw std::logic_error (its
  // parameters are then views of the unit's flat buffer; fill those through init_values).
  void materialize_and_init_layer(int64_t i) override;
  void init_root() override;
  bool has_deferred() const override;

  LlamaModel model{nullptr};
  LlamaLinear lm_head{nullptr};  // null when config.tie_word_embeddings

 private:
  void init_named(const std::string& prefix, torch::nn::Module& module);
  void check_materialized() const;
  at::Tensor logits(const at::Tensor& hidden);  // the output projection (tied or lm_head)


  LlamaConfig config_;
  LlamaParallel parallel_;
  uint64_t init_seed_ = 0;
  std::vector<bool> layer_deferred_;  // per layer: parameters not yet materialised
  bool root_deferred_ = false;
};
TORCH_MODULE(LlamaForCausalLM);

// shard_model (causal_lm.h) for a Llama: the units of its plan (llama_parallel_plan). Throws
// std::logic_error while the model has deferred parameters.
FsdpHandle shard_llama(LlamaForCausalLM& model, const FullyShardOptions& options);

}  // namespace mfsdp
