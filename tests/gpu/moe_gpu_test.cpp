// The MoE block on CUDA (include/mfsdp/models/moe.h, ctest label gpu), in bf16 where
// at::_grouped_mm has its CUDA kernel:
//   - experts that receive no token get exactly zero weight gradient from the grouped GEMM (the
//     per-expert path gives zero by construction), and the busy experts' gradients agree;
//   - without expert parallelism a forward and backward never waits for the GPU with the grouped
//     GEMM, and once (the per-expert path's row counts) without: c10's sync debug mode counts
//     the synchronising CUDA calls.
// Every test skips, naming what is missing, on a machine without a GPU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <functional>
#include <string>
#include <vector>

#include "mfsdp/models/moe.h"
#include "harness/require_gpu.h"

namespace {

const at::Device kGpu(at::kCUDA, 0);
constexpr int64_t kHidden = 64, kExperts = 5;

// Top-1 of 5 experts, bf16 on the GPU; the router sends a token with x[0] > 0 to expert 0 and one
// with x[0] < 0 to expert 3, so experts 1, 2 (between busy groups) and 4 (the last) get none.
mfsdp::MoeBlock idle_experts_block(bool grouped) {
  mfsdp::MoeConfig c;
  c.num_experts = kExperts;
  c.top_k = 1;
  c.ffn_hidden_size = 32;
  torch::manual_seed(21);
  mfsdp::MoeBlock block(kHidden, c, /*deferred=*/false);
  {
    at::NoGradGuard g;
    for (auto& p : block->parameters()) p.normal_(0, 0.2);
    block->gate->weight.zero_();
    block->gate->weight[0][0].fill_(5.0);
    block->gate->weight[3][0].fill_(-5.0);
  }
  block->training_options.grouped_gemm = grouped;
  block->to(kGpu, at::kBFloat16);
  return block;
}

at::Tensor idle_experts_input() {
  torch::manual_seed(22);
  at::Tensor x = at::rand({2, 24, kHidden}) * 0.1;
  x.select(-1, 0).copy_(at::arange(48).remainder(2).mul(2).sub(1).view({2, 24}));  // +-1 alternating
  return x.to(kGpu, at::kBFloat16);
}

// Counts c10's sync-debug warnings ("called a synchronizing CUDA operation"); the autograd
// engine replays its worker threads' warnings on the thread that called backward.
struct SyncCounter : c10::WarningHandler {
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchronizing CUDA operation") != std::string::npos) ++syncs;
  }
  int syncs = 0;
};

int syncs_of(const std::function<void()>& work) {
  SyncCounter counter;
  c10::WarningUtils::WarningHandlerGuard guard(&counter);
  auto& state = c10::cuda::warning_state();
  state.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  try {
    work();
  } catch (...) {
    state.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    throw;
  }
  state.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  return counter.syncs;
}

}  // namespace

TEST(MoeGpu, ExpertsWithoutTokensGetExactlyZeroGradientFromTheGroupedGemm) {
  MFSDP_REQUIRE_GPU();
  const at::Tensor x = idle_experts_input();
  std::vector<at::Tensor> busy;  // per path: experts 0 and 3's gradients, fp32 on the CPU
  for (bool grouped : {false, true}) {
    mfsdp::MoeBlock block = idle_experts_block(grouped);
    block->forward(x).to(at::kFloat).square().sum().backward();
    const std::vector<int64_t> counts = block->take_stats().tokens_per_expert;
    ASSERT_EQ(counts, (std::vector<int64_t>{24, 0, 0, 24, 0})) << "the router did not route as the test needs";
    std::vector<at::Tensor> grads;
    for (int64_t e = 0; e < kExperts; ++e) {
      auto& ex = block->experts->expert(e);
      for (const at::Tensor& w : {ex.gate->weight, ex.up->weight, ex.down->weight}) {
        ASSERT_TRUE(w.grad().defined()) << "grouped " << grouped << ", expert " << e;
        const at::Tensor g = w.grad().to(at::kCPU, at::kFloat);
        if (counts[e] == 0)
          EXPECT_EQ(g.abs().max().item<double>(), 0.0) << "grouped " << grouped << ", idle expert " << e;
        else
          grads.push_back(g.flatten());
      }
    }
    busy.push_back(at::cat(grads));
  }
  const double scale = busy[0].abs().max().item<double>();
  ASSERT_GT(scale, 0.0);
  EXPECT_LE((busy[1] - busy[0]).abs().max().item<double>(), 0.02 * scale)
      << "the grouped GEMM's gradients of the busy experts differ from the per-expert GEMMs'";
}

TEST(MoeGpu, ForwardAndBackwardWithoutExpertParallelismNeverWaitForTheGpu) {
  MFSDP_REQUIRE_GPU();
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  // Elsewhere PyTorch runs _grouped_mm as a loop over the groups, reading the offsets on the host.
  if (major != 9 && major != 10)
    GTEST_SKIP() << "needs a GPU of compute capability 9.x or 10.x (Hopper, Blackwell), where at::_grouped_mm has "
                 << "its bf16 CUDA kernel: this one is " << major << ".x";
  // The counter sees a synchronising call (else zero below would prove nothing).
  const at::Tensor probe = at::ones({1}, at::TensorOptions().device(kGpu));
  EXPECT_GE(syncs_of([&] { (void)probe.item<float>(); }), 1);

  const at::Tensor x = idle_experts_input();
  for (bool grouped : {true, false}) {
    mfsdp::MoeBlock block = idle_experts_block(grouped);
    block->training_options.aux_loss_coeff = 1e-2;  // the losses' path through backward too
    block->training_options.z_loss_coeff = 1e-3;
    auto step = [&] { block->forward(x).to(at::kFloat).square().mean().backward(); };
    step();  // first calls set up cuBLAS and the caching allocator
    const int syncs = syncs_of(step);
    if (grouped)
      EXPECT_EQ(syncs, 0) << "a grouped-GEMM MoE layer without expert parallelism waited for the GPU";
    else
      EXPECT_EQ(syncs, 1) << "the per-expert path waits once, for its row counts";
  }
}
