// The router and the MoE block (include/mfsdp/models/moe.h) against closed forms computed here
// token by token, never through the code under test. transformers' routers are checked through
// whole models in tests/reference/hf_reference_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "mfsdp/models/moe.h"

namespace {

using mfsdp::MoeConfig;

// Row-major [T][E] logits as a tensor and back.
at::Tensor tensor_of(const std::vector<std::vector<double>>& rows) {
  at::Tensor t = at::empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())}, at::kDouble);
  for (size_t i = 0; i < rows.size(); ++i)
    for (size_t j = 0; j < rows[i].size(); ++j) t[i][j] = rows[i][j];
  return t.to(at::kFloat);
}

const std::vector<std::vector<double>> kLogits = {
    {2.0, 0.5, -1.0, 0.1}, {0.3, 1.7, 0.2, -0.4}, {-0.5, -0.2, 1.1, 0.9}, {1.2, 1.1, -2.0, 0.0}, {0.0, 0.1, 0.2, 0.3}};

std::vector<double> softmax(const std::vector<double>& x) {
  const double m = *std::max_element(x.begin(), x.end());
  std::vector<double> e(x.size());
  double sum = 0;
  for (size_t i = 0; i < x.size(); ++i) sum += e[i] = std::exp(x[i] - m);
  for (double& v : e) v /= sum;
  return e;
}

// The k largest indices of `x` (ties: lower index first).
std::vector<size_t> top(const std::vector<double>& x, size_t k) {
  std::vector<size_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return x[a] > x[b]; });
  idx.resize(k);
  return idx;
}

MoeConfig config(int64_t experts, int64_t k) {
  MoeConfig c;
  c.num_experts = experts;
  c.top_k = k;
  c.ffn_hidden_size = 8;
  return c;
}

TEST(MoeRouter, SoftmaxTopKRenormalisedOrNotAndScaled) {
  for (bool norm : {true, false}) {
    MoeConfig c = config(4, 2);
    c.norm_topk_prob = norm;
    c.topk_scaling_factor = 2.5;
    const mfsdp::Routing r = mfsdp::route(tensor_of(kLogits), c, 0.0);
    for (size_t t = 0; t < kLogits.size(); ++t) {
      const std::vector<double> p = softmax(kLogits[t]);
      const std::vector<size_t> chosen = top(p, 2);
      const double sum = p[chosen[0]] + p[chosen[1]];
      for (size_t e = 0; e < 4; ++e) {
        const bool routed = std::find(chosen.begin(), chosen.end(), e) != chosen.end();
        const double want = routed ? 2.5 * (norm ? p[e] / sum : p[e]) : 0.0;
        EXPECT_EQ(r.map[t][e].item<bool>(), routed) << "token " << t << " expert " << e;
        EXPECT_NEAR(r.probs[t][e].item<double>(), want, 1e-6) << "norm " << norm << " token " << t << " expert " << e;
        EXPECT_NEAR(r.scores[t][e].item<double>(), p[e], 1e-6);
      }
    }
  }
}

TEST(MoeRouter, SigmoidScoresAreRenormalisedOverTheTopK) {
  MoeConfig c = config(4, 2);
  c.score = MoeConfig::Score::kSigmoid;
  const mfsdp::Routing r = mfsdp::route(tensor_of(kLogits), c, 0.0);
  for (size_t t = 0; t < kLogits.size(); ++t) {
    std::vector<double> s(4);
    double all = 0;
    for (size_t e = 0; e < 4; ++e) all += s[e] = 1 / (1 + std::exp(-kLogits[t][e]));
    const std::vector<size_t> chosen = top(s, 2);
    const double sum = s[chosen[0]] + s[chosen[1]];
    for (size_t e : chosen) EXPECT_NEAR(r.probs[t][e].item<double>(), s[e] / sum, 1e-6);
    for (size_t e = 0; e < 4; ++e) EXPECT_NEAR(r.scores[t][e].item<double>(), s[e] / all, 1e-6);
  }
}

