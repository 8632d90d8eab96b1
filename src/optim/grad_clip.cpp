// Global-norm gradient clipping over flat main-grad shards (as torch::nn::utils::clip_grad_norm_
// with norm_type 2, but over shards spread across ranks).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "optim/shard_optimizer.h"

namespace mfsdp {
namespace {

// Adds the sum of squares of `runs` to the 1-element fp64 `acc`, without a host sync. As
// torch's clip_grad_norm_ (and Megatron's multi-tensor L2 norm): one norm per run in the runs'
// dtype from one multi-tensor kernel (on CUDA; a loop of vector norms on the CPU, which
// accumulates fp32 in fp64), then the runs' squares added in fp64. Chunked fp64 copies of every
// gradient, as this file once made, cost a GPU step of a 1.5B model ~20 ms in ~4300 kernels
// (docs/PERFORMANCE.md, "GPU: where the step goes").
void add_squared_norms(at::Tensor& acc, const std::vector<at::Tensor>& runs) {
  if (runs.empty()) return;
  const std::vector<at::Tensor> norms = at::_foreach_norm(runs, 2);
  acc.add_(at::stack(norms).to(at::kDouble).square().sum());
}

}  // namespace

double ShardOptimizer::clip_grad_norm(double max_norm) {
  if (std::isnan(max_norm)) throw std::invalid_argument(name_ + ".clip_grad_norm: max_norm is NaN");
  at::NoGradGuard no_grad;
  const auto options = at::TensorOptions().dtype(at::kDouble).device(norm_device());
  // Sharded shards hold disjoint pieces of the model, so their squares add up across ranks.
  // Replicated shards are the same on every rank: all-reducing them would count them world-size
  // times, so they are added once, after the reduction.
  std::vector<at::Tensor> sharded, replicated;
  for (size_t i = 0; i < shards_.size(); ++i)
    for (const SegmentRun& run : runs_[i])
      (shards_[i].replicated ? replicated : sharded).push_back(shards_[i].main_grad.narrow(0, run.offset, run.length));
  at::Tensor sharded_sq = at::zeros({1}, options);
  at::Tensor replicated_sq = at::zeros({1}, options);
  add_squared_norms(sharded_sq, sharded);
  add_squared_norms(replicated_sq, replicated);
  // Every rank joins exactly one all-reduce per call, also with no elements of its own, so the
  // collective sequence is the same on all ranks.
  comm_->all_reduce(sharded_sq);
  const double norm = std::sqrt((sharded_sq + replicated_sq).item<double>());

  // A non-finite norm is returned unscaled (torch would multiply every grad by NaN); the caller
  // decides whether to skip the step.
  if (max_norm > 0 && std::isfinite(norm)) {
    const double clip_coef = max_norm / (norm + 1e-6);
    if (clip_coef < 1) {
      sharded.insert(sharded.end(), replicated.begin(), replicated.end());
      if (!sharded.empty()) at::_foreach_mul_(sharded, clip_coef);  // a rank may hold no elements
    }
  }
  return norm;
}

}  // namespace mfsdp
