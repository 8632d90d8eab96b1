// A model family's parallel plan, applied to the model from outside (docs/design.md "Parallel
// plans"), as TorchTitan's parallelize functions apply a plan to a plain module: the family
// declares, by parameter and module name, which weights are column-, row- or
// vocabulary-parallel, which are routed experts, which replicated weights get partial gradients,
// which modules' inputs and outputs cross the tensor-parallel region, which modules context and
// expert parallelism reach, and its FSDP units in the order a step runs them. The family builds
// its modules whole; apply_expert_parallel makes each named MoE block keep its rank's experts,
// apply_tensor_parallel cuts each split parameter to this rank's slice and sets each named
// module's ParallelBoundary, apply_context_parallel gives the named modules the group, and
// shard_model (causal_lm.h) makes the units. The modules' forwards call their boundary (an
// identity until a plan sets it) and never name a group. The trainers, checkpoints and the
// optimizer ask the plan (CausalLM::tensor_parallel_split and friends) how a parameter is split.
//
//   ParallelPlan plan;
//   plan.tensor_parallel = {{"model.layers.*.self_attn.q_proj.*", TensorParallelSplit::kRows}, ...};
//   plan.boundaries = {{"model.layers.*.self_attn", TensorParallelBoundary::kRegion}, ...};
//   plan.context_parallel = {"model", "model.layers.*.self_attn"};
//   apply_tensor_parallel(model, plan, {tp_group, /*sequence=*/true, /*experts_split=*/false});
//   apply_context_parallel(model, plan, {cp_group, context_parallel::CpAlgorithm::kRing});
//   plan.expert_parallel = {"model.layers.1.mlp"};
//   apply_expert_parallel(model, plan, {ep_group});
//
// Patterns are fnmatch(3) globs over the full dotted name ('*' spans dots); the first rule that
// matches a name decides.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/models/context_parallel.h"

namespace mfsdp {

class Communicator;

// How a parameter is split over the tensor-parallel ranks (Megatron's partition_dim).
enum class TensorParallelSplit {
  kReplicated,  // whole on every rank: norms
  kRows,        // along dim 0: column-parallel weights and biases, the vocabulary-parallel
                // embedding and output layer (rank r holds rows [r * n/tp, (r + 1) * n/tp))
  kColumns,     // along dim 1: row-parallel weights (their input features)
};

// What a module's input and output do under tensor parallelism.
enum class TensorParallelBoundary {
  // The input enters the region (gathered from the sequence slices under sequence parallelism,
  // else copied with its gradient all-reduced), the output leaves it (reduce-scattered to the
  // sequence slices, else all-reduced): attention and MLP blocks, Megatron's column-parallel
  // layers feeding row-parallel ones.
  kRegion,
  // Only the input enters: the output layer, whose logits stay split by vocabulary.
  kInput,
  // A vocabulary-parallel embedding: this rank looks up the ids of its rows (the others give
  // zero), and the result leaves the region as kRegion's output does.
  kVocabulary,
};

// The tensor-parallel group a plan is applied with.
struct TensorParallelism {
  std::shared_ptr<Communicator> group;  // null or of one rank: no tensor parallelism
  bool sequence = false;                // Megatron's --sequence-parallel
  bool experts_split = false;           // --expert-tensor-parallel-size equal to the group's size
  int size() const;
  int rank() const;
  bool active() const { return size() > 1; }
};

// `group` when it splits something (more than one rank), else null: how a plan's groups are kept.
std::shared_ptr<Communicator> split_group(const std::shared_ptr<Communicator>& group);

// The context-parallel group a plan is applied with.
struct ContextParallelism {
  std::shared_ptr<Communicator> group;  // null or of one rank: no context parallelism
  context_parallel::CpAlgorithm algorithm = context_parallel::CpAlgorithm::kAllGather;  // --cp-comm-type
  int size() const;
  int rank() const;
  bool active() const { return size() > 1; }
  // This rank's queries against the whole sequence's keys and values, exchanged over the group by
  // `algorithm` (context_parallel::cp_attention); the padding mask and packed-segment ids are
  // this rank's parts (undefined: none).
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& global_positions,
                    const at::Tensor& key_padding_mask, const at::Tensor& segment_ids, double scale) const;
};

// The groups a plan's expert parallelism gives an MoE block (each null, or of one rank: not
// split).
struct ExpertParallelism {
  // Expert parallelism: rank r of the group holds experts [r E / ep, (r + 1) E / ep).
  std::shared_ptr<Communicator> expert;
  // Expert tensor parallelism (--expert-tensor-parallel-size, only the tensor-parallel group):
  // each expert's gate/up rows and down columns split over the group (the slices
  // apply_tensor_parallel cuts), as a dense MLP under tensor parallelism; the group's ranks run
  // the union of their rows through their slices.
  std::shared_ptr<Communicator> expert_tensor;
  // Tensor parallelism with sequence parallelism (Megatron trains MoE layers under tensor
  // parallelism only with it): each rank routes its own slice of the sequence; the router's
  // gradient is partial (summed over the group by the trainer), so the balancing losses'
  // gradient is this rank's share.
  std::shared_ptr<Communicator> sequence;
  // The ranks one routing's tokens are spread over (Megatron's tp_cp group: the context-parallel
  // ranks, times the sequence-parallel ones): the balancing losses count over it.
  std::shared_ptr<Communicator> tokens;
};

