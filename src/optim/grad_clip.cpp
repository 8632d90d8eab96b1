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

// Elements converted to fp64 at a time on the CPU. An fp32 norm accumulates in fp32 over the
// whole tensor (relative error grows with the length of a shard), and converting a whole shard
// to fp64 would double its memory; fixed-size fp64 chunks bound both.
constexpr int64_t kNormChunk = int64_t{1} << 20;

// Adds the sum of squares of `runs` to the 1-element fp64 `acc`, without a host sync.
// - On CUDA as torch's clip_grad_norm_ and Megatron's multi-tensor L2 norm: one norm per run in
//   the runs' dtype from one multi-tensor kernel, the squares added in fp64. The fp64 chunks
//   below took ~4300 kernels and ~20 ms of a 1.5B model's GPU step (docs/PERFORMANCE.md, "GPU:
//   where the step goes").
// - On the CPU, fp64 chunks: exact to fp64 and cheap there. They are also what the CPU runs'
//   numbers were measured with: a norm one rounding apart changes the clip factor's last bit,
//   and over hundreds of clipped steps a different trajectory (the post-training demo's GRPO
//   start point moved from 13% to 8% exact match with it).
void add_squared_norms(at::Tensor& acc, const std::vector<at::Tensor>& runs) {
  if (runs.empty()) return;
  if (acc.is_cuda()) {
    const std::vector<at::Tensor> norms = at::_foreach_norm(runs, 2);
    acc.add_(at::stack(norms).to(at::kDouble).square().sum());
    return;
  }
  for (const at::Tensor& x : runs)
    for (int64_t start = 0; start < x.numel(); start += kNormChunk) {
      at::Tensor chunk = x.narrow(0, start, std::min(kNormChunk, x.numel() - start)).to(at::kDouble);
      acc.add_(at::dot(chunk, chunk));
    }
}

// The pieces of `run` outside the sorted, disjoint `skip` ranges.
std::vector<ElementRange> ranges_outside(const SegmentRun& run, const std::vector<ElementRange>& skip) {
  std::vector<ElementRange> out;
  int64_t at = run.offset;
  const int64_t end = run.offset + run.length;
  for (const ElementRange& r : skip) {
    const int64_t lo = std::max(r.offset, at), hi = std::min(r.offset + r.length, end);
    if (lo >= hi) continue;
    if (lo > at) out.push_back({at, lo - at});
    at = hi;
  }
  if (at < end) out.push_back({at, end - at});
  return out;
}

}  // namespace

void ShardOptimizer::set_model_parallel(std::vector<std::shared_ptr<Communicator>> groups,
                                        std::vector<std::vector<ElementRange>> not_counted) {
  for (const auto& group : groups)
    if (!group) throw std::invalid_argument(name_ + ".set_model_parallel: a group is null");
  if (not_counted.size() > shards_.size())
    throw std::invalid_argument(name_ + ".set_model_parallel: ranges for " + std::to_string(not_counted.size()) +
                                " shards, the optimizer has " + std::to_string(shards_.size()));
  not_counted.resize(shards_.size());
  for (size_t i = 0; i < not_counted.size(); ++i) {
    auto& ranges = not_counted[i];
    std::sort(ranges.begin(), ranges.end(),
              [](const ElementRange& a, const ElementRange& b) { return a.offset < b.offset; });
    for (size_t j = 0; j < ranges.size(); ++j)
      if (ranges[j].offset < 0 || ranges[j].length < 0 ||
          ranges[j].offset + ranges[j].length > shards_[i].main_grad.numel() ||
          (j > 0 && ranges[j].offset < ranges[j - 1].offset + ranges[j - 1].length))
        throw std::invalid_argument(name_ + ".set_model_parallel: shard " + std::to_string(i) + ": range [" +
                                    std::to_string(ranges[j].offset) + ", +" + std::to_string(ranges[j].length) +
                                    ") overlaps another or leaves the shard's " +
                                    std::to_string(shards_[i].main_grad.numel()) + " elements");
  }
  model_parallel_ = std::move(groups);
  not_counted_ = std::move(not_counted);
}

