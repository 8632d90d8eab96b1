// SGD with momentum over flat shards, op for op as torch::optim::SGD (LibTorch 1.13), applied once
// per segment run instead of once per parameter.
#include <ATen/ATen.h>

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "optim/shard_optimizer.h"

namespace mfsdp {
namespace {

void check_options(const SGDOptions& o) {
  auto fail = [](const char* field, double value, const char* expected) {
    std::ostringstream msg;
    msg << "SGDOptions." << field << " must be " << expected << ", got " << value;
    throw std::invalid_argument(msg.str());
  };
  if (!(o.momentum >= 0) || !std::isfinite(o.momentum)) {
    fail("momentum", o.momentum, "finite and >= 0");
  }
  if (!std::isfinite(o.dampening)) fail("dampening", o.dampening, "finite");
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay)) {
    fail("weight_decay", o.weight_decay, "finite and >= 0");
  }
  if (o.nesterov && !(o.momentum > 0 && o.dampening == 0)) {
    std::ostringstream msg;
    msg << "SGDOptions.nesterov needs momentum > 0 and dampening == 0, got momentum " << o.momentum
        << " and dampening " << o.dampening;
    throw std::invalid_argument(msg.str());
  }
}

class SGD final : public ShardOptimizer {
 public:
  SGD(std::vector<OptimizerShard> shards, std::shared_ptr<Communicator> comm,
      const SGDOptions& options, std::function<void()> after_step)
      : ShardOptimizer("SGD", std::move(shards), std::move(comm), std::move(after_step)),
        options_(options) {
    check_options(options_);
    // torch keeps no buffer without momentum; neither do we.
    if (options_.momentum != 0) {
      for (const OptimizerShard& shard : shards_) {
        momentum_buffer_.push_back(
            at::zeros({shard.main_weight.numel()}, shard.main_weight.options()));
      }
    }
  }

  std::vector<std::pair<std::string, std::vector<at::Tensor>>> state() const override {
    if (options_.momentum == 0) return {};
    return {{"momentum_buffer", momentum_buffer_}};
  }

 private:
  void update(double lr, int64_t step) override {
    const double wd = options_.weight_decay, momentum = options_.momentum;
    for (size_t i = 0; i < shards_.size(); ++i) {
      const at::Tensor& weight = shards_[i].main_weight;
      for (const SegmentRun& run : runs_[i]) {
        at::Tensor p = weight.narrow(0, run.offset, run.length);
        at::Tensor d_p = shards_[i].main_grad.narrow(0, run.offset, run.length);
        // torch: d_p = g.add(p, wd) per parameter with decay. Here a copy of the run's grad takes
        // the L2 term on its decay ranges only; the main grad itself stays read-only.
        if (wd != 0 && !run.decay.empty()) {
          d_p = d_p.clone();
          for (const ElementRange& r : run.decay) {
            d_p.narrow(0, r.offset - run.offset, r.length)
                .add_(weight.narrow(0, r.offset, r.length), wd);
          }
        }
        if (momentum != 0) {
          at::Tensor buf = momentum_buffer_[i].narrow(0, run.offset, run.length);
          // torch clones d_p into a fresh buffer at a parameter's first step.
          if (step == 1) {
            buf.copy_(d_p);
          } else {
            buf.mul_(momentum).add_(d_p, 1 - options_.dampening);
          }
          d_p = options_.nesterov ? d_p.add(buf, momentum) : buf;
        }
        p.add_(d_p, -1 * lr);
      }
    }
  }

  const SGDOptions options_;
  // Per shard: [n], like main_weight; empty without momentum.
  std::vector<at::Tensor> momentum_buffer_;
};

}  // namespace

std::unique_ptr<DistributedOptimizer> make_sgd(std::vector<OptimizerShard> shards,
                                               std::shared_ptr<Communicator> comm,
                                               const SGDOptions& options,
                                               std::function<void()> after_step) {
  return std::make_unique<SGD>(std::move(shards), std::move(comm), options, std::move(after_step));
}

}  // namespace mfsdp
