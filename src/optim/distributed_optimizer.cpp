// Shard validation, segment-run planning and the step protocol shared by every optimizer.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "optim/shard_optimizer.h"

namespace mfsdp {
namespace {

std::string shard_label(size_t index, int rank) {
  return "OptimizerShard " + std::to_string(index) + " (rank " + std::to_string(rank) + ")";
}

void check_flat(const at::Tensor& t, const char* role, const std::string& where) {
  if (!t.defined()) throw std::invalid_argument(where + ": " + role + " is undefined");
  if (t.dim() != 1) {
    std::ostringstream msg;
    msg << where << ": " << role << " must be 1-D, got shape " << t.sizes();
    throw std::invalid_argument(msg.str());
  }
  if (!t.is_floating_point()) {
    throw std::invalid_argument(where + ": " + role + " must be floating point, got " +
                                c10::toString(t.scalar_type()));
  }
}

}  // namespace

std::vector<SegmentRun> plan_segment_runs(const OptimizerShard& shard, size_t index, int rank) {
  const std::string where = shard_label(index, rank);
  check_flat(shard.main_weight, "main_weight", where);
  check_flat(shard.main_grad, "main_grad", where);
  const int64_t n = shard.main_weight.numel();
  if (shard.main_grad.numel() != n) {
    throw std::invalid_argument(where + ": main_grad length " +
                                std::to_string(shard.main_grad.numel()) +
                                " differs from main_weight length " + std::to_string(n));
  }
  if (shard.main_grad.scalar_type() != shard.main_weight.scalar_type()) {
    throw std::invalid_argument(
        where + ": main_grad dtype " + c10::toString(shard.main_grad.scalar_type()) +
        " differs from main_weight dtype " + c10::toString(shard.main_weight.scalar_type()));
  }
  if (shard.main_grad.device() != shard.main_weight.device()) {
    throw std::invalid_argument(where + ": main_grad is on " + shard.main_grad.device().str() +
                                ", main_weight on " + shard.main_weight.device().str());
  }

  std::vector<ShardSegment> segments;
  for (size_t s = 0; s < shard.segments.size(); ++s) {
    const ShardSegment& seg = shard.segments[s];
    // Written as `length > n - offset` so huge values cannot overflow the check itself.
    if (seg.offset < 0 || seg.length < 0 || seg.offset > n || seg.length > n - seg.offset) {
      throw std::invalid_argument(where + ": segment " + std::to_string(s) + " [offset " +
                                  std::to_string(seg.offset) + ", length " +
                                  std::to_string(seg.length) + "] is out of range of " +
                                  std::to_string(n) + " elements");
    }
    if (seg.length > 0) segments.push_back(seg);
  }
  std::sort(segments.begin(), segments.end(),
            [](const ShardSegment& a, const ShardSegment& b) { return a.offset < b.offset; });

  std::vector<SegmentRun> runs;
  for (const ShardSegment& seg : segments) {
    const bool adjacent = !runs.empty() && runs.back().offset + runs.back().length == seg.offset;
    if (!runs.empty() && runs.back().offset + runs.back().length > seg.offset) {
      throw std::invalid_argument(where + ": segment at offset " + std::to_string(seg.offset) +
                                  " overlaps the segments before it, which end at " +
                                  std::to_string(runs.back().offset + runs.back().length));
    }
    if (!adjacent) runs.push_back(SegmentRun{seg.offset, 0, {}});
    SegmentRun& run = runs.back();
    run.length += seg.length;
    if (!seg.weight_decay) continue;
    std::vector<ElementRange>& decay = run.decay;
    if (!decay.empty() && decay.back().offset + decay.back().length == seg.offset) {
      decay.back().length += seg.length;
    } else {
      decay.push_back(ElementRange{seg.offset, seg.length});
    }
  }
  return runs;
}

ShardOptimizer::ShardOptimizer(std::string name, std::vector<OptimizerShard> shards,
                               std::shared_ptr<Communicator> comm, std::function<void()> after_step)
    : name_(std::move(name)),
      shards_(std::move(shards)),
      comm_(std::move(comm)),
      after_step_(std::move(after_step)) {
  if (!comm_) throw std::invalid_argument(name_ + ": the communicator is null");
  runs_.reserve(shards_.size());
  for (size_t i = 0; i < shards_.size(); ++i) {
    runs_.push_back(plan_segment_runs(shards_[i], i, comm_->rank()));
    // One device for all shards: the norm accumulates into a single tensor.
    if (shards_[i].main_weight.device() != shards_[0].main_weight.device()) {
      throw std::invalid_argument(name_ + ": OptimizerShard " + std::to_string(i) + " is on " +
                                  shards_[i].main_weight.device().str() + ", shard 0 on " +
                                  shards_[0].main_weight.device().str());
    }
  }
}

void ShardOptimizer::step(double lr) {
  if (!std::isfinite(lr) || lr < 0) {
    std::ostringstream msg;
    msg << name_ << ".step: lr must be finite and >= 0, got " << lr;
    throw std::invalid_argument(msg.str());
  }
  {
    // Main weights may be leaves that require grad; the update is not part of any graph.
    at::NoGradGuard no_grad;
    update(lr, steps_ + 1);
  }
  ++steps_;
  if (after_step_) after_step_();
}

void ShardOptimizer::set_steps(int64_t steps) {
  if (steps < 0) throw std::invalid_argument(name_ + ".set_steps: steps must be >= 0, got " + std::to_string(steps));
  steps_ = steps;
}

at::Device ShardOptimizer::norm_device() const {
  if (!shards_.empty()) return shards_.front().main_grad.device();
  return comm_->device();
}

}  // namespace mfsdp
