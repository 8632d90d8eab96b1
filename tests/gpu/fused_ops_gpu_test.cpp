// The model's fused ATen ops on CUDA (ctest label gpu), where at::rms_norm runs the fused
// _fused_rms_norm kernels and SDPA flash attention with grouped query heads: the CPU tier's
// checks (tests/harness/fused_ops_check.h, tests/unit/fused_ops_test.cpp) on device 0. Each test
// skips, naming what is missing, on a machine without a GPU.
#include <gtest/gtest.h>

#include "harness/fused_ops_check.h"
#include "harness/require_gpu.h"

namespace {

TEST(FusedOpsGpu, RmsNormIsTheCompositionRoundedOnce) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::check_rms_norm(at::Device(at::kCUDA, 0));
}

TEST(FusedOpsGpu, GroupedQueryAttentionIsTheExpandedComposition) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::check_grouped_query_attention(at::Device(at::kCUDA, 0));
}

}  // namespace
