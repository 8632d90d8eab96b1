#include "fsdp/root_context.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <mutex>

#include "fsdp/unit_state.h"

namespace mfsdp::detail {

namespace {
// Shard group -> its reduction communicator, both held weakly: the units own the reducers, and
// a group or reducer that died is made again at the next fully_shard over it.
std::mutex reducers_mutex;
std::vector<std::pair<std::weak_ptr<Communicator>, std::weak_ptr<Communicator>>> reducers;
}  // namespace

std::shared_ptr<Communicator> reduction_communicator(const std::shared_ptr<Communicator>& shard_group) {
  if (!shard_group->device().is_cuda()) return shard_group;
  std::lock_guard<std::mutex> lock(reducers_mutex);
  reducers.erase(std::remove_if(reducers.begin(), reducers.end(),
                                [](const auto& e) { return e.first.expired() || e.second.expired(); }),
                 reducers.end());
  for (const auto& [group, reducer] : reducers)
    if (group.lock() == shard_group)
      if (auto alive = reducer.lock()) return alive;
  std::vector<int> everyone(shard_group->size());
  for (int r = 0; r < shard_group->size(); ++r) everyone[r] = r;
  std::shared_ptr<Communicator> reducer = shard_group->new_group(everyone, "fsdp_reduce_scatter");
  reducers.emplace_back(shard_group, reducer);
  return reducer;
}

RootContext::RootContext(std::vector<UnitState*> members, const FullyShardOptions& root_options)
    : units(std::move(members)),
      allocator(make_buffer_allocator(root_options.buffer_allocator)),
      divide_factor(root_options.gradient_scaling == GradientScaling::kNone
                        ? 1.0
                        : data_parallel_size(root_options)),
      start_param_sync_(root_options.all_gather_in_start_param_sync) {}

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
void erase(std::vector<UnitState*>& v, UnitState* unit) {
  v.erase(std::remove(v.begin(), v.end(), unit), v.end());
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
  RECORD_USER_SCOPE("mfsdp::finish_backward");
  note("", "end_of_backward");
  if (!forward_order.empty()) order_fixed = true;  // the first step has shown the order
  for (UnitState* unit : units) unit->finish_backward();
  limit_pending(0);
  for (UnitState* unit : units)
    if (unit->requires_gradient_sync())
      for (auto& group : unit->groups()) group->gradients().finish_deferred();
  for (UnitState* unit : units)
    if (!unit->kept_for_next_forward()) unit->reshard();
  callback_queued = false;
}

void RootContext::abandon_backward() {
  note("", "abandon_backward");
  while (!pending.empty()) {
    PendingReduction r = std::move(pending.front());
    pending.pop_front();
    r.discard();
  }
  for (UnitState* unit : units) unit->abandon_backward();
  callback_queued = false;
}

void RootContext::refresh_model_weights() {
  at::NoGradGuard no_grad;
  // Weights kept gathered (e.g. across micro-batches) are stale once the main weights changed.
  for (UnitState* u : units) u->reshard();
  for (UnitState* u : units)
    for (auto& g : u->groups()) g->copy_main_to_model_weights();
}

void RootContext::after_optimizer_step() {
  refresh_model_weights();
  allocator->step_boundary();
  if (start_param_sync_ && order_fixed && !forward_order.empty()) {
    transient.label(forward_order.front()->path(), "after_optimizer_step");
    forward_order.front()->prefetch();
  }
}

void RootContext::forget(UnitState* unit) {
  erase(units, unit);
  erase(forward_order, unit);
  erase(post_forward_order, unit);
}

}  // namespace mfsdp::detail
