// Text generation with a trained (unsharded) model of any family: greedy or top-k / top-p sampling with a
// KV cache. The model comes from load_model (include/mfsdp/checkpoint/load_model.h): there is no
// model format of its own, a run's weights reach generation as its `--save` checkpoint or its
// `--export-hf` folder.
#pragma once

#include <cstdint>
#include <vector>

#include "mfsdp/models/causal_lm.h"

namespace mfsdp {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  bool greedy = false;       // argmax; else sample
  double temperature = 1.0;  // > 0
  int64_t top_k = 0;         // 0: no top-k filter
  double top_p = 1.0;        // (0, 1]: nucleus filter
  uint64_t seed = 0;
  int64_t stop_id = -1;      // stop after generating this id (e.g. EOD); -1: never
  int64_t vocab_size = 0;    // > 0: only ids below it (SamplingOptions::vocab_size)
};

// Returns the generated ids (without the prompt, with stop_id when produced): generate_batch
// (batched_generate.h) on a batch of one with row seed `seed`, so a KV cache, the prompt once,
// then one token per step, stopping before a token would sit at position max_position_embeddings.
// Throws std::invalid_argument on bad options or an empty prompt.
std::vector<int64_t> generate(CausalLM& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options);

}  // namespace mfsdp
