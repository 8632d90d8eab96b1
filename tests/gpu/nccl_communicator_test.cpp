// The NCCL communicator (src/comm/nccl_communicator.h) on a real GPU: one rank, CUDA tensors.
// Every test needs a CUDA GPU and skips, naming what is missing, on a machine without one (the
// CPU machines where CI runs); scripts/gpu_check.sh runs them on a borrowed GPU machine.
// Expected values are computed on the CPU from arange formulas, not by the code under test.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "comm/nccl_communicator.h"
#include "mfsdp/launch/rank_processes.h"
#include "mfsdp/comm/comm.h"
#include "harness/require_gpu.h"
#include "mfsdp/comm/rendezvous.h"

namespace {

std::shared_ptr<mfsdp::Communicator> single_rank_nccl() {
  mfsdp::RendezvousInfo info;
  info.master_port = mfsdp::launch::pick_free_port();
  info.source = "explicit";
  mfsdp::CommOptions options;
  options.backend = "nccl";
  options.device_index = 0;
  options.timeout = std::chrono::milliseconds(60000);
  return mfsdp::init_communicator(info, options);
}

at::TensorOptions cuda(at::ScalarType dtype) { return at::device(at::kCUDA).dtype(dtype); }

TEST(NcclCommunicator, ReportsBackendAndSingleRank) {
  MFSDP_REQUIRE_GPU();
  auto comm = single_rank_nccl();
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
}

TEST(NcclCommunicator, CollectivesOnCudaTensors) {
  MFSDP_REQUIRE_GPU();
  auto comm = single_rank_nccl();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::Tensor expected = at::arange(12, at::kFloat).to(dtype);  // exact in bf16
    at::Tensor input = expected.to(cuda(dtype).device());

    at::Tensor gathered = at::zeros({12}, cuda(dtype));
    comm->all_gather(gathered, input);
    EXPECT_TRUE(gathered.is_cuda());
    EXPECT_TRUE(at::equal(gathered.cpu(), expected));

    at::Tensor reduced = at::zeros({12}, cuda(dtype));
    mfsdp::ReduceScatterOptions sum;
    sum.op = mfsdp::ReduceOp::kSum;
    comm->reduce_scatter(reduced, input, sum);
    EXPECT_TRUE(at::equal(reduced.cpu(), expected));

    at::Tensor summed = input.clone();
    comm->all_reduce_async(summed, {mfsdp::ReduceOp::kAvg})->wait();
    EXPECT_TRUE(at::equal(summed.cpu(), expected));

    at::Tensor root = input.clone();
    comm->broadcast(root, {});
    EXPECT_TRUE(at::equal(root.cpu(), expected));
  }
  comm->barrier();
}

// A finished collective lets go of its tensors at the next launch, not at the watchdog's next
// poll (up to 100 ms later): held until then, every unit's unsharded buffers of a fast step were
// alive at once. use_count: the test's reference, plus one while a work keeps it. (Without the
// release at launch this fails unless the watchdog happens to poll in the microseconds between.)
TEST(NcclCommunicator, FinishedCollectivesReleaseTheirTensorsAtTheNextLaunch) {
  MFSDP_REQUIRE_GPU();
  auto comm = single_rank_nccl();
  at::Tensor first = at::ones({1 << 20}, cuda(at::kFloat));
  comm->all_reduce_async(first, {mfsdp::ReduceOp::kSum})->wait();
  torch::cuda::synchronize();
  at::Tensor second = at::ones({4}, cuda(at::kFloat));
  comm->all_reduce_async(second, {mfsdp::ReduceOp::kSum})->wait();
  EXPECT_EQ(first.use_count(), 1) << "a finished collective still holds its tensor";
  torch::cuda::synchronize();
}

TEST(NcclCommunicator, RejectsCpuTensors) {
  MFSDP_REQUIRE_GPU();
  auto comm = single_rank_nccl();
  at::Tensor cpu = at::ones({4});
  try {
    comm->all_reduce(cpu);
    FAIL() << "all_reduce of a CPU tensor on the NCCL communicator did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cpu"), std::string::npos) << e.what();
  }
}

// A prescaled reduction is an NCCL PreMulSum (no scaled copy of the input); both ways of summing
// bf16 give the known values at world size 1 (factors and values exact in bf16).
TEST(NcclCommunicator, PrescaleAndBothLowPrecisionSums) {
  MFSDP_REQUIRE_GPU();
  auto comm = single_rank_nccl();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (mfsdp::LowPrecisionSum how : {mfsdp::LowPrecisionSum::kNative, mfsdp::LowPrecisionSum::kRankOrderFp32}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (how == mfsdp::LowPrecisionSum::kNative ? " native" : " rank order"));
      at::Tensor values = at::arange(16, at::kFloat).to(dtype);
      at::Tensor out = at::zeros({16}, cuda(dtype));
      mfsdp::ReduceScatterOptions rs;
      rs.prescale = 0.25;
      rs.low_precision_sum = how;
      comm->reduce_scatter(out, values.cuda(), rs);
      EXPECT_TRUE(at::equal(out.cpu(), values * 0.25));
      rs.op = mfsdp::ReduceOp::kAvg;
      comm->reduce_scatter(out, values.cuda(), rs);
      EXPECT_TRUE(at::equal(out.cpu(), values * 0.25));
      rs.op = mfsdp::ReduceOp::kMax;  // no PreMulMax in NCCL: a scaled copy
      comm->reduce_scatter(out, values.cuda(), rs);
      EXPECT_TRUE(at::equal(out.cpu(), values * 0.25));
      at::Tensor summed = values.cuda();
      mfsdp::AllReduceOptions ar;
      ar.low_precision_sum = how;
      comm->all_reduce(summed, ar);
      EXPECT_TRUE(at::equal(summed.cpu(), values));
    }
  torch::cuda::synchronize();
}

