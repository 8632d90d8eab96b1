// What AdamW and SGD share (internal to src/optim): the validated shards, where in each shard an
// update may write (segment runs), the step counter, the after-step callback, and global-norm
// gradient clipping. A concrete optimizer only supplies `update`.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"
#include "mfsdp/optim/optim.h"

namespace mfsdp {

// A maximal run of adjacent segments: the elements of a shard that one vectorised op covers.
// `decay` lists the maximal runs of weight-decay segments inside it (shard offsets, ascending).
// Padding lies outside every run, so no update and no clipping ever writes it.
struct SegmentRun {
  int64_t offset = 0;
  int64_t length = 0;
  std::vector<ElementRange> decay;
};

// Checks shard `index` of an optimizer (defined 1-D floating-point main weight and main grad of
// equal length, dtype and device; segments in range and disjoint) and merges its segments into
// maximal runs, dropping empty segments. Throws std::invalid_argument naming the shard, the
// segment and the values found. `rank` only labels the message.
std::vector<SegmentRun> plan_segment_runs(const OptimizerShard& shard, size_t index, int rank);

class ShardOptimizer : public DistributedOptimizer {
 public:
  at::Tensor clip_grad_norm_on_device(double max_norm) final;  // grad_clip.cpp
  void set_model_parallel(std::vector<std::shared_ptr<Communicator>> groups,
                          std::vector<std::vector<ElementRange>> not_counted) final;  // grad_clip.cpp
  void step(double lr) final;
  int64_t steps() const final { return steps_; }
  void set_steps(int64_t steps) final;
  std::string name() const final { return name_; }

 protected:
  // Validates every shard (all on one device) and `comm` (not null); `name` labels errors.
  ShardOptimizer(std::string name, std::vector<OptimizerShard> shards,
                 std::shared_ptr<Communicator> comm, std::function<void()> after_step);

  // Updates every run of every shard in place with learning rate `lr`; `step` is the 1-based
  // number of the step being taken (steps() + 1).
  virtual void update(double lr, int64_t step) = 0;

  const std::string name_;
  std::vector<OptimizerShard> shards_;
  std::vector<std::vector<SegmentRun>> runs_;  // runs_[i]: the runs of shards_[i]

 private:
  // Device of the 1-element norm accumulator: the shards' device, or the backend's when this
  // rank holds no shard at all (it must still join the all-reduce).
  at::Device norm_device() const;

  std::shared_ptr<Communicator> comm_;
  std::vector<std::shared_ptr<Communicator>> model_parallel_;  // empty: none (set_model_parallel)
  std::vector<std::vector<ElementRange>> not_counted_;        // per shard, sorted; counted elsewhere
  std::function<void()> after_step_;
  int64_t steps_ = 0;
};

}  // namespace mfsdp
