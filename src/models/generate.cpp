// Generation: KV-cache decoding through batched_generate (include/mfsdp/models/generate.h).
#include "mfsdp/models/generate.h"

#include <stdexcept>
#include <string>

#include "mfsdp/models/batched_generate.h"

namespace mfsdp {

std::vector<int64_t> generate(CausalLM& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& o) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt is empty");
  if (!(o.temperature > 0)) throw std::invalid_argument("generate: temperature must be > 0");
  if (!(o.top_p > 0 && o.top_p <= 1)) throw std::invalid_argument("generate: top_p must be in (0, 1]");
  if (o.top_k < 0) throw std::invalid_argument("generate: top_k must be >= 0");
  if (o.max_new_tokens < 0) throw std::invalid_argument("generate: max_new_tokens must be >= 0");
  const int64_t limit = model.max_positions();
  if (static_cast<int64_t>(prompt.size()) >= limit)
    throw std::invalid_argument("generate: the prompt has " + std::to_string(prompt.size()) +
                                " tokens; the model takes at most " + std::to_string(limit));
  // A batch of one (batched_generate.h): the same KV-cache decoding and CPU sampling with a
  // generator seeded o.seed, so one prompt continues exactly as it does inside a rollout batch.
  SamplingOptions s;
  s.max_new_tokens = o.max_new_tokens;
  s.greedy = o.greedy;
  s.temperature = o.temperature;
  s.top_k = o.top_k;
  s.top_p = o.top_p;
  if (o.stop_id >= 0) s.stop_ids = {o.stop_id};
  s.vocab_size = o.vocab_size;
  return generate_batch(model, {prompt}, {o.seed}, s).tokens.front();
}

}  // namespace mfsdp
