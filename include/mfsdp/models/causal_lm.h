// What the trainers, checkpoints and generation call on a causal language model of any family
// (docs/design.md "Model families"). A family (src/models/<family>/) implements CausalLM and
// describes itself with a ModelSpec (model_spec.h); nothing above the models layer names a family.
//
//   std::shared_ptr<mfsdp::CausalLM> model = config.spec->build(config, {});
//   mfsdp::FsdpHandle root = mfsdp::shard_model(*model, options);   // its units, then the root
//   at::Tensor logits = model->call(input_ids);                       // [B, T, V]
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/fsdp/memory_plan.h"
#include "mfsdp/fsdp/recompute.h"
#include "mfsdp/models/chunked_output.h"
#include "mfsdp/models/context_parallel.h"
#include "mfsdp/models/moe.h"
#include "mfsdp/models/parallel_plan.h"
#include "mfsdp/models/pipeline_split.h"

namespace mfsdp {

// How a model is built (not part of its checkpointed config).
struct ModelBuildOptions {
  // Every parameter gets its full sizes but a 0-byte storage; nothing is allocated or
  // initialised until materialize_and_init_layer(i) / init_root() (--init-model-with-meta-device).
  bool deferred_init = false;
  // Activation recompute (--recompute-granularity, --recompute-method, --recompute-num-layers,
  // --recompute-modules; RecomputeOptions in recompute.h). Ignored when there is no backward
  // (no grad mode) or with a KV cache.
  RecomputeOptions recompute;
  // Shorthand kept for existing callers: true means recompute = RecomputeOptions::every_layer()
  // (full, uniform, one layer per checkpoint), whatever `recompute` says.
  bool recompute_layers = false;
  RecomputeOptions effective_recompute() const {
    return recompute_layers ? RecomputeOptions::every_layer() : recompute;
  }
  // Init seed; unset: drawn from the default CPU generator (so torch::manual_seed decides).
  std::optional<uint64_t> init_seed;
  // How MoE layers train (Megatron's --moe-* training arguments); ignored by dense models.
  MoeTraining moe;
  // Expert parallelism: the ranks a layer's experts are split over (this rank holds its share,
  // include/mfsdp/models/moe.h); null or size 1: every expert on every rank.
  std::shared_ptr<Communicator> expert_parallel;
  // Expert tensor parallelism (--expert-tensor-parallel-size): the group each expert's MLP width
  // is split over, which is the tensor-parallel group; null: every expert whole (ETP 1: under
  // tensor parallelism the experts then are sharded over the expert-data-parallel group, which
  // spans the tensor-parallel ranks).
  std::shared_ptr<Communicator> expert_tensor_parallel;
  // Tensor parallelism (Megatron's): the ranks each layer's heads and MLP columns, the
  // vocabulary of the embedding and of the output layer are split over (this rank holds its
  // slice of each such parameter, tensor_parallel_split); null or size 1: none. Every rank of the
  // group must build the model with the same config and seed and run the same forwards.
  std::shared_ptr<Communicator> tensor_parallel;
  // Megatron's --sequence-parallel (with tensor_parallel only): outside the tensor-parallel
  // regions (norms, residual adds) each rank holds its slice of the sequence, [B, T/tp, H].
  bool sequence_parallel = false;
  // Context parallelism (Megatron's): the ranks every sequence is split over, each holding its
  // load-balanced chunks (context_parallel.h: chunks r and 2 x CP - 1 - r of 2 x CP); attention
  // exchanges keys and values over the group by `context_parallel_algorithm`. null or size 1:
  // none. The caller gives each rank its part of the ids, labels and layout
  // (context_parallel::shard_sequence along dim 1); no KV cache.
  std::shared_ptr<Communicator> context_parallel;
  context_parallel::CpAlgorithm context_parallel_algorithm = context_parallel::CpAlgorithm::kAllGather;
  // The tensor- and context-parallel ranks together (Megatron's tp_cp group), needed with both
  // and sequence parallelism: the tokens MoE layers count their balancing losses over.
  std::shared_ptr<Communicator> tensor_context_parallel;
  // Pipeline parallelism: the model chunks this rank holds (pipeline_split.h's stage_chunks: one,
  // or several with interleaving; each its decoder layers, whether it holds the embedding, and
  // the final norm and output layer); empty: the whole model. Names stay global
  // ("model.layers.<i>"), so checkpoints do not depend on the split. The forward runs the chunk
  // CausalLM::select_pipeline_chunk chose: from the token ids when it holds the embedding, else
  // from the previous chunk's hidden states, to logits when it holds the output layer, else to
  // its hidden states.
  std::vector<PipelineChunk> pipeline;
};

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
class KVCache {
 public:
  explicit KVCache(int64_t num_layers);
  // Positions cached (layer 0's count; every layer has the same after a whole forward).
  int64_t length() const;
  // Appends k, v ([B, nkv, T, hd], RoPE already applied) for `layer` and returns the layer's
  // keys and values for all positions so far ([B, nkv, S, hd]). v may be narrower or wider
  // than k (multi-head latent attention's value heads).
  std::pair<at::Tensor, at::Tensor> append(int64_t layer, const at::Tensor& k, const at::Tensor& v);
  void clear();
  int64_t num_layers() const { return static_cast<int64_t>(keys_.size()); }

