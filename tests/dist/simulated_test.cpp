// Simulated scale: one process playing rank r of an N-rank job holds exactly the bytes rank r of
// a real N-rank run holds (model weights, main weights, main grads, optimizer state, transient
// peak, local shards), for every strategy, fp32 and bf16, 1-D and HSDP meshes; and the simulated
// collectives move what their contract says.
#include <torch/torch.h>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "harness/uneven_net.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"

namespace {

using namespace torch;
using mfsdp::ShardingStrategy;

using Net = mfsdp::testing::UnevenNet;

struct Footprint {
  mfsdp::MemoryReport memory;
  int64_t optimizer_state = 0;
  std::vector<std::tuple<std::string, int64_t, int64_t>> shards;  // name, offset, numel
};

Footprint footprint(const std::shared_ptr<mfsdp::Communicator>& world, ShardingStrategy s, bool bf16,
                    std::vector<int> mesh) {
  torch::manual_seed(1);
  Net net;
  mfsdp::FullyShardOptions o;
  if (mesh.empty()) {
    o.comm = world;
  } else {
    o.mesh = std::make_shared<mfsdp::DeviceMesh>(world, mesh, std::vector<std::string>{"outer", "shard"});
  }
  o.strategy = s;
  if (bf16) o.mixed_precision.param_dtype = at::kBFloat16;
  for (auto& b : net->blocks) mfsdp::fully_shard(*b, o);
  auto root = mfsdp::fully_shard(*net, o);
  auto opt = mfsdp::make_adamw(root, {});
  root.reset_peak();
  for (int step = 0; step < 2; ++step) {
    mfsdp::call(*net, torch::randn({4, 7}), true).to(kFloat).pow(2).mean().backward();
    opt->clip_grad_norm(1.0);
    opt->step(1e-3);
    root.zero_grad();
  }
  Footprint f;
  f.memory = root.memory();
  for (auto& [key, tensors] : opt->state())
    for (auto& t : tensors) f.optimizer_state += t.nbytes();
  for (const auto& ls : root.local_shards()) f.shards.emplace_back(ls.name, ls.offset, ls.local.numel());
  return f;
}

}  // namespace

MFSDP_DIST_TEST(Simulated, HoldsTheBytesOfTheRealRank, {2, 3, 4}) {
  auto real = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
  auto simulated = mfsdp::make_simulated_communicator(comm.rank(), comm.size());
  std::vector<std::vector<int>> meshes = {{}};
  if (comm.size() == 4) meshes.push_back({2, 2});
  for (const auto& mesh : meshes)
    for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                               ShardingStrategy::kOptimGradsParams})
      for (bool bf16 : {false, true}) {
        const std::string what = std::string(mfsdp::to_string(s)) + (bf16 ? " bf16" : " fp32") +
                                 (mesh.empty() ? "" : " HSDP 2x2");
        Footprint want = footprint(real, s, bf16, mesh);
        Footprint got = footprint(simulated, s, bf16, mesh);
        EXPECT_GT(want.memory.model_weights, 0) << what;
        EXPECT_EQ(got.memory.model_weights, want.memory.model_weights) << what;
        EXPECT_EQ(got.memory.main_weights, want.memory.main_weights) << what;
        EXPECT_EQ(got.memory.main_grads, want.memory.main_grads) << what;
        EXPECT_EQ(got.memory.transient_peak, want.memory.transient_peak) << what;
        EXPECT_EQ(got.memory.transient_now, want.memory.transient_now) << what;
        EXPECT_EQ(got.optimizer_state, want.optimizer_state) << what;
        EXPECT_EQ(got.shards, want.shards) << what;
      }
}

TEST(Simulated, CollectivesMoveWhatTheContractSays) {
  auto comm = mfsdp::make_simulated_communicator(2, 4);
  EXPECT_TRUE(mfsdp::is_simulated(*comm));
  EXPECT_EQ(comm->rank(), 2);
  EXPECT_EQ(comm->size(), 4);
  // All-gather: this rank's input in every slot (uneven counts: prefix, then zeros).
  at::Tensor out = at::full({9}, -1.0);
  comm->all_gather(out, at::tensor({5.0f, 6.0f}), {{2, 3, 2, 2}});
  EXPECT_TRUE(at::equal(out, at::tensor({5.0f, 6.0f, 5.0f, 6.0f, 0.0f, 5.0f, 6.0f, 5.0f, 6.0f})));
  // Reduce-scatter: its own slice of the input, as the sum of 4 equal contributions x prescale.
  at::Tensor rs = at::zeros({2});
  mfsdp::ReduceScatterOptions sum;
  sum.prescale = 0.25;
  comm->reduce_scatter(rs, at::arange(8, at::kFloat), sum);
  EXPECT_TRUE(at::equal(rs, at::tensor({4.0f, 5.0f})));
  mfsdp::ReduceScatterOptions avg;
  avg.op = mfsdp::ReduceOp::kAvg;
  comm->reduce_scatter(rs, at::arange(8, at::kFloat), avg);
  EXPECT_TRUE(at::equal(rs, at::tensor({4.0f, 5.0f})));
  at::Tensor ar = at::tensor({1.5});
  comm->all_reduce(ar);
  EXPECT_EQ(ar.item<double>(), 6.0);
  mfsdp::AllReduceOptions mean;
  mean.op = mfsdp::ReduceOp::kAvg;
  comm->all_reduce(ar, mean);
  EXPECT_EQ(ar.item<double>(), 6.0);
  // Subgroups keep the rank's place.
  auto group = comm->new_group({0, 2}, "pair");
  EXPECT_EQ(group->rank(), 1);
  EXPECT_EQ(group->size(), 2);
  // Bad calls fail like real ones.
  using mfsdp::testing::error_of;
  mfsdp::testing::expect_contains(error_of([&] { comm->all_gather(at::zeros({5}), at::zeros({2})); }),
                                  {"all_gather"});
  mfsdp::testing::expect_contains(error_of([&] { comm->new_group({0, 1}, "other"); }), {"include rank 2"});
  mfsdp::testing::expect_contains(error_of([] { mfsdp::make_simulated_communicator(4, 4); }),
                                  {"rank 4", "4 ranks"});
}
