#include "fsdp/unit_state.h"

#include <algorithm>

#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/fsdp/recompute.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

namespace mfsdp::detail {
namespace {

struct UnitPointer : torch::CustomClassHolder {
  explicit UnitPointer(UnitState* u) : unit(u) {}
  UnitState* unit;
};

// Identity on a unit's outputs; its backward runs before any of the unit's gradients are
// computed, which is where the unit must be unsharded again (a custom Function's backward may run
// any code, collectives included; tests/dist/unshard_in_backward_test.cpp).
struct PreBackward : torch::autograd::Function<PreBackward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList outputs,
                                                c10::intrusive_ptr<UnitPointer> unit) {
    ctx->saved_data["unit"] = c10::IValue::make_capsule(std::move(unit));
    return outputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    c10::static_intrusive_pointer_cast<UnitPointer>(ctx->saved_data["unit"].toCapsule())
        ->unit->pre_backward();
    grads.emplace_back();  // no gradient for the unit pointer
    return grads;
  }
};

// One input node of a unit with frozen parameters, counted in `pending` from its forward until
// its backward ran or its graph was freed without running it (a forward that never gets a
// backward leaves no count behind). Holds the counter, not the unit, for its destructor: a
// graph may outlive the module.
struct InputTicket : torch::CustomClassHolder {
  InputTicket(UnitState* u, std::shared_ptr<std::atomic<int>> p) : unit(u), pending(std::move(p)) { ++*pending; }
  ~InputTicket() override { settle(); }
  void settle() {
    if (settled) return;
    settled = true;
    --*pending;
  }
  UnitState* unit;
  std::shared_ptr<std::atomic<int>> pending;
  bool settled = false;
};

// Identity on a forward input; its backward runs once the input's gradient is complete, i.e.
// after every node of the unit's backward that leads to the input (FSDP2's
// RegisterPostBackwardFunction on the module's inputs).
struct PostBackward : torch::autograd::Function<PostBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            c10::intrusive_ptr<InputTicket> ticket) {
    ctx->saved_data["ticket"] = c10::IValue::make_capsule(std::move(ticket));
    return input;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto ticket = c10::static_intrusive_pointer_cast<InputTicket>(ctx->saved_data["ticket"].toCapsule());
    ticket->settle();
    ticket->unit->on_input_gradient();
    return {grads[0], at::Tensor()};
  }
};

// Runs after autograd accumulated a parameter's gradient (once per backward).
struct GradientAccumulated : torch::autograd::FunctionPostHook {
  GradientAccumulated(UnitState* u, size_t g, size_t i) : unit(u), group(g), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    unit->on_gradient_accumulated(group, index);
    return outputs;
  }
  UnitState* unit;
  size_t group, index;
};

}  // namespace

UnitState::UnitState(torch::nn::Module& module, std::vector<std::unique_ptr<ParamGroup>> groups,
                     const FullyShardOptions& options)
    : module_(&module),
      groups_(std::move(groups)),
      options_(options),
      members_{this},
      reshard_after_forward_(options.reshard_after_forward),
      reducer_(reduction_communicator(options.comm)) {
  register_gradient_hooks();
  for (auto& g : groups_) has_frozen_ |= !g->requires_grad();
}

UnitState::~UnitState() {
  // Modules may die in any order: forget this unit wherever another one points at it.
  if (context_) context_->forget(this);
  for (UnitState* p = parent_; p != nullptr; p = p->parent_)
    p->members_.erase(std::remove(p->members_.begin(), p->members_.end(), this), p->members_.end());
  for (UnitState* m : members_)
    if (m != this && m->parent_ == this) m->parent_ = nullptr;
}

const char* to_string(UnitState::Phase phase) {
  switch (phase) {
    case UnitState::Phase::kIdle: return "idle";
    case UnitState::Phase::kForward: return "forward";
    case UnitState::Phase::kBackward: return "backward";
  }
  return "?";
}