 private:
  std::vector<at::Tensor> keys_;    // per layer [B, nkv, S, hd]
  std::vector<at::Tensor> values_;  // per layer [B, nkv, S, hd]
};

// ---- The model ------------------------------------------------------------------------------

// A decoder-only language model: token ids in, logits out. A ShardedModule, so the root unit
// runs its hooks: call it as `model->call(ids)` once sharded. Parameters carry the family's
// Hugging Face names, which checkpoints store as "model.<name>".
class CausalLM : public ShardedModule<CausalLM> {
 public:
  // input_ids [B, T] -> logits [B, T, V] in the parameters' dtype; with tensor parallelism this
  // rank's vocabulary slice [B, T, V/tp] (tensor_parallel::vocab_range; the losses of
  // tensor_parallel.h take it as it is). Positions are
  // start_pos .. start_pos + T - 1; start_pos < 0 means the cache's length (0 without cache),
  // and with a cache it must equal the cache's length. Throws std::logic_error while deferred
  // parameters are not yet initialised.
  virtual at::Tensor forward(const at::Tensor& input_ids, KVCache* cache = nullptr, int64_t start_pos = -1) = 0;
  // A padded or packed batch: positions and visible keys from `layout`. With a cache (batched
  // generation) the new tokens follow the cache's keys and layout.attention_mask covers both.
  virtual at::Tensor forward(const at::Tensor& input_ids, const SequenceLayout& layout,
                             KVCache* cache = nullptr) = 0;

  // The fused loss (--cross-entropy-loss-fusion, chunked_output.h): the forward of `input` (token
  // ids, or the previous pipeline chunk's hidden states) laid out by `layout`, then per token the
  // log-probability of `targets` [B, T] (and the entropy with options.entropy) from the output
  // layer in chunks of the vocabulary, never the full logits; vocabulary-parallel under tensor
  // parallelism (options.tensor_parallel is the model's own group). Call it through the root
  // unit's hooks as token_stats(...); with pipeline parallelism only on a chunk that holds the
  // output layer (std::logic_error otherwise).
  virtual TokenStats forward_token_stats(const at::Tensor& input, const SequenceLayout& layout,
                                         const at::Tensor& targets, const ChunkedOutputOptions& options) = 0;
  TokenStats token_stats(const at::Tensor& input, const SequenceLayout& layout, const at::Tensor& targets,
                         const ChunkedOutputOptions& options = {}) {
    const std::vector<at::Tensor> out = call_as_forward(*this, input, [&](const at::Tensor& in) {
      TokenStats s = forward_token_stats(in, layout, targets, options);
      return std::vector<at::Tensor>{s.log_probs, s.entropy};
    });
    return {out[0], out[1]};
  }

  virtual int64_t num_layers() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_positions() const = 0;  // positions must lie in [0, max_positions())

