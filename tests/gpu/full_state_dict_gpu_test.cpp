// Full state dicts on CUDA hold at most one parameter group's full values on the device
// (include/mfsdp/fsdp/fully_shard.h; ctest label gpu): a ZeRO-3 Llama on one GPU (NCCL, world 1)
// trained a few steps, then
//   - full_state_dict with cpu_offload: the CUDA peak allocated during it stays within what was
//     allocated before it plus the largest group's gather buffer; the same bound is broken by
//     full_state_dict(bool), which keeps every gathered tensor on the device (the measure sees it);
//   - RolloutModel::load_from(root), streamed: the peak stays within what was allocated before,
//     plus the rollout copy itself, plus one group's gather buffer (no second full copy).
// Bounds are bytes computed from the tensors, rounded as the CUDA caching allocator rounds small
// blocks (multiples of 512 bytes; every allocation here is under its 1 MiB small-block limit,
// checked). Values: before training the offloaded tensors equal the unsharded model's bit for
// bit; after it the streamed rollout holds exactly the offloaded values.
// Skips on a machine without a GPU, naming what is missing.
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>

#include "harness/dist_test.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/models/lm_loss.h"
#include "mfsdp/models/model_spec.h"
#include "mfsdp/train/rollout_model.h"
#include "harness/require_gpu.h"

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

constexpr int64_t kBlock = 512;              // the caching allocator's block rounding
constexpr int64_t kSmallLimit = 1 << 20;     // blocks up to this size are split exactly

int64_t block_bytes(int64_t bytes) { return bytes == 0 ? 0 : std::max(kBlock, (bytes + kBlock - 1) / kBlock * kBlock); }

int64_t allocated_now(int device) {
  return cca::getDeviceStats(device).allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
}
int64_t allocated_peak(int device) {
  return cca::getDeviceStats(device).allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

mfsdp::LlamaConfig config() {
  mfsdp::LlamaConfig c;
  c.vocab_size = 512;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  return c;
}

}  // namespace

TEST(FullStateDictGpu, OffloadAndStreamedRolloutHoldOneGroupOnTheDevice) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::DistOptions options;
  options.backend = "nccl";
  options.world_sizes = {1};
  mfsdp::testing::run_distributed(options, [](mfsdp::Communicator& comm) {
    ASSERT_TRUE(comm.device().is_cuda());
    const int device = comm.device().index();
    mfsdp::LlamaOptions init;
    init.init_seed = 7;
    mfsdp::LlamaForCausalLM plain(config(), init), policy(config(), init);
    mfsdp::FullyShardOptions o;  // ZeRO-3
    o.comm = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
    mfsdp::FsdpHandle root = mfsdp::shard_llama(policy, o);

    const auto before_training = root.full_state_dict(mfsdp::FullStateDictOptions{true, /*cpu_offload=*/true});
    for (const auto& [name, want] : mfsdp::model_tensors(*plain)) {
      ASSERT_TRUE(before_training.count(name)) << name;
      const at::Tensor& got = before_training.at(name);
      EXPECT_TRUE(got.device().is_cpu()) << name;
      EXPECT_TRUE(at::equal(got, want)) << name << " differs from the unsharded model";
    }

    mfsdp::AdamWOptions adamw;
    adamw.weight_decay = 0.0;
    auto optimizer = mfsdp::make_adamw(root, adamw);
    const at::Tensor ids = at::arange(2 * 17, at::kLong).remainder(config().vocab_size).view({2, 17}).to(comm.device());
    for (int step = 0; step < 3; ++step) {
      mfsdp::lm_loss(policy->call(ids.narrow(1, 0, 16)), ids.narrow(1, 1, 16)).backward();
      optimizer->step(1e-3);
      root.zero_grad();
    }
    torch::cuda::synchronize();

    // One gather buffer: the largest group's main weights, whole (world 1: the shard is the group).
    int64_t group = 0;
    for (const auto& s : root.optimizer_shards()) group = std::max<int64_t>(group, s.main_weight.nbytes());
    ASSERT_GT(group, 0);
    ASSERT_LE(group, kSmallLimit) << "the bound assumes small blocks";

    cca::resetPeakStats(device);
    int64_t before = allocated_now(device);
    const auto offloaded = root.full_state_dict(mfsdp::FullStateDictOptions{true, /*cpu_offload=*/true});
    EXPECT_LE(allocated_peak(device), before + block_bytes(group))
        << "offloaded full state dict: " << allocated_peak(device) - before << " bytes above the "
        << before << " allocated before it; one group is " << group;
    int64_t model_bytes = 0, model_blocks = 0;
    for (const auto& [name, t] : offloaded) {
      EXPECT_TRUE(t.device().is_cpu()) << name;
      model_bytes += static_cast<int64_t>(t.nbytes());
      model_blocks += block_bytes(static_cast<int64_t>(t.nbytes()));
      ASSERT_LE(static_cast<int64_t>(t.nbytes()), kSmallLimit) << name << ": the bound assumes small blocks";
    }
    ASSERT_GT(model_bytes, 2 * group) << "the model must hold several groups for the bound to mean anything";

    // The measure sees what keeping every group on the device costs.
    cca::resetPeakStats(device);
    before = allocated_now(device);
    {
      const auto kept = root.full_state_dict(/*all_ranks=*/true);
      EXPECT_GT(allocated_peak(device), before + block_bytes(group)) << "full_state_dict(bool) on the device";
    }

    mfsdp::RolloutModel rollout(mfsdp::llama_model_config(config()), comm.device());
    for (int load = 0; load < 2; ++load) {  // the first load builds the copy, the second refills it
      cca::resetPeakStats(device);
      before = allocated_now(device);
      rollout.load_from(root);
      EXPECT_LE(allocated_peak(device), before + model_blocks + block_bytes(group))
          << "streamed rollout load " << load << ": " << allocated_peak(device) - before
          << " bytes above the allocation before it; the copy is " << model_blocks << ", one group " << group;
      for (const auto& [name, t] : mfsdp::model_tensors(rollout.model())) {
        EXPECT_TRUE(t.device() == comm.device()) << name;
        EXPECT_TRUE(at::equal(t.cpu(), offloaded.at(name))) << name << ": rollout differs from the offloaded value";
      }
      rollout.release();
    }
  });
}
