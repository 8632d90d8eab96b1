// Tensor parallelism in a training step and around it (include/mfsdp/models/tensor_parallel_training.h).
#include "mfsdp/models/tensor_parallel_training.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <vector>

#include "mfsdp/comm/comm.h"
#include "mfsdp/models/tensor_parallel.h"

namespace mfsdp {
namespace {

// The group, or null when the model is not split.
Communicator* group_of(const CausalLM& model) {
  const std::shared_ptr<Communicator> tp = model.tensor_parallel();
  return tp && tp->size() > 1 ? tp.get() : nullptr;
}

int64_t split_dim(TensorParallelSplit split) { return split == TensorParallelSplit::kColumns ? 1 : 0; }

}  // namespace

bool tensor_parallel_duplicate(const CausalLM& model, const std::string& name) {
  // Whole experts differ over the group: other experts, or other shards of them.
  return group_of(model) != nullptr && !model.expert_parameter(name) &&
         model.tensor_parallel_split(name) == TensorParallelSplit::kReplicated;
}

void sum_partial_gradients(const CausalLM& model, const FsdpHandle& root) {
  Communicator* tp = group_of(model);
  if (tp == nullptr) return;
  at::NoGradGuard no_grad;
  const std::vector<OptimizerShard> shards = root.optimizer_shards();
  std::vector<at::Tensor> grads;
  for (const LocalShard& p : root.local_shards())
    if (p.shard_index >= 0 && p.local.numel() > 0 && model.tensor_parallel_partial_grad(p.name))
      grads.push_back(shards[static_cast<size_t>(p.shard_index)].main_grad.narrow(0, p.shard_offset, p.local.numel()));
  // Every rank of the group has the same list (same layouts), possibly empty on all of them.
  if (grads.empty()) return;
  at::Tensor flat = at::cat(grads);
  tp->all_reduce(flat);
  int64_t at = 0;
  for (at::Tensor& g : grads) {
    g.copy_(flat.narrow(0, at, g.numel()));
    at += g.numel();
  }
}

void set_model_parallel_norm(const CausalLM& model, const FsdpHandle& root, DistributedOptimizer& optimizer,
                             std::shared_ptr<Communicator> pipeline) {
  std::vector<std::shared_ptr<Communicator>> groups;
  if (group_of(model) != nullptr) groups.push_back(model.tensor_parallel());
  if (pipeline && pipeline->size() > 1) groups.push_back(std::move(pipeline));
  if (groups.empty()) return;
  const bool tp_copy = group_of(model) != nullptr && model.tensor_parallel()->rank() != 0;
  const std::string embedding_copy = model.embedding_copy();
  std::vector<std::vector<ElementRange>> not_counted(root.optimizer_shards().size());
  for (const LocalShard& p : root.local_shards())
    if (p.shard_index >= 0 && p.local.numel() > 0 &&
        ((tp_copy && tensor_parallel_duplicate(model, p.name)) || p.name == embedding_copy))
      not_counted[static_cast<size_t>(p.shard_index)].push_back({p.shard_offset, p.local.numel()});
  optimizer.set_model_parallel(std::move(groups), std::move(not_counted));
}

std::map<std::string, at::Tensor> gather_tensor_parallel(const CausalLM& model,
                                                         std::map<std::string, at::Tensor> local) {
  Communicator* tp = group_of(model);
  if (tp == nullptr) return local;
  at::NoGradGuard no_grad;
  for (auto& [name, t] : local) {
    const TensorParallelSplit split = model.tensor_parallel_split(name);
    if (split == TensorParallelSplit::kReplicated) continue;
    const int64_t dim = split_dim(split);
    at::Tensor slice = t.to(tp->device()).contiguous();
    at::Tensor flat = at::empty({tp->size() * slice.numel()}, slice.options());
    tp->all_gather(flat, slice);
    std::vector<int64_t> blocks = slice.sizes().vec(), shape = slice.sizes().vec();
    blocks.insert(blocks.begin(), tp->size());
    shape[static_cast<size_t>(dim)] *= tp->size();
    // [tp, ..., n, ...] -> [..., tp, n, ...] -> [..., tp * n, ...]: rank r's slice is block r.
    t = flat.view(blocks).movedim(0, dim).reshape(shape).to(t.device());
  }
  return local;
}

std::map<std::string, at::Tensor> tensor_parallel_slices(const CausalLM& model,
                                                         std::map<std::string, at::Tensor> full) {
  Communicator* tp = group_of(model);
  if (tp == nullptr) return full;
  for (auto& [name, t] : full) {
    const TensorParallelSplit split = model.tensor_parallel_split(name);
    if (split == TensorParallelSplit::kReplicated) continue;
    try {
      t = split == TensorParallelSplit::kColumns ? tensor_parallel::row_shard(t, tp->rank(), tp->size())
                                                 : tensor_parallel::column_shard(t, tp->rank(), tp->size());
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("tensor_parallel_slices: '" + name + "': " + e.what());
    }
  }
  return full;
}

}  // namespace mfsdp