void UnitState::set_phase(Phase to) {
  using P = Phase;
  const bool valid = (phase_ == P::kIdle && to == P::kForward) ||
                     // a forward that threw left the unit in kForward; the next one starts over
                     (phase_ == P::kForward && to == P::kForward) ||
                     (phase_ == P::kForward && to == P::kIdle) ||
                     (phase_ == P::kIdle && to == P::kBackward) ||
                     (phase_ == P::kForward && to == P::kBackward) ||
                     (phase_ == P::kBackward && to == P::kIdle);
  if (!valid)
    throw std::logic_error("fully_shard unit '" + path_ + "': invalid phase transition " +
                           to_string(phase_) + " -> " + to_string(to));
  phase_ = to;
}

RootContext& UnitState::context() { return *shared_context(); }

std::shared_ptr<RootContext> UnitState::shared_context() {
  if (!context_) {
    UnitState* root = this;
    while (root->parent_ != nullptr) root = root->parent_;
    root->build_context();
  }
  return context_;
}

void UnitState::build_context() {
  // Units may shard over their own group (experts over the expert-data-parallel group): the
  // gradients are still divided by the root's data-parallel size, which the collective's own
  // average (over the unit's group) would not do; HSDP meshes stay one per root.
  for (UnitState* u : members_) {
    // The root's optimizer_comm() (the shard group, or the whole mesh under HFSDP) sums every
    // unit's gradient norm, so a root cannot mix replicated and split main weights.
    if (u->options_.outer_strategy != options_.outer_strategy)
      throw std::invalid_argument("fully_shard: unit '" + u->path_ + "' has outer_strategy " +
                                  mfsdp::to_string(u->options_.outer_strategy) + " but its root " +
                                  mfsdp::to_string(options_.outer_strategy) + "; every unit under one root must use the same");
    if (u->options_.comm == options_.comm && u->options_.mesh == options_.mesh) continue;
    // A unit may shard over an HSDP mesh of its own (the experts over [replicas,
    // expert-data-parallel], train/parallel_dims.h) whose replicas are the root's: as many, and
    // this rank in the same one, so the root's norms and divisor still count each element once.
    const auto replica = [](const FullyShardOptions& o) {
      return o.mesh && o.mesh->dim_names().size() == 2
                 ? std::make_pair(o.mesh->shape().front(), o.mesh->coordinate(o.mesh->dim_names().front()))
                 : std::make_pair(0, 0);
    };
    if ((u->options_.mesh || options_.mesh) && (replica(u->options_) != replica(options_) || !options_.mesh))
      throw std::invalid_argument("fully_shard: unit '" + u->path_ + "' was sharded over another mesh than its root; "
                                  "every unit under one HSDP root must use the same options.mesh, or one with the "
                                  "root's replicas");
    if (options_.gradient_scaling == GradientScaling::kAverageInCollective)
      throw std::invalid_argument("fully_shard: unit '" + u->path_ + "' is sharded over another communicator than its "
                                  "root, which GradientScaling::kAverageInCollective cannot average over the root's "
                                  "data-parallel ranks; use kDivideByWorld");
  }
  auto ctx = std::make_shared<RootContext>(members_, options_);
  for (UnitState* u : members_) {
    u->context_ = ctx;
    for (auto& g : u->groups_) g->attach(&ctx->transient, ctx->allocator.get(), &u->path_);
  }
}

void UnitState::register_gradient_hooks() {
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!groups_[g]->requires_grad()) continue;
    auto& params = groups_[g]->params();
    for (size_t i = 0; i < params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params[i].param);
      acc->add_post_hook(std::make_unique<GradientAccumulated>(this, g, i));
      grad_accumulators_.push_back(std::move(acc));
      ++hooks_expected_;
    }
  }
}

void UnitState::rename_parameters(const std::map<const c10::TensorImpl*, std::string>& names) {
  for (auto& g : groups_)
    for (auto& p : g->params()) {
      auto it = names.find(p.param.unsafeGetTensorImpl());
      if (it != names.end()) p.name = it->second;
    }
}

bool UnitState::start_unshard(const char* why) {
  RECORD_USER_SCOPE("mfsdp::all_gather");
  RootContext& ctx = context();  // the groups' allocator and counter come from it
  bool gathered = false;
  for (auto& g : groups_) gathered |= g->start_unshard();
  if (!gathered) return false;
  ctx.note(path_, "all_gather");
  if (why != nullptr) ctx.note(path_, why);
  return true;
}

void UnitState::wait_unshard() {
  RECORD_USER_SCOPE("mfsdp::wait_all_gather");
  for (auto& g : groups_) g->wait_unshard();
  prefetched_ = false;
}

