// Mixture of experts: the router and the MoE block that replaces a decoder layer's MLP
// (docs/moe.md). Megatron-Core's MoELayer as transformers names it: Qwen3-MoE / Qwen2-MoE
// ("mlp": "gate", "experts.{j}.{gate,up,down}_proj", Qwen2-MoE's "shared_expert" and
// "shared_expert_gate") and Mixtral ("block_sparse_moe": "gate", "experts.{j}.{w1,w3,w2}").
//
// Each expert is its own SwiGLU MLP with 2-D weights under its global index, as in Hugging Face
// folders and Megatron-FSDP's checkpoints (".experts.linear_fc1.weight{j}"), so a checkpoint
// names an expert the same whatever the expert-parallel size.
//
// Routing follows Megatron-Core's TopKRouter (router.py, moe_utils.py topk_softmax_with_capacity):
//   softmax: scores = softmax(logits) over every expert, top-k of them, renormalised to sum to
//            one (norm_topk_prob; Megatron's default, which takes the softmax of the top-k
//            logits, is the same numbers) or not (--moe-router-pre-softmax; Qwen3-MoE's
//            norm_topk_prob false);
//   sigmoid: scores = sigmoid(logits), top-k, renormalised when top_k > 1 and norm_topk_prob
//            (DeepSeek-V3's norm_topk_prob; Megatron always renormalises);
//   with expert_bias (DeepSeek-V3's aux-loss-free balancing, sigmoid only): the top-k are chosen
//            by scores + bias, their weights are the scores without it; after each step the
//            bias moves by update_rate x sign(mean - tokens) per expert (updated_expert_bias);
//   group-limited (n_group > 1; DeepSeek-V3's n_group / topk_group, Megatron's
//            --moe-router-num-groups / --moe-router-group-topk): the experts are split into
//            n_group equal groups, each group scored by the sum of its two best choice scores
//            (biased ones with expert_bias), and the top-k are chosen among the experts of the
//            topk_group best groups only; the weights are as above;
//   then times topk_scaling_factor. Dropless unless a capacity factor is given: then each expert
//   keeps at most ceil(tokens x top_k / experts x factor) tokens, those of highest probability,
//   and the others lose that expert (their weight is zero).
// Losses (added to the gradient by the MoE block, reported as Megatron logs them):
//   aux_loss (Switch/GShard):  coeff x E / (k T^2) x sum_e (sum_t p_te) x tokens_e
//   seq_aux_loss:              the same per sequence, averaged over the sequences
//   z_loss:                    coeff x mean_t (logsumexp_e logits_te)^2
// Implemented in src/models/moe/: router.cpp (the router), moe_block.cpp (the block, its experts and dispatch).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/linear.h"
#include "mfsdp/models/parallel_plan.h"

namespace mfsdp {

// The architecture (what a checkpoint's model_config records).
struct MoeConfig {
  int64_t num_experts = 0;      // 0: a dense model
  int64_t top_k = 2;            // experts per token (num_experts_per_tok, --moe-router-topk)
  int64_t ffn_hidden_size = 0;  // each expert's MLP width (moe_intermediate_size, --moe-ffn-hidden-size)
  int64_t shared_expert_intermediate_size = 0;  // 0: no shared expert
  bool shared_expert_gate = false;  // sigmoid(x W_g) scales the shared expert's output (Qwen2-MoE)
  // The shared expert registered as "shared_experts" (DeepSeek-V3's name: its n_shared_experts
  // experts are one MLP of n_shared_experts x moe_intermediate_size) instead of "shared_expert".
  bool shared_experts_name = false;
  enum class Score { kSoftmax, kSigmoid };
  Score score = Score::kSoftmax;
  bool norm_topk_prob = true;        // renormalise the top-k scores (see above)
  double topk_scaling_factor = 1.0;  // --moe-router-topk-scaling-factor
  // Per decoder layer: true for an MoE block, false for the dense MLP (--moe-layer-freq,
  // Qwen's decoder_sparse_step and mlp_only_layers). Empty: every layer.
  std::vector<bool> moe_layers;
  // Hugging Face's names: "mlp" with {gate,up,down}_proj (Qwen), or Mixtral's
  // "block_sparse_moe" with w1 (gate), w3 (up), w2 (down).
  bool mixtral_names = false;
  // A per-expert routing bias "gate.e_score_correction_bias" (fp32, DeepSeek-V3's name;
  // Megatron's router.expert_bias, --moe-router-enable-expert-bias): a buffer, saved with the
  // model, moved by the trainer after each step (updated_expert_bias). Sigmoid scores only.
  bool expert_bias = false;
  // Group-limited routing (see above): n_group groups of num_experts / n_group consecutive
  // experts, the top-k chosen within the topk_group best groups. n_group 1: off.
  int64_t n_group = 1;     // HF n_group, --moe-router-num-groups
  int64_t topk_group = 1;  // HF topk_group, --moe-router-group-topk

