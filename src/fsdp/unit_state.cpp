#include "fsdp/unit_state.h"

#include <algorithm>

#include "mfsdp/recompute.h"

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
// computed, which is where the unit must be unsharded again (research/libtorch_probe.md Q1).
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

void RootContext::limit_pending(size_t limit) {
  while (pending.size() > limit) {
    pending.front().finish();
    pending.pop_front();
  }
}

namespace {
void record_first_appearance(std::vector<UnitState*>& order, UnitState* unit) {
  if (std::find(order.begin(), order.end(), unit) == order.end()) order.push_back(unit);
}
}  // namespace

void RootContext::record_forward(UnitState* unit) {
  if (!order_fixed) record_first_appearance(forward_order, unit);
}

void RootContext::record_post_forward(UnitState* unit) {
  if (!order_fixed) record_first_appearance(post_forward_order, unit);
}

UnitState* RootContext::next_in_forward(const UnitState* unit) const {
  if (!order_fixed) return nullptr;
  auto it = std::find(forward_order.begin(), forward_order.end(), unit);
  return it == forward_order.end() || it + 1 == forward_order.end() ? nullptr : *(it + 1);
}

UnitState* RootContext::next_in_backward(const UnitState* unit) const {
  if (!order_fixed) return nullptr;
  auto it = std::find(post_forward_order.begin(), post_forward_order.end(), unit);
  return it == post_forward_order.end() || it == post_forward_order.begin() ? nullptr : *(it - 1);
}

bool RootContext::among_first_in_forward(const UnitState* unit, size_t count) const {
  if (!order_fixed) return false;
  const auto end = forward_order.begin() + static_cast<std::ptrdiff_t>(std::min(count, forward_order.size()));
  return std::find(forward_order.begin(), end, unit) != end;
}

bool RootContext::among_first_in_backward(const UnitState* unit, size_t count) const {
  if (!order_fixed) return false;
  const size_t n = post_forward_order.size();
  for (size_t k = 0; k < std::min(count, n); ++k)
    if (post_forward_order[n - 1 - k] == unit) return true;
  return false;
}

void RootContext::finish_backward() {
  note("", "end_of_backward");
  if (!forward_order.empty()) order_fixed = true;  // the first step has shown the order
  for (UnitState* unit : units) unit->finish_backward();
  limit_pending(0);
  if (sync_gradients) {
    for (UnitState* unit : units)
      for (auto& group : unit->groups()) group->finish_optim_sync();
  }
  for (UnitState* unit : units)
    if (!unit->kept_for_next_forward()) unit->reshard();
  callback_queued = false;
}

UnitState::UnitState(torch::nn::Module& module, std::vector<std::unique_ptr<ParamGroup>> groups,
                     const FullyShardOptions& options)
    : module_(&module),
      groups_(std::move(groups)),
      options_(options),
      context_(std::make_shared<RootContext>()),
      reshard_after_forward_(options.reshard_after_forward) {
  context_->units.push_back(this);
  context_->divide_factor =
      options.gradient_scaling == GradientScaling::kNone ? 1.0 : data_parallel_size(options);
  context_->allocator = make_buffer_allocator(options.buffer_allocator);
  for (auto& g : groups_) g->set_memory(&context_->transient, context_->allocator.get());
  register_gradient_hooks();
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
  bool gathered = false;
  for (auto& g : groups_) gathered |= g->start_unshard();
  if (!gathered) return false;
  context_->note(path_, "all_gather");
  if (why != nullptr) context_->note(path_, why);
  return true;
}

void UnitState::wait_unshard() {
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
  for (auto& g : groups_) g->reshard();
  prefetched_ = false;
}

void UnitState::pre_forward() {
  context_->note(path_, "pre_forward");
  if (in_recompute()) {
    // Activation recompute inside backward: this forward's all-gather also serves the unit's
    // backward, which follows right after; prepare for it now and stay unsharded.
    pre_backward();
    unshard();  // even without unshard_in_backward: the forward runs again
    return;
  }
  if (phase_ != Phase::kBackward) phase_ = Phase::kForward;
  context_->record_forward(this);
  start_unshard(nullptr);
  // Overlap: the next unit's all-gather, queued right behind this one's, runs while this one
  // computes.
  if (options_.prefetch)
    if (UnitState* next = context_->next_in_forward(this)) next->prefetch();
  wait_unshard();
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
  context_->note(path_, "post_forward");
  std::vector<at::Tensor> result = attach_pre_backward(outputs);
  if (phase_ == Phase::kForward) {
    context_->record_post_forward(this);
    if (reshard_after_forward_ && !kept_for_backward()) reshard();
    phase_ = Phase::kIdle;
  }
  // The root's forward ends last: a prefetch nobody used (the forward took another path, e.g.
  // an evaluation that skips layers) is released here rather than held until the next use.
  if (parent_ == nullptr)
    for (UnitState* unit : context_->units)
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
  return !context_->sync_gradients && options_.prefetch && context_->among_first_in_forward(this, 2);
}

at::Tensor UnitState::post_forward(const at::Tensor& output) {
  return post_forward(std::vector<at::Tensor>{output})[0];
}

void UnitState::pre_backward() {
  if (!context_->callback_queued) {
    std::shared_ptr<RootContext> ctx = context_;
    torch::autograd::Engine::get_default_engine().queue_callback([ctx] { ctx->finish_backward(); });
    context_->callback_queued = true;
  }
  if (phase_ == Phase::kBackward) return;  // several outputs or several calls: prepared once
  context_->note(path_, "pre_backward");
  phase_ = Phase::kBackward;
  hooks_fired_ = 0;
  reduced_this_backward_ = false;
  if (unshard_in_backward_) start_unshard(nullptr);
  // Overlap: gather the unit whose backward comes next while this one computes.
  if (options_.prefetch)
    if (UnitState* next = context_->next_in_backward(this); next && next->unshard_in_backward_)
      next->prefetch();
  wait_unshard();
  for (auto& g : groups_) g->prepare_gradients();
}

void UnitState::on_gradient_accumulated(size_t group, size_t index) {
  // A gradient without our pre-backward (the forward bypassed mfsdp::call): adopt it anyway.
  if (phase_ != Phase::kBackward) pre_backward();
  groups_[group]->adopt_gradient(index);
  if (++hooks_fired_ == hooks_expected_) post_backward();
}

void UnitState::post_backward() {
  if (reduced_this_backward_) return;
  reduced_this_backward_ = true;
  context_->note(path_, "post_backward");
  if (!context_->sync_gradients) {
    for (auto& g : groups_) g->stash_gradients();
  } else {
    // One unit's reductions in flight at a time: with the unit computing its gradients next,
    // at most two units' unsharded gradient buffers are alive.
    context_->limit_pending(0);
    for (auto& g : groups_) {
      PendingReduction r = g->reduce_gradients(
          context_->divide_factor,
          options_.gradient_scaling == GradientScaling::kAverageInCollective);
      if (r.work || r.finish_fn) context_->pending.push_back(std::move(r));
    }
  }
  if (!kept_for_next_forward()) reshard();
}

void UnitState::finish_backward() {
  // Units where some trainable parameter received no gradient never reached post_backward.
  if (phase_ == Phase::kBackward && !reduced_this_backward_) post_backward();
  phase_ = Phase::kIdle;
  hooks_fired_ = 0;
  reduced_this_backward_ = false;
}

}  // namespace mfsdp::detail
