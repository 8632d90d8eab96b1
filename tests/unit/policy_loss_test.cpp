// The loss math of SFT and GRPO (mfsdp/train/policy_loss.h) against closed forms worked out by hand in
// the comments, against a second implementation in plain torch written the verl way
// (tests/reference/policy_loss_reference.py, run with MFSDP_PYTHON_PATH), and for invariance to how
// the global batch is split into micro-batches and ranks (docs/policy_loss.md).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "harness/expect_error.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/train/policy_loss.h"

namespace {

using mfsdp::KlType;
using mfsdp::LossAggMode;
using mfsdp::LossNormalizer;
using mfsdp::ScaleRewards;

const auto kF64 = torch::TensorOptions().dtype(torch::kDouble);
const double kNaN = std::numeric_limits<double>::quiet_NaN();

const std::vector<std::pair<LossAggMode, std::string>> kModes = {
    {LossAggMode::kTokenMean, "token-mean"},
    {LossAggMode::kSeqMeanTokenMean, "seq-mean-token-mean"},
    {LossAggMode::kSeqMeanTokenSum, "seq-mean-token-sum"},
    {LossAggMode::kSeqMeanTokenSumNorm, "seq-mean-token-sum-norm"}};

torch::Tensor rows(const std::vector<std::vector<double>>& v) {
  std::vector<double> flat;
  for (const auto& r : v) flat.insert(flat.end(), r.begin(), r.end());
  return torch::tensor(flat, kF64).view({static_cast<int64_t>(v.size()), static_cast<int64_t>(v[0].size())});
}

double at2(const torch::Tensor& t, int64_t b, int64_t i) { return t[b][i].item<double>(); }

LossNormalizer whole(const torch::Tensor& mask, double norm_length) {
  LossNormalizer n = mfsdp::local_loss_counts(mask);
  n.norm_length = norm_length;
  return n;
}

// ---------------------------------------------------------------- parsers

TEST(PolicyLoss, ParsersAcceptVerlNamesAndNameTheChoicesOtherwise) {
  for (const auto& [mode, name] : kModes) EXPECT_EQ(mfsdp::parse_loss_agg_mode(name), mode) << name;
  EXPECT_EQ(mfsdp::parse_scale_rewards("group"), ScaleRewards::kGroup);
  EXPECT_EQ(mfsdp::parse_scale_rewards("batch"), ScaleRewards::kBatch);
  EXPECT_EQ(mfsdp::parse_scale_rewards("none"), ScaleRewards::kNone);
  EXPECT_EQ(mfsdp::parse_kl_type("k1"), KlType::kK1);
  EXPECT_EQ(mfsdp::parse_kl_type("kl"), KlType::kK1);
  EXPECT_EQ(mfsdp::parse_kl_type("abs"), KlType::kAbs);
  EXPECT_EQ(mfsdp::parse_kl_type("k2"), KlType::kK2);
  EXPECT_EQ(mfsdp::parse_kl_type("mse"), KlType::kK2);
  EXPECT_EQ(mfsdp::parse_kl_type("k3"), KlType::kK3);
  EXPECT_EQ(mfsdp::parse_kl_type("low_var_kl"), KlType::kK3);
  EXPECT_EQ(mfsdp::parse_kl_type("k3+"), KlType::kK3Plus);
  EXPECT_EQ(mfsdp::parse_kl_type("low_var_kl+"), KlType::kK3Plus);
  using mfsdp::testing::error_of;
  using mfsdp::testing::expect_contains;
  expect_contains(error_of([] { mfsdp::parse_loss_agg_mode("seq-mean"); }),
                  {"'seq-mean'", "token-mean", "seq-mean-token-sum-norm"});
  expect_contains(error_of([] { mfsdp::parse_scale_rewards("std"); }), {"'std'", "group, batch, none"});
  expect_contains(error_of([] { mfsdp::parse_kl_type("k4"); }), {"'k4'", "low_var_kl", "k3+"});
  EXPECT_THROW(mfsdp::parse_kl_type("full"), std::invalid_argument);
}

// ---------------------------------------------------------------- agg_loss closed forms

TEST(PolicyLoss, AggregationModesOnAHandMadeBatch) {
  // row 0: 1 2 3 . (3 tokens, sum 6, mean 2); row 1: 4 . . . (sum 4, mean 4);
  // row 2: no tokens (its NaN must not leak). tokens 4, sequences 3, norm_length 8.
  torch::Tensor loss = rows({{1, 2, 3, 100}, {4, -7, kNaN, 9}, {kNaN, 5, 5, 5}});
  torch::Tensor mask = rows({{1, 1, 1, 0}, {1, 0, 0, 0}, {0, 0, 0, 0}});
  LossNormalizer n = whole(mask, 8);
  EXPECT_EQ(n.global_tokens, 4);
  EXPECT_EQ(n.global_sequences, 3);  // the empty row counts, as verl's global_batch_size
  const double expect[] = {10.0 / 4, (2.0 + 4.0 + 0.0) / 3, 10.0 / 3, 10.0 / 8};
  for (size_t i = 0; i < kModes.size(); ++i) {
    torch::Tensor leaf = loss.clone().requires_grad_();
    torch::Tensor v = mfsdp::agg_loss(leaf, mask, kModes[i].first, n);
    ASSERT_EQ(v.dim(), 0);
    EXPECT_NEAR(v.item<double>(), expect[i], 1e-12) << kModes[i].second;
    v.backward();
    // d/dloss: 1/4 per token (token-mean); 1/(3*3) in row 0 and 1/3 in row 1 (seq-mean-token-mean);
    // 1/3 per token (seq-mean-token-sum); 1/8 (sum-norm); 0 off the mask, NaN or not.
    const double g0[] = {1.0 / 4, 1.0 / 9, 1.0 / 3, 1.0 / 8};
    const double g1[] = {1.0 / 4, 1.0 / 3, 1.0 / 3, 1.0 / 8};
    torch::Tensor g = leaf.grad();
    EXPECT_NEAR(at2(g, 0, 0), g0[i], 1e-12) << kModes[i].second;
    EXPECT_NEAR(at2(g, 0, 2), g0[i], 1e-12) << kModes[i].second;
    EXPECT_NEAR(at2(g, 1, 0), g1[i], 1e-12) << kModes[i].second;
    EXPECT_EQ(at2(g, 0, 3), 0.0);
    EXPECT_EQ(at2(g, 1, 2), 0.0);
    EXPECT_EQ(at2(g, 2, 0), 0.0);
    // A bool mask means the same.
    EXPECT_NEAR(mfsdp::agg_loss(loss, mask.to(torch::kBool), kModes[i].first, n).item<double>(), expect[i], 1e-12);
  }
}

TEST(PolicyLoss, AggregationNeedsItsDenominatorAndMatchingShapes) {
  torch::Tensor loss = torch::ones({2, 3}, kF64);
  torch::Tensor mask = torch::ones({2, 3}, kF64);
  using mfsdp::testing::error_of;
  using mfsdp::testing::expect_contains;
  // A default LossNormalizer (the caller forgot to count) is an error, not a division by zero.
  expect_contains(error_of([&] { mfsdp::agg_loss(loss, mask, LossAggMode::kTokenMean, {}); }),
                  {"global_tokens", "token-mean"});
  expect_contains(error_of([&] { mfsdp::agg_loss(loss, mask, LossAggMode::kSeqMeanTokenMean, {}); }),
                  {"global_sequences"});
  LossNormalizer counts = mfsdp::local_loss_counts(mask);  // norm_length stays 0
  expect_contains(error_of([&] { mfsdp::agg_loss(loss, mask, LossAggMode::kSeqMeanTokenSumNorm, counts); }),
                  {"norm_length", "seq-mean-token-sum-norm"});
  expect_contains(error_of([&] { mfsdp::agg_loss(loss, torch::ones({2, 4}), LossAggMode::kTokenMean, counts); }),
                  {"[2, 3]", "[2, 4]"});
  EXPECT_THROW(mfsdp::local_loss_counts(torch::ones({6})), std::invalid_argument);
}

// ---------------------------------------------------------------- GRPO advantages

TEST(PolicyLoss, GrpoAdvantagesForEachScaleMode) {
  // Groups (ids interleaved on purpose): 7 -> {1, 0, 0, 1}: mean 1/2, unbiased var (4 * 1/4)/3 = 1/3;
  // 9 -> {2}: a group of one, mean 0, std 1 (verl); 4 -> {3, 3}: std 0, advantage 0;
  // 2 -> {0.5, 1.5, 4}: mean 2, var (2.25 + 0.25 + 4)/2 = 3.25.
  const std::vector<double> r = {1, 2, 0, 3, 0, 3, 1, 0.5, 1.5, 4};
  const std::vector<int64_t> ids = {7, 9, 7, 4, 7, 4, 7, 2, 2, 2};
  const double eps = 1e-6;
  const double mean_of[] = {0.5, 0, 0.5, 3, 0.5, 3, 0.5, 2, 2, 2};
  const double std_of[] = {std::sqrt(1.0 / 3), 1, std::sqrt(1.0 / 3), 0, std::sqrt(1.0 / 3), 0, std::sqrt(1.0 / 3),
                           std::sqrt(3.25), std::sqrt(3.25), std::sqrt(3.25)};
  // Batch std: unbiased std of all ten scores, by hand in a loop.
  double m = 0, ss = 0;
  for (double x : r) m += x / r.size();
  for (double x : r) ss += (x - m) * (x - m);
  const double batch_std = std::sqrt(ss / (r.size() - 1));
  torch::Tensor scores = torch::tensor(r, kF64);
  torch::Tensor group = mfsdp::grpo_advantages(scores, ids, ScaleRewards::kGroup, eps);
  torch::Tensor batch = mfsdp::grpo_advantages(scores, ids, ScaleRewards::kBatch, eps);
  torch::Tensor none = mfsdp::grpo_advantages(scores, ids, ScaleRewards::kNone, eps);
  for (size_t i = 0; i < r.size(); ++i) {
    EXPECT_NEAR(group[i].item<double>(), (r[i] - mean_of[i]) / (std_of[i] + eps), 1e-12) << i;
    EXPECT_NEAR(batch[i].item<double>(), (r[i] - mean_of[i]) / (batch_std + eps), 1e-12) << i;
    EXPECT_NEAR(none[i].item<double>(), r[i] - mean_of[i], 1e-12) << i;
  }
  EXPECT_NEAR(group[1].item<double>(), 2.0 / (1 + eps), 1e-12);  // the group of one keeps its score
  EXPECT_EQ(group[3].item<double>(), 0.0);                        // zero-std group: 0, not NaN
  EXPECT_NEAR(group[0].item<double>(), 0.5 / (std::sqrt(1.0 / 3) + eps), 1e-12);
  // Same dtype back; fp32 in, fp32 out.
  EXPECT_EQ(mfsdp::grpo_advantages(scores.to(torch::kFloat), ids, ScaleRewards::kGroup).scalar_type(), torch::kFloat);
  EXPECT_THROW(mfsdp::grpo_advantages(scores, {1, 2}, ScaleRewards::kGroup), std::invalid_argument);
  EXPECT_THROW(mfsdp::grpo_advantages(scores.view({2, 5}), ids, ScaleRewards::kGroup), std::invalid_argument);
}

// ---------------------------------------------------------------- clipped policy loss

TEST(PolicyLoss, ClippedLossCasesByHand) {
  // clip 0.2 / 0.2, dual clip c = 3. Per token (ratio r = exp(logp - old), l1 = -A r,
  // l2 = -A clip(r, 0.8, 1.2), loss = max(l1, l2), for A < 0 then min(., -3A)):
  //  a: A=+1, r=1.5  -> l1=-1.5, l2=-1.2: -1.2, clipped, grad 0
  //  b: A=+1, r=0.5  -> l1=-0.5, l2=-0.8: -0.5, grad d(-A r)/dlogp = -0.5
  //  c: A=-1, r=1.5  -> l1=1.5,  l2=1.2:  1.5 (< 3), grad +1.5
  //  d: A=-1, r=4    -> l1=4,    l2=1.2:  4 -> dual clip 3, grad 0
  //  e: A=-2, r=0.5  -> l1=1,    l2=1.6:  1.6, clipped, grad 0
  //  f: A=+0.5, logp-old=25 clamped to 20 -> l1=-0.5e20, l2=-0.6: -0.6, clipped, grad 0
  //  g: A=-1, logp-old=25 -> l1=e^20, l2=1.2 -> dual clip 3, grad 0
  //  row 0 = a b c d (h masked), row 1 = e f g (two padding tokens). 7 tokens.
  const double l15 = std::log(1.5), l05 = std::log(0.5), l4 = std::log(4.0);
  torch::Tensor old = rows({{0.1, -0.2, 0.3, -0.4, 0.0}, {-1.0, -2.0, -3.0, 0.0, 0.0}});
  torch::Tensor diff = rows({{l15, l05, l15, l4, 7.0}, {l05, 25.0, 25.0, 0.0, 0.0}});
  torch::Tensor adv = rows({{1, 1, -1, -1, -5}, {-2, 0.5, -1, 3, 3}});
  torch::Tensor mask = rows({{1, 1, 1, 1, 0}, {1, 1, 1, 0, 0}});
  LossNormalizer n = whole(mask, 5);
  const double loss_sum = -1.2 - 0.5 + 1.5 + 3 + 1.6 - 0.6 + 3;  // 6.8
  torch::Tensor logp = (old + diff).requires_grad_();
  mfsdp::ClipOptions clip;
  mfsdp::PolicyLossResult r = mfsdp::clipped_policy_loss(old, logp, adv, mask, clip, LossAggMode::kTokenMean, n);
  EXPECT_NEAR(r.pg_loss.item<double>(), loss_sum / 7, 1e-12);
  EXPECT_NEAR(r.pg_clipfrac.item<double>(), 3.0 / 7, 1e-12);        // a, e, f
  EXPECT_NEAR(r.pg_clipfrac_lower.item<double>(), 2.0 / 7, 1e-12);  // d, g
  // ppo_kl = mean(old - logp) with the clamp: -(2 ln 1.5 + 2 ln 0.5 + ln 4 + 20 + 20) / 7.
  EXPECT_NEAR(r.ppo_kl.item<double>(), -(2 * l15 + 2 * l05 + l4 + 40) / 7, 1e-12);
  EXPECT_FALSE(r.pg_clipfrac.requires_grad());
  r.pg_loss.backward();
  torch::Tensor g = logp.grad();
  const double expect_grad[2][5] = {{0, -0.5 / 7, 1.5 / 7, 0, 0}, {0, 0, 0, 0, 0}};
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 5; ++t) EXPECT_NEAR(at2(g, b, t), expect_grad[b][t], 1e-12) << b << "," << t;

