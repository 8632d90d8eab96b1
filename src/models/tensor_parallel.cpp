// Tensor-parallel mappings, layers and loss (include/mfsdp/models/tensor_parallel.h).
//
// The collectives work on flat contiguous tensors, concatenating or splitting in rank order, so
// a gather or scatter along any dim other than 0 moves that dim's rank blocks to the front
// (for a reduce-scatter) or back from it (after an all-gather).
#include "mfsdp/models/tensor_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"

namespace mfsdp::tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string shape_of(const at::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : "<undefined>"; }

int64_t checked_dim(const char* fn, const at::Tensor& x, int64_t dim) {
  const int64_t n = x.dim();
  if (dim < -n || dim >= n)
    throw std::invalid_argument(std::string(fn) + ": dim " + std::to_string(dim) +
                                " is out of range for a tensor of shape " + shape_of(x));
  return dim < 0 ? dim + n : dim;
}

void check_divides(const char* fn, const at::Tensor& x, int64_t dim, int size) {
  if (x.size(dim) % size != 0)
    throw std::invalid_argument(std::string(fn) + ": dim " + std::to_string(dim) + " of shape " +
                                shape_of(x) + " (" + std::to_string(x.size(dim)) +
                                ") does not divide by tensor-parallel size " + std::to_string(size));
}

// The communicator rides in the autograd context as an integer (IValue holds no raw pointers);
// the header's contract keeps it alive until backward.
void keep(AutogradContext* ctx, Communicator& tp) { ctx->saved_data["tp"] = reinterpret_cast<int64_t>(&tp); }
Communicator& kept(AutogradContext* ctx) {
  return *reinterpret_cast<Communicator*>(ctx->saved_data["tp"].toInt());
}

// ---- The collectives on whole tensors -----------------------------------------------------------

// In place on `owned`, a contiguous tensor of our own.
at::Tensor all_reduce_owned(const at::Tensor& owned, Communicator& tp, ReduceOp op = ReduceOp::kSum) {
  if (tp.size() == 1) return owned;
  AllReduceOptions o;
  o.op = op;
  tp.all_reduce(owned, o);
  return owned;
}

at::Tensor all_reduce(const at::Tensor& x, Communicator& tp) {
  if (tp.size() == 1) return x;
  return all_reduce_owned(x.clone(at::MemoryFormat::Contiguous), tp);  // never the caller's tensor
}

at::Tensor split_along(const char* fn, const at::Tensor& x, int64_t dim, Communicator& tp) {
  if (tp.size() == 1) return x;
  check_divides(fn, x, dim, tp.size());
  const int64_t chunk = x.size(dim) / tp.size();
  return x.narrow(dim, tp.rank() * chunk, chunk).contiguous();
}

// Every rank's x, concatenated along dim in rank order.
at::Tensor gather_along(const at::Tensor& x, int64_t dim, Communicator& tp) {
  const int world = tp.size();
  if (world == 1) return x;
  at::Tensor flat = at::empty({world * x.numel()}, x.options());
  tp.all_gather(flat, x.contiguous());
  std::vector<int64_t> blocks = x.sizes().vec(), shape = x.sizes().vec();
  blocks.insert(blocks.begin(), world);
  shape[dim] *= world;
  // [world, ..., n, ...] -> [..., world, n, ...] -> [..., world * n, ...]
  return flat.view(blocks).movedim(0, dim).reshape(shape);
}

// The sum over ranks of x, of which this rank keeps its block of dim.
at::Tensor reduce_scatter_along(const char* fn, const at::Tensor& x, int64_t dim, Communicator& tp) {
  const int world = tp.size();
  if (world == 1) return x;
  check_divides(fn, x, dim, world);
  std::vector<int64_t> blocks = x.sizes().vec(), shape = x.sizes().vec();
  shape[dim] /= world;
  blocks[dim] = shape[dim];
  blocks.insert(blocks.begin() + dim, world);
  // [..., world * n, ...] -> [world, ..., n, ...]: rank r's block is the r-th contiguous slice.
  at::Tensor staged = x.reshape(blocks).movedim(dim, 0).contiguous();
  at::Tensor out = at::empty(shape, x.options());
  tp.reduce_scatter(out, staged);
  return out;
}

// ---- The mappings as autograd functions ---------------------------------------------------------

