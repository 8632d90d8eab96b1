// UnitState: the per-unit lifecycle (DESIGN.md section 4), and RootContext: what all units under
// one root share (gradient-sync switch, pending reductions, transient-memory counter, the
// end-of-backward callback).
//
// Lifecycle of a unit in one step:
//   pre_forward  -> unshard (ZeRO-3 all-gather); prefetch the next unit in forward order
//   post_forward -> identity autograd node on the outputs (its backward is pre_backward);
//                   reshard (ZeRO-3, reshard_after_forward, not while recomputing in backward,
//                   not the first units of the backward order when training)
//   pre_backward -> unshard; gradient buffer ready; queue the root's end-of-backward callback;
//                   prefetch the next unit in backward order (reverse post-forward order)
//   parameter post-accumulate hooks -> when every trainable parameter's hook fired:
//   post_backward -> reduce gradients (async; one unit's reductions in flight), reshard
//   end of backward (root callback) -> post_backward for units whose hooks did not all fire,
//                   drain reductions, ZeRO-1 reduce-scatter, everything resharded (without
//                   gradient sync, i.e. another micro-batch follows: all but the first two
//                   units of the forward order)
#pragma once

#include <torch/csrc/autograd/function.h>

#include <deque>
#include <memory>
#include <vector>

#include "compat/torch_compat.h"
#include "fsdp/param_group.h"
#include "mfsdp/fully_shard.h"

namespace mfsdp::detail {

class UnitState;

struct RootContext {
  std::vector<UnitState*> units;  // every unit under the root, in creation order
  TransientCounter transient;
  std::shared_ptr<BufferAllocator> allocator;  // transient buffers of every unit under the root
  bool sync_gradients = true;
  double divide_factor = 1.0;
  bool callback_queued = false;
  std::deque<PendingReduction> pending;  // gradient reductions in flight, oldest first
  // Lifecycle events ("block0:pre_forward", ...) recorded for tests and debugging when enabled.
  bool record_events = false;
  std::vector<std::string> events;
  void note(const std::string& unit, const char* event) {
    if (record_events) events.push_back(unit + ":" + event);
  }

  // Execution order recorded on the first step (first appearance), fixed at the end of the
  // first backward. Forward prefetching follows the order of pre-forwards; backward runs the
  // units in the reverse order of their post-forwards (the root, which encloses the others,
  // first), and its prefetching follows that.
  std::vector<UnitState*> forward_order;       // pre-forward order
  std::vector<UnitState*> post_forward_order;  // post-forward order (reverse backward order)
  bool order_fixed = false;
  void record_forward(UnitState* unit);
  void record_post_forward(UnitState* unit);
  UnitState* next_in_forward(const UnitState* unit) const;   // null: none or not known yet
  UnitState* next_in_backward(const UnitState* unit) const;  // null: none or not known yet
  // The first `count` units of the forward (backward) order contain `unit` (false until the
  // order is known).
  bool among_first_in_forward(const UnitState* unit, size_t count) const;
  bool among_first_in_backward(const UnitState* unit, size_t count) const;

  // Keeps at most `limit` reductions in flight (each holds an unsharded gradient buffer).
  void limit_pending(size_t limit);
  void finish_backward();
};

class UnitState {
 public:
  enum class Phase { kIdle, kForward, kBackward };

  UnitState(torch::nn::Module& module, std::vector<std::unique_ptr<ParamGroup>> groups,
            const FullyShardOptions& options);

  torch::nn::Module& module() const { return *module_; }
  std::vector<std::unique_ptr<ParamGroup>>& groups() { return groups_; }
  const FullyShardOptions& options() const { return options_; }
  std::shared_ptr<RootContext>& context() { return context_; }
  UnitState* parent() const { return parent_; }
  void set_parent(UnitState* parent) { parent_ = parent; }
  void set_reshard_after_forward(bool r) { reshard_after_forward_ = r; }
  void set_unshard_in_backward(bool u) { unshard_in_backward_ = u; }
  // Module path relative to the root ("" for the root itself).
  const std::string& path() const { return path_; }
  void set_path(std::string p) { path_ = std::move(p); }

  void unshard();
  void reshard();
  // Starts this unit's all-gather without waiting (prefetch); its next pre-forward/pre-backward
  // waits for it. Idle units only.
  void prefetch();

  void pre_forward();
  at::Tensor post_forward(const at::Tensor& output);
  std::vector<at::Tensor> post_forward(const std::vector<at::Tensor>& outputs);
  void pre_backward();
  void on_gradient_accumulated(size_t group, size_t index);
  void post_backward();
  // Called by the root's end-of-backward callback.
  void finish_backward();
  // Stays gathered after its backward for the next micro-batch's forward (see the .cpp).
  bool kept_for_next_forward() const;

  // Names the parameters relative to `prefix`-qualified FQNs (called when a root adopts).
  void rename_parameters(const std::map<const c10::TensorImpl*, std::string>& names);

 private:
  // Starts this unit's all-gathers; returns whether one started (then noted "all_gather" and
  // `why`, if any).
  bool start_unshard(const char* why);
  void wait_unshard();
  std::vector<at::Tensor> attach_pre_backward(const std::vector<at::Tensor>& outputs);
  bool kept_for_backward() const;
  void register_gradient_hooks();

  torch::nn::Module* module_;
  std::vector<std::unique_ptr<ParamGroup>> groups_;
  FullyShardOptions options_;
  std::shared_ptr<RootContext> context_;
  UnitState* parent_ = nullptr;
  std::string path_;
  bool reshard_after_forward_;
  bool unshard_in_backward_ = true;
  Phase phase_ = Phase::kIdle;
  int hooks_expected_ = 0;  // trainable parameters
  int hooks_fired_ = 0;     // in the current backward
  bool reduced_this_backward_ = false;
  bool prefetched_ = false;  // all-gather started by prefetch(), not yet used by a forward/backward
  // The AccumulateGrad nodes hold our hooks; a tensor keeps only a weak reference to them.
  std::vector<compat::NodeRef> grad_accumulators_;
};

}  // namespace mfsdp::detail
