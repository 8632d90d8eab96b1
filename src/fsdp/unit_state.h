// UnitState: the per-unit lifecycle (docs/fully_shard.md); what all units under one root share is
// its RootContext (root_context.h).
//
// Lifecycle of a unit in one step:
//   pre_forward  -> unshard (ZeRO-3 all-gather); prefetch the next unit in forward order
//   post_forward -> identity autograd node on the outputs (its backward is pre_backward);
//                   reshard (ZeRO-3, reshard_after_forward, not while recomputing in backward,
//                   not the first units of the backward order when training)
//   pre_backward -> unshard; gradient buffer ready; queue the root's end-of-backward callback;
//                   prefetch the next unit in backward order (reverse post-forward order)
//   parameter post-accumulate hooks -> when every trainable parameter's hook fired and, for a
//                   unit with frozen parameters, its inputs' gradients are complete too (the
//                   identity node fully_shard.cpp's cast_forward_input puts on its inputs):
//   post_backward -> reduce gradients (async; one unit's reductions in flight), reshard
//   end of backward (root callback) -> post_backward for units that did not get there (a
//                   trainable parameter without a gradient, frozen parameters and no input
//                   that needs a gradient),
//                   drain reductions, ZeRO-1 reduce-scatter, everything resharded (without
//                   gradient sync, i.e. another micro-batch follows: all but the first two
//                   units of the forward order)
#pragma once

#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <deque>
#include <memory>
#include <vector>

#include "compat/torch_compat.h"
#include "fsdp/param_group.h"
#include "fsdp/root_context.h"
#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp::detail {

class UnitState {
 public:
  // Idle -> Forward -> Idle, Idle/Forward -> Backward -> Idle (docs/fully_shard.md); every
  // transition is checked and a wrong one is an error naming the unit and both phases.
  enum class Phase { kIdle, kForward, kBackward };

  UnitState(torch::nn::Module& module, std::vector<std::unique_ptr<ParamGroup>> groups,
            const FullyShardOptions& options);
  ~UnitState();

  torch::nn::Module& module() const { return *module_; }
  std::vector<std::unique_ptr<ParamGroup>>& groups() { return groups_; }
  const FullyShardOptions& options() const { return options_; }
  // The root's context, built by the root on first use (root_context.h).
  RootContext& context();
  std::shared_ptr<RootContext> shared_context();
  bool has_context() const { return context_ != nullptr; }
  UnitState* parent() const { return parent_; }
  // Adoption by an enclosing unit (fully_shard): this unit and `members` (every unit under the
  // enclosing one, itself last) belong to one root from now on.
  void set_parent(UnitState* parent) { parent_ = parent; }
  void set_members(std::vector<UnitState*> members) { members_ = std::move(members); }
  const std::vector<UnitState*>& members() const { return members_; }

  void set_reshard_after_forward(bool r) { reshard_after_forward_ = r; }
  void set_unshard_in_backward(bool u) { unshard_in_backward_ = u; }
  void set_requires_gradient_sync(bool s) { requires_gradient_sync_ = s; }
  bool requires_gradient_sync() const { return requires_gradient_sync_; }
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
  // Units with frozen parameters: `input` (a forward input) through an identity node whose
  // backward runs once the input's gradient is complete, i.e. after every node of the unit's
  // backward that leads to it (FSDP2's RegisterPostBackwardFunction); other units, inputs that
  // need no gradient, no grad mode: `input` itself.
  at::Tensor attach_post_backward(const at::Tensor& input);
  void on_input_gradient();
  void post_backward();
  // Called by the root's end-of-backward callback.
  void finish_backward();
  // Called when the backward was abandoned (root_context.h): idle, resharded, no gradients.
  void abandon_backward();
  // Stays gathered after its backward for the next micro-batch's forward (see the .cpp).
  bool kept_for_next_forward() const;

  // Names the parameters relative to `prefix`-qualified FQNs (called when a root adopts).
  void rename_parameters(const std::map<const c10::TensorImpl*, std::string>& names);

 private:
  void build_context();
  void set_phase(Phase to);
  // Starts this unit's all-gathers; returns whether one started (then noted "all_gather" and
  // `why`, if any).
  bool start_unshard(const char* why);
  void wait_unshard();
  std::vector<at::Tensor> attach_pre_backward(const std::vector<at::Tensor>& outputs);
  bool kept_for_backward() const;
  void register_gradient_hooks();
  // post_backward once every trainable hook fired and, with frozen parameters, every input node ran.
  void maybe_post_backward();

  torch::nn::Module* module_;
  std::vector<std::unique_ptr<ParamGroup>> groups_;
  FullyShardOptions options_;
  std::shared_ptr<RootContext> context_;  // null until the root builds it
  UnitState* parent_ = nullptr;
  std::vector<UnitState*> members_;       // every unit under this one, then this one
  std::string path_;
  bool reshard_after_forward_;
  bool unshard_in_backward_ = true;
  bool requires_gradient_sync_ = true;
  Phase phase_ = Phase::kIdle;
  // Where the gradients are reduced: reduction_communicator(options.comm), made at construction
  // (fully_shard), not in the backward (root_context.h).
  std::shared_ptr<Communicator> reducer_;
  int hooks_expected_ = 0;  // trainable parameters
  int hooks_fired_ = 0;     // in the current backward
  // Frozen parameters: their last reader in backward is not marked by any hook of theirs.
  bool has_frozen_ = false;
  // Input nodes (attach_post_backward) made and neither run nor freed with their graph; shared
  // with the nodes, which may outlive the unit.
  std::shared_ptr<std::atomic<int>> inputs_pending_ = std::make_shared<std::atomic<int>>(0);
  bool input_gradient_seen_ = false;  // an input node ran in the current backward
  bool reduced_this_backward_ = false;
  bool prefetched_ = false;  // all-gather started by prefetch(), not yet used by a forward/backward
  // The AccumulateGrad nodes hold our hooks; a tensor keeps only a weak reference to them.
  std::vector<compat::NodeRef> grad_accumulators_;
};

const char* to_string(UnitState::Phase phase);

}  // namespace mfsdp::detail