  // false: attention through the explicit math path (--attention-backend unfused), the
  // reference the fused kernels are checked against; true (the default): scaled_dot_product_attention.
  virtual void set_use_sdpa(bool on) = 0;
  // Activation recompute from now on (RecomputeOptions, recompute.h).
  virtual void set_recompute(const RecomputeOptions& options) = 0;
  // true: full recompute of every layer (RecomputeOptions::every_layer()); false: none.
  void set_recompute_layers(bool on) { set_recompute(on ? RecomputeOptions::every_layer() : RecomputeOptions{}); }

  // Mixtures of experts (moe.h); a dense model has no MoE layers and ignores the scale.
  // Each MoE layer's router statistics since the last call, by layer index.
  virtual std::vector<std::pair<int64_t, RouterStats>> take_router_stats() { return {}; }
  // The gradient the balancing losses of one forward get (Megatron's MoEAuxLossAutoScaler scale:
  // the trainer's 1 / micro-batches, as its language-model loss).
  virtual void set_aux_loss_scale(double /*scale*/) {}
  // Moves layer `layer`'s aux-loss-free routing bias (MoeConfig::expert_bias) by one step's token
  // counts per expert over the data-parallel group; nothing for a layer without one.
  virtual void update_expert_bias(int64_t /*layer*/, const std::vector<int64_t>& /*tokens_per_expert*/) {}

  // Tensor parallelism (ModelBuildOptions), as the family's plan applied it (parallel_plan.h):
  // the group (null without), whether the sequence is split outside the tensor-parallel regions,
  // and how each parameter (by name) is split.
  std::shared_ptr<Communicator> tensor_parallel() const {
    return tensor_parallelism_.active() ? tensor_parallelism_.group : nullptr;
  }
  bool sequence_parallel() const { return tensor_parallelism_.active() && tensor_parallelism_.sequence; }
  TensorParallelSplit tensor_parallel_split(const std::string& name) const {
    return parallel_plan_.split(name, tensor_parallelism_);
  }
  // True for a replicated parameter whose gradient each tensor-parallel rank holds only its part
  // of, to be summed over the group (Megatron's sequence_parallel parameters and q/k layernorms):
  // the norms under sequence parallelism, a per-head norm under any tensor parallelism.
  bool tensor_parallel_partial_grad(const std::string& name) const {
    return parallel_plan_.partial_gradient(name, tensor_parallelism_);
  }
  // True for a routed expert's parameter: sharded over the expert-data-parallel group, never
  // duplicated over the tensor-parallel ranks (with experts whole, those ranks hold other experts
  // or other shards of them), so counted and saved by every rank that holds it.
  bool expert_parameter(const std::string& name) const { return parallel_plan_.is_expert(name); }
  const ParallelPlan& parallel_plan() const { return parallel_plan_; }
  // Context parallelism (ModelBuildOptions), as the family's plan applied it: the group, null
  // without.
  std::shared_ptr<Communicator> context_parallel() const {
    return context_parallelism_.active() ? context_parallelism_.group : nullptr;
  }

  // Pipeline parallelism (ModelBuildOptions::pipeline): the chunks this model holds (empty: the
  // whole model), and the one its forward runs (unset without pipeline parallelism).
  const std::vector<PipelineChunk>& pipeline_chunks() const { return pipeline_chunks_; }
  std::optional<PipelineChunk> pipeline_chunk() const {
    if (pipeline_chunks_.empty()) return std::nullopt;
    return pipeline_chunks_[static_cast<size_t>(active_chunk_)];
  }
  // Makes chunk `chunk` (an index into pipeline_chunks()) the one the next forwards run.
  void select_pipeline_chunk(int chunk) {
    if (chunk < 0 || chunk >= static_cast<int>(pipeline_chunks_.size()))
      throw std::out_of_range("CausalLM::select_pipeline_chunk: chunk " + std::to_string(chunk) + " of " +
                              std::to_string(pipeline_chunks_.size()));
    active_chunk_ = chunk;
  }
  // Whether some chunk of this model holds the embedding / the output layer (true without
  // pipeline parallelism).
  bool holds_embedding() const {
    for (const PipelineChunk& c : pipeline_chunks_)
      if (c.embedding) return true;
    return pipeline_chunks_.empty();
  }
  bool holds_output() const {
    for (const PipelineChunk& c : pipeline_chunks_)
      if (c.output) return true;
    return pipeline_chunks_.empty();
  }
  // The embedding weight a tied output layer reads (on every stage); empty when untied.
  const std::string& tied_embedding() const { return tied_embedding_; }
  // With tied embeddings, a pipeline stage that holds the output layer but not the embedding
  // keeps its own copy of the embedding weight (Megatron's shared_embedding_or_output_weight):
  // its gradient is summed with the first stage's, and it is neither saved nor counted twice.
  // The name of that copy's parameter; empty when this model holds none.
  std::string embedding_copy() const {
    return holds_output() && !holds_embedding() ? tied_embedding_ : std::string();
  }