TEST(MoeRouter, ExpertBiasChoosesTheExpertsButNotTheirWeights) {
  MoeConfig c = config(4, 2);
  c.score = MoeConfig::Score::kSigmoid;
  c.expert_bias = true;
  const std::vector<double> bias = {-0.3, 0.0, 0.8, 0.05};
  const mfsdp::Routing r = mfsdp::route(tensor_of(kLogits), c, 0.0, tensor_of({bias}).view({4}));
  for (size_t t = 0; t < kLogits.size(); ++t) {
    std::vector<double> s(4), biased(4);
    for (size_t e = 0; e < 4; ++e) {
      s[e] = 1 / (1 + std::exp(-kLogits[t][e]));
      biased[e] = s[e] + bias[e];
    }
    const std::vector<size_t> chosen = top(biased, 2), plain = top(s, 2);
    const double sum = s[chosen[0]] + s[chosen[1]];
    for (size_t e = 0; e < 4; ++e) {
      const bool in = e == chosen[0] || e == chosen[1];
      EXPECT_EQ(r.map[t][e].item<bool>(), in) << "token " << t << " expert " << e;
      EXPECT_NEAR(r.probs[t][e].item<double>(), in ? s[e] / sum : 0.0, 1e-6) << "token " << t << " expert " << e;
      // The balancing losses still count the plain top-k.
      EXPECT_EQ(r.top_map[t][e].item<bool>(), e == plain[0] || e == plain[1]) << "token " << t << " expert " << e;
    }
  }
  // The bias changes at least one choice here, so the test tells biased from plain routing.
  EXPECT_FALSE(r.map.equal(r.top_map));
  // Softmax scores take no bias (Megatron refuses the pair).
  MoeConfig softmax_bias = config(4, 2);
  softmax_bias.expert_bias = true;
  EXPECT_THROW(softmax_bias.validate(2), std::invalid_argument);
}

TEST(MoeRouter, ExpertBiasUpdateIsMegatronsSignRule) {
  // get_updated_expert_bias: bias + rate x sign(mean - tokens); mean = (10 + 2 + 4 + 0) / 4 = 4.
  const at::Tensor bias = at::tensor({0.0f, 0.1f, 0.0f, -0.2f});
  const at::Tensor got = mfsdp::updated_expert_bias(bias, {10, 2, 4, 0}, 0.01);
  const std::vector<double> want = {-0.01, 0.11, 0.0, -0.19};
  for (int64_t e = 0; e < 4; ++e) EXPECT_NEAR(got[e].item<double>(), want[static_cast<size_t>(e)], 1e-7) << e;
  EXPECT_THROW(mfsdp::updated_expert_bias(bias, {1, 2, 3}, 0.01), std::invalid_argument);
}

TEST(MoeRouter, LossesAreMegatronsClosedForms) {
  const MoeConfig c = config(4, 2);
  const mfsdp::Routing r = mfsdp::route(tensor_of(kLogits), c, 0.0);
  const double T = kLogits.size(), E = 4, k = 2;
  // switch_load_balancing_loss_func: E / (k T^2) x sum_e (sum_t p_te) (tokens routed to e).
  std::vector<double> prob_sum(4, 0), count(4, 0);
  double z = 0;
  for (const auto& row : kLogits) {
    const std::vector<double> p = softmax(row);
    for (size_t e = 0; e < 4; ++e) prob_sum[e] += p[e];
    for (size_t e : top(p, 2)) count[e] += 1;
    double lse = 0;
    for (double x : row) lse += std::exp(x);
    z += std::pow(std::log(lse), 2) / T;
  }
  double aux = 0;
  for (size_t e = 0; e < 4; ++e) aux += prob_sum[e] * count[e];
  aux *= E / (k * T * T);
  EXPECT_NEAR(mfsdp::load_balancing_loss(r, 2).item<double>(), aux, 1e-6);
  EXPECT_NEAR(mfsdp::z_loss(r.logits).item<double>(), z, 1e-5);
  // One sequence of all the tokens: the sequence loss is the batch loss.
  EXPECT_NEAR(mfsdp::sequence_load_balancing_loss(r, 2, 1).item<double>(), aux, 1e-6);
  // Perfect balance gives exactly 1 (uniform scores, every expert the same count).
  const mfsdp::Routing uniform = mfsdp::route(at::zeros({4, 4}), config(4, 1), 0.0);
  // With equal scores topk picks expert 0 for every token: count (4, 0, 0, 0), sum_t p = 1 each.
  EXPECT_NEAR(mfsdp::load_balancing_loss(uniform, 1).item<double>(), 4.0 / (1 * 16) * (1 * 4), 1e-6);
}

