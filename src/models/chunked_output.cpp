// chunked_output_token_stats (include/mfsdp/models/chunked_output.h): an autograd function that
// keeps per-token statistics, never a chunk's logits, between its forward and its backward.
//
// Per token, over the vocabulary rows seen so far, with m the running max of the logits z:
//   s = sum exp(z - m),  e = sum (z - m) exp(z - m)  (shifted, so the entropy has no cancellation)
// and a new chunk with max m' rescales both by r = exp(m - m'): s' = r s + ..., e' = r (e + (m -
// m') s) + .... At the end lse = m + log s, log p(target) = z_target - lse and the entropy
// H = log s - e / s. Backward, per chunk, with log p_j = z_j - lse and p_j = exp(log p_j):
//   d log p(target) / d z_j = [j = target] - p_j,   d H / d z_j = -p_j (log p_j + H).
#include "mfsdp/models/chunked_output.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "mfsdp/comm/comm.h"
#include "mfsdp/models/tensor_parallel.h"

namespace mfsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The rows of each chunk (at least one).
int64_t rows_per_chunk(int64_t chunk_elements, int64_t tokens, int64_t rows) {
  const int64_t budget = chunk_elements > 0 ? chunk_elements : kDefaultChunkElements;
  return std::clamp<int64_t>(budget / std::max<int64_t>(tokens, 1), 1, std::max<int64_t>(rows, 1));
}

void all_reduce_in_place(const at::Tensor& t, Communicator* tp, ReduceOp op) {
  if (tp == nullptr || tp->size() == 1) return;
  AllReduceOptions o;
  o.op = op;
  tp->all_reduce(t, o);
}

// One chunk's logits [n, v] in fp32, divided by the temperature.
at::Tensor chunk_logits(const at::Tensor& x, const at::Tensor& weight_rows, double temperature) {
  at::Tensor z = at::linear(x, weight_rows).to(at::kFloat);  // a new tensor either way: ours to change
  if (temperature != 1.0) z.div_(temperature);
  return z;
}

struct ChunkedOutputFunction : public torch::autograd::Function<ChunkedOutputFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& target, const at::Tensor& valid, const at::Tensor& local,
                               Communicator* tp, double temperature, bool entropy, int64_t chunk_rows) {
    const int64_t n = x.size(0), rows = weight.size(0);
    const at::TensorOptions f32 = x.options().dtype(at::kFloat);
    const at::Tensor mine = valid & local.ge(0) & local.lt(rows);
    at::Tensor m, s, e;
    at::Tensor picked = at::zeros({n}, f32);
    for (int64_t v0 = 0; v0 < rows; v0 += chunk_rows) {
      const int64_t v = std::min(chunk_rows, rows - v0);
      const at::Tensor z = chunk_logits(x, weight.narrow(0, v0, v), temperature);
      const at::Tensor in_chunk = mine & local.ge(v0) & local.lt(v0 + v);
      const at::Tensor index = (local - v0).clamp(0, v - 1).unsqueeze(1);
      picked.add_(z.gather(1, index).squeeze(1).masked_fill(in_chunk.logical_not(), 0));
      const at::Tensor chunk_max = std::get<0>(z.max(1));
      const at::Tensor m_new = m.defined() ? at::maximum(m, chunk_max) : chunk_max;
      const at::Tensor shifted = z.sub_(m_new.unsqueeze(1));  // z - m', in place: z is not read again
      const at::Tensor ez = shifted.exp();
      const at::Tensor chunk_s = ez.sum(1);
      if (!m.defined()) {
        s = chunk_s;
        if (entropy) e = (shifted * ez).sum(1);
      } else {
        const at::Tensor diff = m - m_new;
        const at::Tensor r = diff.exp();
        if (entropy) e = r * (e + diff * s) + (shifted * ez).sum(1);
        s = r * s + chunk_s;
      }
      m = m_new;
    }
    if (tp != nullptr && tp->size() > 1) {
      // One rank's running statistics to the group's: shift every rank's to the global max.
      at::Tensor global_max = m.clone();
      all_reduce_in_place(global_max, tp, ReduceOp::kMax);
      const at::Tensor diff = m - global_max;
      const at::Tensor r = diff.exp();
      at::Tensor both = entropy ? at::stack({picked, r * s, r * (e + diff * s)}) : at::stack({picked, r * s});
      all_reduce_in_place(both, tp, ReduceOp::kSum);
      picked = both[0];
      s = both[1];
      if (entropy) e = both[2];
      m = global_max;
    }
    const at::Tensor log_s = s.log();
    const at::Tensor lse = m + log_s;
    const at::Tensor log_probs = (picked - lse).masked_fill(valid.logical_not(), 0);
    at::Tensor ent = entropy ? log_s - e / s : at::Tensor();
    ctx->save_for_backward({x, weight, local, mine, valid, lse, entropy ? ent : at::zeros({0}, f32)});
    ctx->saved_data["tp"] = reinterpret_cast<int64_t>(tp);
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["entropy"] = entropy;
    ctx->saved_data["chunk_rows"] = chunk_rows;
    if (!entropy) return {log_probs};
    return {log_probs, ent};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &local = saved[2], &mine = saved[3], &valid = saved[4],
                     &lse = saved[5], &ent = saved[6];
    const double temperature = ctx->saved_data["temperature"].toDouble();
    const bool entropy = ctx->saved_data["entropy"].toBool();
    const int64_t chunk_rows = ctx->saved_data["chunk_rows"].toInt();
    const at::Tensor g_lp = grads[0].defined() ? grads[0].to(at::kFloat) * valid : at::Tensor();
    const at::Tensor g_ent = entropy && grads.size() > 1 && grads[1].defined() ? grads[1].to(at::kFloat) : at::Tensor();
    variable_list out(9);
    if (!g_lp.defined() && !g_ent.defined()) return out;
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const int64_t rows = weight.size(0);
    // The hidden states' gradient is summed over the chunks in fp32 (as one matmul over the whole
    // vocabulary would accumulate it); each weight row's gradient comes from one chunk, whole.
    at::Tensor grad_x = want_x ? at::zeros(x.sizes(), x.options().dtype(at::kFloat)) : at::Tensor();
    at::Tensor grad_w = want_w ? at::empty_like(weight, at::MemoryFormat::Contiguous) : at::Tensor();
    for (int64_t v0 = 0; v0 < rows; v0 += chunk_rows) {
      const int64_t v = std::min(chunk_rows, rows - v0);
      const at::Tensor w_rows = weight.narrow(0, v0, v);
      const at::Tensor log_p = chunk_logits(x, w_rows, temperature).sub_(lse.unsqueeze(1));
      const at::Tensor p = log_p.exp();
      at::Tensor gz = at::zeros_like(p);
      if (g_lp.defined()) {
        gz.sub_(p * g_lp.unsqueeze(1));
        const at::Tensor in_chunk = mine & local.ge(v0) & local.lt(v0 + v);
        gz.scatter_add_(1, (local - v0).clamp(0, v - 1).unsqueeze(1), (g_lp * in_chunk).unsqueeze(1));
      }
      if (g_ent.defined()) gz.sub_(p * log_p.add_(ent.unsqueeze(1)) * g_ent.unsqueeze(1));
      if (temperature != 1.0) gz.div_(temperature);
      const at::Tensor gz_w = gz.to(weight.scalar_type());
      if (want_x) grad_x.add_(at::mm(gz_w, w_rows));
      if (want_w) {
        at::Tensor rows_grad = grad_w.narrow(0, v0, v);  // contiguous rows: mm writes them in place
        at::mm_out(rows_grad, gz_w.t(), x);
      }
    }
    if (want_x) out[0] = grad_x.to(x.scalar_type());
    out[1] = grad_w;
    return out;
  }
};

}  // namespace