  // Dual clip off (c <= 1): d costs 4 and g e^20; nothing is counted as lower-clipped.
  clip.clip_ratio_c = 1.0;
  mfsdp::PolicyLossResult off = mfsdp::clipped_policy_loss(old, old + diff, adv, mask, clip,
                                                           LossAggMode::kSeqMeanTokenSum, n);
  EXPECT_NEAR(off.pg_loss.item<double>(), (loss_sum - 6 + 4 + std::exp(20.0)) / 2, 1e-12 * std::exp(20.0));
  EXPECT_EQ(off.pg_clipfrac_lower.item<double>(), 0.0);

  // Asymmetric clip (DAPO 0.2 / 0.28): a (r = 1.5) now costs -1.28.
  mfsdp::ClipOptions dapo{0.2, 0.28, 3.0};
  torch::Tensor one = torch::ones({1, 1}, kF64);
  EXPECT_NEAR(mfsdp::clipped_policy_loss(torch::zeros({1, 1}, kF64), one * l15, one, one, dapo,
                                         LossAggMode::kTokenMean, whole(one, 1)).pg_loss.item<double>(),
              -1.28, 1e-12);
}

TEST(PolicyLoss, PerSequenceAdvantagesBroadcastOverTokens) {
  torch::manual_seed(3);
  torch::Tensor old = torch::randn({3, 4}, kF64), logp = old + 0.4 * torch::randn({3, 4}, kF64);
  torch::Tensor mask = rows({{1, 1, 1, 0}, {1, 1, 1, 1}, {1, 0, 0, 0}});
  torch::Tensor adv = torch::tensor({0.7, -1.3, 2.0}, kF64);
  LossNormalizer n = whole(mask, 4);
  for (const auto& [mode, name] : kModes) {
    double per_seq = mfsdp::clipped_policy_loss(old, logp, adv, mask, {}, mode, n).pg_loss.item<double>();
    double per_tok =
        mfsdp::clipped_policy_loss(old, logp, adv.unsqueeze(-1).expand({3, 4}), mask, {}, mode, n).pg_loss.item<double>();
    EXPECT_EQ(per_seq, per_tok) << name;
  }
  EXPECT_THROW(mfsdp::clipped_policy_loss(old, logp, torch::ones({4}, kF64), mask, {}, LossAggMode::kTokenMean, n),
               std::invalid_argument);
  EXPECT_THROW(mfsdp::clipped_policy_loss(old, logp, adv, mask, {1.5, 0.2, 3}, LossAggMode::kTokenMean, n),
               std::invalid_argument);
}