struct CopyToRegion : public torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* tp) {
    keep(ctx, *tp);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_reduce(grad[0], kept(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : public torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* tp) {
    return all_reduce(x, *tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) { return {grad[0], at::Tensor()}; }
};

// Split along dim forward, all-gather along dim backward.
struct SplitAlong : public torch::autograd::Function<SplitAlong> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* tp, int64_t dim) {
    keep(ctx, *tp);
    ctx->saved_data["dim"] = dim;
    return split_along("scatter_to_parallel_region", x, dim, *tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {gather_along(grad[0], ctx->saved_data["dim"].toInt(), kept(ctx)), at::Tensor(), at::Tensor()};
  }
};

// All-gather along dim forward; backward a reduce-scatter along dim (the gradient is a partial
// sum on every rank) or only this rank's slice (it is the same full gradient on every rank).
struct GatherAlong : public torch::autograd::Function<GatherAlong> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* tp, int64_t dim,
                            bool reduce_grad) {
    keep(ctx, *tp);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["reduce_grad"] = reduce_grad;
    return gather_along(x, dim, *tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    Communicator& tp = kept(ctx);
    at::Tensor g = ctx->saved_data["reduce_grad"].toBool()
                       ? reduce_scatter_along("gather_from_parallel_region backward", grad[0], dim, tp)
                       : split_along("gather_from_parallel_region backward", grad[0], dim, tp);
    return {g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Reduce-scatter along dim forward, all-gather along dim backward.
struct ReduceScatterAlong : public torch::autograd::Function<ReduceScatterAlong> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* tp, int64_t dim) {
    keep(ctx, *tp);
    ctx->saved_data["dim"] = dim;
    return reduce_scatter_along("reduce_scatter_to_sequence_parallel_region", x, dim, *tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {gather_along(grad[0], ctx->saved_data["dim"].toInt(), kept(ctx)), at::Tensor(), at::Tensor()};
  }
};

// ---- Vocabulary-parallel cross entropy ----------------------------------------------------------

struct VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits_shard, const at::Tensor& targets,
                            Communicator* tp, int64_t ignore_index) {
    const int64_t per_rank = logits_shard.size(-1);
    const VocabRange range = vocab_range(per_rank, tp->rank());
    at::Tensor logits = logits_shard.reshape({-1, per_rank}).to(at::kFloat);
    at::Tensor target = targets.reshape({-1}).to(at::kLong);
    at::Tensor valid = target.ne(ignore_index);
    // A softmax is unchanged by subtracting a constant per token; the global max keeps exp() in range.
    at::Tensor max = all_reduce_owned(std::get<0>(logits.max(-1)).contiguous(), *tp, ReduceOp::kMax);
    at::Tensor shifted = logits - max.unsqueeze(1);
    at::Tensor mine = valid & target.ge(range.start) & target.lt(range.end);
    at::Tensor local = (target - range.start).masked_fill(mine.logical_not(), 0);
    at::Tensor predicted =
        shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(mine.logical_not(), 0);
    at::Tensor exp = shifted.exp_();
    // The target logit (held by one rank, zero elsewhere) and the sum of exponentials in one all-reduce.
    at::Tensor both = all_reduce_owned(at::stack({predicted, exp.sum(-1)}), *tp);
    at::Tensor sum_exp = both[1];
    at::Tensor loss = (sum_exp.log() - both[0]).masked_fill(valid.logical_not(), 0);
    at::Tensor softmax = exp.div_(sum_exp.unsqueeze(1));
    ctx->save_for_backward({softmax, local, mine, valid});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits_shard.scalar_type());
    ctx->saved_data["shape"] = logits_shard.sizes().vec();
    return loss.view(targets.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &softmax = saved[0], &local = saved[1], &mine = saved[2], &valid = saved[3];
    at::Tensor g = grad[0].reshape({-1}).to(at::kFloat) * valid;
    // d loss / d logit = softmax - one-hot(target): the one-hot part only where this rank holds it.
    at::Tensor out = softmax * g.unsqueeze(1);
    out.scatter_add_(1, local.unsqueeze(1), (-g * mine).unsqueeze(1));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {out.view(ctx->saved_data["shape"].toIntVector()).to(dtype), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// `expected` names the tensor the caller wants, `along` what its sharded dim counts.
at::Tensor shard_along(const char* fn, const char* expected, const char* along, const at::Tensor& full,
                       int64_t dim, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument(std::string(fn) + ": rank " + std::to_string(rank) + " is not in [0, " +
                                std::to_string(size) + ")");
  if (!full.defined() || full.dim() <= dim)
    throw std::invalid_argument(std::string(fn) + ": expected " + expected + ", found a tensor of shape " +
                                shape_of(full));
  if (full.size(dim) % size != 0)
    throw std::invalid_argument(std::string(fn) + ": " + std::to_string(full.size(dim)) + " " + along +
                                " (dim " + std::to_string(dim) + " of " + shape_of(full) +
                                ") do not divide by tensor-parallel size " + std::to_string(size));
  const int64_t chunk = full.size(dim) / size;
  return full.narrow(dim, rank * chunk, chunk).clone(at::MemoryFormat::Contiguous);
}

// x's last dim must be weight's inputs times `split` (the ranks a full input is split over).
void check_linear(const char* fn, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  int split = 1) {
  if (!x.defined() || !weight.defined() || weight.dim() != 2 || x.dim() < 1 ||
      x.size(-1) != weight.size(1) * split)
    throw std::invalid_argument(std::string(fn) + ": input " + shape_of(x) + " does not match weight shard " +
                                shape_of(weight));
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0)))
    throw std::invalid_argument(std::string(fn) + ": bias " + shape_of(bias) +
                                " does not match weight shard " + shape_of(weight));
}

