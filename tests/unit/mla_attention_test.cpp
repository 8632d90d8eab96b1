// Multi-head latent attention (include/mfsdp/models/mla_attention.h) against transformers'
// DeepseekV3Attention (tests/reference/deepseek_v3_reference.py) with the same random weights,
// written here and loaded there by their HF names: with and without the query bottleneck
// (q_lora_rank), with and without YaRN, interleaved or half RoPE, with attention biases; and the
// config checks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "harness/expect_error.h"
#include "harness/hf_deepseek_reference.h"
#include "mfsdp/models/mla_attention.h"

namespace {

using mfsdp::MlaConfig;

nlohmann::json hf_config(const MlaConfig& c) {
  nlohmann::json rope = {{"rope_type", c.yarn ? "yarn" : "default"}, {"rope_theta", c.rope_theta}};
  int64_t max_positions = 2048;
  if (c.yarn) {
    rope["factor"] = c.yarn->factor;
    rope["original_max_position_embeddings"] = c.yarn->original_max_position_embeddings;
    rope["beta_fast"] = c.yarn->beta_fast;
    rope["beta_slow"] = c.yarn->beta_slow;
    rope["mscale"] = c.yarn->mscale;
    rope["mscale_all_dim"] = c.yarn->mscale_all_dim;
    max_positions = static_cast<int64_t>(c.yarn->factor) * c.yarn->original_max_position_embeddings;
  }
  return {{"hidden_size", c.hidden_size},
          {"num_attention_heads", c.num_heads},
          {"num_key_value_heads", c.num_heads},
          {"q_lora_rank", c.q_lora_rank == 0 ? nlohmann::json() : nlohmann::json(c.q_lora_rank)},
          {"kv_lora_rank", c.kv_lora_rank},
          {"qk_nope_head_dim", c.qk_nope_head_dim},
          {"qk_rope_head_dim", c.qk_rope_head_dim},
          {"v_head_dim", c.v_head_dim},
          {"attention_bias", c.attention_bias},
          {"rope_interleave", c.rope_interleave},
          {"max_position_embeddings", max_positions},
          {"rope_parameters", rope}};
}

void check(const std::string& name, const MlaConfig& c, int64_t seed) {
  SCOPED_TRACE(name);
  torch::manual_seed(seed);
  mfsdp::MlaAttention attn(c, /*deferred=*/false);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : attn->named_parameters()) {
      const bool norm = p.key().find("layernorm") != std::string::npos;
      p.value().copy_(norm ? 1 + 0.2 * torch::randn(p.value().sizes()) : 0.15 * torch::randn(p.value().sizes()));
      tensors.emplace_back(p.key(), p.value().clone());
    }
  }
  const int64_t batch = 2, length = 9;
  const at::Tensor x = torch::randn({batch, length, c.hidden_size});
  tensors.emplace_back("x", x);
  auto ref = mfsdp::testing::run_deepseek_reference("mla", hf_config(c), tensors);
  ASSERT_EQ(ref.count("out"), 1u);
  torch::NoGradGuard no_grad;
  const at::Tensor out = attn->forward(x, mfsdp::mla_rotary_tables(torch::arange(0, length), c));
  ASSERT_EQ(out.sizes(), ref.at("out").sizes());
  EXPECT_LE((out - ref.at("out")).abs().max().item<double>(), 1e-5);
}

MlaConfig small() {
  MlaConfig c;
  c.hidden_size = 48;
  c.num_heads = 4;
  c.kv_lora_rank = 32;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 12;
  return c;
}

mfsdp::YarnRopeScaling deepseek_v3_yarn(double mscale) {
  mfsdp::YarnRopeScaling y;
  y.factor = 40;
  y.original_max_position_embeddings = 4;  // scaled so that the 9 positions reach past it
  y.mscale = mscale;
  y.mscale_all_dim = mscale;
  return y;
}

TEST(MlaAttention, MatchesTransformersDeepseekV3Attention) {
  MlaConfig with_q_lora = small();
  with_q_lora.q_lora_rank = 24;
  with_q_lora.yarn = deepseek_v3_yarn(1.0);
  check("q_lora_rank 24, YaRN as DeepSeek-V3", with_q_lora, 1);

  check("q_proj, plain RoPE", small(), 2);

  MlaConfig plain_q_yarn = small();
  plain_q_yarn.yarn = deepseek_v3_yarn(0.707);
  plain_q_yarn.attention_bias = true;
  plain_q_yarn.rope_interleave = false;
  check("q_proj, YaRN mscale 0.707, biases, RoPE in halves", plain_q_yarn, 3);

  MlaConfig no_nope = small();
  no_nope.q_lora_rank = 16;
  no_nope.qk_nope_head_dim = 0;
  no_nope.rope_theta = 50000;
  check("q_lora_rank 16, RoPE on the whole head", no_nope, 4);
}

TEST(MlaAttention, ParametersHaveTransformersNames) {
  MlaConfig c = small();
  c.q_lora_rank = 24;
  mfsdp::MlaAttention attn(c, /*deferred=*/true);
  std::vector<std::string> names;
  for (const auto& p : attn->named_parameters()) names.push_back(p.key());
  EXPECT_EQ(names, (std::vector<std::string>{"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                                             "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                                             "o_proj.weight"}));
  EXPECT_EQ(attn->q_b_proj->weight.sizes(), (std::vector<int64_t>{4 * 24, 24}));
  EXPECT_EQ(attn->kv_a_proj_with_mqa->weight.sizes(), (std::vector<int64_t>{32 + 8, 48}));
  EXPECT_EQ(attn->kv_b_proj->weight.sizes(), (std::vector<int64_t>{4 * (16 + 12), 32}));
  EXPECT_EQ(attn->o_proj->weight.sizes(), (std::vector<int64_t>{48, 4 * 12}));
}

TEST(MlaAttention, ConfigChecksNameTheField) {
  using mfsdp::testing::error_of;
  using mfsdp::testing::expect_contains;
  auto with = [](auto change) {
    MlaConfig c = small();
    change(c);
    return error_of([&] { mfsdp::MlaAttention(c, true); });
  };
  expect_contains(with([](MlaConfig& c) { c.kv_lora_rank = 0; }), {"MlaConfig.kv_lora_rank", "found 0"});
  expect_contains(with([](MlaConfig& c) { c.q_lora_rank = -1; }), {"MlaConfig.q_lora_rank", "found -1"});
  expect_contains(with([](MlaConfig& c) { c.qk_rope_head_dim = 7; }), {"MlaConfig.qk_rope_head_dim", "even", "7"});
  expect_contains(with([](MlaConfig& c) { c.rope_theta = 0; }), {"MlaConfig.rope_theta"});
  expect_contains(with([](MlaConfig& c) { c.yarn = mfsdp::YarnRopeScaling{}; }),
                  {"rope_scaling.original_max_position_embeddings"});
}

}  // namespace
