// The output layer and the per-token loss fused, so no rank holds the full logits
// (--cross-entropy-loss-fusion, on by default; docs/model.md "The loss without full logits").
//
// A language model's loss, SFT's masked token losses and GRPO's log-probs and entropies all
// reduce to two per-token numbers of the output distribution: the log-probability of a given
// token and the entropy. Computing them from logits [B, T, V] holds those logits (and their fp32
// copy, the softmax and its gradient) at once: 4096 tokens x 128256 vocabulary rows are 2 GiB a
// copy in fp32. Here the output projection runs over the vocabulary in chunks of rows: each
// chunk's logits [N, v] update running per-token statistics (max, sum of exponentials, the
// target's logit, the entropy's sum) as an online log-sum-exp, and are dropped; backward
// recomputes each chunk's logits from the saved hidden states and weight and turns them into
// the chunk's gradient rows (exact, one matmul each) and its part of the hidden states' gradient
// (summed in fp32). The price is one more output-layer matmul per step (forward recomputed in
// backward); what it saves is every full-logits tensor.
//
// Under tensor parallelism the weight is this rank's vocabulary rows (vocab_range) and the
// statistics are combined over the group in two all-reduces (max, then the rest together), so
// it stays vocabulary-parallel; the hidden states' gradient is this rank's partial sum, which
// the caller's tensor-parallel region entry sums over the group (as for the plain projection).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace mfsdp {

class Communicator;

struct ChunkedOutputOptions {
  double temperature = 1.0;  // the logits are divided by it first (GRPO's sampling temperature)
  bool entropy = false;      // also the entropy of each token's distribution
  int64_t ignore_index = -100;
  // Logits elements (tokens x vocabulary rows) computed at once: each chunk holds
  // max(1, chunk_elements / tokens) rows. 0: kDefaultChunkElements.
  int64_t chunk_elements = 0;
  // The weight holds this rank's vocabulary rows of the group's whole vocabulary; null: all.
  Communicator* tensor_parallel = nullptr;
};

// 16M elements: 64 MiB of fp32 logits per chunk, a few such temporaries at once (on the GPU
// large enough that each chunk's matmul runs at full speed: 4096 rows for 4096 tokens).
inline constexpr int64_t kDefaultChunkElements = int64_t{1} << 24;

// Per token, fp32 and differentiable (to the hidden states and the weight).
struct TokenStats {
  at::Tensor log_probs;  // [B, T]: log softmax(logits / temperature) at the target; 0 where the
                         // target is ignore_index (and no gradient there)
  at::Tensor entropy;    // [B, T] with options.entropy, else undefined
};

// hidden [B, T, H] (the output layer's input, in the weight's dtype), weight [V, H] ([V/tp, H]),
// targets [B, T] integer. The same values, to rounding, as token_log_probs / token_entropy
// (token_stats.h) or tensor_parallel::vocab_parallel_cross_entropy of at::linear(hidden,
// weight) / temperature. A target outside the vocabulary that is not ignore_index throws
// std::invalid_argument for CPU tensors (CUDA ones skip the check, which would wait on the
// device, and count such a target's logit as 0).
TokenStats chunked_output_token_stats(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                      const ChunkedOutputOptions& options = {});

}  // namespace mfsdp