TEST(MoeRouter, CapacityDropsTheLeastProbableTokensOfAnOverfullExpert) {
  // Every token prefers expert 0; top-1 of 2 experts, factor 1: capacity ceil(5 x 1 / 2) = 3.
  const std::vector<std::vector<double>> logits = {{3.0, 0.0}, {1.0, 0.0}, {2.0, 0.0}, {0.5, 0.0}, {4.0, 0.0}};
  // Not renormalised (--moe-router-pre-softmax): a renormalised top-1 weight is 1 for everyone.
  MoeConfig c = config(2, 1);
  c.norm_topk_prob = false;
  const mfsdp::Routing r = mfsdp::route(tensor_of(logits), c, 1.0);
  // Kept: tokens 4, 0, 2 (the three most probable); 1 and 3 lose their expert.
  const std::vector<bool> kept = {true, false, true, false, true};
  for (size_t t = 0; t < 5; ++t) {
    EXPECT_EQ(r.map[t][0].item<bool>(), kept[t]) << "token " << t;
    EXPECT_FALSE(r.map[t][1].item<bool>());
    EXPECT_EQ(r.probs[t][0].item<double>() > 0, kept[t]);
  }
  // The balancing loss counts the top-k before dropping (Megatron's
  // compute_routing_scores_for_aux_loss): 5 tokens on expert 0, not the 3 kept.
  double p0 = 0, p1 = 0;
  for (const auto& row : logits) {
    const std::vector<double> p = softmax(row);
    p0 += p[0];
    p1 += p[1];
  }
  EXPECT_NEAR(mfsdp::load_balancing_loss(r, 1).item<double>(), 2.0 / (1 * 25) * (p0 * 5 + p1 * 0), 1e-6);
  // Dropless by default: everyone keeps expert 0.
  EXPECT_EQ(mfsdp::route(tensor_of(logits), config(2, 1), 0.0).map.select(1, 0).sum().item<int64_t>(), 5);
}

// Padding (Megatron's padding_mask) neither counts nor weighs: the losses of a masked routing are
// those of its unmasked rows alone, and the block counts only those rows' experts.
TEST(MoeRouter, PaddingIsLeftOutOfTheLossesAndCounts) {
  const MoeConfig c = config(4, 2);
  const at::Tensor logits = tensor_of(kLogits);
  const at::Tensor valid = at::tensor({1, 0, 1, 1, 0}, at::kLong).to(at::kBool);
  const at::Tensor kept = at::tensor({0, 2, 3}, at::kLong);
  const mfsdp::Routing all = mfsdp::route(logits, c, 0.0), some = mfsdp::route(logits.index_select(0, kept), c, 0.0);
  EXPECT_NEAR(mfsdp::load_balancing_loss(all, 2, valid).item<double>(), mfsdp::load_balancing_loss(some, 2).item<double>(),
              1e-6);
  EXPECT_NEAR(mfsdp::z_loss(logits, valid).item<double>(), mfsdp::z_loss(logits.index_select(0, kept)).item<double>(),
              1e-5);
  // One sequence: the per-sequence loss over the valid tokens is the batch loss over them.
  EXPECT_NEAR(mfsdp::sequence_load_balancing_loss(all, 2, 1, valid).item<double>(),
              mfsdp::load_balancing_loss(some, 2).item<double>(), 1e-6);
  // Without padding nothing changes.
  const at::Tensor none = at::ones({5}, at::kBool);
  EXPECT_NEAR(mfsdp::load_balancing_loss(all, 2, none).item<double>(), mfsdp::load_balancing_loss(all, 2).item<double>(),
              1e-6);

  torch::manual_seed(4);
  mfsdp::MoeBlock block(16, c, /*deferred=*/false);
  const at::Tensor x = at::randn({1, 5, 16});
  block->forward(x, valid);
  const mfsdp::RouterStats stats = block->take_stats();
  const at::Tensor routed = mfsdp::route(at::linear(x.reshape({-1, 16}).index_select(0, kept), block->gate->weight), c, 0.0).map;
  for (int64_t e = 0; e < 4; ++e)
    EXPECT_EQ(stats.tokens_per_expert[static_cast<size_t>(e)], routed.select(1, e).sum().item<int64_t>()) << e;
}

