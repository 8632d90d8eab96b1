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
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/fsdp/fully_shard.h"

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
  // transformers' LlamaConfig.attention_bias, which also puts one on o_proj: hf_llama.h refuses
  // that.
  bool attention_bias = false;
  // The MLP: true, Llama's SwiGLU, down_proj(silu(gate_proj(x)) * up_proj(x)); false, the MLP
  // Megatron builds without --swiglu, down_proj(gelu(up_proj(x))) with the exact (erf) GeLU, no
  // gate_proj (HF names as in Nemotron's non-gated MLP). Only SwiGLU models are Hugging Face
  // Llama/Qwen2 models: hf_llama.h writes the other with hidden_act "gelu" and gated_mlp false
  // for checkpoints and refuses it in an HF folder.
  bool swiglu = true;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // Throws std::invalid_argument naming the field: every size positive, heads divide
  // hidden_size, key/value heads divide heads, an even head_dim (RoPE rotates pairs),
  // rope_theta > 0, rms_norm_eps >= 0, init_std >= 0.
  void validate() const;
};

// Megatron-LM's MLP width when --ffn-hidden-size is not given (its arguments.py): 4 x hidden,
// or with --swiglu int(4 x hidden x 2/3 / 64) x 64, which keeps the three SwiGLU matrices near
// the parameters of the two GeLU ones, at a multiple of 64. 0 for a SwiGLU hidden_size under 48.
int64_t megatron_default_ffn_hidden_size(int64_t hidden_size, bool swiglu);

// How the model is built (not part of the checkpointed config).
struct LlamaOptions {
  // Every parameter gets its full sizes but a 0-byte storage; nothing is allocated or
  // initialised until materialize_and_init_layer(i) / init_root() (--init-model-with-meta-device).
  bool deferred_init = false;
  // Full activation recompute per decoder layer (--recompute-granularity full): each layer's
  // activations are recomputed in backward instead of kept. Ignored when there is no backward
  // (no grad mode) or with a KV cache.
  bool recompute_layers = false;
  // Init seed; unset: drawn from the default CPU generator (so torch::manual_seed decides).
  std::optional<uint64_t> init_seed;
};

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

// ---- Padded and packed batches ---------------------------------------------------------------

// Per-row positions and which keys each query may see. Every field is optional.
// With a KV cache holding `past` positions (batched generation, left-padded prompts), the T new
// tokens are keys past .. past + T - 1 and attention_mask covers every key, cached and new:
// [B, past + T] (transformers' convention); position_ids are the new tokens' positions.
struct SequenceLayout {
  at::Tensor position_ids;    // [B, T] int64 RoPE positions; undefined: past .. past + T - 1
  at::Tensor attention_mask;  // [B, past + T], nonzero for tokens, 0 for padding (never a key);
                              // undefined: no padding
  at::Tensor segment_ids;     // [B, T] int64, packed samples: a query sees only keys of its own
                              // segment (with position_ids restarting per sample); undefined: one.
                              // Not with a cache (past > 0).
  // [B, 1, T, past + T] bool: query i (key index past + i) may see key j (j <= past + i, a token,
  // the same segment). Padding queries see themselves, so no row of the softmax is empty; their
  // outputs mean nothing. Throws std::invalid_argument on a misshapen field.
  at::Tensor allowed_keys(int64_t batch, int64_t length, const at::Device& device, int64_t past = 0) const;
};

// ---- KV cache for incremental decoding --------------------------------------------------

// Keys and values of every layer for the positions seen so far; each layer appends its new
// positions in its forward. One cache per sequence batch; not used in training.
class LlamaKVCache {
 public:
  explicit LlamaKVCache(int64_t num_layers);
  // Positions cached (layer 0's count; every layer has the same after a whole forward).
  int64_t length() const;
  // Appends k, v ([B, nkv, T, hd], RoPE already applied) for `layer` and returns the layer's
  // keys and values for all positions so far ([B, nkv, S, hd]).
  std::pair<at::Tensor, at::Tensor> append(int64_t layer, const at::Tensor& k, const at::Tensor& v);
  void clear();
  int64_t num_layers() const { return static_cast<int64_t>(keys_.size()); }

 private:
  std::vector<at::Tensor> keys_;    // per layer [B, nkv, S, hd]
  std::vector<at::Tensor> values_;  // per layer [B, nkv, S, hd]
};

// ---- Modules ----------------------------------------------------------------------------

// y = x @ weight^T (+ bias). Its own type (not torch::nn::Linear, which allocates and
// kaiming-initialises at construction) so parameters can be deferred.
class LlamaLinearImpl : public torch::nn::Module {
 public:
  LlamaLinearImpl(int64_t in_features, int64_t out_features, bool deferred, bool bias = false);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;  // [out, in]
  at::Tensor bias;    // [out]; undefined (not a parameter) without bias
};
TORCH_MODULE(LlamaLinear);

class LlamaEmbeddingImpl : public torch::nn::Module {
 public:
  LlamaEmbeddingImpl(int64_t num_embeddings, int64_t dim, bool deferred);
  at::Tensor forward(const at::Tensor& ids);
  at::Tensor weight;  // [V, H]
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
class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& config, int64_t layer_idx, bool deferred);
  // x: [B, T, H]; rope: tables for the T new positions; cache: null in training. Query t (at
  // key index start + t, start = keys cached before this call) attends to keys 0 .. start + t.
  // `allowed` [B, 1, T, S] bool (SequenceLayout::allowed_keys; S = cached + T) replaces that
  // causal mask.
  at::Tensor forward(const at::Tensor& x, const RotaryTables& rope, LlamaKVCache* cache,
                     const at::Tensor& allowed = {});
  LlamaLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  // false: the explicit math path (matmul, causal mask, fp32 softmax, matmul), Hugging Face's
  // eager attention; the reference SDPA is checked against (tests/unit/llama_test.cpp).
  bool use_sdpa = true;

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_, layer_idx_;
};
TORCH_MODULE(LlamaAttention);

