// The NCCL communicator (src/comm/nccl_communicator.h) on a real GPU: one rank, CUDA tensors.
// Every test needs a CUDA GPU and skips, naming what is missing, on a machine without one (the
// CPU machines where CI runs); scripts/gpu_check.sh runs them on a borrowed GPU machine.
// Expected values are computed on the CPU from arange formulas, not by the code under test.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <memory>
#include <string>

#include "launch/rank_processes.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"

namespace {

#define MFSDP_REQUIRE_GPU()                                                                   \
  do {                                                                                        \
    if (!torch::cuda::is_available())                                                         \
      GTEST_SKIP() << "needs a CUDA GPU: this machine has none (torch::cuda::device_count() " \
                   << "== " << torch::cuda::device_count() << ")";                           \
  } while (0)

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

}  // namespace