// The block's output is sum over the chosen experts of weight x expert(x), token by token, plus
// the gated shared expert; both expert paths agree; experts without tokens still get a gradient.
TEST(MoeBlock, OutputIsTheWeightedSumOfTheChosenExpertsTokenByToken) {
  torch::manual_seed(3);
  MoeConfig c = config(4, 2);
  c.shared_expert_intermediate_size = 6;
  c.shared_expert_gate = true;
  c.norm_topk_prob = false;
  mfsdp::MoeBlock block(16, c, /*deferred=*/false);
  for (auto& p : block->parameters()) {
    torch::NoGradGuard g;
    p.normal_(0, 0.5);
  }
  const at::Tensor x = at::randn({2, 5, 16});
  const at::Tensor y = block->forward(x);
  const at::Tensor tokens = x.reshape({-1, 16});
  const at::Tensor logits = at::linear(tokens, block->gate->weight);
  for (int64_t t = 0; t < tokens.size(0); ++t) {
    std::vector<double> row(4);
    for (int e = 0; e < 4; ++e) row[e] = logits[t][e].item<double>();
    const std::vector<double> p = softmax(row);
    at::Tensor want = at::zeros({16});
    const at::Tensor xt = tokens[t];
    for (size_t e : top(p, 2)) {
      auto& ex = block->experts->expert(e);
      at::Tensor h = at::silu(at::mv(ex.gate->weight, xt)) * at::mv(ex.up->weight, xt);
      want = want + p[e] * at::mv(ex.down->weight, h);
    }
    const auto& sh = *block->shared_expert;
    at::Tensor shared = at::mv(sh.down->weight, at::silu(at::mv(sh.gate->weight, xt)) * at::mv(sh.up->weight, xt));
    want = want + at::sigmoid(at::dot(block->shared_expert_gate->weight[0], xt)) * shared;
    EXPECT_TRUE(at::allclose(y.reshape({-1, 16})[t], want, 1e-5, 1e-5)) << "token " << t;
  }
  block->training_options.grouped_gemm = true;
  EXPECT_TRUE(at::allclose(block->forward(x), y, 1e-5, 1e-5)) << "grouped GEMM differs from per-expert GEMMs";
}

// Experts 0 and 2 (the first and the last group of the grouped GEMM) get no token: all their
// weights get exactly zero gradient on both paths, which agree on the busy expert's gradient.
TEST(MoeBlock, AnExpertWithoutTokensGetsAZeroGradientAndCountsAreKept) {
  torch::manual_seed(4);
  const at::Tensor x = at::rand({1, 6, 8}) + 0.1;
  std::vector<at::Tensor> busy_grads;
  for (bool grouped : {false, true}) {
    torch::manual_seed(40);
    mfsdp::MoeBlock block(8, config(3, 1), false);
    block->training_options.grouped_gemm = grouped;
    {
      torch::NoGradGuard g;
      for (auto& p : block->parameters()) p.normal_(0, 0.3);
      block->gate->weight.zero_();
      block->gate->weight[1].fill_(5.0);  // every positive-sum token goes to expert 1
    }
    block->forward(x).sum().backward();
    for (int64_t idle : {0, 2}) {
      auto& e = block->experts->expert(idle);
      for (const at::Tensor& w : {e.gate->weight, e.up->weight, e.down->weight}) {
        ASSERT_TRUE(w.grad().defined()) << "grouped " << grouped << ", expert " << idle;
        EXPECT_EQ(w.grad().abs().sum().item<double>(), 0.0) << "grouped " << grouped << ", expert " << idle;
      }
    }
    auto& busy = block->experts->expert(1);
    EXPECT_GT(busy.down->weight.grad().abs().sum().item<double>(), 0.0);
    busy_grads.push_back(at::cat({busy.gate->weight.grad().flatten(), busy.up->weight.grad().flatten(),
                                  busy.down->weight.grad().flatten()}));
    const mfsdp::RouterStats stats = block->take_stats();
    EXPECT_EQ(stats.tokens_per_expert, (std::vector<int64_t>{0, 6, 0}));
    EXPECT_EQ(stats.forwards, 1);
    EXPECT_EQ(block->take_stats().forwards, 0);  // taken: reset
  }
  EXPECT_TRUE(at::allclose(busy_grads[0], busy_grads[1], 1e-5, 1e-6)) << "grouped GEMM's gradient differs";
}

