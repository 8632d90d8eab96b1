// lm_loss and lm_loss_sum (include/mfsdp/models/lm_loss.h).
#include <ATen/ATen.h>

#include <stdexcept>

#include "mfsdp/models/lm_loss.h"

namespace mfsdp {
namespace {

void check_shapes(const char* fn, const at::Tensor& logits, const at::Tensor& labels) {
  if (logits.dim() != 3 || labels.dim() != 2 || logits.size(0) != labels.size(0) ||
      logits.size(1) != labels.size(1))
    throw std::invalid_argument(std::string(fn) + ": expected logits [B, T, V] and labels [B, T], found " +
                                c10::str(logits.sizes()) + " and " + c10::str(labels.sizes()));
}

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index,
                         int64_t reduction) {
  at::Tensor flat = logits.reshape({-1, logits.size(2)}).to(at::kFloat);
  return at::cross_entropy_loss(flat, labels.reshape({-1}).to(at::kLong), {}, reduction,
                                ignore_index, 0.0);
}

}  // namespace

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index) {
  check_shapes("lm_loss", logits, labels);
  return cross_entropy(logits, labels, ignore_index, at::Reduction::Mean);
}

TokenLossSum lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index) {
  check_shapes("lm_loss_sum", logits, labels);
  return {cross_entropy(logits, labels, ignore_index, at::Reduction::Sum),
          labels.ne(ignore_index).sum().to(at::kLong)};
}

}  // namespace mfsdp