// One FSDP unit (fully_shard) of a plan, by module name.
struct FsdpUnit {
  std::string module;  // "" is the root
  // The decoder layer the unit is part of (materialised right before its units are sharded, under
  // deferred init); -1: outside the layers (materialised with the root).
  int64_t layer = -1;
  // false: its backward needs no gathered weights (an embedding's reads only the token ids).
  bool unshard_in_backward = true;
  // Routed experts split over expert-parallel ranks (or whole under tensor parallelism): sharded
  // over their own expert-data-parallel group, run inside the unit listed before them.
  bool experts = false;
};

struct ParallelPlan {
  // Dense weights split over the tensor-parallel ranks, by parameter name; unmatched:
  // replicated.
  std::vector<std::pair<std::string, TensorParallelSplit>> tensor_parallel;
  // The routed experts' parameters (every name one of these matches is an expert's), and how
  // expert tensor parallelism splits them (TensorParallelism::experts_split; whole otherwise).
  std::vector<std::pair<std::string, TensorParallelSplit>> experts;
  // Replicated parameters whose gradient each tensor-parallel rank holds only its part of, to be
  // summed over the group (Megatron's sequence_parallel attribute): always (a norm over each of
  // this rank's heads), and under sequence parallelism only (a weight reading this rank's slice
  // of the sequence: norms between the regions, routers).
  std::vector<std::string> partial_gradients;
  std::vector<std::string> sequence_partial_gradients;
  // Module boundaries by module name ("" is the root).
  std::vector<std::pair<std::string, TensorParallelBoundary>> boundaries;
  // The modules context parallelism reaches, by module name: the one that takes each rank's
  // chunks of the sequences in (and gives every layer their global positions), and each
  // attention (this rank's queries against the whole sequence's keys, exchanged over the group).
  std::vector<std::string> context_parallel;
  // The MoE blocks expert parallelism reaches, by module name: each keeps its rank's experts and
  // dispatches tokens over the groups.
  std::vector<std::string> expert_parallel;
  // The FSDP units in the order a training step's forward enters them, the root first; after how
  // many of them (in backward order) the root's own parameters have all their gradients (-1:
  // unknown). shard_model (causal_lm.h) shards them, the memory plan schedules them.
  std::vector<FsdpUnit> fsdp_units;
  int root_gradients_after = -1;

  // How `name` is split under `tp` (kReplicated without tensor parallelism).
  TensorParallelSplit split(const std::string& name, const TensorParallelism& tp) const;
  bool is_expert(const std::string& name) const;
  bool partial_gradient(const std::string& name, const TensorParallelism& tp) const;
  std::optional<TensorParallelBoundary> boundary(const std::string& module_name) const;
};

// The boundary a plan gives a module; an identity until set.
class ParallelBoundary {
 public:
  void set(TensorParallelBoundary kind, std::shared_ptr<Communicator> group, bool sequence);
  // x as the module's computation takes it in (kRegion, kInput: entered; else x).
  at::Tensor enter(const at::Tensor& x) const;
  // y as the module gives it out (kRegion, kVocabulary: left; else y).
  at::Tensor leave(const at::Tensor& y) const;
  // ids looked up in `weight`, this rank's rows of the vocabulary under kVocabulary.
  at::Tensor embed(const at::Tensor& ids, const at::Tensor& weight) const;
  bool active() const { return kind_.has_value(); }

 private:
  std::optional<TensorParallelBoundary> kind_;
  std::shared_ptr<Communicator> group_;
  bool sequence_ = false;
};

// A module that has a boundary for a plan to set (inherit beside torch::nn::Module).
class WithParallelBoundary {
 public:
  virtual ~WithParallelBoundary() = default;
  ParallelBoundary parallel_boundary;
};

// A module a plan's context parallelism reaches (inherit beside torch::nn::Module): inactive
// until set.
class WithContextParallelism {
 public:
  virtual ~WithContextParallelism() = default;
  ContextParallelism context_parallelism;
};

// An MoE block a plan's expert parallelism reaches (inherit beside torch::nn::Module).
class WithExpertParallelism {
 public:
  virtual ~WithExpertParallelism() = default;
  // Keeps this rank's experts (built whole, still deferred) and routes over `groups`.
  virtual void parallelize_experts(const ExpertParallelism& groups) = 0;
};

// Applies `plan` to `root` (built whole, every parameter deferred: 0-byte storage, full sizes):
// each split parameter becomes its rank's slice (still deferred), each named module's boundary
// is set. Does nothing without tensor parallelism. Throws std::invalid_argument naming a
// parameter whose split dimension does not divide by the group's size, std::logic_error for a
// boundary on a module that has none or a parameter that is not deferred.
void apply_tensor_parallel(torch::nn::Module& root, const ParallelPlan& plan, const TensorParallelism& tp);

// Gives each module the plan's context_parallel names `cp`. Does nothing without context
// parallelism. Throws std::logic_error naming a module that cannot take it.
void apply_context_parallel(torch::nn::Module& root, const ParallelPlan& plan, const ContextParallelism& cp);

// Gives each MoE block the plan's expert_parallel names `groups` (before apply_tensor_parallel
// cuts the experts it keeps). Throws std::logic_error naming a module that cannot take them.
void apply_expert_parallel(torch::nn::Module& root, const ParallelPlan& plan, const ExpertParallelism& groups);

}  // namespace mfsdp