  bool is_moe_layer(int64_t layer) const;
  // Throws std::invalid_argument naming the MoeConfig field: positive sizes, 0 < top_k <= experts,
  // scaling factor > 0, moe_layers of `num_layers` entries, expert_bias with sigmoid scores,
  // n_group dividing num_experts, 0 < topk_group <= n_group, top_k <= topk_group x experts per group.
  void validate(int64_t num_layers) const;
};

// How the block trains (Megatron's training arguments, not part of the model).
struct MoeTraining {
  enum class Balancing { kAuxLoss, kSeqAuxLoss, kNone };
  Balancing balancing = Balancing::kAuxLoss;
  double aux_loss_coeff = 0.0;   // --moe-aux-loss-coeff
  double z_loss_coeff = 0.0;     // --moe-z-loss-coeff
  double capacity_factor = 0.0;  // --moe-expert-capacity-factor; <= 0: dropless
  // Experts as one grouped GEMM (at::_grouped_mm over the weights stacked per call,
  // --moe-grouped-gemm) instead of one GEMM per expert over its contiguous tokens.
  bool grouped_gemm = false;
  double bias_update_rate = 1e-3;  // --moe-router-bias-update-rate (with MoeConfig::expert_bias)
};

// One routing decision of T tokens over E experts.
struct Routing {
  at::Tensor logits;     // [T, E], the router's output (autograd)
  at::Tensor probs;      // [T, E], the weight of each (token, expert), zero where not routed (autograd)
  at::Tensor map;        // [T, E] bool, routed (after capacity dropping)
  at::Tensor top_map;    // [T, E] bool, each token's top-k before capacity dropping: what the
                         // balancing losses count (Megatron's compute_routing_scores_for_aux_loss)
  at::Tensor scores;     // [T, E], the full-score distribution the aux loss uses (autograd)
};

// Routes `logits` [T, E] (top_k, score function, normalisation, scaling, capacity); `expert_bias`
// [E] (undefined: none) shifts which experts are chosen, not their weights.
Routing route(const at::Tensor& logits, const MoeConfig& config, double capacity_factor,
              const at::Tensor& expert_bias = {});
// Megatron's get_updated_expert_bias: `bias` + rate x sign(mean - tokens), per expert, from the
// (token, expert) pairs routed to each expert over the whole data-parallel group in one step.
at::Tensor updated_expert_bias(const at::Tensor& bias, const std::vector<int64_t>& tokens_per_expert, double rate);
// Megatron's losses of one routing, before the coefficient (tokens counted by top_map):
// switch_load_balancing_loss_func (tokens counted over the whole batch), sequence_load_balancing_loss_func (`batch` sequences of
// T / batch tokens, token t in sequence t / (T / batch)), z_loss_func. `tokens` [T] bool, false
// at padding (undefined: none): as Megatron's padding_mask, padding neither counts nor weighs,
// and T is the number of tokens (per sequence, their mean). `context_parallel` (null: none): the
// rows are this rank's chunks of sequences split over that group; the counts are summed over it
// and each rank's loss is its share of the whole sequences' loss times the group's size, so the
// ranks' mean (the gradient reduction's) is the loss of the whole sequences.
at::Tensor load_balancing_loss(const Routing& r, int64_t top_k, const at::Tensor& tokens = {},
                               Communicator* context_parallel = nullptr);
at::Tensor sequence_load_balancing_loss(const Routing& r, int64_t top_k, int64_t batch, const at::Tensor& tokens = {},
                                        Communicator* context_parallel = nullptr);
at::Tensor z_loss(const at::Tensor& logits, const at::Tensor& tokens = {}, Communicator* context_parallel = nullptr);
// What a block saw since its counters were last taken: Megatron's log fields.
struct RouterStats {
  double load_balancing_loss = 0;  // sum over forwards of the balancing loss, before its coefficient
  double z_loss = 0;               // same, z-loss
  std::vector<int64_t> tokens_per_expert;  // routed (token, expert) pairs per expert, padding left out
  int64_t forwards = 0;
};

// An expert: SwiGLU MLP, down(silu(gate(x)) * up(x)); a shared expert's boundary may make it a
// tensor-parallel region (parallel_plan.h).
class ExpertMlpImpl : public torch::nn::Module, public WithParallelBoundary {
 public:
  ExpertMlpImpl(int64_t hidden, int64_t intermediate, bool mixtral_names, bool deferred);
  at::Tensor forward(const at::Tensor& x);
  // Whatever their Hugging Face names: gate [I, H], up [I, H], down [H, I].
  LlamaLinear gate{nullptr}, up{nullptr}, down{nullptr};
  // silu(gate) * up checkpointed (moe_act; MoeExperts sets it on its routed experts only).
  bool recompute_activation = false;
};
TORCH_MODULE(ExpertMlp);

// The experts this rank holds: with expert parallelism over `ep` ranks, rank r keeps experts
// [r E / ep, (r + 1) E / ep) (keep()), registered under their global index ("experts.{j}"), so a
// checkpoint names an expert the same at every expert-parallel size. A fully_shard unit of its
// own under expert parallelism (sharded over the expert-data-parallel group), called through the
// runtime: `experts->call(tokens, counts)`.
class MoeExpertsImpl : public ShardedModule<MoeExpertsImpl> {
 public:
  // Each expert `width` wide (its MLP width; a tensor-parallel plan may cut it to this rank's
  // slice under expert tensor parallelism).
  MoeExpertsImpl(int64_t hidden, int64_t width, bool mixtral_names, int64_t first, int64_t count, bool deferred);
  // tokens [n, H] sorted by local expert, counts [count] (int64) rows per local expert ->
  // each row through its expert, [n, H]. `grouped`: one grouped GEMM (at::_grouped_mm) over the
  // weights stacked for the call, with counts on the tokens' device never read by the host;
  // else one GEMM per expert (Megatron's SequentialMLP), which reads counts on the host (one
  // wait for the device when they are on it). An expert without rows still runs, so every
  // expert has a gradient (exactly zero) each step.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& counts, bool grouped);
  ExpertMlpImpl& expert(int64_t local) { return *local_[static_cast<size_t>(local)]; }
  int64_t first() const { return first_; }
  int64_t count() const { return static_cast<int64_t>(local_.size()); }
  // Keeps experts [first, first + count) of those held, unregistering the others.
  void keep(int64_t first, int64_t count);
  // Selective recompute's "moe_act" (recompute.h): each expert's silu(gate) * up checkpointed
  // (in both the per-expert and the grouped-GEMM path).
  bool recompute_activation = false;