at::Tensor ShardOptimizer::clip_grad_norm_on_device(double max_norm) {
  if (std::isnan(max_norm)) throw std::invalid_argument(name_ + ".clip_grad_norm: max_norm is NaN");
  at::NoGradGuard no_grad;
  const auto options = at::TensorOptions().dtype(at::kDouble).device(norm_device());
  // Sharded shards hold disjoint pieces of the model, so their squares add up across ranks.
  // Replicated shards are the same on every rank: all-reducing them would count them world-size
  // times, so they are added once, after the reduction.
  // A shard replicated over a sub-group only (no_shard experts) is counted once per copy in the
  // all-reduce: its squares are divided by its copies first.
  std::vector<at::Tensor> sharded, replicated, all;
  at::Tensor sharded_sq = at::zeros({1}, options);
  at::Tensor replicated_sq = at::zeros({1}, options);
  // Under model parallelism, elements another rank of the groups counts are left out here.
  const bool skip_duplicates = !not_counted_.empty();
  for (size_t i = 0; i < shards_.size(); ++i) {
    const bool everywhere = shards_[i].replicated && (shards_[i].copies == 0 || shards_[i].copies == comm_->size());
    std::vector<at::Tensor> partial;
    for (const SegmentRun& run : runs_[i]) {
      all.push_back(shards_[i].main_grad.narrow(0, run.offset, run.length));
      const std::vector<ElementRange> counted =
          skip_duplicates ? ranges_outside(run, not_counted_[i]) : std::vector<ElementRange>{{run.offset, run.length}};
      for (const ElementRange& r : counted)
        (everywhere ? replicated : shards_[i].replicated ? partial : sharded)
            .push_back(shards_[i].main_grad.narrow(0, r.offset, r.length));
    }
    if (!partial.empty()) {
      at::Tensor sq = at::zeros({1}, options);
      add_squared_norms(sq, partial);
      sharded_sq.add_(sq / shards_[i].copies);
    }
  }
  add_squared_norms(sharded_sq, sharded);
  add_squared_norms(replicated_sq, replicated);
  // Every rank joins exactly one all-reduce per call, also with no elements of its own, so the
  // collective sequence is the same on all ranks.
  comm_->all_reduce(sharded_sq);
  at::Tensor total = sharded_sq + replicated_sq;
  for (const auto& group : model_parallel_) group->all_reduce(total);  // the other parts of the model
  // On the CPU the host is the device, so reading costs no wait: std::sqrt there, because ATen's
  // CPU fp64 sqrt is not always correctly rounded (sqrt(0.8228409606810413) comes out one ulp
  // above std::sqrt's), and the CPU runs' numbers were measured with std::sqrt. CUDA's double
  // sqrt is correctly rounded.
  const at::Tensor norm =
      total.is_cuda() ? total.sqrt() : at::full({1}, std::sqrt(total.item<double>()), total.options());

  // A non-finite norm leaves the gradients unscaled (torch would multiply every grad by NaN); the
  // caller decides whether to skip the step. The factor is the host's fp64 arithmetic on the
  // device (the same roundings), and multiplying by exactly 1 changes nothing: no branch on the
  // host, so nothing here waits for the device.
  if (max_norm > 0 && !all.empty()) {  // a rank may hold no elements
    // 0-dim, so the multiply reads it as a scalar in the gradients' own math (as a double did).
    const at::Tensor n = norm.reshape({});
    const at::Tensor coef = at::full_like(n, max_norm).div_(n + 1e-6).clamp_max_(1.0);
    at::_foreach_mul_(all, at::where(at::isfinite(n), coef, at::ones_like(coef)));
  }
  return norm;
}

}  // namespace mfsdp