void UnitState::unshard() {
  start_unshard(nullptr);
  wait_unshard();
}

void UnitState::prefetch() {
  if (phase_ == Phase::kIdle && start_unshard("prefetch")) prefetched_ = true;
}

void UnitState::reshard() {
  RECORD_USER_SCOPE("mfsdp::reshard");
  for (auto& g : groups_) g->reshard();
  prefetched_ = false;
}

void UnitState::pre_forward() {
  RECORD_USER_SCOPE("mfsdp::pre_forward");
  context().note(path_, "pre_forward");
  context().transient.label(path_, "forward");  // what the bytes counted from here are for
  if (in_recompute()) {
    // Activation recompute inside backward: this forward's all-gather also serves the unit's
    // backward, which follows right after; prepare for it now and stay unsharded.
    pre_backward();
    unshard();  // even without unshard_in_backward: the forward runs again
    for (auto& g : groups_) g->expect_unsharded("a recomputed forward");
    return;
  }
  if (parent_ == nullptr && context().callback_queued) context().abandon_backward();
  if (phase_ != Phase::kBackward) set_phase(Phase::kForward);
  context().record_forward(this);
  start_unshard(nullptr);
  // Overlap: the next unit's all-gather, queued right behind this one's, runs while this one
  // computes.
  if (options_.prefetch)
    if (UnitState* next = context().next_in_forward(this)) next->prefetch();
  wait_unshard();
  for (auto& g : groups_) g->expect_unsharded("forward");
}

std::vector<at::Tensor> UnitState::attach_pre_backward(const std::vector<at::Tensor>& outputs) {
  if (!at::GradMode::is_enabled()) return outputs;
  std::vector<at::Tensor> needing;
  std::vector<size_t> where;
  for (size_t i = 0; i < outputs.size(); ++i)
    if (outputs[i].defined() && outputs[i].requires_grad()) {
      needing.push_back(outputs[i]);
      where.push_back(i);
    }
  if (needing.empty()) return outputs;
  auto hooked = PreBackward::apply(at::TensorList(needing), c10::make_intrusive<UnitPointer>(this));
  std::vector<at::Tensor> result = outputs;
  for (size_t k = 0; k < where.size(); ++k) result[where[k]] = hooked[k];
  return result;
}

std::vector<at::Tensor> UnitState::post_forward(const std::vector<at::Tensor>& outputs) {
  RECORD_USER_SCOPE("mfsdp::post_forward");
  context().note(path_, "post_forward");
  std::vector<at::Tensor> result = attach_pre_backward(outputs);
  if (phase_ == Phase::kForward) {
    context().record_post_forward(this);
    if (reshard_after_forward_ && !kept_for_backward()) reshard();
    set_phase(Phase::kIdle);
  }
  // The root's forward ends last: a prefetch nobody used (the forward took another path, e.g.
  // an evaluation that skips layers) is released here rather than held until the next use.
  if (parent_ == nullptr)
    for (UnitState* unit : context().units)
      if (unit->prefetched_ && unit->phase_ == Phase::kIdle) unit->reshard();
  return result;
}

bool UnitState::kept_for_backward() const {
  // The units whose backward comes first would be gathered again at once (by the root's
  // pre-backward and its prefetch), so resharding them after forward saves no memory at the
  // peak and costs an all-gather: the root stays gathered (FSDP2's default for the root) and,
  // with prefetching, so does the last unit to finish its forward. Not in evaluation.
  const bool training = at::GradMode::is_enabled() || in_recompute_first_forward();
  return training && unshard_in_backward_ &&
         (parent_ == nullptr || (options_.prefetch && context_->among_first_in_backward(this, 2)));
}

bool UnitState::kept_for_next_forward() const {
  // Without gradient sync another micro-batch follows with unchanged weights: the first two
  // units of the forward order (the root and the unit whose backward finishes last) stay
  // gathered for it instead of being gathered again at once.
  return !requires_gradient_sync_ && options_.prefetch && context_->among_first_in_forward(this, 2);
}

at::Tensor UnitState::post_forward(const at::Tensor& output) {
  return post_forward(std::vector<at::Tensor>{output})[0];
}