// SwiGLU: down(silu(gate(x)) * up(x)); without config.swiglu: down(gelu(up(x))), no gate.
class LlamaMLPImpl : public torch::nn::Module {
 public:
  LlamaMLPImpl(const LlamaConfig& config, bool deferred);
  at::Tensor forward(const at::Tensor& x);
  LlamaLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

// Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)). A fully_shard unit: call it as
// `layer->call(hidden, rope, cache)`.
class LlamaDecoderLayerImpl : public ShardedModule<LlamaDecoderLayerImpl> {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& config, int64_t layer_idx, bool deferred);
  at::Tensor forward(const at::Tensor& hidden, const RotaryTables& rope, LlamaKVCache* cache,
                     const at::Tensor& allowed = {});
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// Embedding, the decoder layers, the final norm (HF LlamaModel).
class LlamaModelImpl : public torch::nn::Module {
 public:
  LlamaModelImpl(const LlamaConfig& config, bool deferred);
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

  LlamaEmbedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};  // LlamaDecoderLayerImpl, registered as "layers"
  LlamaRMSNorm norm{nullptr};
  bool recompute_layers = false;

 private:
  at::Tensor run_layers(const at::Tensor& input_ids, const RotaryTables& rope, LlamaKVCache* cache,
                        const at::Tensor& allowed);
  LlamaConfig config_;
};
TORCH_MODULE(LlamaModel);

// The causal LM: LlamaModel plus the output projection (HF LlamaForCausalLM). A ShardedModule so
// that the root unit runs its hooks: call it as `model->call(ids)` once fully_shard is applied.
class LlamaForCausalLMImpl : public ShardedModule<LlamaForCausalLMImpl> {
 public:
  explicit LlamaForCausalLMImpl(const LlamaConfig& config, const LlamaOptions& options = {});
  // input_ids [B, T] -> logits [B, T, V] in the parameters' dtype. See LlamaModelImpl::forward.
  // Throws std::logic_error while deferred parameters are not yet initialised.
  at::Tensor forward(const at::Tensor& input_ids, LlamaKVCache* cache = nullptr,
                     int64_t start_pos = -1);
  at::Tensor forward(const at::Tensor& input_ids, const SequenceLayout& layout, LlamaKVCache* cache = nullptr);

  const LlamaConfig& config() const { return config_; }
  uint64_t init_seed() const { return init_seed_; }
  void set_recompute_layers(bool on) { model->recompute_layers = on; }

  // Fills `out` (any dtype/device, the parameter's shape) with the initial values of the
  // parameter named `name` (its HF name): the same values whenever and wherever it is called.
  void init_values(const std::string& name, const at::Tensor& out) const;
  // Re-initialises every parameter in place (what the constructor does in eager mode).
  void reset_parameters();

  // Deferred init: gives every parameter of layer i (resp. the embedding, final norm and
  // lm_head) its storage, growing the existing 0-byte storage in place (the parameter keeps its
  // TensorImpl), and initialises it. Also valid on an eager model (re-initialises). Call before
  // fully_shard: on a module that is already a unit they throw std::logic_error (its
  // parameters are then views of the unit's flat buffer; fill those through init_values).
  void materialize_and_init_layer(int64_t i);
  void init_root();
  // True while some parameter still waits for materialize_and_init_layer / init_root.
  bool has_deferred() const;

  LlamaModel model{nullptr};
  LlamaLinear lm_head{nullptr};  // null when config.tie_word_embeddings

 private:
  void init_named(const std::string& prefix, torch::nn::Module& module);
  void check_materialized() const;
  at::Tensor logits(const at::Tensor& hidden);  // the output projection (tied or lm_head)

  LlamaConfig config_;
  uint64_t init_seed_ = 0;
  std::vector<bool> layer_deferred_;  // per layer: parameters not yet materialised
  bool root_deferred_ = false;
};
TORCH_MODULE(LlamaForCausalLM);

// Applies fully_shard to every decoder layer, then shard_llama_root; returns the root handle.
// Throws std::logic_error while the model has deferred parameters (fully_shard copies every
// parameter into its flat buffer).
FsdpHandle shard_llama(LlamaForCausalLM& model, const FullyShardOptions& options);
// The part after the layers: with untied embeddings, embed_tokens and lm_head become units of
// their own (the two vocabulary-sized weights are never unsharded together); then the root
// (the final norm, and the tied embedding). For callers that shard layer by layer.
FsdpHandle shard_llama_root(LlamaForCausalLM& model, const FullyShardOptions& options);

// ---- Loss ---------------------------------------------------------------------------------

// Mean cross entropy over tokens whose label != ignore_index, computed in fp32.
// logits [B, T, V], labels [B, T] (already aligned: labels[b, t] is the target of position t).
// NaN when every label is ignored (as torch's mean reduction).
at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index = -100);

// --calculate-per-token-loss: the summed cross entropy and the number of counted tokens, so the
// trainer can divide by the global token count after reducing both across ranks.
struct TokenLossSum {
  at::Tensor sum;         // fp32 scalar, differentiable
  at::Tensor num_tokens;  // int64 scalar on the logits' device
};
TokenLossSum lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels,
                         int64_t ignore_index = -100);

}  // namespace mfsdp