// With a capacity factor the dropped (token, expert) pairs leave the sum: the output is, token by
// token, the sum over the pairs the router kept of weight x expert(x), on both expert paths.
TEST(MoeBlock, CapacityDroppedPairsLeaveTheOutput) {
  torch::manual_seed(6);
  MoeConfig c = config(4, 2);
  mfsdp::MoeBlock block(16, c, false);
  {
    torch::NoGradGuard g;
    for (auto& p : block->parameters()) p.normal_(0, 0.5);
  }
  block->training_options.capacity_factor = 0.5;  // 3 tokens per expert of 12 x 2 / 4 = 6
  const at::Tensor x = at::randn({3, 4, 16});
  const at::Tensor tokens = x.reshape({-1, 16});
  const mfsdp::Routing r = mfsdp::route(at::linear(tokens, block->gate->weight), c, 0.5);
  ASSERT_LT(r.map.sum().item<int64_t>(), 12 * 2) << "nothing dropped: the test would not test it";
  for (bool grouped : {false, true}) {
    block->training_options.grouped_gemm = grouped;
    const at::Tensor y = block->forward(x).reshape({-1, 16});
    for (int64_t t = 0; t < tokens.size(0); ++t) {
      at::Tensor want = at::zeros({16});
      const at::Tensor xt = tokens[t];
      for (int64_t e = 0; e < 4; ++e) {
        if (!r.map[t][e].item<bool>()) continue;
        auto& ex = block->experts->expert(e);
        at::Tensor h = at::silu(at::mv(ex.gate->weight, xt)) * at::mv(ex.up->weight, xt);
        want = want + r.probs[t][e] * at::mv(ex.down->weight, h);
      }
      EXPECT_TRUE(at::allclose(y[t], want, 1e-5, 1e-5)) << "grouped " << grouped << ", token " << t;
    }
  }
}

// The balancing losses reach the router through the block's output (MoEAuxLossAutoScaler):
// the router's gradient equals that of output.sum() + scale x (coeff x aux + z_coeff x z).
TEST(MoeBlock, BalancingLossesAddTheirScaledGradientToTheRouter) {
  torch::manual_seed(5);
  MoeConfig c = config(4, 2);
  mfsdp::MoeBlock block(8, c, false);
  {
    torch::NoGradGuard g;
    for (auto& p : block->parameters()) p.normal_(0, 0.5);
  }
  block->training_options.aux_loss_coeff = 0.3;
  block->training_options.z_loss_coeff = 0.7;
  block->aux_loss_scale = 0.25;
  const at::Tensor x = at::randn({2, 3, 8});
  block->forward(x).sum().backward();
  const at::Tensor got = block->gate->weight.grad().clone();

  block->zero_grad();
  block->training_options.aux_loss_coeff = 0;
  block->training_options.z_loss_coeff = 0;
  const at::Tensor plain = block->forward(x).sum();
  const mfsdp::Routing r = mfsdp::route(at::linear(x.reshape({-1, 8}), block->gate->weight), c, 0.0);
  (plain + 0.25 * (0.3 * mfsdp::load_balancing_loss(r, 2) + 0.7 * mfsdp::z_loss(r.logits))).backward();
  EXPECT_TRUE(at::allclose(got, block->gate->weight.grad(), 1e-5, 1e-6));
  // And without the losses the gradient differs (the test can fail).
  block->zero_grad();
  block->forward(x).sum().backward();
  EXPECT_FALSE(at::allclose(got, block->gate->weight.grad(), 1e-5, 1e-6));
}

}  // namespace