// ---------------------------------------------------------------- KL estimators

TEST(PolicyLoss, KlEstimatorValuesAndGradients) {
  // d = logp - ref per token: 0.5, -0.3, 0, 25 (k3's log-ratio clamps at -20 and its value at 10),
  // -25 (value clamps at 10).
  const std::vector<double> d = {0.5, -0.3, 0.0, 25.0, -25.0};
  torch::Tensor ref = torch::tensor({-1.0, -2.0, -0.5, -30.0, -0.1}, kF64).view({1, 5});
  torch::Tensor dt = torch::tensor(d, kF64).view({1, 5});
  auto k3 = [](double x) {  // exp(ref - logp) - (ref - logp) - 1 = exp(-x) + x - 1, clamped
    if (std::fabs(x) > 20) x = x > 0 ? 20 : -20;
    return std::min(10.0, std::exp(-x) + x - 1);
  };
  auto k3_grad = [&](double x) { return (std::fabs(x) >= 20 || k3(x) >= 10) ? 0.0 : 1 - std::exp(-x); };
  auto sign = [](double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0); };
  struct Case {
    KlType type;
    std::function<double(double)> value, grad;
  };
  const std::vector<Case> cases = {
      {KlType::kK1, [](double x) { return x; }, [](double) { return 1.0; }},
      {KlType::kAbs, [](double x) { return std::fabs(x); }, sign},
      {KlType::kK2, [](double x) { return 0.5 * x * x; }, [](double x) { return x; }},
      {KlType::kK3, k3, k3_grad},
      {KlType::kK3Plus, k3, [](double x) { return x; }},  // k3's value, k2's gradient
  };
  for (const auto& c : cases) {
    torch::Tensor logp = (ref + dt).requires_grad_();
    torch::Tensor kl = mfsdp::kl_penalty(logp, ref, c.type);
    ASSERT_EQ(kl.sizes(), logp.sizes());
    kl.sum().backward();
    for (int t = 0; t < 5; ++t) {
      EXPECT_NEAR(kl[0][t].item<double>(), c.value(d[t]), 1e-9) << static_cast<int>(c.type) << " token " << t;
      EXPECT_NEAR(logp.grad()[0][t].item<double>(), c.grad(d[t]), 1e-9) << static_cast<int>(c.type) << " token " << t;
    }
  }
  EXPECT_NEAR(mfsdp::kl_penalty(ref + dt, ref, KlType::kK3)[0][3].item<double>(), 10.0, 0);
  EXPECT_THROW(mfsdp::kl_penalty(torch::zeros({2, 3}, kF64), torch::zeros({3, 2}, kF64), KlType::kK1),
               std::invalid_argument);
}

