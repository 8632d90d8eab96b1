// The fully_shard runtime on CUDA with NCCL (ctest label gpu; scripts/gpu_check.sh runs it):
//   - every strategy against single-process LibTorch training on the same GPU,
//   - bf16 compute with fp32 main weights and a bf16 gradient reduction on the wire,
//   - prefetching (comm streams ordered by events) giving the same weights as no prefetching,
//   - a checkpoint saved under one layout and loaded under another,
//   - a short mfsdp-pretrain run on --device cuda against the same run on the CPU.
// Multi-rank tests run on 1 GPU and, where the machine has 2 or more, also on 2 ranks (one GPU
// each). On a machine without a GPU every test skips, naming what is missing.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "harness/dist_test.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/launch/rank_processes.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "harness/require_gpu.h"

namespace {

int gpu_count() { return static_cast<int>(torch::cuda::device_count()); }

// 1 rank, and 2 where there are two GPUs (one rank per GPU).
mfsdp::testing::DistOptions on_gpus(std::string phase = "") {
  mfsdp::testing::DistOptions o;
  o.backend = "nccl";
  o.world_sizes = gpu_count() >= 2 ? std::vector<int>{1, 2} : std::vector<int>{1};
  o.phase = std::move(phase);
  return o;
}

constexpr int64_t kIn = 24, kHidden = 40, kBatchPerRank = 4, kSteps = 3;

struct BlockImpl : mfsdp::ShardedModule<BlockImpl> {
  BlockImpl() {
    up = register_module("up", torch::nn::Linear(kIn, kHidden));
    down = register_module("down", torch::nn::Linear(kHidden, kIn));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(at::gelu(up(x))); }
  torch::nn::Linear up{nullptr}, down{nullptr};
};
MFSDP_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block()));
    head = register_module("head", torch::nn::Linear(kIn, 1));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b(x);  // MFSDP_MODULE: routed through the runtime
    return head(x);
  }
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(1234);
  return Net();
}

// Deterministic data for step `step`, all ranks' rows together (rank r owns rows r*B .. +B).
std::pair<at::Tensor, at::Tensor> batch(int step, int world) {
  at::Tensor x = at::sin(at::arange(world * kBatchPerRank * kIn, at::kFloat).view({world * kBatchPerRank, kIn}) *
                         (0.37 + 0.11 * step));
  at::Tensor y = x.sum(1, /*keepdim=*/true).cos();
  return {x, y};
}

// Single-process reference on this rank's GPU (not cuda:0: a rank touching another GPU is what
// the runtime must not do): the whole global batch, torch AdamW.
std::map<std::string, at::Tensor> reference_after_training(const mfsdp::Communicator& comm) {
  const int world = comm.size();
  const at::Device device = comm.device();
  Net net = make_net();
  net->to(device);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.0));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, world);
    opt.zero_grad();
    at::Tensor loss = at::mse_loss(net->forward(x.to(device)), y.to(device));
    loss.backward();
    opt.step();
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().cpu();
  return out;
}

struct Sharded {
  Net net;
  mfsdp::FsdpHandle root;
  std::unique_ptr<mfsdp::DistributedOptimizer> opt;
};

Sharded shard(mfsdp::Communicator& comm, const mfsdp::FullyShardOptions& base) {
  Sharded s{make_net(), {}, nullptr};
  mfsdp::FullyShardOptions o = base;
  o.comm = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
  for (auto& b : s.net->blocks) mfsdp::fully_shard(*b, o);
  s.root = mfsdp::fully_shard(*s.net, o);
  mfsdp::AdamWOptions adamw;
  adamw.weight_decay = 0.0;
  s.opt = mfsdp::make_adamw(s.root, adamw);
  return s;
}

void train(Sharded& s, mfsdp::Communicator& comm) {
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, comm.size());
    const at::Device device = comm.device();
    at::Tensor mine = x.narrow(0, comm.rank() * kBatchPerRank, kBatchPerRank).to(device);
    at::Tensor target = y.narrow(0, comm.rank() * kBatchPerRank, kBatchPerRank).to(device);
    at::Tensor loss = at::mse_loss(mfsdp::call(*s.net, mine).to(at::kFloat), target);
    loss.backward();
    s.opt->step(1e-2);
    s.root.zero_grad();
  }
}

void expect_close(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                  double atol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, w] : want) {
    const at::Tensor g = got.at(name).cpu().to(at::kFloat);
    const double diff = (g - w).abs().max().item<double>();
    EXPECT_LE(diff, atol) << what << ": " << name << " differs from the single-process reference by " << diff;
  }
}

