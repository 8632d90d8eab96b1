// AdamW over flat shards, op for op as torch::optim::AdamW (LibTorch 1.13, amsgrad off), so a
// sharded run reproduces single-process training: each elementwise op below is the one torch
// applies per parameter, applied here once per segment run instead. With AdamWOptions::fused,
// at::_fused_adamw_ (torch.optim.AdamW(fused=True)'s kernel, CPU and CUDA) updates the same runs
// in one pass: the decay ranges in one call, the rest in another with weight decay 0.
#include <ATen/ATen.h>

#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <stdexcept>
#include <vector>

#include "optim/shard_optimizer.h"

namespace mfsdp {
namespace {

void check_options(const AdamWOptions& o) {
  auto fail = [](const char* field, double value, const char* expected) {
    std::ostringstream msg;
    msg << "AdamWOptions." << field << " must be " << expected << ", got " << value;
    throw std::invalid_argument(msg.str());
  };
  if (!(o.beta1 >= 0 && o.beta1 < 1)) fail("beta1", o.beta1, "in [0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) fail("beta2", o.beta2, "in [0, 1)");
  if (!(o.eps >= 0) || !std::isfinite(o.eps)) fail("eps", o.eps, "finite and >= 0");
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay)) {
    fail("weight_decay", o.weight_decay, "finite and >= 0");
  }
  for (const auto& [field, dtype] : {std::pair{"exp_avg_dtype", o.exp_avg_dtype}, {"exp_avg_sq_dtype", o.exp_avg_sq_dtype}})
    if (dtype && *dtype != at::kFloat && *dtype != at::kBFloat16)
      throw std::invalid_argument(std::string("AdamWOptions.") + field + " must be float32 or bfloat16, got " +
                                  c10::toString(*dtype) + " (fp16 and fp8 moments need scaled storage)");
}

class AdamW final : public ShardOptimizer {
 public:
  AdamW(std::vector<OptimizerShard> shards, std::shared_ptr<Communicator> comm,
        const AdamWOptions& options, std::function<void()> after_step)
      : ShardOptimizer("AdamW", std::move(shards), std::move(comm), std::move(after_step)),
        options_(options) {
    check_options(options_);
    // Allocated up front (not at the first step) so checkpoint loading and memory accounting
    // see the state before training starts. Padding stays zero forever.
    for (const OptimizerShard& shard : shards_) {
      const at::TensorOptions like = shard.main_weight.options();
      exp_avg_.push_back(at::zeros({shard.main_weight.numel()}, like.dtype(options_.exp_avg_dtype.value_or(like.dtype().toScalarType()))));
      exp_avg_sq_.push_back(
          at::zeros({shard.main_weight.numel()}, like.dtype(options_.exp_avg_sq_dtype.value_or(like.dtype().toScalarType()))));
      stored_apart_ = stored_apart_ || exp_avg_.back().scalar_type() != like.dtype().toScalarType() ||
                      exp_avg_sq_.back().scalar_type() != like.dtype().toScalarType();
    }
  }

  std::vector<std::pair<std::string, std::vector<at::Tensor>>> state() const override {
    return {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}};
  }

