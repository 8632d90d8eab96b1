// YaRN rotary tables and DeepSeek-V3's softmax scale (include/mfsdp/models/rope_scaling.h)
// against transformers' DeepseekV3RotaryEmbedding and DeepseekV3Attention.scaling
// (tests/reference/deepseek_v3_reference.py), for the rope_scaling of DeepSeek-V3, Kimi-K2 and
// DeepSeek-V2-Lite and a few corner cases; and the field checks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "harness/expect_error.h"
#include "harness/hf_deepseek_reference.h"
#include "mfsdp/models/rope_scaling.h"

namespace {

using mfsdp::YarnRopeScaling;

struct Case {
  std::string name;
  int64_t rope_dim, nope_dim;
  double theta;
  YarnRopeScaling yarn;
};

at::Tensor positions() { return torch::cat({torch::arange(0, 64), torch::arange(100, 20000, 997)}); }

nlohmann::json hf_config(const Case& c) {
  nlohmann::json rope = {{"rope_type", "yarn"},
                         {"rope_theta", c.theta},
                         {"factor", c.yarn.factor},
                         {"original_max_position_embeddings", c.yarn.original_max_position_embeddings},
                         {"beta_fast", c.yarn.beta_fast},
                         {"beta_slow", c.yarn.beta_slow},
                         {"truncate", c.yarn.truncate}};
  if (c.yarn.mscale != 0) rope["mscale"] = c.yarn.mscale;
  if (c.yarn.mscale_all_dim != 0) rope["mscale_all_dim"] = c.yarn.mscale_all_dim;
  return {{"hidden_size", 64},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 4},
          {"qk_rope_head_dim", c.rope_dim},
          {"qk_nope_head_dim", c.nope_dim},
          {"v_head_dim", 16},
          {"max_position_embeddings",
           static_cast<int64_t>(std::llround(c.yarn.factor * static_cast<double>(c.yarn.original_max_position_embeddings)))},
          {"rope_parameters", rope}};
}

// Every case's tables and softmax scale here and by the reference (one run of it), compared.
void check(const std::vector<Case>& cases) {
  std::vector<mfsdp::testing::DeepseekReferenceCase> ref_cases;
  for (const Case& c : cases) ref_cases.push_back({hf_config(c), {{"positions", positions()}}});
  const auto ref = mfsdp::testing::run_deepseek_reference("rope", ref_cases);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.name);
    ASSERT_EQ(ref[i].count("cos"), 1u);
    const mfsdp::RotaryTables t = mfsdp::rotary_tables(positions(), c.rope_dim, c.theta, c.yarn);
    ASSERT_EQ(t.cos.sizes(), ref[i].at("cos").sizes());
    EXPECT_LE((t.cos - ref[i].at("cos")).abs().max().item<double>(), 1e-6);
    EXPECT_LE((t.sin - ref[i].at("sin")).abs().max().item<double>(), 1e-6);
    const double scale =
        mfsdp::yarn_softmax_scale(1.0 / std::sqrt(static_cast<double>(c.rope_dim + c.nope_dim)), c.yarn);
    EXPECT_NEAR(scale, ref[i].at("scaling").item<double>(), 1e-12);
    // YaRN changes the tables here (a test that ignored it would fail the comparison).
    EXPECT_GT((t.cos - mfsdp::rotary_tables(positions(), c.rope_dim, c.theta).cos).abs().max().item<double>(), 1e-3);
  }
}

YarnRopeScaling yarn(double factor, int64_t original, double beta_fast, double beta_slow, double mscale,
                     double mscale_all_dim, bool truncate = true) {
  YarnRopeScaling y;
  y.factor = factor;
  y.original_max_position_embeddings = original;
  y.beta_fast = beta_fast;
  y.beta_slow = beta_slow;
  y.mscale = mscale;
  y.mscale_all_dim = mscale_all_dim;
  y.truncate = truncate;
  return y;
}

TEST(YarnRope, TablesAndSoftmaxScaleMatchTransformersDeepseekV3) {
  check({{"DeepSeek-V3", 64, 128, 10000, yarn(40, 4096, 32, 1, 1.0, 1.0)},
         {"Kimi-K2 (beta_fast = beta_slow)", 64, 128, 50000, yarn(32, 4096, 1, 1, 1.0, 1.0)},
         {"DeepSeek-V2-Lite (mscale 0.707)", 64, 128, 10000, yarn(40, 4096, 32, 1, 0.707, 0.707)},
         {"mscale alone: attention factor 1 + 0.1 ln s", 16, 32, 10000, yarn(8, 512, 32, 1, 1.0, 0)},
         {"different mscales, no truncation", 32, 16, 1e6, yarn(16, 1024, 24, 2, 1.0, 0.5, false)}});
}

TEST(YarnRope, FactorOneGivesThePlainTables) {
  const at::Tensor positions = torch::arange(0, 300);
  const mfsdp::RotaryTables plain = mfsdp::rotary_tables(positions, 32, 10000);
  const mfsdp::RotaryTables one = mfsdp::rotary_tables(positions, 32, 10000, yarn(1, 4096, 32, 1, 1, 1));
  EXPECT_TRUE(torch::equal(plain.cos, one.cos));
  EXPECT_TRUE(torch::equal(plain.sin, one.sin));
  EXPECT_EQ(mfsdp::yarn_softmax_scale(0.125, yarn(1, 4096, 32, 1, 1, 1)), 0.125);
}

TEST(YarnRope, ChecksNameTheField) {
  using mfsdp::testing::error_of;
  using mfsdp::testing::expect_contains;
  const at::Tensor p = torch::arange(0, 4);
  expect_contains(error_of([&] { mfsdp::rotary_tables(p, 16, 1e4, yarn(0, 4096, 32, 1, 1, 1)); }),
                  {"rope_scaling.factor", "found 0"});
  expect_contains(error_of([&] { mfsdp::rotary_tables(p, 16, 1e4, yarn(4, 0, 32, 1, 1, 1)); }),
                  {"rope_scaling.original_max_position_embeddings"});
  expect_contains(error_of([&] { mfsdp::rotary_tables(p, 16, 1e4, yarn(4, 64, -1, 1, 1, 1)); }),
                  {"rope_scaling.beta_fast", "found -1"});
  expect_contains(error_of([&] { mfsdp::rotary_tables(p, 16, 1e4, yarn(4, 64, 32, 1, 1, NAN)); }),
                  {"rope_scaling.mscale_all_dim"});
  expect_contains(error_of([&] { mfsdp::rotary_tables(p, 15, 1e4, yarn(4, 64, 32, 1, 1, 1)); }),
                  {"head_dim", "15"});
}

}  // namespace
