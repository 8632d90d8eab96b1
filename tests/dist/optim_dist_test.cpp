// The flat-shard optimizer across ranks against single-process LibTorch: every rank trains the
// full parameters with torch::optim (same seeds, so the same reference everywhere) and checks
// that its own slice of the flat buffer, stepped by the distributed optimizer with global-norm
// clipping active, matches that reference. Slices are uneven and cut through parameters and
// padding; with three or more ranks one rank holds nothing. Replicated shards (no_shard) must
// enter the global norm once, not once per rank.
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "harness/dist_test.h"
#include "mfsdp/optim/optim.h"

namespace {

using mfsdp::Communicator;
using mfsdp::OptimizerShard;
using mfsdp::ShardSegment;

// As in tests/unit/optim_test.cpp: the code under test runs torch's own elementwise ops, so it
// agrees with torch to a few fp32 ulps at most (bit for bit on the machines we tried); the norm
// differs only by fp32 (torch) vs fp64 (ours) accumulation.
constexpr double kRtol = 1e-6;
constexpr double kAtol = 1e-7;
constexpr int kSteps = 5;
constexpr double kMaxNorm = 1.0;  // far below the norm of randn grads (~20): clipping is active

struct ParamSpec {
  std::vector<int64_t> shape;
  bool weight_decay;
  int64_t offset;  // in the full flat buffer
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Padding gaps between parameters and at the end of the buffer.
const std::vector<ParamSpec> kParams = {
    {{40, 9}, true, 0},   // [0, 360)
    {{31}, false, 363},   // [363, 394), bias-like
    {{1}, true, 394},     // [394, 395), one element
    {{5, 7}, true, 395},  // [395, 430)
    {{17}, false, 437},   // [437, 454)
};
constexpr int64_t kFlatNumel = 460;

// This rank's contiguous slice [offset, offset + count) of the flat buffer: uneven, cutting
// through parameters and padding, and empty for rank 1 once there are three or more ranks.
std::pair<int64_t, int64_t> rank_slice(int rank, int world) {
  const std::vector<std::vector<int64_t>> weights = {{1}, {2, 1}, {3, 0, 2}, {1, 0, 3, 2}};
  const std::vector<int64_t>& w = weights.at(world - 1);
  int64_t total = 0, before = 0;
  for (int64_t x : w) total += x;
  for (int r = 0; r < rank; ++r) before += w[r];
  const int64_t offset = kFlatNumel * before / total;
  const int64_t end = rank == world - 1 ? kFlatNumel : kFlatNumel * (before + w[rank]) / total;
  return {offset, end - offset};
}

// One flat buffer of kParams: the reference leaves and this rank's shard of it.
struct Buffer {
  std::vector<at::Tensor> params;  // full parameters, trained by torch::optim
  OptimizerShard shard;            // this rank's slice (or everything, when replicated)
  int64_t offset = 0;              // where the shard starts in the flat buffer
};

// Packs `tensors` (one per kParams entry) into a zero-padded flat buffer.
at::Tensor pack(const std::vector<at::Tensor>& tensors) {
  at::Tensor flat = at::zeros({kFlatNumel});
  for (size_t i = 0; i < kParams.size(); ++i) {
    flat.narrow(0, kParams[i].offset, kParams[i].numel()).copy_(tensors[i].detach().flatten());
  }
  return flat;
}

Buffer make_buffer(uint64_t seed, bool replicated, int rank, int world) {
  Buffer b;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (const ParamSpec& spec : kParams) {
    b.params.push_back(at::randn(spec.shape, gen).set_requires_grad(true));
  }
  auto [offset, count] =
      replicated ? std::make_pair(int64_t{0}, kFlatNumel) : rank_slice(rank, world);
  b.offset = offset;
  b.shard.main_weight = pack(b.params).narrow(0, offset, count).clone();
  b.shard.main_grad = at::zeros({count});
  b.shard.replicated = replicated;
  for (const ParamSpec& spec : kParams) {
    const int64_t lo = std::max(spec.offset, offset);
    const int64_t hi = std::min(spec.offset + spec.numel(), offset + count);
    if (hi > lo) b.shard.segments.push_back(ShardSegment{lo - offset, hi - lo, spec.weight_decay});
  }
  return b;
}

// Gradients of step `step` for buffer `index`: the same on every rank.
void set_grads(Buffer& b, int index, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7000 + 100 * index + step);
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < kParams.size(); ++i) {
    grads.push_back(at::randn(kParams[i].shape, gen));
    b.params[i].mutable_grad() = grads.back().clone();
  }
  b.shard.main_grad.copy_(pack(grads).narrow(0, b.offset, b.shard.main_grad.numel()));
}

// `got` (this rank's shard of some flat tensor) against the same slice of the packed reference.
void expect_slice_close(const at::Tensor& got, const std::vector<at::Tensor>& want_params,
                        const Buffer& b, const std::string& what, int rank) {
  at::Tensor want = pack(want_params).narrow(0, b.offset, got.numel());
  const double max_abs = got.numel() == 0 ? 0.0 : (got - want).abs().max().item<double>();
  EXPECT_TRUE(at::allclose(got, want, kRtol, kAtol))
      << what << " on rank " << rank << ": max |diff| " << max_abs;
  // Padding must come out exactly zero (allclose alone would let it drift by kAtol).
  at::Tensor padding_mask = at::ones({kFlatNumel}, at::kBool);
  for (const ParamSpec& spec : kParams) {
    padding_mask.narrow(0, spec.offset, spec.numel()).fill_(false);
  }
  at::Tensor padding = got.masked_select(padding_mask.narrow(0, b.offset, got.numel()));
  EXPECT_TRUE(at::equal(padding, at::zeros_like(padding)))
      << what << " on rank " << rank << ": padding changed: " << padding;
}

