// How a rank picks its device (src/comm/device_selection.h, docs/comm.md "Devices"): every rule
// of select_device with the machine's answers passed in, resolve_device reading the real ones,
// and the check that no two ranks of an NCCL communicator share a GPU, in real processes.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstdlib>
#include <optional>
#include <string>

#include "comm/device_selection.h"
#include "comm/store.h"
#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"

namespace {

using mfsdp::select_device;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;

const at::Device kCpu(at::kCPU);
at::Device cuda(int index) { return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)); }
const std::optional<std::string> kUnset;

TEST(DeviceSelection, CpuIsTheCpuWhateverTheGpus) {
  for (int gpus : {0, 1, 8}) EXPECT_EQ(select_device("cpu", 3, 8, gpus, "0"), kCpu) << gpus << " GPUs";
}

TEST(DeviceSelection, UnknownChoiceIsRefused) {
  expect_contains(error_of([] { select_device("tpu", 0, 1, 1, kUnset); }), {"--device", "'tpu'", "auto, cpu or cuda"});
}

TEST(DeviceSelection, NoGpuAutoIsTheCpuCudaIsAnError) {
  EXPECT_EQ(select_device("auto", 0, 1, 0, kUnset), kCpu);
  EXPECT_EQ(select_device("auto", 5, 8, 0, kUnset), kCpu);
  expect_contains(error_of([] { select_device("cuda", 0, 1, 0, kUnset); }),
                  {"--device cuda", "no CUDA GPU", "--device cpu"});
  // A CUDA_VISIBLE_DEVICES that hides every GPU is named.
  expect_contains(error_of([] { select_device("cuda", 0, 1, 0, std::string("")); }), {"CUDA_VISIBLE_DEVICES=''"});
}

// Slurm --gpus-per-task=1: each of 8 tasks on the node sees its own GPU only, as device 0.
TEST(DeviceSelection, OneVisibleGpuPerTaskIsCuda0OnEveryRank) {
  for (const char* choice : {"auto", "cuda"})
    for (int local_rank = 0; local_rank < 8; ++local_rank) {
      EXPECT_EQ(select_device(choice, local_rank, 8, 1, "0"), cuda(0)) << choice << " local rank " << local_rank;
      EXPECT_EQ(select_device(choice, local_rank, 8, 1, std::to_string(local_rank)), cuda(0));
      EXPECT_EQ(select_device(choice, local_rank, 8, 1, kUnset), cuda(0));
    }
}

// torchrun: every GPU visible to every rank, LOCAL_RANK picks one.
TEST(DeviceSelection, EnoughGpusIsCudaLocalRank) {
  for (const char* choice : {"auto", "cuda"}) {
    for (int local_rank = 0; local_rank < 8; ++local_rank)
      EXPECT_EQ(select_device(choice, local_rank, 8, 8, kUnset), cuda(local_rank)) << choice;
    EXPECT_EQ(select_device(choice, 1, 2, 8, "0,1,2,3,4,5,6,7"), cuda(1)) << choice;
    EXPECT_EQ(select_device(choice, 0, 1, 1, kUnset), cuda(0)) << choice;
    EXPECT_EQ(select_device(choice, 0, 0, 1, kUnset), cuda(0)) << choice;  // no launcher: one rank
  }
}

// 4 GPUs for 8 ranks (or --gpus-per-task=2): refused, never the CPU.
TEST(DeviceSelection, SomeGpusButFewerThanTheRanksIsRefused) {
  for (const char* choice : {"auto", "cuda"})
    for (int local_rank : {0, 3, 4, 7}) {
      const std::string e = error_of([&] { select_device(choice, local_rank, 8, 4, "0,1,2,3"); });
      expect_contains(e, {std::string("--device ") + choice, "sees 4 GPUs", "CUDA_VISIBLE_DEVICES='0,1,2,3'",
                          "8 ranks", "--gpus-per-task=1", "at most 4 ranks per node"});
    }
  expect_contains(error_of([] { select_device("auto", 0, 8, 2, kUnset); }), {"sees 2 GPUs", "8 ranks"});
}

TEST(DeviceSelection, LocalRankPastTheGpusIsRefused) {
  expect_contains(error_of([] { select_device("cuda", 2, 2, 2, kUnset); }), {"LOCAL_RANK 2", "sees 2"});
  expect_contains(error_of([] { select_device("auto", -1, 1, 1, kUnset); }), {"LOCAL_RANK -1"});
}

// resolve_device asks the machine: CUDA_VISIBLE_DEVICES='' hides every GPU from this process
// (set before its first CUDA call; ctest runs each test in its own process), whatever it has.
TEST(DeviceSelection, ResolveDeviceReadsTheGpusAndCudaVisibleDevices) {
  ASSERT_EQ(setenv("CUDA_VISIBLE_DEVICES", "", 1), 0);
  EXPECT_EQ(mfsdp::resolve_device("auto", 1, 2), kCpu);
  EXPECT_EQ(mfsdp::resolve_device("cpu", 1, 2), kCpu);
  expect_contains(error_of([] { mfsdp::resolve_device("cuda", 0, 1); }), {"no CUDA GPU", "CUDA_VISIBLE_DEVICES=''"});
}

TEST(DeviceSelection, OneRankHasItsGpuToItself) {
  c10d::HashStore store;
  EXPECT_NO_THROW(mfsdp::check_one_rank_per_gpu(store, 0, 1, "GPU-a", "GPU-a (test)", std::chrono::seconds(10)));
}

// The job's store (rank 0 serves it for the harness's communicator), under `name`.
c10::intrusive_ptr<c10d::Store> store_for(const std::string& name) {
  auto base = mfsdp::connect_store_client(mfsdp::rendezvous_from_env(), std::chrono::seconds(60));
  return c10::make_intrusive<c10d::PrefixStore>("device_selection_test/" + name, base);
}

MFSDP_DIST_TEST(DeviceSelection, RanksOnDistinctGpusPass, {2, 3}) {
  auto store = store_for("distinct");
  const std::string id = "GPU-" + std::to_string(comm.rank());
  EXPECT_NO_THROW(mfsdp::check_one_rank_per_gpu(*store, comm.rank(), comm.size(), id, id + " (test)",
                                                std::chrono::seconds(60)));
  // Rank 0 serves the store: it must not exit while another rank still reads the others' GPUs
  // (seen in CI on a loaded machine: "rank 0 exited or failed"). A job's rank 0 trains on.
  comm.barrier();
}

// Ranks 0 and 2 of 3 share a GPU: every rank (rank 1 too, which would otherwise wait in NCCL's
// init for them) fails, naming both and the GPU.
MFSDP_DIST_TEST(DeviceSelection, RanksSharingAGpuAllFailNamingThem, {3}) {
  auto store = store_for("shared");
  const std::string id = comm.rank() == 1 ? "GPU-b" : "GPU-a";
  const std::string e = error_of([&] {
    mfsdp::check_one_rank_per_gpu(*store, comm.rank(), comm.size(), id, id + " (PCI bus 0000:3b:00.0 on host h)",
                                  std::chrono::seconds(60));
  });
  expect_contains(e, {"ranks 0 and 2 both use GPU GPU-a (PCI bus 0000:3b:00.0 on host h)", "its own GPU",
                      "--gpus-per-task=1"});
  comm.barrier();  // rank 0 serves the store (see above)
}

}  // namespace
