// Loss math of SFT and GRPO, following verl's definitions (docs/policy_loss.md). Everything here
// is elementwise or a reduction, so a micro-batch computes its share of the global loss alone; the
// global denominators come in through LossNormalizer.
#include "mfsdp/train/policy_loss.h"

#include <ATen/ATen.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace mfsdp {
namespace {

[[noreturn]] void bad_choice(const char* what, const std::string& value, const char* choices) {
  throw std::invalid_argument(std::string(what) + ": unknown value '" + value + "' (choices: " + choices + ")");
}

void check_2d_same(const char* fn, const char* a_name, const at::Tensor& a, const char* b_name,
                   const at::Tensor& b) {
  if (!a.defined() || !b.defined())
    throw std::invalid_argument(std::string(fn) + ": " + a_name + " and " + b_name + " must be defined tensors");
  if (a.dim() != 2 || a.sizes() != b.sizes())
    throw std::invalid_argument(std::string(fn) + ": expected " + a_name + " and " + b_name +
                                " of the same shape [B, T], found " + c10::str(a.sizes()) + " and " +
                                c10::str(b.sizes()));
}

void check_floating(const char* fn, const char* name, const at::Tensor& t) {
  if (!at::isFloatingType(t.scalar_type()))
    throw std::invalid_argument(std::string(fn) + ": " + name + " must be a floating tensor, found " +
                                std::string(c10::toString(t.scalar_type())));
}

// verl's masked_sum: entries where the mask is zero are replaced by 0 before the product, so a NaN
// or inf in padding cannot leak into the sum (nor into the gradient: where() sends it 0 there).
at::Tensor masked_values(const at::Tensor& values, const at::Tensor& mask) {
  at::Tensor m = mask.to(values.scalar_type());
  return at::where(mask != 0, values, at::zeros({}, values.options())) * m;
}

// Token-mean over this call's mask, 0 where it has no tokens; for metrics only.
at::Tensor local_masked_mean(const at::Tensor& values, const at::Tensor& mask) {
  at::Tensor v = values.detach().to(at::kDouble);
  at::Tensor count = mask.to(at::kDouble).sum();
  at::Tensor sum = masked_values(v, mask).sum();
  return at::where(count > 0, sum / at::where(count > 0, count, at::ones_like(count)), at::zeros_like(sum));
}

double positive_denominator(double value, const char* field, LossAggMode mode) {
  static const char* names[] = {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"};
  if (!(value > 0) || !std::isfinite(value))
    throw std::invalid_argument(std::string("agg_loss: LossNormalizer.") + field + " must be a positive finite number for " +
                                names[static_cast<int>(mode)] + ", found " + std::to_string(value) +
                                " (count it over the whole global batch with local_loss_counts before the micro-batch loop)");
  return value;
}

}  // namespace

LossAggMode parse_loss_agg_mode(const std::string& name) {
  if (name == "token-mean") return LossAggMode::kTokenMean;
  if (name == "seq-mean-token-mean") return LossAggMode::kSeqMeanTokenMean;
  if (name == "seq-mean-token-sum") return LossAggMode::kSeqMeanTokenSum;
  if (name == "seq-mean-token-sum-norm") return LossAggMode::kSeqMeanTokenSumNorm;
  bad_choice("loss_agg_mode", name, "token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm");
}

ScaleRewards parse_scale_rewards(const std::string& name) {
  if (name == "group") return ScaleRewards::kGroup;
  if (name == "batch") return ScaleRewards::kBatch;
  if (name == "none") return ScaleRewards::kNone;
  bad_choice("scale_rewards", name, "group, batch, none");
}

KlType parse_kl_type(const std::string& name) {
  if (name == "k1" || name == "kl") return KlType::kK1;
  if (name == "abs") return KlType::kAbs;
  if (name == "k2" || name == "mse") return KlType::kK2;
  if (name == "k3" || name == "low_var_kl") return KlType::kK3;
  if (name == "k3+" || name == "low_var_kl+") return KlType::kK3Plus;
  bad_choice("kl type", name, "k1 (kl), abs, k2 (mse), k3 (low_var_kl), k3+ (low_var_kl+)");
}

at::Tensor agg_loss(const at::Tensor& loss_mat, const at::Tensor& mask, LossAggMode mode, const LossNormalizer& norm) {
  check_2d_same("agg_loss", "loss_mat", loss_mat, "mask", mask);
  check_floating("agg_loss", "loss_mat", loss_mat);
  at::Tensor valid = masked_values(loss_mat, mask);
  switch (mode) {
    case LossAggMode::kTokenMean:
      return valid.sum() / positive_denominator(norm.global_tokens, "global_tokens", mode);
    case LossAggMode::kSeqMeanTokenMean: {
      // Each row's token-mean; a row with no tokens gives 0 (verl divides by count + 1e-8, the
      // same value without the 1e-8 bias on the other rows) yet counts in global_sequences.
      at::Tensor row_tokens = norm.row_tokens.defined() ? norm.row_tokens.to(loss_mat.device(), loss_mat.scalar_type())
                                                        : mask.to(loss_mat.scalar_type()).sum(-1);
      at::Tensor has = row_tokens > 0;
      at::Tensor row_mean = valid.sum(-1) / at::where(has, row_tokens, at::ones_like(row_tokens));
      return at::where(has, row_mean, at::zeros_like(row_mean)).sum() /
             positive_denominator(norm.global_sequences, "global_sequences", mode);
    }
    case LossAggMode::kSeqMeanTokenSum:
      // sum over rows of row sums is the plain masked sum.
      return valid.sum() / positive_denominator(norm.global_sequences, "global_sequences", mode);
    case LossAggMode::kSeqMeanTokenSumNorm:
      // verl (after PR#5366): the masked sum over the global batch divided by loss_scale_factor
      // only; a constant, so the gradient scale does not follow the sampled lengths (Dr. GRPO).
      return valid.sum() / positive_denominator(norm.norm_length, "norm_length", mode);
  }
  throw std::invalid_argument("agg_loss: unknown LossAggMode " + std::to_string(static_cast<int>(mode)));
}

LossNormalizer local_loss_counts(const at::Tensor& mask) {
  if (!mask.defined() || mask.dim() != 2)
    throw std::invalid_argument("local_loss_counts: expected mask [B, T], found " +
                                (mask.defined() ? c10::str(mask.sizes()) : std::string("an undefined tensor")));
  LossNormalizer n;
  n.global_tokens = mask.to(at::kDouble).sum().item<double>();
  n.global_sequences = static_cast<double>(mask.size(0));  // every row, as verl's global_batch_size
  return n;
}

at::Tensor grpo_advantages(const at::Tensor& scores, const std::vector<int64_t>& group_ids, ScaleRewards mode,
                           double eps) {
  if (!scores.defined() || scores.dim() != 1)
    throw std::invalid_argument("grpo_advantages: expected scores [N], found " +
                                (scores.defined() ? c10::str(scores.sizes()) : std::string("an undefined tensor")));
  check_floating("grpo_advantages", "scores", scores);
  const int64_t n = scores.size(0);
  if (static_cast<int64_t>(group_ids.size()) != n)
    throw std::invalid_argument("grpo_advantages: " + std::to_string(group_ids.size()) + " group ids for " +
                                std::to_string(n) + " scores");
  if (!(eps >= 0) || !std::isfinite(eps))
    throw std::invalid_argument("grpo_advantages: eps must be finite and >= 0, found " + std::to_string(eps));
  if (n == 0) return scores.detach().clone();

  // Dense group index per response, in order of first appearance.
  std::unordered_map<int64_t, int64_t> dense;
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = dense.emplace(group_ids[i], static_cast<int64_t>(dense.size())).first->second;
  const int64_t groups = static_cast<int64_t>(dense.size());

  // fp64 statistics whatever the scores' dtype: they are N numbers.
  at::Tensor s = scores.detach().to(at::kDouble);
  at::Tensor gi = at::tensor(idx, at::TensorOptions().dtype(at::kLong)).to(s.device());
  at::Tensor count = at::zeros({groups}, s.options()).index_add_(0, gi, at::ones_like(s));
  at::Tensor single = count == 1;
  // verl: a group of one has mean 0 (its score is its advantage) and std 1.
  at::Tensor mean = at::where(single, at::zeros_like(count), at::zeros_like(count).index_add_(0, gi, s) / count);
  at::Tensor centred = s - mean.index_select(0, gi);
  if (mode == ScaleRewards::kNone) return centred.to(scores.scalar_type());

  at::Tensor std_dev;
  if (mode == ScaleRewards::kGroup) {
    at::Tensor sq = at::zeros_like(count).index_add_(0, gi, centred * centred);
    at::Tensor var = sq / at::where(single, at::ones_like(count), count - 1);  // unbiased
    std_dev = at::where(single, at::ones_like(count), var.sqrt()).index_select(0, gi);
  } else {
    std_dev = n > 1 ? s.std(/*unbiased=*/true) : at::ones({}, s.options());
  }
  return (centred / (std_dev + eps)).to(scores.scalar_type());
}

PolicyLossResult clipped_policy_loss(const at::Tensor& old_log_prob, const at::Tensor& log_prob,
                                     const at::Tensor& advantages, const at::Tensor& mask, const ClipOptions& clip,
                                     LossAggMode mode, const LossNormalizer& norm) {
  check_2d_same("clipped_policy_loss", "log_prob", log_prob, "old_log_prob", old_log_prob);
  check_2d_same("clipped_policy_loss", "log_prob", log_prob, "mask", mask);
  check_floating("clipped_policy_loss", "log_prob", log_prob);
  if (!advantages.defined() ||
      !(advantages.sizes() == log_prob.sizes() || (advantages.dim() == 1 && advantages.size(0) == log_prob.size(0))))
    throw std::invalid_argument("clipped_policy_loss: expected advantages [B, T] or [B] for log_prob " +
                                c10::str(log_prob.sizes()) + ", found " +
                                (advantages.defined() ? c10::str(advantages.sizes()) : std::string("undefined")));
  if (!(clip.clip_ratio_low >= 0 && clip.clip_ratio_low <= 1) || !(clip.clip_ratio_high >= 0) ||
      !std::isfinite(clip.clip_ratio_high) || std::isnan(clip.clip_ratio_c))
    throw std::invalid_argument("clipped_policy_loss: need 0 <= clip_ratio_low <= 1 and finite clip_ratio_high >= 0, found " +
                                std::to_string(clip.clip_ratio_low) + " and " + std::to_string(clip.clip_ratio_high));

  // Advantages and old log-probs are data: the gradient flows through log_prob only.
  at::Tensor a = advantages.detach().to(log_prob.scalar_type());
  if (a.dim() == 1) a = a.unsqueeze(-1).expand_as(log_prob);
  at::Tensor negative_approx_kl = at::clamp(log_prob - old_log_prob.detach().to(log_prob.scalar_type()), -20.0, 20.0);
  at::Tensor ratio = at::exp(negative_approx_kl);

  at::Tensor pg_losses1 = -a * ratio;
  at::Tensor pg_losses2 = -a * at::clamp(ratio, 1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high);
  at::Tensor clip_pg_losses1 = at::maximum(pg_losses1, pg_losses2);

  PolicyLossResult r;
  r.pg_clipfrac = local_masked_mean(at::gt(pg_losses2, pg_losses1), mask);
  r.ppo_kl = local_masked_mean(-negative_approx_kl, mask);
  at::Tensor pg_losses = clip_pg_losses1;
  if (clip.clip_ratio_c > 1.0) {
    // Dual clip (arXiv 1912.09729): for A < 0 the loss is at most -A * c, however large the ratio.
    at::Tensor pg_losses3 = -a * clip.clip_ratio_c;
    at::Tensor negative = a < 0;
    r.pg_clipfrac_lower = local_masked_mean(at::gt(clip_pg_losses1, pg_losses3).logical_and(negative), mask);
    pg_losses = at::where(negative, at::minimum(pg_losses3, clip_pg_losses1), clip_pg_losses1);
  } else {
    r.pg_clipfrac_lower = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(log_prob.device()));
  }
  r.pg_loss = agg_loss(pg_losses, mask, mode, norm);
  return r;
}