enum class Kind { kAdamW, kSGD };

// Trains `buffers` (each sharded or replicated) for kSteps with clipping, against torch::optim
// over all their parameters, and checks norms, weights and optimizer state on this rank.
void run_against_reference(Communicator& comm, Kind kind, std::vector<bool> replicated) {
  const int rank = comm.rank(), world = comm.size();
  const std::string label =
      std::string(kind == Kind::kAdamW ? "AdamW" : "SGD") + ", world " + std::to_string(world);
  std::vector<Buffer> buffers;
  std::vector<OptimizerShard> shards;
  std::vector<at::Tensor> decay, no_decay;
  for (size_t i = 0; i < replicated.size(); ++i) {
    buffers.push_back(make_buffer(11 + i, replicated[i], rank, world));
    shards.push_back(buffers.back().shard);
    for (size_t p = 0; p < kParams.size(); ++p) {
      (kParams[p].weight_decay ? decay : no_decay).push_back(buffers.back().params[p]);
    }
  }
  // The harness hands out a reference; the optimizer wants shared ownership it will not outlive.
  std::shared_ptr<Communicator> comm_ptr(&comm, [](Communicator*) {});

  std::unique_ptr<mfsdp::DistributedOptimizer> opt;
  std::unique_ptr<torch::optim::Optimizer> ref;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (kind == Kind::kAdamW) {
    mfsdp::AdamWOptions options;
    options.weight_decay = 0.1;
    opt = mfsdp::make_adamw(shards, comm_ptr, options);
    auto group = [](double wd) {
      return std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(1e-3).weight_decay(wd));
    };
    groups.emplace_back(decay, group(0.1));
    groups.emplace_back(no_decay, group(0.0));
    ref = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(1e-3));
  } else {
    mfsdp::SGDOptions options;
    options.momentum = 0.9;
    options.nesterov = true;
    options.weight_decay = 0.05;
    opt = mfsdp::make_sgd(shards, comm_ptr, options);
    auto group = [](double wd) {
      return std::make_unique<torch::optim::SGDOptions>(
          torch::optim::SGDOptions(1e-2).momentum(0.9).nesterov(true).weight_decay(wd));
    };
    groups.emplace_back(decay, group(0.05));
    groups.emplace_back(no_decay, group(0.0));
    ref = std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(1e-2));
  }

  std::vector<at::Tensor> all_params = decay;
  all_params.insert(all_params.end(), no_decay.begin(), no_decay.end());
  for (int k = 0; k < kSteps; ++k) {
    const double lr = (kind == Kind::kAdamW ? 1e-2 : 5e-2) * (1 + k % 3);
    for (size_t i = 0; i < buffers.size(); ++i) set_grads(buffers[i], static_cast<int>(i), k);
    const double want_norm = torch::nn::utils::clip_grad_norm_(all_params, kMaxNorm);
    ASSERT_GT(want_norm, 2 * kMaxNorm) << label << ": clipping must be active";
    const double got_norm = opt->clip_grad_norm(kMaxNorm);
    EXPECT_NEAR(got_norm, want_norm, kRtol * want_norm)
        << label << ", step " << k << ", rank " << rank;
    for (auto& group : ref->param_groups()) group.options().set_lr(lr);
    ref->step();
    opt->step(lr);
  }

  for (size_t i = 0; i < buffers.size(); ++i) {
    const std::string what =
        label + ", buffer " + std::to_string(i) + (replicated[i] ? " (replicated)" : " (sharded)");
    expect_slice_close(buffers[i].shard.main_weight, buffers[i].params, buffers[i],
                       what + ", main weight", rank);
    for (const auto& [name, tensors] : opt->state()) {
      std::vector<at::Tensor> want;
      for (const at::Tensor& p : buffers[i].params) {
        auto& state = *ref->state().at(p.unsafeGetTensorImpl());
        if (name == "exp_avg")
          want.push_back(static_cast<torch::optim::AdamWParamState&>(state).exp_avg());
        if (name == "exp_avg_sq")
          want.push_back(static_cast<torch::optim::AdamWParamState&>(state).exp_avg_sq());
        if (name == "momentum_buffer")
          want.push_back(static_cast<torch::optim::SGDParamState&>(state).momentum_buffer());
      }
      ASSERT_EQ(want.size(), kParams.size()) << "unexpected state " << name;
      expect_slice_close(tensors.at(i), want, buffers[i], what + ", " + name, rank);
    }
  }
}

}  // namespace

MFSDP_DIST_TEST(OptimDist, ShardedMatchesFullBufferReference, {1, 2, 3, 4}) {
  run_against_reference(comm, Kind::kAdamW, {false});
  run_against_reference(comm, Kind::kSGD, {false});
}

MFSDP_DIST_TEST(OptimDist, ReplicatedShardsCountOnceInTheNorm, {1, 2, 3, 4}) {
  // no_shard: every rank holds the whole buffer; the norm must not grow with the world size.
  run_against_reference(comm, Kind::kAdamW, {true});
  // A sharded and a replicated buffer in one optimizer: sum of the sharded squares over ranks
  // plus the replicated squares once.
  run_against_reference(comm, Kind::kAdamW, {false, true});
}