// ---------------------------------------------------------------- against plain torch (verl's way)

std::string json_of(const torch::Tensor& t) {
  torch::Tensor c = t.to(torch::kDouble).contiguous();
  std::ostringstream out;
  out << std::setprecision(17);
  auto scalar = [&](double v) {
    if (std::isnan(v))
      out << "NaN";
    else
      out << v;
  };
  const double* p = c.data_ptr<double>();
  if (c.dim() == 1) {
    out << "[";
    for (int64_t i = 0; i < c.size(0); ++i) {
      if (i) out << ",";
      scalar(p[i]);
    }
    out << "]";
    return out.str();
  }
  out << "[";
  for (int64_t b = 0; b < c.size(0); ++b) {
    out << (b ? ",[" : "[");
    for (int64_t i = 0; i < c.size(1); ++i) {
      if (i) out << ",";
      scalar(p[b * c.size(1) + i]);
    }
    out << "]";
  }
  out << "]";
  return out.str();
}

// Runs the reference on `json` and returns its lines as key -> values.
std::map<std::string, std::vector<double>> run_reference(const std::string& json) {
  mfsdp::testing::TempDir dir("policy_loss");
  const std::string input = dir.file("batch.json");
  std::ofstream(input) << json;
  const std::string cmd = std::string("OMP_NUM_THREADS=1 '") + MFSDP_PYTHON_PATH + "' '" + MFSDP_SOURCE_DIR +
                          "/tests/reference/policy_loss_reference.py' '" + input + "'";
  mfsdp::testing::CommandOutcome r = mfsdp::testing::run_command(cmd);
  std::map<std::string, std::vector<double>> out;
  EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
  std::istringstream lines(r.output);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string key, word;
    fields >> key;
    if (key.find('/') == std::string::npos) continue;  // not a result line (e.g. a warning)
    std::vector<double> values;
    while (fields >> word) values.push_back(std::strtod(word.c_str(), nullptr));  // reads "nan", "inf"
    out[key] = values;
  }
  return out;
}

