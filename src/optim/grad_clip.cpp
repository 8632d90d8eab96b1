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

// Elements converted to fp64 at a time. An fp32 norm kernel accumulates in fp32 over the whole
// tensor (relative error grows with the length of a shard), and converting a whole shard to fp64
// would double its memory; fixed-size fp64 chunks bound both.
constexpr int64_t kNormChunk = int64_t{1} << 20;

// Adds the sum of squares of `x` to the 1-element fp64 `acc`, without a host sync.
void add_squared_norm(at::Tensor& acc, const at::Tensor& x) {
  for (int64_t start = 0; start < x.numel(); start += kNormChunk) {
    at::Tensor chunk = x.narrow(0, start, std::min(kNormChunk, x.numel() - start)).to(at::kDouble);
    acc.add_(at::dot(chunk, chunk));
  }
}

}  // namespace

double ShardOptimizer::clip_grad_norm(double max_norm) {
  if (std::isnan(max_norm)) throw std::invalid_argument(name_ + ".clip_grad_norm: max_norm is NaN");
  at::NoGradGuard no_grad;
  const auto options = at::TensorOptions().dtype(at::kDouble).device(norm_device());
  // Sharded shards hold disjoint pieces of the model, so their squares add up across ranks.
  // Replicated shards are the same on every rank: all-reducing them would count them world-size
  // times, so they are added once, after the reduction.
  at::Tensor sharded_sq = at::zeros({1}, options);
  at::Tensor replicated_sq = at::zeros({1}, options);
  for (size_t i = 0; i < shards_.size(); ++i) {
    at::Tensor& acc = shards_[i].replicated ? replicated_sq : sharded_sq;
    for (const SegmentRun& run : runs_[i]) {
      add_squared_norm(acc, shards_[i].main_grad.narrow(0, run.offset, run.length));
    }
  }
  // Every rank joins exactly one all-reduce per call, also with no elements of its own, so the
  // collective sequence is the same on all ranks.
  comm_->all_reduce(sharded_sq);
  const double norm = std::sqrt((sharded_sq + replicated_sq).item<double>());

  // A non-finite norm is returned unscaled (torch would multiply every grad by NaN); the caller
  // decides whether to skip the step.
  if (max_norm > 0 && std::isfinite(norm)) {
    const double clip_coef = max_norm / (norm + 1e-6);
    if (clip_coef < 1) {
      for (size_t i = 0; i < shards_.size(); ++i) {
        for (const SegmentRun& run : runs_[i]) {
          shards_[i].main_grad.narrow(0, run.offset, run.length).mul_(clip_coef);
        }
      }
    }
  }
  return norm;
}

}  // namespace mfsdp
