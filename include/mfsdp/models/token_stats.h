// Per-token statistics of a language model's logits, computed in fp32 whatever the logits'
// dtype: the log-probability of given tokens (labels, or the tokens a rollout sampled) and the
// entropy of the predicted distribution, as post-training losses and metrics need them (verl's
// log_probs_from_logits and entropy_from_logits). Both are differentiable.
#pragma once

#include <ATen/core/Tensor.h>

namespace mfsdp {

// logits [B, T, V], tokens [B, T] (int64) -> [B, T] fp32: log softmax(logits)[b, t, tokens[b, t]].
at::Tensor token_log_probs(const at::Tensor& logits, const at::Tensor& tokens);

// logits [B, T, V] -> [B, T] fp32: -sum_v p_v log p_v, p = softmax(logits).
at::Tensor token_entropy(const at::Tensor& logits);

}  // namespace mfsdp
