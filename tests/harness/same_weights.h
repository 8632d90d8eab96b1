// Two checkpoints' model weights compared bit for bit (a resumed or restarted run against an
// uninterrupted one), through mfsdp::load_model, which reads any checkpoint mfsdp writes.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "mfsdp/checkpoint/load_model.h"

namespace mfsdp::testing {

// Every weight of the checkpoint at `dir` equals `want`'s, bit for bit.
inline void expect_same_weights(const std::string& dir, const std::string& want) {
  auto got = mfsdp::load_model(dir), ref = mfsdp::load_model(want);
  const auto ref_params = ref.model->named_parameters();
  int compared = 0;
  for (const auto& p : got.model->named_parameters()) {
    ASSERT_TRUE(ref_params.contains(p.key())) << p.key();
    EXPECT_TRUE(at::equal(p.value(), ref_params[p.key()])) << dir << ": " << p.key();
    ++compared;
  }
  EXPECT_GT(compared, 10);
}

}  // namespace mfsdp::testing
