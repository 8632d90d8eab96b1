// Group-limited top-k routing (MoeConfig::n_group / topk_group, include/mfsdp/models/moe.h)
// against transformers' DeepseekV3TopkRouter on random logits and biases, and, for softmax
// scores, against Megatron-Core's topk_softmax_with_capacity with groups as written out in
// tests/reference/deepseek_v3_reference.py; and the MoeConfig checks of the two fields.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "harness/expect_error.h"
#include "harness/hf_deepseek_reference.h"
#include "mfsdp/models/moe.h"

namespace {

using mfsdp::MoeConfig;

struct Setting {
  int64_t experts, n_group, topk_group, k;
  bool bias;
  double scaling;
  MoeConfig::Score score;
  bool norm;
};

std::string name_of(const Setting& s) {
  return "E" + std::to_string(s.experts) + " groups " + std::to_string(s.n_group) + " keep " +
         std::to_string(s.topk_group) + " k " + std::to_string(s.k) + (s.bias ? " bias" : "") +
         (s.score == MoeConfig::Score::kSoftmax ? " softmax" : " sigmoid") + (s.norm ? " norm" : "");
}

MoeConfig config_of(const Setting& s) {
  MoeConfig c;
  c.num_experts = s.experts;
  c.top_k = s.k;
  c.ffn_hidden_size = 8;
  c.score = s.score;
  c.norm_topk_prob = s.norm;
  c.topk_scaling_factor = s.scaling;
  c.expert_bias = s.bias;
  c.n_group = s.n_group;
  c.topk_group = s.topk_group;
  return c;
}

struct Inputs {
  at::Tensor logits, bias;
};

Inputs inputs_of(const Setting& s, int64_t seed) {
  torch::manual_seed(seed);
  const int64_t tokens = 64;
  Inputs in{torch::randn({tokens, s.experts}) * 2, at::Tensor()};
  if (s.bias) in.bias = torch::randn({s.experts}) * 0.3;
  return in;
}

// Each setting routed here and by the reference (one run of it for all), compared.
void check(const std::vector<std::pair<Setting, int64_t>>& settings) {
  std::vector<Inputs> inputs;
  std::vector<mfsdp::testing::DeepseekReferenceCase> cases;
  for (const auto& [s, seed] : settings) {
    ASSERT_NO_THROW(config_of(s).validate(1)) << name_of(s);
    inputs.push_back(inputs_of(s, seed));
    mfsdp::testing::DeepseekReferenceCase c;
    c.config = {{"n_group", s.n_group},
                {"topk_group", s.topk_group},
                {"num_experts_per_tok", s.k},
                {"norm_topk_prob", s.norm},
                {"routed_scaling_factor", s.scaling},
                {"score", s.score == MoeConfig::Score::kSoftmax ? "softmax" : "sigmoid"}};
    c.inputs.emplace_back("logits", inputs.back().logits);
    if (s.bias) c.inputs.emplace_back("bias", inputs.back().bias);
    cases.push_back(std::move(c));
  }
  const auto ref = mfsdp::testing::run_deepseek_reference("route", cases);
  for (size_t i = 0; i < settings.size(); ++i) {
    const Setting& s = settings[i].first;
    SCOPED_TRACE(name_of(s));
    ASSERT_EQ(ref[i].count("probs"), 1u);
    const at::Tensor expected = ref[i].at("probs");
    const MoeConfig config = config_of(s);
    const at::Tensor &logits = inputs[i].logits, &bias = inputs[i].bias;
    const mfsdp::Routing r = mfsdp::route(logits, config, 0.0, bias);
    // The same experts, exactly, and their weights within 1e-6.
    EXPECT_TRUE(torch::equal(r.map, expected.ne(0))) << "chosen experts differ";
    EXPECT_LE((r.probs.detach() - expected).abs().max().item<double>(), 1e-6);
    // The groups matter here: the plain top-k chooses otherwise for some token, so a router that
    // ignored them would fail the comparison above.
    MoeConfig plain = config;
    plain.n_group = plain.topk_group = 1;
    if (s.n_group > 1) {
      EXPECT_FALSE(torch::equal(mfsdp::route(logits, plain, 0.0, bias).map, r.map));
    }
    // The balancing losses count the plain top-k of the scores, groups or not (Megatron's
    // compute_routing_scores_for_aux_loss).
    const at::Tensor plain_top = std::get<1>(at::topk(r.scores.detach(), s.k, -1));
    EXPECT_TRUE(torch::equal(r.top_map, at::zeros_like(r.map).scatter(1, plain_top, true)));
  }
}

TEST(MoeGroupRouting, SigmoidWithBiasMatchesTransformersDeepseekV3Router) {
  const auto kSig = MoeConfig::Score::kSigmoid;
  check({{{16, 4, 2, 4, true, 2.5, kSig, true}, 1},
         {{64, 8, 4, 8, true, 2.5, kSig, true}, 2},   // DeepSeek-V3's 256 / 8 / 4 / 8, scaled down
         {{12, 3, 1, 3, false, 1.0, kSig, true}, 3},  // one group kept, no bias
         // Not top-1: there transformers renormalises the one weight to 1, Megatron (and moe.h) do not.
         {{32, 8, 3, 2, true, 1.0, kSig, true}, 4},
         // One group (Moonlight's and Kimi-K2's n_group 1): the plain router, as transformers'.
         {{64, 1, 1, 6, true, 2.446, kSig, true}, 5},
         // norm_topk_prob false: the top-k sigmoid scores as they are (grouped, and one group).
         {{16, 4, 2, 3, true, 2.5, kSig, false}, 9},
         {{16, 1, 1, 3, true, 1.0, kSig, false}, 10}});
}

TEST(MoeGroupRouting, SoftmaxMatchesMegatronGroupLimitedTopK) {
  const auto kSoft = MoeConfig::Score::kSoftmax;
  check({{{16, 4, 2, 4, false, 1.0, kSoft, true}, 6},   // chosen by the logits
         {{16, 4, 2, 4, false, 2.0, kSoft, false}, 7},  // --moe-router-pre-softmax: by the scores
         {{24, 6, 2, 3, false, 1.0, kSoft, true}, 8}});
}

TEST(MoeGroupRouting, ConfigChecksNameTheField) {
  using mfsdp::testing::error_of;
  using mfsdp::testing::expect_contains;
  MoeConfig c;
  c.num_experts = 16;
  c.top_k = 4;
  c.ffn_hidden_size = 8;
  c.n_group = 4;
  c.topk_group = 2;
  EXPECT_NO_THROW(c.validate(1));
  auto with = [&](auto change) {
    MoeConfig d = c;
    change(d);
    return error_of([&] { d.validate(1); });
  };
  expect_contains(with([](MoeConfig& d) { d.n_group = 3; }), {"MoeConfig.n_group", "divisor of num_experts (16)", "3"});
  expect_contains(with([](MoeConfig& d) { d.n_group = 0; }), {"MoeConfig.n_group", "found 0"});
  expect_contains(with([](MoeConfig& d) { d.topk_group = 0; }), {"MoeConfig.topk_group", "1 .. n_group (4)", "found 0"});
  expect_contains(with([](MoeConfig& d) { d.topk_group = 5; }), {"MoeConfig.topk_group", "found 5"});
  expect_contains(with([](MoeConfig& d) { d.topk_group = 1; d.top_k = 5; }),
                  {"MoeConfig.top_k", "topk_group x experts per group (1 x 4)", "found 5"});
  // And route() refuses logits whose experts do not split into the groups.
  MoeConfig d = c;
  expect_contains(error_of([&] { mfsdp::route(torch::randn({2, 18}), d, 0.0); }), {"n_group 4"});
}

}  // namespace