void expect_close(const std::map<std::string, std::vector<double>>& ref, const std::string& key,
                  const torch::Tensor& got) {
  auto it = ref.find(key);
  ASSERT_NE(it, ref.end()) << "the reference printed no " << key;
  torch::Tensor g = got.detach().to(torch::kDouble).contiguous().view({-1});
  ASSERT_EQ(static_cast<int64_t>(it->second.size()), g.numel()) << key;
  for (int64_t i = 0; i < g.numel(); ++i) {
    const double a = it->second[i], b = g[i].item<double>();
    EXPECT_LE(std::fabs(a - b), 1e-6 * std::max(std::fabs(a), std::fabs(b)) + 1e-12)
        << key << "[" << i << "]: reference " << a << ", mfsdp " << b;
  }
}

TEST(PolicyLoss, EverythingMatchesAPlainTorchReference) {
  torch::manual_seed(11);
  const int64_t B = 6, T = 8;
  torch::Tensor loss = torch::randn({B, T}, kF64);
  // Lengths 8, 3, 0 (an empty row), 5 with a hole, 1, 6; NaN under the mask in two places.
  torch::Tensor mask = torch::zeros({B, T}, kF64);
  const int64_t len[] = {8, 3, 0, 5, 1, 6};
  for (int64_t b = 0; b < B; ++b) mask[b].narrow(0, 0, len[b]).fill_(1);
  mask[3][2] = 0;
  loss[2][0] = kNaN;
  loss[1][6] = kNaN;
  torch::Tensor old = -torch::rand({B, T}, kF64) * 3;
  torch::Tensor diff = 0.5 * torch::randn({B, T}, kF64);
  diff[0][1] = 25;  // the +-20 clamp
  diff[4][0] = -30;
  diff[5][2] = 2;   // ratio e^2 > c = 3 with a negative advantage below
  torch::Tensor logp = old + diff;
  torch::Tensor adv = torch::randn({B, T}, kF64);
  adv[5][2] = -1.5;
  torch::Tensor ref_lp = logp - 0.3 * torch::randn({B, T}, kF64);
  ref_lp[1][1] = logp[1][1].item<double>() + 30;  // k3 clamps
  torch::Tensor scores = torch::tensor(std::vector<double>{1, 0, 1, 1, 0.5, 0.25, 3, 3, 2, 0, 1, 7}, kF64);
  const std::vector<int64_t> ids = {5, 5, 5, 5, 1, 1, 2, 2, 9, 3, 3, 3};
  const double norm_length = 16;

  std::ostringstream json;
  json << std::setprecision(17) << "{\"agg\":{\"loss\":" << json_of(loss) << ",\"mask\":" << json_of(mask)
       << ",\"norm_length\":" << norm_length << "},\"clip\":{\"old\":" << json_of(old) << ",\"logp\":" << json_of(logp)
       << ",\"adv\":" << json_of(adv) << ",\"mask\":" << json_of(mask) << ",\"norm_length\":" << norm_length
       << ",\"low\":0.2,\"high\":0.28,\"c\":3.0},\"kl\":{\"logp\":" << json_of(logp) << ",\"ref\":" << json_of(ref_lp)
       << "},\"adv\":{\"scores\":" << json_of(scores) << ",\"ids\":[";
  for (size_t i = 0; i < ids.size(); ++i) json << (i ? "," : "") << ids[i];
  json << "],\"eps\":1e-6}}";
  auto ref = run_reference(json.str());
  ASSERT_FALSE(ref.empty());

  LossNormalizer n = whole(mask, norm_length);
  mfsdp::ClipOptions clip{0.2, 0.28, 3.0};
  for (const auto& [mode, name] : kModes) {
    torch::Tensor leaf = loss.clone().requires_grad_();
    torch::Tensor v = mfsdp::agg_loss(leaf, mask, mode, n);
    v.backward();
    expect_close(ref, "agg/" + name, v);
    expect_close(ref, "agg_grad/" + name, leaf.grad());

    torch::Tensor lp = logp.clone().requires_grad_();
    mfsdp::PolicyLossResult r = mfsdp::clipped_policy_loss(old, lp, adv, mask, clip, mode, n);
    r.pg_loss.backward();
    expect_close(ref, "clip/" + name, r.pg_loss);
    expect_close(ref, "clip_grad/" + name, lp.grad());
    expect_close(ref, "clip/pg_clipfrac", r.pg_clipfrac);
    expect_close(ref, "clip/ppo_kl", r.ppo_kl);
    expect_close(ref, "clip/pg_clipfrac_lower", r.pg_clipfrac_lower);
  }
  const std::pair<KlType, std::string> kls[] = {
      {KlType::kK1, "k1"}, {KlType::kAbs, "abs"}, {KlType::kK2, "k2"}, {KlType::kK3, "k3"}, {KlType::kK3Plus, "k3+"}};
  for (const auto& [type, name] : kls) {
    torch::Tensor lp = logp.clone().requires_grad_();
    torch::Tensor kl = mfsdp::kl_penalty(lp, ref_lp, type);
    kl.sum().backward();
    expect_close(ref, "kl/" + name, kl);
    expect_close(ref, "kl_grad/" + name, lp.grad());
  }
  expect_close(ref, "adv/group", mfsdp::grpo_advantages(scores, ids, ScaleRewards::kGroup));
  expect_close(ref, "adv/batch", mfsdp::grpo_advantages(scores, ids, ScaleRewards::kBatch));
  expect_close(ref, "adv/none", mfsdp::grpo_advantages(scores, ids, ScaleRewards::kNone));
}

