#include "fsdp/transient_schedule.h"

#include <algorithm>
#include <deque>

namespace mfsdp::detail {
namespace {

// Unit 0 is the root; children 1..n-1 in forward order, so the backward order is 0, n-1, ..., 1.
class Replay {
 public:
  Replay(const std::vector<UnitTransients>& units, const ScheduleOptions& o)
      : u_(units), o_(o), n_(static_cast<int>(units.size())), gathered_(n_), grad_(n_), accum_(n_) {}

  TransientPeak run() {
    if (o_.all_gather_in_start_param_sync) gather(0, "all-gather of " + name(0) + " after the optimizer step");
    const int64_t steps = std::max<int64_t>(1, o_.micro_batches);
    for (int64_t m = 0; m < steps; ++m) {
      sync_ = m == steps - 1;
      forward();
      backward();
    }
    return peak_;
  }

 private:
  int backward_unit(int k) const { return k == 0 ? 0 : n_ - k; }
  const std::string& name(int i) const { return u_[i].path.empty() ? root_name_ : u_[i].path; }

  void add(int64_t bytes, const std::string& where) {
    now_ += bytes;
    if (bytes > 0 && now_ > peak_.bytes) peak_ = {now_, where};
  }
  void gather(int i, const std::string& where) {
    if (gathered_[i] || u_[i].weights == 0) return;
    gathered_[i] = true;
    add(u_[i].weights, where);
  }
  void reshard(int i) {
    if (!gathered_[i]) return;
    gathered_[i] = false;
    now_ -= u_[i].weights;
  }
  void release_gradients(int i) {
    if (grad_[i]) now_ -= u_[i].gradients;
    if (accum_[i]) now_ -= u_[i].accumulator;
    grad_[i] = accum_[i] = false;
  }
  // UnitState::kept_for_backward: the root and the first child of the backward order.
  bool kept_for_backward(int i) const {
    return u_[i].unshard_in_backward && (i == 0 || (o_.prefetch && n_ > 1 && i == backward_unit(1)));
  }
  // UnitState::kept_for_next_forward: without gradient sync, the first two units of the forward.
  bool kept_for_next_forward(int i) const { return !sync_ && o_.prefetch && i < 2; }

  void forward() {
    gather(0, "forward of " + name(0));
    if (o_.prefetch && n_ > 1) gather(1, "forward of " + name(0) + " (prefetching " + name(1) + ")");
    for (int i = 1; i < n_; ++i) {
      gather(i, "forward of " + name(i));
      if (o_.prefetch && i + 1 < n_) gather(i + 1, "forward of " + name(i) + " (prefetching " + name(i + 1) + ")");
      if (o_.reshard_after_forward && !kept_for_backward(i)) reshard(i);
    }
  }

  void pre_backward(int i, int next) {
    const std::string where = "backward of " + name(i);
    if (u_[i].unshard_in_backward) gather(i, where);
    if (o_.prefetch && next >= 0 && u_[next].unshard_in_backward)
      gather(next, where + " (prefetching " + name(next) + ")");
    if (!grad_[i] && u_[i].gradients > 0) {
      grad_[i] = true;
      add(u_[i].gradients, where);
    }
  }

  void post_backward(int i) {
    if (!sync_) {
      if (u_[i].accumulator > 0 && grad_[i]) {  // GradientReducer::stash: into the main-grad dtype
        if (!accum_[i]) add(u_[i].accumulator, "backward of " + name(i) + " (accumulating a micro-batch)");
        accum_[i] = true;
        grad_[i] = false;
        now_ -= u_[i].gradients;
      }
    } else {
      finish_pending();
      if (o_.deferred_reduction) {
        release_gradients(i);
      } else {
        pending_.push_back(i);
      }
    }
    if (!kept_for_next_forward(i)) reshard(i);
  }

  void finish_pending() {
    for (int i : pending_) release_gradients(i);
    pending_.clear();
  }

  void backward() {
    const int root_after = o_.root_gradients_after < 0 ? n_ - 1 : std::min(o_.root_gradients_after, n_ - 1);
    pre_backward(0, n_ > 1 ? backward_unit(1) : -1);
    if (root_after == 0) post_backward(0);
    for (int k = 1; k < n_; ++k) {
      const int i = backward_unit(k);
      pre_backward(i, k + 1 < n_ ? backward_unit(k + 1) : -1);
      post_backward(i);
      if (k == root_after) post_backward(0);
    }
    finish_pending();  // RootContext::finish_backward
    for (int i = 0; i < n_; ++i)
      if (!kept_for_next_forward(i)) reshard(i);
  }

  const std::vector<UnitTransients>& u_;
  const ScheduleOptions& o_;
  const int n_;
  const std::string root_name_ = "the root";
  std::vector<char> gathered_, grad_, accum_;
  std::deque<int> pending_;
  bool sync_ = true;
  int64_t now_ = 0;
  TransientPeak peak_;
};

}  // namespace

TransientPeak plan_transient_peak(const std::vector<UnitTransients>& units, const ScheduleOptions& options) {
  if (units.empty()) return {};
  return Replay(units, options).run();
}

}  // namespace mfsdp::detail