TEST(FsdpGpu, EveryStrategyMatchesSingleProcess) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::run_distributed(on_gpus(), [](mfsdp::Communicator& comm) {
    ASSERT_TRUE(comm.device().is_cuda());
    const auto reference = reference_after_training(comm);
    for (auto strategy : {mfsdp::ShardingStrategy::kNoShard, mfsdp::ShardingStrategy::kOptim,
                          mfsdp::ShardingStrategy::kOptimGrads, mfsdp::ShardingStrategy::kOptimGradsParams}) {
      mfsdp::FullyShardOptions o;
      o.strategy = strategy;
      Sharded s = shard(comm, o);
      for (const auto& shard : s.root.local_shards()) ASSERT_TRUE(shard.local.is_cuda()) << shard.name;
      train(s, comm);
      expect_close(s.root.full_state_dict(/*all_ranks=*/true), reference, 2e-5, mfsdp::to_string(strategy));
    }
  });
}

TEST(FsdpGpu, Bf16ComputeAndBf16ReductionTrackTheFp32Reference) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::run_distributed(on_gpus(), [](mfsdp::Communicator& comm) {
    const auto reference = reference_after_training(comm);
    mfsdp::FullyShardOptions o;
    o.mixed_precision.param_dtype = at::kBFloat16;
    o.mixed_precision.grad_comm_dtype = at::kBFloat16;
    Sharded s = shard(comm, o);
    train(s, comm);
    // fp32 main weights hold the result; bf16 forward/backward and reduction cost ~1e-2 relative.
    for (const auto& shard : s.root.local_shards()) EXPECT_EQ(shard.local.scalar_type(), at::kFloat);
    for (const auto& [name, got] : s.root.full_state_dict(true)) {
      const at::Tensor want = reference.at(name);
      const double relative = (got.cpu() - want).norm().item<double>() / want.norm().item<double>();
      EXPECT_LE(relative, 2e-2) << "bf16: " << name << " is off the fp32 reference by " << relative << " (relative)";
    }
  });
}

TEST(FsdpGpu, PrefetchOnCommStreamsGivesTheSameWeights) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::run_distributed(on_gpus(), [](mfsdp::Communicator& comm) {
    std::map<std::string, at::Tensor> results[2];
    for (int prefetch = 0; prefetch < 2; ++prefetch) {
      mfsdp::FullyShardOptions o;
      o.prefetch = prefetch == 1;
      o.all_gather_in_start_param_sync = prefetch == 1;
      Sharded s = shard(comm, o);
      s.root.record_events(true);
      train(s, comm);
      const auto events = s.root.events();
      const bool prefetched = std::any_of(events.begin(), events.end(), [](const std::string& e) {
        return e.find(":prefetch") != std::string::npos;
      });
      EXPECT_EQ(prefetched, prefetch == 1);
      results[prefetch] = s.root.full_state_dict(true);
    }
    // Same kernels in the same order on the compute stream: identical bits, unless an
    // all-gather or reduce-scatter was not ordered against the compute that used its buffers.
    for (const auto& [name, t] : results[0]) EXPECT_TRUE(at::equal(t, results[1].at(name))) << name;
  });
}

TEST(FsdpGpu, CheckpointReshardsBetweenLayouts) {
  MFSDP_REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("mfsdp_gpu_ckpt_" + std::to_string(::getpid()));
  auto options = [&](const char* phase, std::vector<int> worlds) {
    auto o = on_gpus(phase);
    o.world_sizes = std::move(worlds);
    o.shared_dir = dir.string();
    return o;
  };
  const int saver = std::min(gpu_count(), 2);
  mfsdp::testing::run_distributed(options("save", {saver}), [](mfsdp::Communicator& comm) {
    Sharded s = shard(comm, {});  // ZeRO-3
    train(s, comm);
    auto world = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
    mfsdp::CheckpointInfo info;
    info.iteration = 3;
    mfsdp::save_checkpoint(mfsdp::testing::shared_temp_dir() + "/ckpt", world, s.root, s.opt.get(), info);
    auto full = s.root.full_state_dict(false);
    if (comm.rank() == 0)
      for (const auto& [name, t] : full) torch::save(t.cpu(), mfsdp::testing::shared_temp_dir() + "/" + name + ".pt");
  });
  mfsdp::testing::run_distributed(options("load", {1}), [](mfsdp::Communicator& comm) {
    mfsdp::FullyShardOptions o;
    o.strategy = mfsdp::ShardingStrategy::kNoShard;  // another layout than the saver's
    Sharded s = shard(comm, o);
    auto world = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
    mfsdp::load_checkpoint(mfsdp::testing::shared_temp_dir() + "/ckpt", world, s.root, s.opt.get());
    for (const auto& [name, t] : s.root.full_state_dict(true)) {
      at::Tensor saved;
      torch::load(saved, mfsdp::testing::shared_temp_dir() + "/" + name + ".pt");
      EXPECT_TRUE(at::equal(t.cpu(), saved)) << name;
    }
  });
  mfsdp::remove_tree(dir);
}