size_t free_bytes() {
  size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  return free;
}

// Sub-groups are split from their parent (ncclCommSplit); the device memory the world and each
// split take is printed for the record (gpu_check's log: one GPU says little about the buffers
// of many peers, the 8-GPU number is still to measure).
TEST(NcclCommunicator, SplitGroupsWorkAndTheirMemoryIsRecorded) {
  MFSDP_REQUIRE_GPU();
  torch::cuda::synchronize();
  const size_t before_world = free_bytes();
  auto comm = single_rank_nccl();
  const size_t after_world = free_bytes();
  auto first = comm->new_group({0}, "first");
  const size_t after_first = free_bytes();
  auto second = first->new_group({0}, "second");  // a split of a split
  const size_t after_second = free_bytes();
  std::printf("communicator device memory (MiB): world %.1f, a split %.1f, a split of it %.1f\n",
              (double(before_world) - double(after_world)) / (1 << 20),
              (double(after_world) - double(after_first)) / (1 << 20),
              (double(after_first) - double(after_second)) / (1 << 20));
  for (auto& group : {first, second}) {
    at::Tensor t = at::arange(8, cuda(at::kFloat));
    group->all_reduce(t);
    EXPECT_TRUE(at::equal(t.cpu(), at::arange(8, at::kFloat)));
    EXPECT_EQ(group->size(), 1);
  }
}

// A world whose peer never comes: the nonblocking init ends with an error at the rendezvous
// timeout instead of blocking forever inside ncclCommInitRank. (Straight to the NCCL factory:
// init_communicator would stop earlier, at the store's wait for every rank's GPU claim.)
TEST(NcclCommunicator, InitWithoutItsPeerFailsAtTheTimeout) {
  MFSDP_REQUIRE_GPU();
  auto store = c10::make_intrusive<c10d::HashStore>();
  mfsdp::RendezvousInfo info;
  info.world_size = 2;
  info.rank = 0;
  try {
    mfsdp::make_nccl_communicator(store, info, /*device_index=*/0, std::chrono::seconds(60),
                                  /*connect_timeout=*/std::chrono::seconds(5));
    FAIL() << "an init without its peer returned";
  } catch (const mfsdp::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("still in progress at the timeout"), std::string::npos) << e.what();
  }
}

// MFSDP_DEBUG_STREAM_SLEEP=comm:<cycles> holds the communication stream before each collective:
// a collective stays unfinished while the host goes on, and a reader that skips wait() sees the
// old bits, deterministically: what the FSDP tests run under it rely on (scripts/gpu_check.sh).
TEST(NcclCommunicator, StreamSleepMakesAMissingWaitVisible) {
  MFSDP_REQUIRE_GPU();
  setenv("MFSDP_DEBUG_STREAM_SLEEP", "comm:2000000000", 1);  // ~1 s at 2 GHz
  auto comm = single_rank_nccl();
  unsetenv("MFSDP_DEBUG_STREAM_SLEEP");
  at::Tensor input = at::ones({1024}, cuda(at::kFloat));
  at::Tensor output = at::zeros({1024}, cuda(at::kFloat));
  mfsdp::WorkHandle work = comm->all_gather_async(output, input);
  EXPECT_FALSE(work->is_completed()) << "the sleep did not hold the communication stream";
  at::Tensor early = output.sum();  // no wait(): the compute stream races the collective
  EXPECT_EQ(early.item<float>(), 0.0f) << "read before the all-gather without waiting for it";
  work->wait();
  EXPECT_EQ(output.sum().item<float>(), 1024.0f);
}

// A malformed switch is refused, naming it, when the communicator is made.
TEST(NcclCommunicator, RefusesAMalformedStreamSleep) {
  MFSDP_REQUIRE_GPU();
  setenv("MFSDP_DEBUG_STREAM_SLEEP", "comm", 1);
  try {
    single_rank_nccl();
    ADD_FAILURE() << "MFSDP_DEBUG_STREAM_SLEEP=comm accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("MFSDP_DEBUG_STREAM_SLEEP"), std::string::npos) << e.what();
  }
  unsetenv("MFSDP_DEBUG_STREAM_SLEEP");
}

}  // namespace