// ---------------------------------------------------------------- split invariance

// A split of the global batch: row ranges [start, start + rows), each one micro-batch on some rank
// (the ranks only regroup the same sum). `trim` drops each micro-batch's trailing all-padding
// columns, as a per-micro-batch padder would.
struct Split {
  std::vector<std::pair<int64_t, int64_t>> micro;
  bool trim = false;
};

torch::Tensor trimmed(const torch::Tensor& t, const torch::Tensor& mask, bool trim) {
  if (!trim) return t;
  torch::Tensor cols = (mask != 0).any(0).nonzero();
  int64_t width = cols.numel() ? cols.max().item<int64_t>() + 1 : 1;
  return t.narrow(1, 0, width);
}

TEST(PolicyLoss, SumOverMicroBatchesAndRanksIsTheWholeBatchLoss) {
  torch::manual_seed(5);
  const int64_t B = 7, T = 6;
  torch::Tensor loss = torch::randn({B, T}, kF64);
  torch::Tensor old = -torch::rand({B, T}, kF64);
  torch::Tensor logp = old + 0.5 * torch::randn({B, T}, kF64);
  torch::Tensor adv = torch::randn({B}, kF64);
  torch::Tensor mask = torch::zeros({B, T}, kF64);
  const int64_t len[] = {6, 0, 2, 5, 0, 1, 3};  // two rows with no tokens
  for (int64_t b = 0; b < B; ++b) mask[b].narrow(0, 0, len[b]).fill_(1);
  const double norm_length = T;
  const std::vector<Split> splits = {
      {{{0, 7}}},
      {{{0, 1}, {1, 6}}},
      {{{0, 3}, {3, 4}}, true},
      {{{0, 2}, {2, 2}, {4, 3}}, true},                                    // e.g. rank 0: 0..3, rank 1: 4..6
      {{{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}}, true},  // one row each
      {{{0, 5}, {5, 2}}},
  };
  for (const auto& [mode, name] : kModes) {
    torch::Tensor whole_leaf = loss.clone().requires_grad_();
    torch::Tensor whole_lp = logp.clone().requires_grad_();
    LossNormalizer n = whole(mask, norm_length);
    torch::Tensor whole_loss = mfsdp::agg_loss(whole_leaf, mask, mode, n);
    whole_loss.backward();
    torch::Tensor whole_pg = mfsdp::clipped_policy_loss(old, whole_lp, adv, mask, {}, mode, n).pg_loss;
    whole_pg.backward();
    for (size_t s = 0; s < splits.size(); ++s) {
      // Denominators first: local counts of every micro-batch, summed (the all-reduce).
      LossNormalizer global;
      global.norm_length = norm_length;
      for (const auto& [start, count] : splits[s].micro) {
        LossNormalizer c = mfsdp::local_loss_counts(trimmed(mask.narrow(0, start, count),
                                                            mask.narrow(0, start, count), splits[s].trim));
        global.global_tokens += c.global_tokens;
        global.global_sequences += c.global_sequences;
      }
      torch::Tensor leaf = loss.clone().requires_grad_();
      torch::Tensor lp = logp.clone().requires_grad_();
      double sum = 0, pg_sum = 0;
      for (const auto& [start, count] : splits[s].micro) {
        torch::Tensor m = mask.narrow(0, start, count);
        auto cut = [&](const torch::Tensor& t) { return trimmed(t.narrow(0, start, count), m, splits[s].trim); };
        torch::Tensor v = mfsdp::agg_loss(cut(leaf), cut(mask), mode, global);
        v.backward();  // gradients accumulate into the leaf, as over micro-batches
        sum += v.item<double>();
        torch::Tensor pg = mfsdp::clipped_policy_loss(cut(old), cut(lp), adv.narrow(0, start, count), cut(mask), {},
                                                      mode, global).pg_loss;
        pg.backward();
        pg_sum += pg.item<double>();
      }
      EXPECT_NEAR(sum, whole_loss.item<double>(), 1e-12) << name << " split " << s;
      EXPECT_NEAR(pg_sum, whole_pg.item<double>(), 1e-12) << name << " split " << s;
      EXPECT_TRUE(torch::allclose(leaf.grad(), whole_leaf.grad(), 0, 1e-14)) << name << " split " << s;
      EXPECT_TRUE(torch::allclose(lp.grad(), whole_lp.grad(), 0, 1e-14)) << name << " split " << s;
    }
  }
  // The bug these denominators exist for (verl#5625): each micro-batch's own token-mean, averaged
  // over the 2 micro-batches as plain gradient accumulation does, is not the whole batch's
  // token-mean on this uneven split.
  double local_sum = 0;
  for (auto [start, count] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 6}}) {
    torch::Tensor m = mask.narrow(0, start, count);
    local_sum += mfsdp::agg_loss(loss.narrow(0, start, count), m, LossAggMode::kTokenMean,
                                 mfsdp::local_loss_counts(m)).item<double>() / 2;
  }
  EXPECT_GT(std::fabs(local_sum - mfsdp::agg_loss(loss, mask, LossAggMode::kTokenMean, whole(mask, T)).item<double>()),
            1e-3);
}

}  // namespace