// The first iterations' losses of mfsdp-pretrain on --device `device` with `extra` flags; its
// output into *output when given.
std::vector<double> pretrain_losses(const std::string& device, const std::string& extra = "",
                                    std::string* output = nullptr) {
  namespace fs = std::filesystem;
  mfsdp::testing::TempDir dir("mfsdp-gpu-pretrain");
  const fs::path metrics = dir.path() / "metrics.jsonl";
  const std::string command =
      "env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
      std::to_string(mfsdp::launch::pick_free_port()) + " " + std::string(MFSDP_PRETRAIN_BIN_PATH) + " --device " + device +
      " --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32"
      " --num-attention-heads 4 --swiglu --ffn-hidden-size 48 --seq-length 16 --micro-batch-size 2"
      " --global-batch-size 4 --train-iters 6 --lr 3e-3 --log-interval 1 --eval-interval 1000"
      " --eval-iters 1 --seed 7 --metrics-file " + metrics.string() + extra + " 2>&1";
  auto r = mfsdp::testing::run_command(command);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (output) *output = r.output;
  EXPECT_NE(r.output.find(" device: " + std::string(device == "cuda" ? "cuda:0 (nccl)" : "cpu (gloo)")),
            std::string::npos)
      << r.output;
  std::vector<double> losses;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("eval")) losses.push_back(j["lm_loss"].get<double>());
  }
  return losses;
}

TEST(FsdpGpu, PretrainOnCudaFollowsTheCpuRun) {
  MFSDP_REQUIRE_GPU();
  const auto gpu = pretrain_losses("cuda"), cpu = pretrain_losses("cpu");
  ASSERT_EQ(gpu.size(), 6u);
  ASSERT_EQ(cpu.size(), 6u);
  for (size_t i = 0; i < gpu.size(); ++i)
    EXPECT_NEAR(gpu[i], cpu[i], 1e-3 * std::abs(cpu[i])) << "iteration " << i + 1;
  EXPECT_LT(gpu.back(), gpu.front());
  // The default, --optimizer-implementation auto, is fused AdamW on CUDA, bit for bit.
  EXPECT_EQ(pretrain_losses("cuda", " --optimizer-implementation fused"), gpu);
}

// --profile on CUDA: --use-pytorch-profiler's trace holds the steps' CUDA kernels (CUPTI), and
// nsys's capture range (cudaProfilerStart/Stop, NVTX) runs; neither changes a loss.
TEST(FsdpGpu, ProfileRecordsTheStepsKernels) {
  MFSDP_REQUIRE_GPU();
  const auto plain = pretrain_losses("cuda");
  mfsdp::testing::TempDir dir("mfsdp-gpu-profile");
  const std::string tb = dir.file("tb");
  std::string output;
  const auto traced = pretrain_losses(
      "cuda", " --profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 4 --tensorboard-dir " + tb,
      &output);
  EXPECT_EQ(traced, plain);
  EXPECT_NE(output.find("rank 0: profile of iterations 3..4 written to " + tb), std::string::npos) << output;
  int kernels = 0;
  std::set<std::string> steps;
  for (const std::string& name : mfsdp::list_directory(tb)) {
    if (name.find(".pt.trace.json") == std::string::npos) continue;
    std::ifstream in(tb + "/" + name);
    const nlohmann::json trace = nlohmann::json::parse(in);  // kept: a range-for over a temporary's member dangles
    ASSERT_TRUE(trace.contains("traceEvents")) << name;
    for (const auto& e : trace["traceEvents"]) {
      if (e.value("cat", "") == "kernel") ++kernels;
      const std::string n = e.value("name", "");
      if (n.rfind("ProfilerStep#", 0) == 0) steps.insert(n);
    }
  }
  EXPECT_GT(kernels, 0) << "no CUDA kernel in the trace";
  EXPECT_EQ(steps, (std::set<std::string>{"ProfilerStep#3", "ProfilerStep#4"}));

  const auto nsys = pretrain_losses("cuda", " --profile --profile-step-start 2 --profile-step-end 4", &output);
  EXPECT_EQ(nsys, plain);
  EXPECT_NE(output.find("rank 0: nsys capture range of iterations 3..4 ended"), std::string::npos) << output;
}

}  // namespace
