// The GPU tier's skip (tests/gpu/): a test that needs a CUDA GPU skips, naming what is missing,
// on machines without one (CI); scripts/gpu_check.sh fails its tier when every test skipped.
#pragma once

#include <gtest/gtest.h>
#include <torch/cuda.h>

#define MFSDP_REQUIRE_GPU()                                                                   \
  do {                                                                                        \
    if (torch::cuda::device_count() == 0)                                                     \
      GTEST_SKIP() << "needs a CUDA GPU: this machine has none (torch::cuda::device_count() " \
                   << "== 0)";                                                                \
  } while (0)