TokenStats chunked_output_token_stats(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                      const ChunkedOutputOptions& options) {
  if (!hidden.defined() || !weight.defined() || !targets.defined() || hidden.dim() != 3 || weight.dim() != 2 ||
      targets.dim() != 2 || hidden.size(0) != targets.size(0) || hidden.size(1) != targets.size(1) ||
      hidden.size(2) != weight.size(1))
    throw std::invalid_argument("chunked_output_token_stats: expected hidden [B, T, H], weight [V, H] and targets "
                                "[B, T], found " +
                                (hidden.defined() ? c10::str(hidden.sizes()) : std::string("none")) + ", " +
                                (weight.defined() ? c10::str(weight.sizes()) : std::string("none")) + " and " +
                                (targets.defined() ? c10::str(targets.sizes()) : std::string("none")));
  if (weight.size(0) == 0) throw std::invalid_argument("chunked_output_token_stats: the weight holds no vocabulary");
  if (!(options.temperature > 0))
    throw std::invalid_argument("chunked_output_token_stats: temperature must be > 0, got " +
                                std::to_string(options.temperature));
  Communicator* tp = options.tensor_parallel != nullptr && options.tensor_parallel->size() > 1 ? options.tensor_parallel
                                                                                               : nullptr;
  const int64_t rows = weight.size(0);
  const int64_t start = tp ? tensor_parallel::vocab_range(rows, tp->rank()).start : 0;
  const at::Tensor target = targets.reshape({-1}).to(at::kLong);
  const at::Tensor valid = target.ne(options.ignore_index);
  if (target.device().is_cpu()) {
    const int64_t vocab = rows * (tp ? tp->size() : 1);
    const at::Tensor bad = valid & (target.lt(0) | target.ge(vocab));
    if (bad.any().item<bool>())
      throw std::invalid_argument("chunked_output_token_stats: target " +
                                  std::to_string(target.masked_select(bad)[0].item<int64_t>()) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) +
                                  ") and is not the ignore index " + std::to_string(options.ignore_index));
  }
  const int64_t tokens = target.numel();
  const at::Tensor x = hidden.reshape({tokens, hidden.size(2)});
  variable_list out = ChunkedOutputFunction::apply(x, weight, target, valid, target - start, tp, options.temperature,
                                                   options.entropy,
                                                   rows_per_chunk(options.chunk_elements, tokens, rows));
  TokenStats stats;
  stats.log_probs = out[0].view(targets.sizes());
  if (options.entropy) stats.entropy = out[1].view(targets.sizes());
  return stats;
}

}  // namespace mfsdp
