// How ranks find their GPU, on a real one (ctest label gpu; skips, naming the missing GPU, on a
// machine without one). The rules themselves are tested without a GPU in
// tests/unit/device_selection_test.cpp; here the machine answers:
//   - two local ranks that each see one GPU (CUDA_VISIBLE_DEVICES=0, as Slurm's
//     --gpus-per-task=1 shows it) both resolve --device auto to cuda:0, not to the CPU;
//   - when they in fact share it, creating the NCCL communicator fails on both, naming them;
//   - init_communicator leaves the rank's GPU current, and FSDP's plain buffers land on the
//     device asked for whatever GPU is current.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/buffer_allocator.h"
#include "harness/expect_error.h"
#include "mfsdp/launch/rank_processes.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"
#include "harness/require_gpu.h"

namespace {

using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;

constexpr const char* kChild = "MFSDP_DEVICE_SELECTION_CHILD";

int gpu_count() { return static_cast<int>(torch::cuda::device_count()); }

// The child's part when this process is one of the two ranks started below ("" in the parent).
std::string child_mode() {
  const char* mode = std::getenv(kChild);
  return mode != nullptr ? mode : "";
}

// Runs the current test again as local ranks 0 and 1 of a two-rank job (torchrun's variables)
// that each see only the first GPU, with `mode` set; fails naming the rank that failed, with
// both ranks' output.
void run_two_ranks_on_gpu0(const std::string& mode) {
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const int port = mfsdp::launch::pick_free_port();
  std::vector<mfsdp::launch::RankProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    mfsdp::launch::RankProcessSpec spec;
    spec.rank = r;
    spec.argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
                 std::string("--gtest_filter=") + test->test_suite_name() + "." + test->name(), "--gtest_color=no"};
    spec.env = mfsdp::launch::rank_environment(0, 1, 2, r, "127.0.0.1", port);
    spec.env["CUDA_VISIBLE_DEVICES"] = "0";
    spec.env[kChild] = mode;
    specs.push_back(std::move(spec));
  }
  std::map<int, std::vector<std::string>> output;
  mfsdp::launch::SuperviseOptions supervise;
  supervise.deadline = std::chrono::seconds(240);
  supervise.failure_grace = std::chrono::seconds(10);  // the other rank's own report
  supervise.on_line = [&](int rank, mfsdp::launch::OutputStream, const std::string& line) {
    output[rank].push_back(line);
  };
  const mfsdp::launch::SuperviseResult result = mfsdp::launch::run_rank_processes(specs, supervise);
  if (result.ok()) return;
  std::string report = result.summary() + "\n";
  for (const auto& [rank, lines] : output)
    for (const auto& line : lines) report += "[rank" + std::to_string(rank) + "] " + line + "\n";
  ADD_FAILURE() << report;
}

TEST(DeviceSelectionGpu, OneVisibleGpuPerRankResolvesAutoToCuda0) {
  if (child_mode() == "resolve") {
    const mfsdp::RendezvousInfo info = mfsdp::rendezvous_from_env();
    ASSERT_EQ(info.local_world_size, 2);
    ASSERT_EQ(gpu_count(), 1) << "CUDA_VISIBLE_DEVICES=0 shows one GPU";
    // What mfsdp-pretrain does with its --device (src/train/trainer_main.cpp).
    EXPECT_EQ(mfsdp::resolve_device("auto", info.local_rank, info.local_world_size), at::Device(at::kCUDA, 0));
    EXPECT_EQ(mfsdp::resolve_device("cuda", info.local_rank, info.local_world_size), at::Device(at::kCUDA, 0));
    return;
  }
  MFSDP_REQUIRE_GPU();
  run_two_ranks_on_gpu0("resolve");
}

// NCCL refuses two ranks on one GPU deep in its init ("duplicate GPU"); init_communicator says
// so first, on every rank, naming both.
TEST(DeviceSelectionGpu, TwoRanksSharingTheGpuAreRefusedNamingBoth) {
  if (child_mode() == "share") {
    mfsdp::CommOptions options;
    options.backend = "nccl";
    options.timeout = options.rendezvous_timeout = std::chrono::seconds(60);
    const std::string e = error_of([&] { mfsdp::init_communicator(options); });
    expect_contains(e, {"communicator 'nccl': ranks 0 and 1 both use GPU GPU-", "its own GPU", "--gpus-per-task=1"});
    return;
  }
  MFSDP_REQUIRE_GPU();
  run_two_ranks_on_gpu0("share");
}

// Where there are two GPUs, the communicator takes the last and cuda:0 is made current before an
// allocation, so that a missing device switch shows; on one GPU both are cuda:0.
TEST(DeviceSelectionGpu, InitCommunicatorMakesItsGpuCurrentAndPlainBuffersLandThere) {
  MFSDP_REQUIRE_GPU();
  const int last = gpu_count() - 1;
  mfsdp::RendezvousInfo info;  // one rank
  info.master_port = mfsdp::launch::pick_free_port();
  info.source = "explicit";
  mfsdp::CommOptions options;
  options.backend = "nccl";
  options.device_index = last;
  options.timeout = std::chrono::seconds(60);
  auto comm = mfsdp::init_communicator(info, options);
  ASSERT_EQ(comm->device(), at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(last)));
  EXPECT_EQ(c10::cuda::current_device(), comm->device().index());

  auto allocator = mfsdp::detail::make_buffer_allocator(mfsdp::BufferAllocatorKind::kPlain);
  auto expect_on_comm_device = [&](const char* when) {
    const c10::DataPtr memory =
        allocator->allocate(nullptr, mfsdp::detail::BufferRole::kWeights, 1 << 20, at::kFloat, comm->device());
    EXPECT_EQ(memory.device(), comm->device()) << when;
    cudaPointerAttributes where{};
    ASSERT_EQ(cudaPointerGetAttributes(&where, memory.get()), cudaSuccess) << when;
    EXPECT_EQ(where.device, last) << when << ": the memory itself is on GPU " << where.device;
  };
  expect_on_comm_device("after init_communicator");
  c10::cuda::set_device(0);
  expect_on_comm_device("with cuda:0 current");
  EXPECT_EQ(c10::cuda::current_device(), 0) << "the allocation restores the current device";
}

}  // namespace