void UnitState::pre_backward() {
  if (!context().callback_queued) {
    std::shared_ptr<RootContext> ctx = shared_context();
    torch::autograd::Engine::get_default_engine().queue_callback([ctx] { ctx->finish_backward(); });
    context().callback_queued = true;
  }
  if (phase_ == Phase::kBackward) return;  // several outputs or several calls: prepared once
  RECORD_USER_SCOPE("mfsdp::pre_backward");
  context().note(path_, "pre_backward");
  context().transient.label(path_, "backward");
  set_phase(Phase::kBackward);
  hooks_fired_ = 0;
  reduced_this_backward_ = false;
  input_gradient_seen_ = false;
  if (unshard_in_backward_) start_unshard(nullptr);
  // Overlap: gather the unit whose backward comes next while this one computes.
  if (options_.prefetch)
    if (UnitState* next = context().next_in_backward(this); next && next->unshard_in_backward_)
      next->prefetch();
  wait_unshard();
  if (unshard_in_backward_)
    for (auto& g : groups_) g->expect_unsharded("backward");
  for (auto& g : groups_) g->gradients().prepare();
}

void UnitState::on_gradient_accumulated(size_t group, size_t index) {
  // A gradient without our pre-backward (the forward bypassed mfsdp::call): adopt it anyway.
  if (phase_ != Phase::kBackward) pre_backward();
  groups_[group]->gradients().adopt(index);
  if (++hooks_fired_ == hooks_expected_) maybe_post_backward();
}

at::Tensor UnitState::attach_post_backward(const at::Tensor& input) {
  if (!has_frozen_ || !input.defined() || !input.requires_grad() || !at::GradMode::is_enabled()) return input;
  return PostBackward::apply(input, c10::make_intrusive<InputTicket>(this, inputs_pending_));
}

void UnitState::on_input_gradient() {
  if (phase_ != Phase::kBackward) return;  // not in a backward of ours: the end of backward decides
  input_gradient_seen_ = true;
  maybe_post_backward();
}

void UnitState::maybe_post_backward() {
  if (hooks_fired_ < hooks_expected_) return;
  // A trainable weight's readers in backward all feed its gradient, so its hook marks their end.
  // A frozen weight has no hook, and a node that runs after the last trainable parameter's may
  // still read it (LoRA's x W^T beside its adapter, frozen attention under a trainable MLP): wait
  // until every input node of the unit ran, i.e. its whole backward is done. Without one (the
  // inputs need no gradient, or are not tensors), the end of backward reshards it.
  if (has_frozen_ && (!input_gradient_seen_ || *inputs_pending_ > 0)) return;
  post_backward();
}

void UnitState::post_backward() {
  if (reduced_this_backward_) return;
  reduced_this_backward_ = true;
  RECORD_USER_SCOPE("mfsdp::post_backward");
  context().note(path_, "post_backward");
  context().transient.label(path_, "backward");
  if (!requires_gradient_sync_) {
    for (auto& g : groups_) g->gradients().stash();
  } else {
    // One unit's reductions in flight at a time: with the unit computing its gradients next,
    // at most two units' unsharded gradient buffers are alive.
    context().limit_pending(0);
    for (auto& g : groups_) {
      PendingReduction r = g->gradients().reduce(
          *reducer_, context().divide_factor,
          options_.gradient_scaling == GradientScaling::kAverageInCollective);
      if (r.work || r.finish_fn) context().pending.push_back(std::move(r));
    }
  }
  if (!kept_for_next_forward()) reshard();
}

void UnitState::finish_backward() {
  // Units where some trainable parameter received no gradient, or with frozen parameters and
  // no input node, never reached post_backward.
  if (phase_ == Phase::kBackward && !reduced_this_backward_) post_backward();
  if (phase_ != Phase::kIdle) set_phase(Phase::kIdle);
  hooks_fired_ = 0;
  reduced_this_backward_ = false;
  input_gradient_seen_ = false;
}

void UnitState::abandon_backward() {
  if (phase_ == Phase::kBackward) set_phase(Phase::kIdle);
  hooks_fired_ = 0;
  reduced_this_backward_ = false;
  input_gradient_seen_ = false;
  for (auto& g : groups_) g->gradients().drop_unsharded();
  reshard();
}

}  // namespace mfsdp::detail
