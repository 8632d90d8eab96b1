// Megatron-style tensor parallelism as functions over a Communicator: the conjugate mappings
// between the replicated, tensor-parallel and sequence-parallel regions (each a collective in one
// direction and its transpose in the other, as autograd functions), the column- and row-parallel
// linear layers built from them, the vocabulary-parallel embedding and cross entropy, and the
// helpers that cut a full weight into a rank's shard (for checkpoint and Hugging Face import).
//
// Functional rather than modules: the caller owns the weight shards (parameters of its own
// modules, sharded further by FSDP if it likes) and passes the tensor-parallel communicator, so
// the same code serves training, checkpoint conversion and tests.
//
// Layout. Activations are [batch, seq, hidden], batch first as everywhere in mfsdp, so the
// sequence dimension that sequence parallelism splits is dim 1 (kSequenceDim), where Megatron's
// sequence-first layout splits dim 0. The sequence mappings take the dim as an argument.
// Weights are [out, in] as in torch.nn.Linear: a column-parallel layer holds rows
// [r * out/tp, (r + 1) * out/tp) of the full weight (column_shard), a row-parallel layer
// columns [r * in/tp, (r + 1) * in/tp) (row_shard), a vocabulary-parallel embedding or output
// layer rows [r * V/tp, (r + 1) * V/tp) of [V, hidden] (vocab_shard).
//
// Every rank of `tp` must call the same functions in the same order with the same shapes (they
// issue collectives, forward and backward). `tp` must outlive the backward pass: the autograd
// nodes keep a pointer to it. With a one-rank communicator every mapping is the identity and
// issues nothing.
//
// Gradients of replicated parameters used inside the sequence-parallel region (the row-parallel
// bias under sequence parallelism, norms between the layers) come out partial on each rank,
// covering its own part of the sequence: the caller sums them over `tp`, as Megatron does for
// parameters marked sequence_parallel.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "mfsdp/models/lm_loss.h"

namespace mfsdp {

class Communicator;

namespace tensor_parallel {

// The sequence dimension of [batch, seq, hidden] activations.
constexpr int64_t kSequenceDim = 1;

// ---- Mappings (autograd functions; forward / backward) ----------------------------------------

// Identity / all-reduce (sum) of the gradient. Enters the tensor-parallel region with a
// replicated input (Megatron's copy_to_tensor_model_parallel_region).
at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x, Communicator& tp);
// All-reduce (sum) / identity. Leaves the tensor-parallel region with partial sums.
at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x, Communicator& tp);
// Keeps this rank's slice of the last dim / all-gathers the gradient along the last dim.
at::Tensor scatter_to_tensor_parallel_region(const at::Tensor& x, Communicator& tp);
// All-gathers along the last dim (rank order) / keeps this rank's slice of the gradient.
at::Tensor gather_from_tensor_parallel_region(const at::Tensor& x, Communicator& tp);

// Keeps this rank's slice of `dim` / all-gathers the gradient along `dim`.
at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, Communicator& tp,
                                               int64_t dim = kSequenceDim);
// All-gathers along `dim` / reduce-scatters the gradient along `dim`: the layers after the gather
// are tensor-parallel, so every rank holds a partial gradient of the whole sequence. With
// tensor_parallel_output_grad false (the computation after the gather is replicated, each rank
// holding the full gradient) the backward only keeps this rank's slice.
at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, Communicator& tp,
                                                int64_t dim = kSequenceDim,
                                                bool tensor_parallel_output_grad = true);
// Reduce-scatters (sum) along `dim` / all-gathers the gradient along `dim`.
at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, Communicator& tp,
                                                      int64_t dim = kSequenceDim);

// Entering and leaving a tensor-parallel region, as the column- and row-parallel layers below do
// and as a model whose several projections share one input (q/k/v, gate/up) does once for all:
// enter gives the full-sequence input [batch, seq, hidden] every rank's column-parallel
// projections read (copy_to_tensor_parallel_region, or with sequence_parallel the all-gather of
// this rank's [batch, seq/tp, hidden] along the sequence); exit sums the row-parallel partial
// outputs (reduce_from_tensor_parallel_region, or with sequence_parallel the reduce-scatter that
// leaves this rank's sequence slice).
at::Tensor enter_tensor_parallel_region(const at::Tensor& x, Communicator& tp, bool sequence_parallel);
at::Tensor exit_tensor_parallel_region(const at::Tensor& x, Communicator& tp, bool sequence_parallel);

