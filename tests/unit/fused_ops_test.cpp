// The model's fused ATen ops against the plain compositions they replace, on the CPU
// (tests/harness/fused_ops_check.h says what each check holds; the GPU tier runs the same checks
// on CUDA: tests/gpu/fused_ops_gpu_test.cpp).
#include <gtest/gtest.h>

#include "harness/fused_ops_check.h"

namespace {

TEST(FusedOps, RmsNormIsTheCompositionRoundedOnce) { mfsdp::testing::check_rms_norm(at::Device(at::kCPU)); }

TEST(FusedOps, GroupedQueryAttentionIsTheExpandedComposition) {
  mfsdp::testing::check_grouped_query_attention(at::Device(at::kCPU));
}

}  // namespace
