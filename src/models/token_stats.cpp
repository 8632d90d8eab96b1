#include "mfsdp/models/token_stats.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

namespace mfsdp {

at::Tensor token_log_probs(const at::Tensor& logits, const at::Tensor& tokens) {
  if (logits.dim() != 3 || tokens.dim() != 2 || logits.size(0) != tokens.size(0) ||
      logits.size(1) != tokens.size(1))
    throw std::invalid_argument("token_log_probs: expected logits [B, T, V] and tokens [B, T], found " +
                                c10::str(logits.sizes()) + " and " + c10::str(tokens.sizes()));
  // log_softmax subtracts the row's logsumexp: exact where p is tiny, unlike log(softmax).
  at::Tensor log_p = at::log_softmax(logits.to(at::kFloat), -1);
  return log_p.gather(-1, tokens.to(at::kLong).unsqueeze(-1)).squeeze(-1);
}

at::Tensor token_entropy(const at::Tensor& logits) {
  if (logits.dim() != 3)
    throw std::invalid_argument("token_entropy: expected logits [B, T, V], found " + c10::str(logits.sizes()));
  at::Tensor log_p = at::log_softmax(logits.to(at::kFloat), -1);
  return -(log_p.exp() * log_p).sum(-1);
}

}  // namespace mfsdp