 private:
  std::vector<ExpertMlp> local_;
  int64_t first_;
};
MFSDP_MODULE(MoeExperts);

// The MoE block: router "gate", experts "experts.{j}", optional "shared_expert" (or
// "shared_experts", MoeConfig::shared_experts_name) and
// "shared_expert_gate". x [B, T, H] -> [B, T, H]. In training the losses reach the gradient
// through the block's output (Megatron's MoEAuxLossAutoScaler), times aux_loss_scale (the
// trainer's 1 / micro-batches, as Megatron's set_loss_scale). Built with every expert; a plan's
// expert parallelism (parallel_plan.h, parallelize_experts) keeps this rank's. With its `expert`
// group the (token, expert) pairs go to their expert's rank and back by all-to-all (Megatron's
// alltoall token dispatcher), then with `expert_tensor` to every rank of that group (an
// all-gather of the rows, and a reduce-scatter of the partial outputs). With `tokens` the tokens
// are this rank's part of sequences split over that group, and the balancing losses count the
// whole sequences (load_balancing_loss).
class MoeBlockImpl : public torch::nn::Module, public WithExpertParallelism {
 public:
  MoeBlockImpl(int64_t hidden, const MoeConfig& config, bool deferred);
  // Throws std::invalid_argument when the expert-parallel ranks do not divide the experts.
  void parallelize_experts(const ExpertParallelism& groups) override;
  // `tokens` [B x T] bool, false at padding (undefined: none): padding is routed and computed
  // like the rest but not counted (tokens per expert, the expert bias) nor in the losses.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& tokens = {});

  LlamaLinear gate{nullptr};  // the router, [E, H]
  MoeExperts experts{nullptr};
  ExpertMlp shared_expert{nullptr};
  LlamaLinear shared_expert_gate{nullptr};  // [1, H]

  MoeTraining training_options;
  double aux_loss_scale = 1.0;
  // Selective recompute's "shared_experts" (recompute.h): the shared expert (and its gate)
  // checkpointed.
  bool recompute_shared_expert = false;
  // The counters since the last call, and resets them.
  RouterStats take_stats();
  // The aux-loss-free bias (MoeConfig::expert_bias) moved by one step's token counts over the
  // whole data-parallel group, at training_options.bias_update_rate; nothing without the bias.
  void update_expert_bias(const std::vector<int64_t>& tokens_per_expert);

 private:
  at::Tensor expert_bias() const;  // undefined without MoeConfig::expert_bias
  at::Tensor run_experts(const at::Tensor& tokens, const Routing& r);
  // The routed rows `sorted` (grouped by global expert, `counts` [E] on the device) through their
  // experts on the expert-parallel ranks, back in the same order.
  at::Tensor dispatch(const at::Tensor& sorted, const at::Tensor& counts);
  // This rank's rows `rows` (by local expert, `per_expert` rows each: on the host, or on the
  // device for the grouped GEMM) through its experts; under expert tensor parallelism through
  // every slice of the group.
  at::Tensor run_local(const at::Tensor& rows, const at::Tensor& per_expert);
  at::Tensor shared(const at::Tensor& x);  // the shared expert (gated), x [B, T, H]
  MoeConfig config_;
  std::shared_ptr<Communicator> ep_;   // null: every expert is here
  std::shared_ptr<Communicator> etp_;  // null: each expert whole here
  std::shared_ptr<Communicator> sp_;   // null: no sequence parallelism
  std::shared_ptr<Communicator> tokens_;  // null: whole sequences here
  struct Tally {
    at::Tensor balance, z, counts;  // sums since take_stats, on the device
    int64_t forwards = 0;
  } tally_;
};
TORCH_MODULE(MoeBlock);

}  // namespace mfsdp