at::Tensor kl_penalty(const at::Tensor& log_prob, const at::Tensor& ref_log_prob, KlType type) {
  if (!log_prob.defined() || !ref_log_prob.defined() || log_prob.sizes() != ref_log_prob.sizes())
    throw std::invalid_argument("kl_penalty: expected log_prob and ref_log_prob of the same shape, found " +
                                (log_prob.defined() ? c10::str(log_prob.sizes()) : std::string("undefined")) + " and " +
                                (ref_log_prob.defined() ? c10::str(ref_log_prob.sizes()) : std::string("undefined")));
  check_floating("kl_penalty", "log_prob", log_prob);
  at::Tensor ref = ref_log_prob.to(log_prob.scalar_type());
  auto k2 = [&] { return 0.5 * (log_prob - ref).square(); };
  auto k3 = [&] {
    // Schulman's low-variance estimator of KL(pi || ref) from samples of pi; both clamps for
    // stability as verl (exp of a large log-ratio, and the estimate itself).
    at::Tensor kl = at::clamp(ref - log_prob, -20.0, 20.0);
    return at::clamp(at::exp(kl) - kl - 1.0, -10.0, 10.0);
  };
  switch (type) {
    case KlType::kK1: return log_prob - ref;
    case KlType::kAbs: return (log_prob - ref).abs();
    case KlType::kK2: return k2();
    case KlType::kK3: return k3();
    case KlType::kK3Plus: {
      // k3 is an unbiased value but its gradient is not the KL's; k2's gradient is (verl): the
      // value of k3 with the gradient of k2.
      at::Tensor back = k2();
      return back - back.detach() + k3().detach();
    }
  }
  throw std::invalid_argument("kl_penalty: unknown KlType " + std::to_string(static_cast<int>(type)));
}

}  // namespace mfsdp
