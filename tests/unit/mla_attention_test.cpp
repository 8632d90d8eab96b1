// Multi-head latent attention (include/mfsdp/models/mla_attention.h) against transformers'
// DeepseekV3Attention (tests/reference/deepseek_v3_reference.py), output and gradients, with the
// same random weights, written here and loaded there by their HF names: with and without the
// query bottleneck (q_lora_rank), with and without YaRN, interleaved or half RoPE, with attention
// biases; and the config checks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
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

struct Case {
  std::string name;
  MlaConfig config;
};

// Each case's module, with random weights, here and in transformers (one run of the reference
// for all), on the same input.
void check(const std::vector<Case>& cases) {
  const int64_t batch = 2, length = 9;
  std::vector<mfsdp::MlaAttention> modules;
  std::vector<at::Tensor> inputs, grads_out;
  std::vector<mfsdp::testing::DeepseekReferenceCase> ref_cases;
  torch::manual_seed(1);
  for (const Case& c : cases) {
    modules.emplace_back(c.config, /*deferred=*/false);
    mfsdp::testing::DeepseekReferenceCase r{hf_config(c.config), {}};
    torch::NoGradGuard no_grad;
    for (auto& p : modules.back()->named_parameters()) {
      const bool norm = p.key().find("layernorm") != std::string::npos;
      p.value().copy_(norm ? 1 + 0.2 * torch::randn(p.value().sizes()) : 0.15 * torch::randn(p.value().sizes()));
      r.inputs.emplace_back(p.key(), p.value().clone());
    }
    inputs.push_back(torch::randn({batch, length, c.config.hidden_size}));
    r.inputs.emplace_back("x", inputs.back());
    grads_out.push_back(torch::randn({batch, length, c.config.hidden_size}));
    r.inputs.emplace_back("grad_out", grads_out.back());
    ref_cases.push_back(std::move(r));
  }
  const auto ref = mfsdp::testing::run_deepseek_reference("mla", ref_cases);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    ASSERT_EQ(ref[i].count("out"), 1u);
    const at::Tensor expected = ref[i].at("out");
    const at::Tensor positions = torch::arange(0, length);
    const at::Tensor x = inputs[i].clone().requires_grad_();
    const at::Tensor out = modules[i]->forward(x, mfsdp::mla_rotary_tables(positions, cases[i].config));
    ASSERT_EQ(out.sizes(), expected.sizes());
    EXPECT_LE((out - expected).abs().max().item<double>(), 1e-5);
    // The gradients of <out, grad_out>, of the input and of every parameter, as transformers'.
    out.backward(grads_out[i]);
    auto expect_grad = [&](const std::string& name, const at::Tensor& got) {
      ASSERT_EQ(ref[i].count("grad." + name), 1u) << name;
      ASSERT_TRUE(got.defined()) << name << " has no gradient";
      const at::Tensor want = ref[i].at("grad." + name);
      EXPECT_LE((got - want).abs().max().item<double>(), 1e-5 * std::max(1.0, want.abs().max().item<double>()))
          << name;
    };
    expect_grad("x", x.grad());
    for (const auto& p : modules[i]->named_parameters()) expect_grad(p.key(), p.value().grad());
    // Per-row tables ([B, T] positions, as packed or padded batches give) of the same positions.
    torch::NoGradGuard no_grad;
    const at::Tensor per_row =
        modules[i]->forward(inputs[i], mfsdp::mla_rotary_tables(positions.expand({batch, length}), cases[i].config));
    EXPECT_LE((per_row - expected).abs().max().item<double>(), 1e-5);
  }
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

  MlaConfig plain_q_yarn = small();
  plain_q_yarn.yarn = deepseek_v3_yarn(0.707);
  plain_q_yarn.attention_bias = true;
  plain_q_yarn.rope_interleave = false;

  MlaConfig no_nope = small();
  no_nope.q_lora_rank = 16;
  no_nope.qk_nope_head_dim = 0;
  no_nope.rope_theta = 50000;

  check({{"q_lora_rank 24, YaRN as DeepSeek-V3", with_q_lora},
         {"q_proj, plain RoPE", small()},
         {"q_proj, YaRN mscale 0.707, biases, RoPE in halves", plain_q_yarn},
         {"q_lora_rank 16, RoPE on the whole head", no_nope}});
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
