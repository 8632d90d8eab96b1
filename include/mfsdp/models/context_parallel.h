// Context parallelism (CP) for causal attention, as functions over a Communicator: each rank of
// the CP group holds a slice of every sequence, and attention runs over the keys and values of
// the whole sequence, exchanged across the group, with the masks the single-process model uses.
//
// Layout (Megatron's load balancing). A causal query at position p attends to p + 1 keys, so
// contiguous slices would leave the last rank with most of the work. Instead a sequence of
// length S is cut into 2 x CP equal chunks and rank r holds chunks r and 2 x CP - 1 - r, in that
// order: every rank gets the same amount of causal work. S = 8, CP = 2: rank 0 holds positions
// 0, 1, 6, 7 and rank 1 holds 2, 3, 4, 5. The sequence dimension of [batch, heads, seq, head_dim]
// attention tensors is dim 2 (kAttentionSeqDim); the chunking functions take the dim.
//
// Attention. cp_attention takes this rank's queries, keys and values (RoPE already applied by
// the caller with the tokens' positions) and the tokens' GLOBAL indices in the sequence
// (cp_positions): the causal mask compares those, never local indices. The masks equal
// SequenceLayout::allowed_keys (causal_lm.h) of the full sequence: query i sees key j when
// j <= i, key j is a token (not padding) and, for packed sequences, both are in the same
// segment; every query also sees itself, so no softmax row is empty. A padding query therefore
// gets its own value row, as in the single-process model: finite, meaningless, and never NaN.
// Softmax runs in fp32 with scale 1/sqrt(head_dim). Two algorithms, same results:
//  - kAllGather: all-gather K, V (and the masks' inputs) over the group and attend locally with
//    scaled_dot_product_attention and an explicit mask; backward reduce-scatters the gathered
//    K/V gradients to their owners. Memory O(S) keys per rank; one collective each way.
//  - kRing: K/V blocks travel around the ring (rank r sends to r + 1), each block's attention
//    merged by log-sum-exp (online softmax), the next exchange in flight while the current block
//    computes. Backward walks the ring again, the K/V gradients travelling with their blocks
//    back to their owners. Memory O(S / CP) keys per rank.
//
// Every rank of `cp` must call the same functions in the same order with the same shapes (they
// issue collectives, forward and backward). `cp` must outlive the backward pass: the autograd
// nodes keep a pointer to it. With a one-rank communicator nothing is exchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace mfsdp {

class Communicator;

namespace context_parallel {

// The sequence dimension of [batch, heads, seq, head_dim] attention tensors.
constexpr int64_t kAttentionSeqDim = 2;

// ---- Load-balanced chunking --------------------------------------------------------------------
// Each throws std::invalid_argument naming S and CP when S is not divisible by 2 x CP, and naming
// the values when cp_size < 1, cp_rank is not in [0, cp_size) or seq_dim is out of range.

// The global positions (int64, length S / CP, ascending) rank `cp_rank` of `cp_size` holds.
at::Tensor cp_positions(int64_t seq_len, int cp_size, int cp_rank);

// This rank's part of a full `x` along `seq_dim` (size S): chunks r and 2 x CP - 1 - r,
// concatenated. Differentiable (a slice).
at::Tensor shard_sequence(const at::Tensor& x, int64_t seq_dim, int cp_size, int cp_rank);

// The inverse on one process: every rank's part (`parts[r]` from rank r, equal shapes) put back
// in global order along `seq_dim`. Differentiable.
at::Tensor unshard_sequence(const std::vector<at::Tensor>& parts, int64_t seq_dim);

// All-gathers this rank's part over `cp` and returns the full sequence in global order on every
// rank. Backward: with sum_grad (the default) every rank's gradient of the full sequence is
// partial (each rank computed something different from it) and they are reduce-scattered,
// summed, to the parts' owners; without it every rank holds the same full gradient (the work
// after the gather is replicated) and keeps its own part of it.
at::Tensor gather_sequence(const at::Tensor& local, int64_t seq_dim, Communicator& cp, bool sum_grad = true);

// ---- Attention ---------------------------------------------------------------------------------

enum class CpAlgorithm { kAllGather, kRing };

struct CpAttentionOptions {
  CpAlgorithm algorithm = CpAlgorithm::kAllGather;
  // [B, T_local], nonzero (or true) for real tokens, 0 for padding: padding is never a key.
  // Undefined: every token is real.
  at::Tensor key_padding_mask;
  // [B, T_local] int64, packed samples: a query sees only keys of its own segment. Undefined:
  // one sample per row.
  at::Tensor segment_ids;
  // Softmax scale; unset: 1/sqrt(head_dim).
  std::optional<double> scale;
};

// q and k [B, Hq, T_local, D] and [B, Hkv, T_local, D], v [B, Hkv, T_local, Dv] (Dv may differ
// from D, as in multi-head latent attention; Hq a multiple of Hkv: grouped-query
// attention, query head h reads key head h / (Hq / Hkv)); global_query_positions [T_local] or
// [B, T_local] int64: the tokens' indices in the full sequence (cp_positions for the balanced
// layout; any layout works as long as every index of 0 .. S-1 appears once over the group). For
// packed samples these are still the indices in the packed row, not the RoPE positions that
// restart per sample. T_local must be the same on every rank. Returns [B, Hq, T_local, Dv] in
// q's dtype, differentiable in q, k and v. Throws std::invalid_argument naming the shapes when
// they do not fit together.
at::Tensor cp_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& global_query_positions, Communicator& cp,
                        const CpAttentionOptions& options = {});

}  // namespace context_parallel
}  // namespace mfsdp
