// Batched generation for rollouts (GRPO): many prompts at once, left-padded, one KV cache for the
// batch, each row with its own RNG so that its tokens do not depend on the other rows. A
// tensor-parallel model's vocabulary slices are gathered before sampling.
//
//   mfsdp::SamplingOptions o;  o.max_new_tokens = 32;  o.temperature = 0.7;  o.stop_ids = {eos};
//   std::vector<uint64_t> seeds;
//   for (int64_t p = 0; p < n_prompts; ++p)
//     for (int64_t s = 0; s < rollout_n; ++s) seeds.push_back(mfsdp::sample_seed(seed, step, p, s));
//   mfsdp::GeneratedBatch out = mfsdp::generate_batch(*model, prompts, seeds, o);
//
// How a step runs (docs/model.md, "Batched generation"): the prompts are left-padded with pad_id to
// the longest; every row's positions count only its real tokens (0 .. len-1), and a key-padding
// mask (SequenceLayout over the cache's keys and the new ones) hides the padding. The prompt runs
// in one forward, then one token per row per forward. Sampling happens on the CPU in fp32 with
// row r's own generator (seeded row_seeds[r]): a seed draws the same tokens from the same logits
// on every device and in every batch. A row stops at its first stop id; finished rows are fed
// pad_id (masked out, their outputs ignored) until every row is done or max_new_tokens is reached.
// The model is called through model.call(...), so it may be the root of fully_shard (every
// forward then all-gathers the parameters).
#pragma once

#include <cstdint>
#include <vector>

#include "mfsdp/models/causal_lm.h"

namespace mfsdp {

class Communicator;

struct SamplingOptions {
  int64_t max_new_tokens = 64;   // >= 0
  bool greedy = false;           // argmax; else sample from softmax(filtered logits / temperature)
  double temperature = 1.0;      // > 0 (ignored when greedy)
  int64_t top_k = 0;             // <= 0: off; else keep the k largest logits
  double top_p = 1.0;            // (0, 1]: keep the smallest set of tokens reaching this mass
  std::vector<int64_t> stop_ids; // a row ends after generating any of these (e.g. EOS ids)
  int64_t pad_id = 0;            // fills the left padding and the inputs of finished rows
  // > 0: only ids below it are generated (the tokenizer's vocabulary, when the model's is padded
  // past it as Megatron pads it); the padded rows' logits are dropped before sampling.
  int64_t vocab_size = 0;
};

struct GeneratedBatch {
  // Per row: the generated ids (no prompt), including the stop id when one was produced.
  std::vector<std::vector<int64_t>> tokens;
  // Per generated token: log_softmax(logits / temperature) at the chosen token (greedy:
  // temperature 1), fp32, before top-k/top-p filtering (what verl's rollout reports).
  std::vector<std::vector<float>> log_probs;
  // Per row, 1 when it ended without a stop id: max_new_tokens reached, or its next token would
  // lie beyond max_position_embeddings.
  std::vector<uint8_t> truncated;
};

// A seed for one sample: splitmix64 mixes of (seed, step, prompt_index, sample_index), so nearby
// arguments give unrelated seeds; the same arguments always give the same seed.
uint64_t sample_seed(uint64_t seed, int64_t step, int64_t prompt_index, int64_t sample_index);

// Generates a continuation of every prompt (row r: prompts[r], sampled with row_seeds[r]) with
// `model` in eval mode, no grad, where its parameters are. Each prompt must be non-empty, shorter
// than max_position_embeddings, with ids in [0, vocab_size); pad_id too must be in the vocabulary.
//
// `lockstep` (sharded rollout, the model a fully_shard root over that communicator's ranks): every
// rank must run the same number of forwards, so the decode loop runs while any rank has an
// unfinished row (a flag all-reduced per step on lockstep->device()), and a rank with no prompts
// runs one dummy row (pad_id) and returns an empty batch. Every rank must pass the same options.
// Without lockstep, no prompts give an empty batch without a forward.
//
// Throws std::invalid_argument naming what is wrong: an empty prompt (its index), row_seeds of
// another size than prompts, temperature <= 0 (unless greedy), top_p outside (0, 1],
// max_new_tokens < 0, an id outside the vocabulary, a prompt too long.
GeneratedBatch generate_batch(CausalLM& model, const std::vector<std::vector<int64_t>>& prompts,
                              const std::vector<uint64_t>& row_seeds, const SamplingOptions& options,
                              Communicator* lockstep = nullptr);

}  // namespace mfsdp
