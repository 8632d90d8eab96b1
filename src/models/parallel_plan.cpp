#include "mfsdp/models/parallel_plan.h"

#include <fnmatch.h>

#include <stdexcept>

#include "mfsdp/comm/comm.h"
#include "mfsdp/models/tensor_parallel.h"
#include "models/param_init.h"

namespace mfsdp {
namespace {

bool matches(const std::string& pattern, const std::string& name) {
  return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

template <typename Value>
const Value* first_match(const std::vector<std::pair<std::string, Value>>& rules, const std::string& name) {
  for (const auto& [pattern, value] : rules)
    if (matches(pattern, name)) return &value;
  return nullptr;
}

bool any_match(const std::vector<std::string>& patterns, const std::string& name) {
  for (const std::string& pattern : patterns)
    if (matches(pattern, name)) return true;
  return false;
}

// `visit(name, module)` for the root ("") and every module under it.
template <typename Visit>
void for_each_module(torch::nn::Module& root, const Visit& visit) {
  visit(std::string(), root);
  for (const auto& item : root.named_modules("", /*include_self=*/false)) visit(item.key(), *item.value());
}

// The module `name` as a `Holder` (what a plan's rule needs it to be); std::logic_error naming
// it and `what` it is not otherwise.
template <typename Holder>
Holder& holder_of(torch::nn::Module& module, const std::string& name, const char* apply, const std::string& what) {
  auto* holder = dynamic_cast<Holder*>(&module);
  if (holder == nullptr)
    throw std::logic_error(std::string(apply) + ": the plan makes module '" + name + "' (" + module.name() + ") " + what);
  return *holder;
}

}  // namespace

std::shared_ptr<Communicator> split_group(const std::shared_ptr<Communicator>& group) {
  return group && group->size() > 1 ? group : nullptr;
}

int TensorParallelism::size() const { return group ? group->size() : 1; }
int TensorParallelism::rank() const { return group ? group->rank() : 0; }
int ContextParallelism::size() const { return group ? group->size() : 1; }
int ContextParallelism::rank() const { return group ? group->rank() : 0; }

at::Tensor ContextParallelism::attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& global_positions, const at::Tensor& key_padding_mask,
                                      const at::Tensor& segment_ids, double scale) const {
  context_parallel::CpAttentionOptions o;
  o.algorithm = algorithm;
  o.key_padding_mask = key_padding_mask;
  o.segment_ids = segment_ids;
  o.scale = scale;
  return context_parallel::cp_attention(q, k, v, global_positions, *group, o);
}

TensorParallelSplit ParallelPlan::split(const std::string& name, const TensorParallelism& tp) const {
  if (!tp.active()) return TensorParallelSplit::kReplicated;
  if (const TensorParallelSplit* expert = first_match(experts, name))
    return tp.experts_split ? *expert : TensorParallelSplit::kReplicated;
  const TensorParallelSplit* dense = first_match(tensor_parallel, name);
  return dense ? *dense : TensorParallelSplit::kReplicated;
}

bool ParallelPlan::is_expert(const std::string& name) const { return first_match(experts, name) != nullptr; }

bool ParallelPlan::partial_gradient(const std::string& name, const TensorParallelism& tp) const {
  if (!tp.active()) return false;
  return any_match(partial_gradients, name) || (tp.sequence && any_match(sequence_partial_gradients, name));
}

std::optional<TensorParallelBoundary> ParallelPlan::boundary(const std::string& module_name) const {
  const TensorParallelBoundary* kind = first_match(boundaries, module_name);
  return kind ? std::optional<TensorParallelBoundary>(*kind) : std::nullopt;
}

void ParallelBoundary::set(TensorParallelBoundary kind, std::shared_ptr<Communicator> group, bool sequence) {
  kind_ = kind;
  group_ = std::move(group);
  sequence_ = sequence;
}

at::Tensor ParallelBoundary::enter(const at::Tensor& x) const {
  if (!kind_ || *kind_ == TensorParallelBoundary::kVocabulary) return x;
  return tensor_parallel::enter_tensor_parallel_region(x, *group_, sequence_);
}

at::Tensor ParallelBoundary::leave(const at::Tensor& y) const {
  if (!kind_ || *kind_ == TensorParallelBoundary::kInput) return y;
  return tensor_parallel::exit_tensor_parallel_region(y, *group_, sequence_);
}

at::Tensor ParallelBoundary::embed(const at::Tensor& ids, const at::Tensor& weight) const {
  if (kind_ != TensorParallelBoundary::kVocabulary) return at::embedding(weight, ids);
  return tensor_parallel::vocab_parallel_embedding(ids, weight, *group_, sequence_);
}

void apply_tensor_parallel(torch::nn::Module& root, const ParallelPlan& plan, const TensorParallelism& tp) {
  if (!tp.active()) return;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const TensorParallelSplit split = plan.split(item.key(), tp);
    if (split == TensorParallelSplit::kReplicated) continue;
    const at::Tensor& param = item.value();
    const int64_t dim = split == TensorParallelSplit::kRows ? 0 : 1;
    if (param.dim() <= dim)
      throw std::logic_error("apply_tensor_parallel: the plan splits '" + item.key() + "' (shape " +
                             c10::str(param.sizes()) + ") along dim " + std::to_string(dim));
    if (!detail::is_deferred(param))
      throw std::logic_error("apply_tensor_parallel: '" + item.key() +
                             "' already has its values; build the model deferred, apply the plan, then initialise");
    if (param.size(dim) % tp.size() != 0)
      throw std::invalid_argument("apply_tensor_parallel: tensor parallelism over " + std::to_string(tp.size()) +
                                  " ranks splits '" + item.key() + "' along dim " + std::to_string(dim) + " (" +
                                  std::to_string(param.size(dim)) + "), which does not divide by " +
                                  std::to_string(tp.size()));
    std::vector<int64_t> sizes = param.sizes().vec();
    sizes[static_cast<size_t>(dim)] /= tp.size();
    detail::resize_deferred(param, sizes);
  }
  for_each_module(root, [&](const std::string& name, torch::nn::Module& module) {
    const std::optional<TensorParallelBoundary> kind = plan.boundary(name);
    if (!kind) return;
    auto* holder = dynamic_cast<WithParallelBoundary*>(&module);
    if (holder == nullptr)
      throw std::logic_error("apply_tensor_parallel: the plan gives module '" + name + "' (" + module.name() +
                             ") a boundary, and it has none");
    holder->parallel_boundary.set(*kind, tp.group, tp.sequence);
  });
}

void apply_context_parallel(torch::nn::Module& root, const ParallelPlan& plan, const ContextParallelism& cp) {
  if (!cp.active()) return;
  for_each_module(root, [&](const std::string& name, torch::nn::Module& module) {
    if (!any_match(plan.context_parallel, name)) return;
    holder_of<WithContextParallelism>(module, name, "apply_context_parallel", "context-parallel, and it cannot be")
        .context_parallelism = cp;
  });
}

void apply_expert_parallel(torch::nn::Module& root, const ParallelPlan& plan, const ExpertParallelism& groups) {
  for_each_module(root, [&](const std::string& name, torch::nn::Module& module) {
    if (!any_match(plan.expert_parallel, name)) return;
    holder_of<WithExpertParallelism>(module, name, "apply_expert_parallel", "expert-parallel, and it is not an MoE block")
        .parallelize_experts(groups);
  });
}

}  // namespace mfsdp
