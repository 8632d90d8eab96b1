// token_log_probs and token_entropy against closed forms computed here in fp64.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "mfsdp/models/token_stats.h"

namespace {

TEST(TokenStats, LogProbsMatchTheClosedForm) {
  // Row logits [0, 1, 2, ln 4]: log p(v) = x_v - log(1 + e + e^2 + 4).
  const double z = std::log(1 + std::exp(1.0) + std::exp(2.0) + 4);
  torch::Tensor logits = torch::tensor({0.0, 1.0, 2.0, std::log(4.0)}, torch::kFloat).view({1, 1, 4}).repeat({2, 3, 1});
  torch::Tensor tokens = torch::tensor({0, 1, 2, 3, 2, 1}, torch::kLong).view({2, 3});
  torch::Tensor got = mfsdp::token_log_probs(logits, tokens);
  ASSERT_EQ(got.scalar_type(), torch::kFloat);
  const double x[] = {0.0, 1.0, 2.0, std::log(4.0)};
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 3; ++t)
      EXPECT_NEAR(got[b][t].item<double>(), x[tokens[b][t].item<int64_t>()] - z, 1e-6) << b << "," << t;
}

TEST(TokenStats, LogProbGradientIsOneHotMinusSoftmax) {
  torch::Tensor logits = torch::tensor({0.5, -1.0, 2.0}, torch::kFloat).view({1, 1, 3}).requires_grad_();
  mfsdp::token_log_probs(logits, torch::tensor({{2}}, torch::kLong)).sum().backward();
  const double e[] = {std::exp(0.5), std::exp(-1.0), std::exp(2.0)};
  const double sum = e[0] + e[1] + e[2];
  for (int v = 0; v < 3; ++v)
    EXPECT_NEAR(logits.grad()[0][0][v].item<double>(), (v == 2 ? 1.0 : 0.0) - e[v] / sum, 1e-6) << v;
}

TEST(TokenStats, EntropyOfUniformPeakedAndTwoPointDistributions) {
  // uniform over 8: ln 8; two equal logits and the rest at -inf-ish: ln 2; one dominant: ~0.
  torch::Tensor logits = torch::stack({torch::zeros({8}),
                                       torch::tensor({5.0f, 5.0f, -1e4f, -1e4f, -1e4f, -1e4f, -1e4f, -1e4f}),
                                       torch::tensor({60.0f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f})})
                             .view({1, 3, 8});
  torch::Tensor h = mfsdp::token_entropy(logits.to(torch::kBFloat16));  // bf16 in, fp32 out
  ASSERT_EQ(h.scalar_type(), torch::kFloat);
  EXPECT_NEAR(h[0][0].item<double>(), std::log(8.0), 1e-6);
  EXPECT_NEAR(h[0][1].item<double>(), std::log(2.0), 1e-6);
  EXPECT_NEAR(h[0][2].item<double>(), 0.0, 1e-6);
}

TEST(TokenStats, BadShapesAreErrors) {
  EXPECT_THROW(mfsdp::token_log_probs(torch::zeros({2, 3, 4}), torch::zeros({2, 4}, torch::kLong)), std::invalid_argument);
  EXPECT_THROW(mfsdp::token_entropy(torch::zeros({3, 4})), std::invalid_argument);
}

}  // namespace