  // Fills `out` (any dtype/device, the parameter's shape) with the initial values of the
  // parameter named `name`: the same values whenever and wherever it is called.
  virtual void init_values(const std::string& name, const at::Tensor& out) const = 0;
  // Deferred init: gives every parameter of layer i (resp. those outside the layers) its storage
  // and initial values. Call before the module becomes a fully_shard unit (std::logic_error after).
  virtual void materialize_and_init_layer(int64_t i) = 0;
  virtual void init_root() = 0;
  // True while some parameter still waits for materialize_and_init_layer / init_root.
  virtual bool has_deferred() const = 0;

  // The plan's FSDP units in the order a training step runs them (StepShape's forward_order and
  // root_gradients_after; the caller fills the micro-batches and optimizer states), for the
  // memory plan. Tests compare plans with what runs (tests/dist/memory_plan_test.cpp).
  StepShape unit_schedule() const;

 protected:
  // A family builds its modules whole and deferred, declares its plan, and applies it with the
  // groups before it initialises any parameter (parallel_plan.h): the MoE blocks keep their
  // rank's experts, then the split parameters are cut, then context parallelism is set.
  void apply_parallel_plan(ParallelPlan plan, TensorParallelism tensor_parallelism,
                           ContextParallelism context_parallelism, const ExpertParallelism& expert_parallelism,
                           std::vector<PipelineChunk> pipeline = {}, std::string tied_embedding = {}) {
    pipeline_chunks_ = std::move(pipeline);
    tied_embedding_ = std::move(tied_embedding);
    parallel_plan_ = std::move(plan);
    tensor_parallelism_ = std::move(tensor_parallelism);
    context_parallelism_ = std::move(context_parallelism);
    apply_expert_parallel(*this, parallel_plan_, expert_parallelism);
    apply_tensor_parallel(*this, parallel_plan_, tensor_parallelism_);
    apply_context_parallel(*this, parallel_plan_, context_parallelism_);
  }

 private:
  ParallelPlan parallel_plan_;
  TensorParallelism tensor_parallelism_;
  ContextParallelism context_parallelism_;
  std::vector<PipelineChunk> pipeline_chunks_;
  int active_chunk_ = 0;
  std::string tied_embedding_;  // the embedding weight a tied output layer reads; empty: untied
};

// fully_shard over the plan's units (ParallelPlan::fsdp_units): each layer's units, deepest first
// (an MoE layer's experts before the layer), then the units outside the layers, then the root;
// returns the root handle. A model built with deferred parameters
// (ModelBuildOptions::deferred_init) has each layer materialised and initialised just before its
// units are sharded, and the rest before the units outside the layers, so no rank ever holds
// more than one unsharded layer beyond the root's parameters. `experts_options` (expert
// parallelism: over the ranks holding the same experts as this one, a 1-D communicator or the
// HSDP mesh of them): the experts' units are sharded with them; without it they stay in their
// layer's unit.
FsdpHandle shard_model(CausalLM& model, const FullyShardOptions& options,
                       const FullyShardOptions* experts_options = nullptr);

}  // namespace mfsdp
