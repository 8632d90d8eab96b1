// make_simulated_communicator: collectives as local copies of the sizes rank `rank` of a real
// job would move (include/mfsdp/comm/simulated_comm.h).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <stdexcept>

#include "comm/collective_args.h"
#include "mfsdp/comm/simulated_comm.h"

namespace mfsdp {
namespace {

struct DoneWork final : Work {
  void wait() override {}
  bool is_completed() override { return true; }
};

class SimulatedCommunicator final : public Communicator {
 public:
  SimulatedCommunicator(int rank, int size, at::Device device)
      : rank_(rank), size_(size), device_(device) {
    if (size < 1 || rank < 0 || rank >= size)
      throw std::invalid_argument("simulated communicator: rank " + std::to_string(rank) + " is not in a job of " +
                                  std::to_string(size) + " ranks");
    if (!device.is_cpu() && !device.is_cuda() && !device.is_meta())
      throw std::invalid_argument("simulated communicator: device must be CPU, CUDA or meta, got " + device.str());
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return device_.is_cuda() ? "nccl" : "gloo"; }
  at::Device device() const override { return device_; }
  std::chrono::milliseconds default_timeout() const override { return std::chrono::minutes(5); }

  WorkHandle all_gather_async(const at::Tensor& output, const at::Tensor& input,
                              const AllGatherOptions& options) override {
    const RankSlices s = all_gather_layout(output, input, options, rank_, size_, device_.type());
    at::NoGradGuard no_grad;
    const at::Tensor flat_in = input.reshape({-1});
    const at::Tensor flat_out = output.view({-1});
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;  // last: the input may alias its own slot
      at::Tensor slot = flat_out.narrow(0, s.offsets[r], s.counts[r]);
      const int64_t n = std::min(s.counts[r], flat_in.numel());
      slot.narrow(0, 0, n).copy_(flat_in.narrow(0, 0, n));
      if (n < s.counts[r]) slot.narrow(0, n, s.counts[r] - n).zero_();
    }
    flat_out.narrow(0, s.offsets[rank_], s.counts[rank_]).copy_(flat_in);
    return done();
  }

  WorkHandle reduce_scatter_async(const at::Tensor& output, const at::Tensor& input,
                                  const ReduceScatterOptions& options) override {
    const RankSlices s = reduce_scatter_layout(output, input, options, rank_, size_, device_.type());
    check_reduction("reduce_scatter", options.op, input.scalar_type(), options.prescale);
    at::NoGradGuard no_grad;
    output.view({-1}).copy_(input.reshape({-1}).narrow(0, s.offsets[rank_], s.counts[rank_]));
    const double factor = options.prescale * (options.op == ReduceOp::kSum ? size_ : 1);
    if (factor != 1.0) output.mul_(factor);
    return done();
  }

  WorkHandle all_reduce_async(const at::Tensor& tensor, const AllReduceOptions& options) override {
    check_tensor("all_reduce", "tensor", tensor, device_.type());
    check_reduction("all_reduce", options.op, tensor.scalar_type(), 1.0);
    at::NoGradGuard no_grad;
    if (options.op == ReduceOp::kSum && size_ > 1) tensor.mul_(size_);  // N identical contributions
    return done();
  }

  WorkHandle broadcast_async(const at::Tensor& tensor, const BroadcastOptions& options) override {
    check_tensor("broadcast", "tensor", tensor, device_.type());
    if (options.root < 0 || options.root >= size_)
      throw std::invalid_argument("broadcast: root " + std::to_string(options.root) + " is not a rank of " +
                                  std::to_string(size_));
    return done();
  }

  // As all-gather: as if every rank sent this rank what this rank sends itself (cut or padded
  // with zeros to the rows expected from it); the own rows are exact.
  WorkHandle all_to_all_single_async(const at::Tensor& output, const at::Tensor& input,
                                     const AllToAllOptions& options) override {
    const AllToAllLayout l = all_to_all_layout(output, input, options, rank_, size_, device_.type());
    at::NoGradGuard no_grad;
    const at::Tensor own = input.reshape({-1}).narrow(0, l.send.offsets[rank_], l.send.counts[rank_]);
    const at::Tensor flat_out = output.view({-1});
    for (int q = 0; q < size_; ++q) {
      at::Tensor slot = flat_out.narrow(0, l.recv.offsets[q], l.recv.counts[q]);
      const int64_t n = std::min(l.recv.counts[q], own.numel());
      slot.narrow(0, 0, n).copy_(own.narrow(0, 0, n));
      if (n < l.recv.counts[q]) slot.narrow(0, n, l.recv.counts[q] - n).zero_();
    }
    return done();
  }

  // No peer to talk to: sends move nothing, receives get zeros.
  WorkHandle send_recv_async(const std::vector<P2POp>& ops, const P2POptions&) override {
    check_p2p_ops(ops, rank_, size_, device_.type());
    at::NoGradGuard no_grad;
    for (const P2POp& op : ops)
      if (op.kind == P2POp::Kind::kRecv) op.tensor.zero_();
    return done();
  }

  WorkHandle barrier_async(const BarrierOptions&) override { return done(); }

  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks, const std::string& name) override {
    const bool ascending = std::is_sorted(ranks.begin(), ranks.end()) &&
                           std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end();
    auto me = std::find(ranks.begin(), ranks.end(), rank_);
    if (ranks.empty() || !ascending || ranks.front() < 0 || ranks.back() >= size_ || me == ranks.end())
      throw std::invalid_argument("new_group '" + name + "': ranks must be ascending, within [0, " +
                                  std::to_string(size_) + ") and include rank " + std::to_string(rank_));
    return std::make_shared<SimulatedCommunicator>(static_cast<int>(me - ranks.begin()),
                                                   static_cast<int>(ranks.size()), device_);
  }

 private:
  static WorkHandle done() { return std::make_shared<DoneWork>(); }

  const int rank_, size_;
  const at::Device device_;
};

}  // namespace

std::shared_ptr<Communicator> make_simulated_communicator(int rank, int world_size, at::Device device) {
  return std::make_shared<SimulatedCommunicator>(rank, world_size, device);
}

bool is_simulated(const Communicator& comm) { return dynamic_cast<const SimulatedCommunicator*>(&comm) != nullptr; }

}  // namespace mfsdp
