// A model family's tensor-parallel plan, applied to the model from outside (docs/design.md
// "Parallel plans"), as TorchTitan's parallelize functions apply a plan to a plain module: the
// family declares, by parameter and module name, which weights are column-, row- or
// vocabulary-parallel, which are routed experts, which replicated weights get partial gradients,
// and which modules' inputs and outputs cross the tensor-parallel region. The family builds its
// modules whole; apply_tensor_parallel cuts each split parameter to this rank's slice and sets
// each named module's ParallelBoundary. The modules' forwards call their boundary (an identity
// until a plan sets it) and never name a group; the trainers, checkpoints and the optimizer ask
// the plan (CausalLM::tensor_parallel_split and friends) how a parameter is split.
//
//   ParallelPlan plan;
//   plan.tensor_parallel = {{"model.layers.*.self_attn.q_proj.*", TensorParallelSplit::kRows}, ...};
//   plan.boundaries = {{"model.layers.*.self_attn", TensorParallelBoundary::kRegion}, ...};
//   apply_tensor_parallel(model, plan, {tp_group, /*sequence=*/true, /*experts_split=*/false});
//
// Patterns are fnmatch(3) globs over the full dotted name ('*' spans dots); the first rule that
// matches a name decides.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

// Applies `plan` to `root` (built whole, every parameter deferred: 0-byte storage, full sizes):
// each split parameter becomes its rank's slice (still deferred), each named module's boundary
// is set. Does nothing without tensor parallelism. Throws std::invalid_argument naming a
// parameter whose split dimension does not divide by the group's size, std::logic_error for a
// boundary on a module that has none or a parameter that is not deferred.
void apply_tensor_parallel(torch::nn::Module& root, const ParallelPlan& plan, const TensorParallelism& tp);

}  // namespace mfsdp