void check_loss_shapes(const char* fn, const at::Tensor& logits, const at::Tensor& labels) {
  if (logits.dim() != 3 || labels.dim() != 2 || logits.size(0) != labels.size(0) ||
      logits.size(1) != labels.size(1))
    throw std::invalid_argument(std::string(fn) + ": expected logits [B, T, V/tp] and labels [B, T], found " +
                                shape_of(logits) + " and " + shape_of(labels));
}

}  // namespace

at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x, Communicator& tp) {
  return CopyToRegion::apply(x, &tp);
}

at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x, Communicator& tp) {
  return ReduceFromRegion::apply(x, &tp);
}

at::Tensor scatter_to_tensor_parallel_region(const at::Tensor& x, Communicator& tp) {
  return SplitAlong::apply(x, &tp, checked_dim("scatter_to_tensor_parallel_region", x, -1));
}

at::Tensor gather_from_tensor_parallel_region(const at::Tensor& x, Communicator& tp) {
  // Megatron splits the gradient: whatever follows the gather is replicated.
  return GatherAlong::apply(x, &tp, checked_dim("gather_from_tensor_parallel_region", x, -1), false);
}

at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, Communicator& tp, int64_t dim) {
  const int64_t d = checked_dim("scatter_to_sequence_parallel_region", x, dim);
  if (tp.size() > 1) check_divides("scatter_to_sequence_parallel_region", x, d, tp.size());
  return SplitAlong::apply(x, &tp, d);
}

at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, Communicator& tp, int64_t dim,
                                                bool tensor_parallel_output_grad) {
  return GatherAlong::apply(x, &tp, checked_dim("gather_from_sequence_parallel_region", x, dim),
                            tensor_parallel_output_grad);
}

at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, Communicator& tp, int64_t dim) {
  const int64_t d = checked_dim("reduce_scatter_to_sequence_parallel_region", x, dim);
  if (tp.size() > 1) check_divides("reduce_scatter_to_sequence_parallel_region", x, d, tp.size());
  return ReduceScatterAlong::apply(x, &tp, d);
}

at::Tensor enter_tensor_parallel_region(const at::Tensor& x, Communicator& tp, bool sequence_parallel) {
  return sequence_parallel ? gather_from_sequence_parallel_region(x, tp) : copy_to_tensor_parallel_region(x, tp);
}

at::Tensor exit_tensor_parallel_region(const at::Tensor& x, Communicator& tp, bool sequence_parallel) {
  return sequence_parallel ? reduce_scatter_to_sequence_parallel_region(x, tp)
                           : reduce_from_tensor_parallel_region(x, tp);
}

at::Tensor column_shard(const at::Tensor& full, int rank, int size) {
  return shard_along("column_shard", "a weight [out, in] or bias [out]", "output features", full, 0, rank,
                     size);
}

at::Tensor row_shard(const at::Tensor& full, int rank, int size) {
  if (full.defined() && full.dim() != 2)
    throw std::invalid_argument("row_shard: expected a weight [out, in], found a tensor of shape " +
                                shape_of(full));
  return shard_along("row_shard", "a weight [out, in]", "input features", full, 1, rank, size);
}

at::Tensor vocab_shard(const at::Tensor& full, int rank, int size) {
  return shard_along("vocab_shard", "an embedding [V, hidden]", "vocabulary rows", full, 0, rank, size);
}

VocabRange vocab_range(int64_t per_rank, int rank) { return {rank * per_rank, (rank + 1) * per_rank}; }

