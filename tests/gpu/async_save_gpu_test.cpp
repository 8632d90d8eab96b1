// --async-save's staging on CUDA (AsyncCheckpointSaver, ctest label gpu): the staging buffer is
// page-locked host memory of exactly the staged size, taken beside PyTorch's caching pinned
// allocator (which rounds a block up to a power of two, 17 MiB + a little to 32 MiB, and keeps it
// after release); a save that needs more gives the old buffer back; and what the GPU shards were
// copied into is what loads back. Every test skips, naming what is missing, without a GPU.
#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>
#include <vector>

#include "harness/dist_test.h"
#include "mfsdp/checkpoint/async_save.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"
#include "harness/require_gpu.h"

namespace {

struct WideImpl : torch::nn::Module {
  WideImpl(int64_t in, int64_t out) { fc = register_module("fc", torch::nn::Linear(in, out)); }
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Wide);

struct Sharded {
  Wide net;
  mfsdp::FsdpHandle root;
  std::unique_ptr<mfsdp::DistributedOptimizer> opt;
};

// Linear(in, out) with bias on the rank's GPU, fully sharded, after one AdamW step (so the
// optimizer has its two moments): 3 x (in + 1) x out fp32 values of state.
Sharded trained(mfsdp::Communicator& comm, int64_t in, int64_t out, uint64_t seed) {
  torch::manual_seed(seed);
  Sharded s{Wide(in, out), {}, nullptr};
  mfsdp::FullyShardOptions o;
  o.comm = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
  s.root = mfsdp::fully_shard(*s.net, o);
  s.opt = mfsdp::make_adamw(s.root, mfsdp::AdamWOptions{});
  mfsdp::call(*s.net, at::randn({4, in}).to(comm.device())).square().mean().backward();
  s.opt->step(1e-3);
  s.root.zero_grad();
  return s;
}

// This rank's model and optimizer values, on the CPU, and their bytes.
std::vector<at::Tensor> state_of(const Sharded& s) {
  std::vector<at::Tensor> out;
  for (const auto& shard : s.root.local_shards()) out.push_back(shard.local.cpu());
  for (const auto& [key, tensors] : s.opt->state())
    for (const auto& t : tensors) out.push_back(t.cpu());
  return out;
}
int64_t bytes_of(const std::vector<at::Tensor>& state) {
  int64_t n = 0;
  for (const auto& t : state) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

// What PyTorch's CUDA caching pinned allocator holds, in use or cached (the C++ behind
// torch.cuda.host_memory_stats()["allocated_bytes.current"]).
int64_t caching_pinned_bytes() { return at::getHostAllocator(at::kCUDA)->get_stats().allocated_bytes.current; }

cudaMemoryType memory_type(const void* p) {
  cudaPointerAttributes a{};
  EXPECT_EQ(cudaPointerGetAttributes(&a, p), cudaSuccess);
  return a.type;
}

mfsdp::testing::DistOptions one_gpu() {
  mfsdp::testing::DistOptions o;
  o.backend = "nccl";
  o.world_sizes = {1};
  return o;
}

}  // namespace

TEST(AsyncSaveGpu, StagingPinsExactlyItsSizeAndGivesAGrownBufferBack) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::run_distributed(one_gpu(), [](mfsdp::Communicator& comm) {
    auto world = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
    const std::string dir = mfsdp::testing::shared_temp_dir();
    mfsdp::AsyncCheckpointSaver saver;
    const int64_t cached_before = caching_pinned_bytes();

    // 3 x 1001 x 1500 fp32 = 17.18 MiB of state: PyTorch's allocator would pin 32 MiB for it.
    Sharded small = trained(comm, 1000, 1500, 1);
    const std::vector<at::Tensor> saved = state_of(small);
    const int64_t small_bytes = bytes_of(saved);
    ASSERT_GT(small_bytes, 17 << 20);
    mfsdp::CheckpointInfo info;
    info.iteration = 1;
    saver.save(dir + "/small", world, small.root, small.opt.get(), info);
    ASSERT_EQ(saver.finish(world).value_or(-1), 1);
    // Exactly the state plus the generator states and each piece's alignment to 64 bytes.
    EXPECT_GE(saver.staging_bytes(), small_bytes);
    EXPECT_LE(saver.staging_bytes(), small_bytes + (64 << 10));
    EXPECT_EQ(saver.pinned_bytes(), saver.staging_bytes());
    const void* first = saver.staging_data();
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(memory_type(first), cudaMemoryTypeHost) << "the staging buffer is not page-locked";
    EXPECT_EQ(caching_pinned_bytes(), cached_before) << "staging went through PyTorch's caching pinned allocator";

    // What was staged is what was saved: it loads back into another model bit for bit.
    Sharded other = trained(comm, 1000, 1500, 2);
    mfsdp::load_checkpoint(dir + "/small", world, other.root, other.opt.get());
    const std::vector<at::Tensor> loaded = state_of(other);
    ASSERT_EQ(loaded.size(), saved.size());
    for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(at::equal(loaded[i], saved[i])) << "tensor " << i;

    // A save that needs more replaces the buffer: the old one is no longer page-locked memory.
    Sharded big = trained(comm, 1000, 2600, 3);
    const int64_t big_bytes = bytes_of(state_of(big));
    info.iteration = 2;
    saver.save(dir + "/big", world, big.root, big.opt.get(), info);
    ASSERT_EQ(saver.finish(world).value_or(-1), 2);
    EXPECT_GE(saver.staging_bytes(), big_bytes);
    EXPECT_LE(saver.staging_bytes(), big_bytes + (64 << 10));
    EXPECT_EQ(saver.pinned_bytes(), saver.staging_bytes());
    const auto* now = static_cast<const char*>(saver.staging_data());
    EXPECT_EQ(memory_type(now), cudaMemoryTypeHost);
    const auto* old = static_cast<const char*>(first);
    if (old < now || old >= now + saver.staging_bytes()) {  // else the new buffer lies where the old one was
      EXPECT_EQ(memory_type(old), cudaMemoryTypeUnregistered) << "the outgrown staging buffer is still pinned";
    }
    EXPECT_EQ(caching_pinned_bytes(), cached_before);
  });
}
