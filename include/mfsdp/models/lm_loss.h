// The language-model loss of any family's logits (docs/model.md): cross entropy over the
// labelled tokens, as a mean or, for --calculate-per-token-loss, as a sum and a count.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace mfsdp {

// Mean cross entropy over tokens whose label != ignore_index, computed in fp32.
// logits [B, T, V], labels [B, T] (already aligned: labels[b, t] is the target of position t).
// NaN when every label is ignored (as torch's mean reduction).
at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index = -100);

// --calculate-per-token-loss: the summed cross entropy and the number of counted tokens, so the
// trainer can divide by the global token count after reducing both across ranks.
struct TokenLossSum {
  at::Tensor sum;         // fp32 scalar, differentiable
  at::Tensor num_tokens;  // int64 scalar on the logits' device
};
TokenLossSum lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels,
                         int64_t ignore_index = -100);

}  // namespace mfsdp