 private:
  void update(double lr, int64_t step) override {
    std::vector<size_t> all(shards_.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    if (!stored_apart_) return update_shards(lr, step, all, exp_avg_, exp_avg_sq_);
    // Moments stored in another dtype: each shard's upcast, updated as above, rounded back; one
    // shard's full-precision copies at a time.
    for (size_t i : all) {
      const at::ScalarType dtype = shards_[i].main_weight.scalar_type();
      const std::vector<at::Tensor> m{exp_avg_[i].to(dtype)}, v{exp_avg_sq_[i].to(dtype)};
      update_shards(lr, step, {i}, m, v);
      exp_avg_[i].copy_(m[0]);
      exp_avg_sq_[i].copy_(v[0]);
    }
  }

  // Updates shards `which` with moments `exp_avg[k]`, `exp_avg_sq[k]` of shard which[k]
  // (every shard's own, or their upcast copies).
  void update_shards(double lr, int64_t step, const std::vector<size_t>& which, const std::vector<at::Tensor>& exp_avg,
                     const std::vector<at::Tensor>& exp_avg_sq) {
    if (options_.fused) return update_fused(lr, step, which, exp_avg, exp_avg_sq);
    const double beta1 = options_.beta1, beta2 = options_.beta2;
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    const double step_size = lr / bias_correction1;
    const double decay_factor = 1 - lr * options_.weight_decay;
    for (size_t k = 0; k < which.size(); ++k) {
      const size_t i = which[k];
      const at::Tensor& weight = shards_[i].main_weight;
      const at::Tensor& grad = shards_[i].main_grad;
      for (const SegmentRun& run : runs_[i]) {
        // Decoupled weight decay first, on the decay segments only (torch skips the op for a
        // group with weight_decay == 0, so do we).
        if (options_.weight_decay != 0) {
          for (const ElementRange& r : run.decay) {
            weight.narrow(0, r.offset, r.length).mul_(decay_factor);
          }
        }
        at::Tensor p = weight.narrow(0, run.offset, run.length);
        at::Tensor g = grad.narrow(0, run.offset, run.length);
        at::Tensor m = exp_avg[k].narrow(0, run.offset, run.length);
        at::Tensor v = exp_avg_sq[k].narrow(0, run.offset, run.length);
        m.mul_(beta1).add_(g, 1 - beta1);
        v.mul_(beta2).addcmul_(g, g, 1 - beta2);
        // torch: denom = (v.sqrt() / sqrt(bc2)).add_(eps); the same ops, one temporary fewer.
        at::Tensor denom = v.sqrt();
        denom.div_(std::sqrt(bias_correction2)).add_(options_.eps);
        p.addcdiv_(m, denom, -step_size);
      }
    }
  }

  // Views of weights, gradients and moments for one _fused_adamw_ call.
  struct FusedLists {
    std::vector<at::Tensor> weights, grads, exp_avgs, exp_avg_sqs;
    void add(const at::Tensor& w, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v, int64_t offset,
             int64_t length) {
      if (length == 0) return;
      weights.push_back(w.narrow(0, offset, length));
      grads.push_back(g.narrow(0, offset, length));
      exp_avgs.push_back(m.narrow(0, offset, length));
      exp_avg_sqs.push_back(v.narrow(0, offset, length));
    }
  };

  void update_fused(double lr, int64_t step, const std::vector<size_t>& which, const std::vector<at::Tensor>& exp_avg,
                    const std::vector<at::Tensor>& exp_avg_sq) {
    FusedLists decay, no_decay;
    for (size_t k = 0; k < which.size(); ++k) {
      const size_t i = which[k];
      const at::Tensor &w = shards_[i].main_weight, &g = shards_[i].main_grad, &m = exp_avg[k], &v = exp_avg_sq[k];
      for (const SegmentRun& run : runs_[i]) {
        int64_t at = run.offset;  // the decay ranges lie inside the run, ascending
        for (const ElementRange& r : run.decay) {
          no_decay.add(w, g, m, v, at, r.offset - at);
          decay.add(w, g, m, v, r.offset, r.length);
          at = r.offset + r.length;
        }
        no_decay.add(w, g, m, v, at, run.offset + run.length - at);
      }
    }
    auto apply = [&](const FusedLists& lists, double weight_decay) {
      if (lists.weights.empty()) return;
      // The step count as torch.optim keeps it for a fused group: a float32 scalar beside the
      // weights, already counting this step; the kernel only reads it.
      const at::Tensor count = at::full({}, static_cast<double>(step), lists.weights[0].options().dtype(at::kFloat));
      at::_fused_adamw_(lists.weights, lists.grads, lists.exp_avgs, lists.exp_avg_sqs, /*max_exp_avg_sqs=*/{},
                        std::vector<at::Tensor>(lists.weights.size(), count), lr, options_.beta1, options_.beta2,
                        weight_decay, options_.eps, /*amsgrad=*/false, /*maximize=*/false);
    };
    apply(decay, options_.weight_decay);
    apply(no_decay, 0.0);
  }

  const AdamWOptions options_;
  std::vector<at::Tensor> exp_avg_;     // per shard: [n], like main_weight
  std::vector<at::Tensor> exp_avg_sq_;  // per shard: [n], like main_weight
  bool stored_apart_ = false;           // some moment in another dtype than its main weights
};

}  // namespace

std::unique_ptr<DistributedOptimizer> make_adamw(std::vector<OptimizerShard> shards,
                                                 std::shared_ptr<Communicator> comm,
                                                 const AdamWOptions& options,
                                                 std::function<void()> after_step) {
  return std::make_unique<AdamW>(std::move(shards), std::move(comm), options,
                                 std::move(after_step));
}

}  // namespace mfsdp