// ---- Shards of full weights ---------------------------------------------------------------------
// Each returns a fresh contiguous copy (so it can become a parameter without keeping the full
// tensor alive) and throws std::invalid_argument, naming the sizes, when the sharded dimension
// does not divide by `size` or `rank` is not in [0, size).

// Rows [rank * out/size, (rank + 1) * out/size) of a column-parallel weight [out, in], or the
// matching slice of its bias [out].
at::Tensor column_shard(const at::Tensor& full, int rank, int size);
// Columns [rank * in/size, (rank + 1) * in/size) of a row-parallel weight [out, in]. (Its bias
// is not sharded.)
at::Tensor row_shard(const at::Tensor& full, int rank, int size);
// Rows [rank * V/size, (rank + 1) * V/size) of a vocabulary-parallel embedding or output layer
// [V, hidden]. Megatron pads the vocabulary to a multiple of tp (and more) beforehand.
at::Tensor vocab_shard(const at::Tensor& full, int rank, int size);

// The vocabulary ids [start, end) a rank holds when each rank holds `per_rank` of them.
struct VocabRange {
  int64_t start = 0;
  int64_t end = 0;
};
VocabRange vocab_range(int64_t per_rank, int rank);

// ---- Layers -------------------------------------------------------------------------------------

// y = x @ weight_shard^T + bias_shard on this rank's output features, weight_shard [out/tp, in],
// bias_shard [out/tp] or undefined. x: [batch, seq, in] replicated on every rank, or with
// sequence_parallel this rank's [batch, seq/tp, in] (all-gathered along the sequence first).
// Returns [batch, seq, out/tp], or the full [batch, seq, out] with gather_output (which
// sequence parallelism does not allow, as in Megatron).
at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight_shard,
                                  const at::Tensor& bias_shard, Communicator& tp,
                                  bool sequence_parallel = false, bool gather_output = false);

// y = sum over ranks of x_r @ weight_shard_r^T, + bias once after the reduction. weight_shard
// [out, in/tp], bias [out] (replicated) or undefined. x: this rank's [batch, seq, in/tp]
// (input_is_parallel, the output of a column-parallel layer), or the full [batch, seq, in] that
// is split here (not with sequence parallelism, as in Megatron). Returns [batch, seq, out]
// replicated (all-reduce), or with sequence_parallel this rank's [batch, seq/tp, out]
// (reduce-scatter along the sequence).
at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight_shard, const at::Tensor& bias,
                               Communicator& tp, bool sequence_parallel = false,
                               bool input_is_parallel = true);

// Embedding lookup with the vocabulary split over ranks: weight_shard [V/tp, hidden] holds ids
// vocab_range(V/tp, rank); ids outside it give zero rows here and come from their owner through
// the all-reduce. ids: any shape, [batch, seq] with sequence_parallel, whose output is this
// rank's [batch, seq/tp, hidden] (reduce-scatter along the sequence). Ids outside [0, V) give
// zero rows on every rank rather than an error.
at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight_shard, Communicator& tp,
                                    bool sequence_parallel = false);

// ---- Loss ---------------------------------------------------------------------------------------

// Per-token cross entropy of vocabulary-parallel logits without assembling the full vocabulary
// on any rank: logits_shard [..., V/tp] (this rank's vocab_range), targets [...] (integer, the
// same on every rank). Returns fp32 [...]; tokens whose target is ignore_index have loss 0 and
// gradient 0 (torch's cross_entropy with reduction none). Computed in fp32 whatever the logits'
// dtype; the gradient to the logits is (softmax - one-hot) of this rank's shard, in their dtype.
// Three all-reduces per call: the max, then the target logit and the sum of exponentials together.
// A target outside [0, V) that is not ignore_index throws std::invalid_argument for CPU tensors;
// CUDA tensors skip that check (it would synchronise with the host) and such a target counts as
// a logit of 0.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& targets,
                                        Communicator& tp, int64_t ignore_index = -100);

// lm_loss and lm_loss_sum (mfsdp/models/lm_loss.h) on vocabulary-parallel logits [B, T, V/tp]
// with labels [B, T]: the same values and the same masking, so a trainer can swap them in.
at::Tensor vocab_parallel_lm_loss(const at::Tensor& logits_shard, const at::Tensor& labels, Communicator& tp,
                                  int64_t ignore_index = -100);
TokenLossSum vocab_parallel_lm_loss_sum(const at::Tensor& logits_shard, const at::Tensor& labels,
                                        Communicator& tp, int64_t ignore_index = -100);

}  // namespace tensor_parallel
}  // namespace mfsdp
