// The top-k router and Megatron's MoE losses (include/mfsdp/models/moe.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <stdexcept>
#include <string>

#include "mfsdp/models/moe.h"

namespace mfsdp {

bool MoeConfig::is_moe_layer(int64_t layer) const {
  if (num_experts == 0) return false;
  return moe_layers.empty() || moe_layers.at(static_cast<size_t>(layer));
}

void MoeConfig::validate(int64_t num_layers) const {
  auto bad = [](const std::string& field, const std::string& what) {
    throw std::invalid_argument("MoeConfig." + field + ": " + what);
  };
  if (num_experts < 0) bad("num_experts", "expected >= 0, found " + std::to_string(num_experts));
  if (num_experts == 0) return;
  if (top_k <= 0 || top_k > num_experts)
    bad("top_k", "expected 1 .. num_experts (" + std::to_string(num_experts) + "), found " + std::to_string(top_k));
  if (ffn_hidden_size <= 0) bad("ffn_hidden_size", "expected a positive value, found " + std::to_string(ffn_hidden_size));
  if (shared_expert_intermediate_size < 0)
    bad("shared_expert_intermediate_size", "expected >= 0, found " + std::to_string(shared_expert_intermediate_size));
  if (shared_expert_gate && shared_expert_intermediate_size == 0)
    bad("shared_expert_gate", "a gate without a shared expert (shared_expert_intermediate_size 0)");
  if (!(topk_scaling_factor > 0) || !std::isfinite(topk_scaling_factor))
    bad("topk_scaling_factor", "expected a positive value, found " + std::to_string(topk_scaling_factor));
  if (!moe_layers.empty() && static_cast<int64_t>(moe_layers.size()) != num_layers)
    bad("moe_layers", "has " + std::to_string(moe_layers.size()) + " entries for " + std::to_string(num_layers) +
                          " layers");
  if (expert_bias && score != Score::kSigmoid)
    bad("expert_bias", "aux-loss-free balancing needs sigmoid scores (--moe-router-score-function sigmoid), as in "
                       "Megatron-LM");
  if (!moe_layers.empty() && std::none_of(moe_layers.begin(), moe_layers.end(), [](bool m) { return m; }))
    bad("moe_layers", "no layer is an MoE layer");
  if (n_group < 1 || num_experts % n_group != 0)
    bad("n_group", "expected a divisor of num_experts (" + std::to_string(num_experts) + "), found " +
                       std::to_string(n_group));
  if (topk_group < 1 || topk_group > n_group)
    bad("topk_group", "expected 1 .. n_group (" + std::to_string(n_group) + "), found " + std::to_string(topk_group));
  if (top_k > topk_group * (num_experts / n_group))
    bad("top_k", "expected at most topk_group x experts per group (" + std::to_string(topk_group) + " x " +
                     std::to_string(num_experts / n_group) + "), found " + std::to_string(top_k));
}

namespace {
// The top-k of `choice` [T, E] among the experts of each row's `topk_group` best groups of
// E / n_group consecutive experts, a group scored by the sum of its two highest choices
// (transformers' DeepseekV3TopkRouter; Megatron-Core's group_limited_topk sums the top
// top_k / topk_group, also 2 for DeepSeek-V3's top_k 8 and topk_group 4). Indices [T, k].
at::Tensor group_limited_topk(const at::Tensor& choice, int64_t k, int64_t n_group, int64_t topk_group) {
  const int64_t tokens = choice.size(0), experts = choice.size(1);
  if (experts % n_group != 0)
    throw std::invalid_argument("route: " + std::to_string(experts) + " experts do not split into n_group " +
                                std::to_string(n_group) + " groups");
  const int64_t per_group = experts / n_group;
  at::Tensor grouped = choice.reshape({tokens, n_group, per_group});
  at::Tensor group_scores = std::get<0>(at::topk(grouped, std::min<int64_t>(2, per_group), -1)).sum(-1);  // [T, G]
  at::Tensor best_groups = std::get<1>(at::topk(group_scores, topk_group, -1, /*largest=*/true, /*sorted=*/false));
  at::Tensor kept = at::zeros({tokens, n_group}, choice.options().dtype(at::kBool)).scatter(1, best_groups, true);
  at::Tensor masked = choice.masked_fill(kept.unsqueeze(-1).expand({tokens, n_group, per_group})
                                             .reshape({tokens, experts})
                                             .logical_not(),
                                         -std::numeric_limits<double>::infinity());
  return std::get<1>(at::topk(masked, k, -1));
}
}  // namespace

Routing route(const at::Tensor& logits, const MoeConfig& config, double capacity_factor,
              const at::Tensor& expert_bias) {
  const int64_t tokens = logits.size(0), experts = logits.size(1), k = config.top_k;
  if (expert_bias.defined() && config.score != MoeConfig::Score::kSigmoid)
    throw std::invalid_argument("route: an expert bias needs sigmoid scores");
  Routing r;
  r.logits = logits;
  at::Tensor top_values, top_index;
  const bool grouped = config.n_group > 1;
  if (grouped) {
    // Which experts: the group-limited top-k of the choice scores (no gradient); their weights:
    // the scores themselves, gathered. As Megatron-Core's topk_softmax_with_capacity, softmax
    // routing chooses by the logits when it renormalises (the default, the softmax of the top-k
    // logits) and by the softmax scores with --moe-router-pre-softmax (norm_topk_prob false);
    // the two choose differently once whole groups are compared by sums.
    at::Tensor choice;
    if (config.score == MoeConfig::Score::kSoftmax) {
      r.scores = at::softmax(logits, -1, at::kFloat);
      choice = config.norm_topk_prob ? logits.detach().to(at::kFloat) : r.scores.detach();
    } else {
      r.scores = at::sigmoid(logits.to(at::kFloat));
      choice = expert_bias.defined() ? r.scores.detach() + expert_bias.to(at::kFloat) : r.scores.detach();
    }
    top_index = group_limited_topk(choice, k, config.n_group, config.topk_group);
    top_values = r.scores.gather(1, top_index);
    if (config.score == MoeConfig::Score::kSoftmax) {
      if (config.norm_topk_prob) top_values = top_values / top_values.sum(-1, /*keepdim=*/true);
    } else {
      if (k > 1 && config.norm_topk_prob) top_values = top_values / (top_values.sum(-1, true) + 1e-20);
      r.scores = r.scores / (r.scores.sum(-1, true) + 1e-20);  // what the aux loss balances
    }
  } else if (config.score == MoeConfig::Score::kSoftmax) {
    r.scores = at::softmax(logits, -1, at::kFloat);
    std::tie(top_values, top_index) = at::topk(r.scores, k, -1);
    // Megatron without --moe-router-pre-softmax takes the softmax of the top-k logits: the same
    // numbers as renormalising the top-k of the full softmax.
    if (config.norm_topk_prob) top_values = top_values / top_values.sum(-1, /*keepdim=*/true);
  } else {
    at::Tensor scores = at::sigmoid(logits.to(at::kFloat));
    if (expert_bias.defined()) {
      // Chosen by the biased scores, weighted by the plain ones (Megatron's
      // topk_routing_with_score_function with expert_bias).
      top_index = std::get<1>(at::topk(scores.detach() + expert_bias.to(at::kFloat), k, -1));
      top_values = scores.gather(1, top_index);
    } else {
      std::tie(top_values, top_index) = at::topk(scores, k, -1);
    }
    if (k > 1 && config.norm_topk_prob) top_values = top_values / (top_values.sum(-1, true) + 1e-20);
    r.scores = scores / (scores.sum(-1, true) + 1e-20);  // what the aux loss balances
  }
  if (config.topk_scaling_factor != 1.0) top_values = top_values * config.topk_scaling_factor;
  r.probs = at::zeros({tokens, experts}, top_values.options()).scatter(1, top_index, top_values);
  r.map = at::zeros({tokens, experts}, logits.options().dtype(at::kBool)).scatter(1, top_index, true);
  // The balancing losses count each token's plain top-k, bias and groups or not.
  r.top_map = expert_bias.defined() || grouped
                  ? at::zeros_like(r.map).scatter(1, std::get<1>(at::topk(r.scores.detach(), k, -1)), true)
                  : r.map;
  if (capacity_factor > 0) {
    // Megatron's get_capacity over tokens x top_k assignments, then the "probs" drop policy:
    // each expert keeps its `capacity` most probable tokens.
    const int64_t capacity =
        static_cast<int64_t>(std::ceil(static_cast<double>(tokens * k) / experts * capacity_factor));
    if (capacity < tokens) {
      at::Tensor kept = std::get<1>(at::topk(r.probs.detach(), capacity, 0, /*largest=*/true, /*sorted=*/false));
      at::Tensor within = at::zeros_like(r.map).scatter(0, kept, true);
      r.map = r.map.logical_and(within);
      r.probs = r.probs * r.map;
    }
  }
  return r;
}

at::Tensor updated_expert_bias(const at::Tensor& bias, const std::vector<int64_t>& tokens_per_expert, double rate) {
  if (static_cast<int64_t>(tokens_per_expert.size()) != bias.numel())
    throw std::invalid_argument("updated_expert_bias: " + std::to_string(tokens_per_expert.size()) +
                                " token counts for " + std::to_string(bias.numel()) + " experts");
  at::Tensor tokens = at::tensor(tokens_per_expert, at::kDouble).to(bias.device(), at::kFloat);
  return bias + at::sign(tokens.mean() - tokens) * rate;
}

namespace {
// top_map and scores with the padding rows zeroed (Megatron masks both), as [T, E] floats.
std::pair<at::Tensor, at::Tensor> counted(const Routing& r, const at::Tensor& tokens) {
  if (!tokens.defined()) return {r.top_map.to(at::kFloat), r.scores};
  const at::Tensor keep = tokens.reshape({-1, 1}).to(r.scores.device(), at::kFloat);
  return {r.top_map.to(at::kFloat) * keep, r.scores * keep};
}

// Counts summed over the context-parallel group (Megatron's reduce over tp_cp): no gradient.
at::Tensor over_group(const at::Tensor& local, Communicator* context_parallel) {
  if (context_parallel == nullptr) return local;
  at::Tensor global = local.detach().clone();
  context_parallel->all_reduce(global);
  return global;
}

int64_t size_of(Communicator* group) { return group ? group->size() : 1; }
}  // namespace

// Under context parallelism (Megatron's switch_load_balancing_loss_func over its tp_cp group):
// the token counts are the whole sequences', the scores this rank's, so that the ranks' losses
// add up to the whole sequences' loss; times the group's size, since the gradient reduction
// averages over the context-parallel ranks (trainer.cpp: each rank's loss is its chunks' mean).
at::Tensor load_balancing_loss(const Routing& r, int64_t top_k, const at::Tensor& tokens, Communicator* context_parallel) {
  const int64_t experts = r.scores.size(1), cp = size_of(context_parallel);
  auto [map, scores] = counted(r, tokens);
  at::Tensor per_expert = over_group(map.sum(0), context_parallel);
  // Megatron's total_num_tokens: the routed pairs / top_k (every row without a mask).
  const at::Tensor total = tokens.defined() ? (per_expert.sum() / static_cast<double>(top_k)).clamp_min(1)
                                            : at::full({}, static_cast<double>(r.scores.size(0) * cp), scores.options());
  at::Tensor loss = (scores.sum(0) * per_expert).sum() * (static_cast<double>(experts) / static_cast<double>(top_k)) /
                    total.square();
  return cp > 1 ? loss * static_cast<double>(cp) : loss;
}

at::Tensor sequence_load_balancing_loss(const Routing& r, int64_t top_k, int64_t batch, const at::Tensor& tokens,
                                        Communicator* context_parallel) {
  const int64_t rows = r.scores.size(0), experts = r.scores.size(1), cp = size_of(context_parallel);
  if (batch <= 0 || rows % batch != 0)
    throw std::invalid_argument("sequence_load_balancing_loss: " + std::to_string(rows) + " tokens in " +
                                std::to_string(batch) + " sequences");
  const int64_t length = rows / batch;
  auto [map, scores] = counted(r, tokens);
  at::Tensor per_sequence = over_group(map.view({batch, length, experts}).sum(1), context_parallel);  // [B, E]
  // The tokens of a sequence: `length`, or with padding their mean over the sequences (Megatron).
  const at::Tensor mean_length = tokens.defined()
                                     ? (per_sequence.sum() / static_cast<double>(top_k * batch)).clamp_min(1)
                                     : at::full({}, static_cast<double>(length * cp), scores.options());
  at::Tensor cost = per_sequence / (mean_length * (static_cast<double>(top_k) / experts));
  at::Tensor loss = (cost * scores.view({batch, length, experts}).sum(1) / mean_length).sum(1).mean();
  return cp > 1 ? loss * static_cast<double>(cp) : loss;
}

at::Tensor z_loss(const at::Tensor& logits, const at::Tensor& tokens, Communicator* context_parallel) {
  at::Tensor z = at::logsumexp(logits.to(at::kFloat), -1).square();
  // Without padding every context-parallel chunk has as many tokens: the chunks' means average
  // to the whole mean. With it, this rank's sum over all the ranks' tokens, times the group.
  if (!tokens.defined()) return z.mean();
  const at::Tensor keep = tokens.reshape({-1}).to(z.device(), at::kFloat);
  const int64_t cp = size_of(context_parallel);
  at::Tensor loss = (z * keep).sum() / over_group(keep.sum(), context_parallel).clamp_min(1);
  return cp > 1 ? loss * static_cast<double>(cp) : loss;
}

}  // namespace mfsdp