at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight_shard,
                                  const at::Tensor& bias_shard, Communicator& tp, bool sequence_parallel,
                                  bool gather_output) {
  check_linear("column_parallel_linear", x, weight_shard, bias_shard);
  if (sequence_parallel && gather_output)
    throw std::invalid_argument(
        "column_parallel_linear: gather_output needs the full sequence, which sequence parallelism splits");
  at::Tensor y = at::linear(enter_tensor_parallel_region(x, tp, sequence_parallel), weight_shard, bias_shard);
  return gather_output ? gather_from_tensor_parallel_region(y, tp) : y;
}

at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight_shard, const at::Tensor& bias,
                               Communicator& tp, bool sequence_parallel, bool input_is_parallel) {
  if (!input_is_parallel && sequence_parallel)
    throw std::invalid_argument(
        "row_parallel_linear: sequence parallelism needs input_is_parallel (the output of a column-parallel "
        "layer)");
  check_linear("row_parallel_linear", x, weight_shard, bias, input_is_parallel ? 1 : tp.size());
  at::Tensor input = input_is_parallel ? x : scatter_to_tensor_parallel_region(x, tp);
  at::Tensor partial = at::linear(input, weight_shard);
  // The bias is added once, after the sum: adding it per rank would count it tp times.
  at::Tensor y = exit_tensor_parallel_region(partial, tp, sequence_parallel);
  return bias.defined() ? y + bias : y;
}

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight_shard, Communicator& tp,
                                    bool sequence_parallel) {
  if (weight_shard.dim() != 2)
    throw std::invalid_argument("vocab_parallel_embedding: expected a weight shard [V/tp, hidden], found " +
                                shape_of(weight_shard));
  if (sequence_parallel && ids.dim() != 2)
    throw std::invalid_argument(
        "vocab_parallel_embedding: sequence parallelism expects ids [batch, seq], found " + shape_of(ids));
  const VocabRange range = vocab_range(weight_shard.size(0), tp.rank());
  at::Tensor foreign = ids.lt(range.start) | ids.ge(range.end);
  // Foreign ids look up row 0 and are zeroed after, so their gradient to row 0 is zero too.
  at::Tensor local = (ids - range.start).masked_fill(foreign, 0);
  at::Tensor rows = at::embedding(weight_shard, local).masked_fill(foreign.unsqueeze(-1), 0);
  return exit_tensor_parallel_region(rows, tp, sequence_parallel);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& targets,
                                        Communicator& tp, int64_t ignore_index) {
  if (logits_shard.dim() < 1 || logits_shard.sizes().slice(0, logits_shard.dim() - 1) != targets.sizes())
    throw std::invalid_argument(
        "vocab_parallel_cross_entropy: expected logits [..., V/tp] and targets [...], found " +
        shape_of(logits_shard) + " and " + shape_of(targets));
  if (logits_shard.size(-1) == 0)
    throw std::invalid_argument("vocab_parallel_cross_entropy: logits shard " + shape_of(logits_shard) +
                                " holds no vocabulary");
  if (targets.device().is_cpu()) {
    const int64_t vocab = logits_shard.size(-1) * tp.size();
    at::Tensor bad = targets.ne(ignore_index) & (targets.lt(0) | targets.ge(vocab));
    if (bad.any().item<bool>())
      throw std::invalid_argument("vocab_parallel_cross_entropy: target " +
                                  std::to_string(targets.masked_select(bad)[0].item<int64_t>()) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) +
                                  ") and is not the ignore index " + std::to_string(ignore_index));
  }
  return VocabParallelCrossEntropy::apply(logits_shard, targets, &tp, ignore_index);
}

at::Tensor vocab_parallel_lm_loss(const at::Tensor& logits_shard, const at::Tensor& labels, Communicator& tp,
                                  int64_t ignore_index) {
  check_loss_shapes("vocab_parallel_lm_loss", logits_shard, labels);
  // 0 / 0 = NaN when every label is ignored, as lm_loss (torch's mean reduction).
  return vocab_parallel_cross_entropy(logits_shard, labels, tp, ignore_index).sum() /
         labels.ne(ignore_index).sum().to(at::kFloat);
}

TokenLossSum vocab_parallel_lm_loss_sum(const at::Tensor& logits_shard, const at::Tensor& labels,
                                        Communicator& tp, int64_t ignore_index) {
  check_loss_shapes("vocab_parallel_lm_loss_sum", logits_shard, labels);
  return {vocab_parallel_cross_entropy(logits_shard, labels, tp, ignore_index).sum(),
          labels.ne(ignore_index).sum().to(at::kLong)};
}

}  // namespace mfsdp::tensor_parallel
