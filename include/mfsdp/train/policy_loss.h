// The loss math of post-training (SFT and GRPO) as plain LibTorch functions, following verl's
// definitions and names (verl/trainer/ppo/core_algos.py: agg_loss, compute_policy_loss_vanilla,
// kl_penalty, compute_grpo_outcome_advantage). See docs/policy_loss.md.
//
// Every loss is aggregated with denominators of the WHOLE global batch (all micro-batches, all
// ranks), counted before the micro-batch loop, so that the sum of agg_loss over micro-batches and
// ranks is the loss of the whole batch whatever the split (verl PR#5641).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace mfsdp {

enum class LossAggMode { kTokenMean, kSeqMeanTokenMean, kSeqMeanTokenSum, kSeqMeanTokenSumNorm };

// "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm";
// std::invalid_argument naming the value and the choices otherwise.
LossAggMode parse_loss_agg_mode(const std::string& name);

// Denominators of the whole global batch. global_tokens: sum of the mask (the token count);
// global_sequences: number of rows, every row counted, also one with no tokens (verl's engine
// passes global_batch_size = ppo_mini_batch_size * n, all rows); norm_length: the constant of
// seq-mean-token-sum-norm (verl's loss_scale_factor, e.g. the max response length), a setting
// rather than a count. A denominator that the mode uses must be > 0: a default-constructed
// normalizer is an error, not a silent division by zero.
struct LossNormalizer {
  double global_tokens = 0;
  double global_sequences = 0;
  double norm_length = 0;
  // [B]: each row's tokens when the mask holds only part of every row (context parallelism:
  // a rank's chunks), for seq-mean-token-mean; undefined: the mask's own row sums.
  at::Tensor row_tokens;
};

// loss_mat, mask [B, T]; mask bool or 0/1 float (as verl's masked_sum: entries where the mask is
// zero are ignored, NaN or not; a float mask also weights). Returns a differentiable 0-dim tensor:
//   token-mean:              sum(loss*mask) / global_tokens
//   seq-mean-token-mean:     sum_b (row sum_b / row tokens_b) / global_sequences (a row with no
//                            tokens contributes 0 but counts in global_sequences)
//   seq-mean-token-sum:      sum_b row sum_b / global_sequences
//   seq-mean-token-sum-norm: sum(loss*mask) / norm_length (verl: the row sums over the global
//                            batch divided by loss_scale_factor only, not by a sequence count;
//                            set norm_length = B * max length for TRL's dr_grpo)
// No dp_size factor: the sum over micro-batches AND ranks is the global loss, so gradients must
// be summed over ranks (verl multiplies by dp_size to cancel FSDP's mean).
at::Tensor agg_loss(const at::Tensor& loss_mat, const at::Tensor& mask, LossAggMode mode,
                    const LossNormalizer& norm);

// What LossNormalizer needs, counted on a local batch's mask [B, T]: global_tokens = sum of the
// mask, global_sequences = B (all rows, as verl does). norm_length is left 0 (a setting, not a
// count). The caller sums these over micro-batches and all-reduces over ranks.
LossNormalizer local_loss_counts(const at::Tensor& mask);

// TRL's scale_rewards; kNone is Dr. GRPO (no division by a std).
enum class ScaleRewards { kGroup, kBatch, kNone };

// "group", "batch", "none"; std::invalid_argument naming the value and the choices otherwise.
ScaleRewards parse_scale_rewards(const std::string& name);

// scores [N] (one scalar reward per response), group_ids [N] (responses of one prompt share an
// id, in any order). advantage_i = (r_i - mean_g) / (std + eps): std is the unbiased std of the
// group (kGroup), the unbiased std of the whole batch of scores (kBatch, TRL), or none at all
// (kNone, Dr. GRPO: r_i - mean_g, no eps). A group of one response has mean 0 and, for kGroup,
// std 1 (verl), so its advantage is r / (1 + eps); a batch of one has std 1 for kBatch. A group
// whose scores are all equal gets advantage 0. Returns [N] in scores' dtype, detached (rewards
// are data).
at::Tensor grpo_advantages(const at::Tensor& scores, const std::vector<int64_t>& group_ids,
                           ScaleRewards mode, double eps = 1e-6);

struct ClipOptions {
  double clip_ratio_low = 0.2;
  double clip_ratio_high = 0.2;
  double clip_ratio_c = 3.0;  // dual clip for negative advantages; <= 1 disables it
};

struct PolicyLossResult {
  at::Tensor pg_loss;            // aggregated with agg_loss, differentiable
  // Metrics: token-means over this call's mask (0 when it has no tokens), detached 0-dim.
  at::Tensor pg_clipfrac;        // fraction where the clipped term won (-A*clip > -A*ratio)
  at::Tensor ppo_kl;             // mean of -negative_approx_kl = old_log_prob - log_prob (clamped)
  at::Tensor pg_clipfrac_lower;  // fraction with A < 0 where the dual clip acted
};

// verl's vanilla PPO clipped objective: negative_approx_kl = clamp(log_prob - old_log_prob,
// -20, 20); ratio = exp(negative_approx_kl); pg_losses = max(-A*ratio, -A*clip(ratio, 1-low,
// 1+high)); for A < 0 (dual clip, when clip_ratio_c > 1): min(that, -A*clip_ratio_c).
// advantages [B, T] or [B] (broadcast over T); old_log_prob and advantages are treated as data
// (detached). Shapes must agree, else std::invalid_argument.
PolicyLossResult clipped_policy_loss(const at::Tensor& old_log_prob, const at::Tensor& log_prob,
                                     const at::Tensor& advantages, const at::Tensor& mask,
                                     const ClipOptions& clip, LossAggMode mode,
                                     const LossNormalizer& norm);

enum class KlType { kK1, kAbs, kK2, kK3, kK3Plus };

// "k1" ("kl"), "abs", "k2" ("mse"), "k3" ("low_var_kl"), "k3+" ("low_var_kl+");
// std::invalid_argument naming the value and the choices otherwise.
KlType parse_kl_type(const std::string& name);

// Per-token KL estimate [B, T] of the policy (log_prob) from the reference (ref_log_prob), verl's
// kl_penalty: k1 = logp - ref; abs = |k1|; k2 = 0.5 (logp - ref)^2;
// k3 = clamp(exp(d) - d - 1, -10, 10) with d = clamp(ref - logp, -20, 20); k3+ = k3's value with
// k2's gradient (straight-through: k2 - detach(k2) + detach(k3)). Differentiable with respect to
// both inputs; same shape and dtype as log_prob.
at::Tensor kl_penalty(const at::Tensor& log_prob, const at::Tensor& ref_log_prob, KlType type);

}  // namespace mfsdp
