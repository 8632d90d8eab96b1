// Batched generation: left-padded prompts, one KV cache for the batch, a generator per row
// (include/mfsdp/models/batched_generate.h, docs/model.md).
#include "mfsdp/models/batched_generate.h"

#include "mfsdp/base/splitmix64.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "mfsdp/comm/comm.h"
#include "mfsdp/models/tensor_parallel.h"

namespace mfsdp {
namespace {

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("generate_batch: " + what); }

void check_options(const SamplingOptions& o, int64_t vocab) {
  if (o.max_new_tokens < 0) bad("max_new_tokens must be >= 0, found " + std::to_string(o.max_new_tokens));
  if (!o.greedy && !(o.temperature > 0 && o.temperature < std::numeric_limits<double>::infinity()))
    bad("temperature must be a finite value > 0, found " + std::to_string(o.temperature));
  if (!(o.top_p > 0 && o.top_p <= 1)) bad("top_p must be in (0, 1], found " + std::to_string(o.top_p));
  if (o.pad_id < 0 || o.pad_id >= vocab)
    bad("pad_id " + std::to_string(o.pad_id) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

// Keeps the logits of the k largest and of the smallest set of tokens whose probability reaches
// top_p; the rest become -inf. `logits` [V] fp32 (already divided by the temperature).
at::Tensor filter_logits(at::Tensor logits, int64_t top_k, double top_p) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (top_k > 0 && top_k < logits.size(0)) {
    at::Tensor kth = std::get<0>(logits.topk(top_k)).index({-1});
    logits = logits.masked_fill(logits < kth, neg_inf);
  }
  if (top_p < 1.0) {
    auto [sorted, order] = logits.sort(/*dim=*/0, /*descending=*/true);
    at::Tensor probs = sorted.softmax(0);
    // Drop a token when the tokens before it already reach top_p (the first always stays).
    at::Tensor drop = (probs.cumsum(0) - probs) >= top_p;
    at::Tensor mask = at::zeros_like(drop).scatter(0, order, drop);
    logits = logits.masked_fill(mask, neg_inf);
  }
  return logits;
}

}  // namespace

uint64_t sample_seed(uint64_t seed, int64_t step, int64_t prompt_index, int64_t sample_index) {
  // Chained: each argument goes through a full splitmix64 round before the next is mixed in, so
  // (step, prompt, sample) triples that differ in any position give unrelated seeds.
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<uint64_t>(step));
  h = splitmix64(h ^ static_cast<uint64_t>(prompt_index));
  return splitmix64(h ^ static_cast<uint64_t>(sample_index));
}

GeneratedBatch generate_batch(CausalLM& model, const std::vector<std::vector<int64_t>>& prompts,
                              const std::vector<uint64_t>& row_seeds, const SamplingOptions& o,
                              Communicator* lockstep) {
  check_options(o, model.vocab_size());
  if (row_seeds.size() != prompts.size())
    bad("row_seeds has " + std::to_string(row_seeds.size()) + " seeds for " + std::to_string(prompts.size()) +
        " prompts (one per row)");
  const int64_t limit = model.max_positions();
  for (size_t r = 0; r < prompts.size(); ++r) {
    const auto& p = prompts[r];
    if (p.empty()) bad("prompt " + std::to_string(r) + " is empty");
    if (static_cast<int64_t>(p.size()) >= limit)
      bad("prompt " + std::to_string(r) + " has " + std::to_string(p.size()) +
          " tokens; with max_position_embeddings " + std::to_string(limit) + " it must have fewer");
    for (size_t i = 0; i < p.size(); ++i)
      if (p[i] < 0 || p[i] >= model.vocab_size())
        bad("prompt " + std::to_string(r) + ", token " + std::to_string(i) + ": id " + std::to_string(p[i]) +
            " is outside the vocabulary [0, " + std::to_string(model.vocab_size()) + ")");
  }

  const int64_t n = static_cast<int64_t>(prompts.size());
  GeneratedBatch out;
  out.tokens.resize(n);
  out.log_probs.resize(n);
  out.truncated.assign(n, o.max_new_tokens == 0 ? 1 : 0);
  // Every rank has the same max_new_tokens: with 0 none runs a forward.
  if (o.max_new_tokens == 0 || (n == 0 && lockstep == nullptr)) return out;

  // A rank without prompts still runs every forward of the lock-step loop: one dummy row,
  // finished from the start, whose outputs are never read.
  const bool dummy = n == 0;
  const std::vector<std::vector<int64_t>> dummy_rows = {{o.pad_id}};
  const std::vector<std::vector<int64_t>>& rows = dummy ? dummy_rows : prompts;
  const int64_t b = static_cast<int64_t>(rows.size());

  at::NoGradGuard no_grad;
  const at::Device device = model.parameters().front().device();
  const auto longs = at::TensorOptions().dtype(at::kLong);

  // Left padding: row r's prompt fills the last len_r columns; positions count real tokens only.
  int64_t longest = 0;
  for (const auto& p : rows) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  at::Tensor ids = at::full({b, longest}, o.pad_id, longs);
  at::Tensor mask = at::zeros({b, longest}, longs);
  at::Tensor positions = at::zeros({b, longest}, longs);
  std::vector<int64_t> length(b);  // tokens of row r so far (prompt + generated)
  for (int64_t r = 0; r < b; ++r) {
    const int64_t len = static_cast<int64_t>(rows[r].size()), start = longest - len;
    length[r] = len;
    ids[r].narrow(0, start, len).copy_(at::tensor(rows[r], longs));
    mask[r].narrow(0, start, len).fill_(1);
    positions[r].narrow(0, start, len).copy_(at::arange(len, longs));
  }

  std::vector<at::Generator> generators;
  std::vector<bool> done(b, dummy);
  for (int64_t r = 0; r < b; ++r)
    generators.push_back(at::make_generator<at::CPUGeneratorImpl>(dummy ? 0 : row_seeds[r]));
  auto is_stop = [&](int64_t id) { return std::find(o.stop_ids.begin(), o.stop_ids.end(), id) != o.stop_ids.end(); };

  KVCache cache(model.num_layers());
  at::Tensor key_mask = mask;  // [B, keys so far]: 1 for a real token, 0 for padding
  at::Tensor input = ids, input_positions = positions;
  const double temperature = o.greedy ? 1.0 : o.temperature;
  while (true) {
    SequenceLayout layout;
    layout.position_ids = input_positions.to(device);
    layout.attention_mask = key_mask.to(device);
    at::Tensor logits = model.call(input.to(device), layout, &cache);  // [B, T, V]
    // The last column is every row's newest token (left padding aligns the rows' ends).
    at::Tensor last = logits.select(1, logits.size(1) - 1);
    // A tensor-parallel model gives each rank its vocabulary slice: every rank samples from the
    // whole vocabulary (the same draws: the same seed on every rank of the group).
    if (const auto tp = model.tensor_parallel(); tp && tp->size() > 1)
      last = tensor_parallel::gather_from_tensor_parallel_region(last.contiguous(), *tp);
    if (o.vocab_size > 0 && o.vocab_size < last.size(-1)) last = last.narrow(-1, 0, o.vocab_size);
    last = last.to(at::kCPU, at::kFloat);
    at::Tensor scaled = temperature == 1.0 ? last : last / temperature;
    at::Tensor log_probs = at::log_softmax(scaled, -1);  // unfiltered, as verl reports them

    std::vector<int64_t> next(b, o.pad_id);
    for (int64_t r = 0; r < b; ++r) {
      if (done[r]) continue;
      int64_t token;
      if (o.greedy) {
        token = last[r].argmax().item<int64_t>();
      } else {
        at::Tensor probs = filter_logits(scaled[r], o.top_k, o.top_p).softmax(0);
        token = at::multinomial(probs, 1, /*replacement=*/false, generators[r]).item<int64_t>();
      }
      next[r] = token;
      out.tokens[r].push_back(token);
      out.log_probs[r].push_back(log_probs[r][token].item<float>());
      ++length[r];
      const int64_t generated = static_cast<int64_t>(out.tokens[r].size());
      if (is_stop(token)) {
        done[r] = true;
      } else if (generated >= o.max_new_tokens || length[r] >= limit) {
        // The row's next token would exceed max_new_tokens or sit at position >= limit.
        done[r] = true;
        out.truncated[r] = 1;
      }
    }

    bool more = std::find(done.begin(), done.end(), false) != done.end();
    if (lockstep != nullptr) {
      // Every rank runs the same forwards (each all-gathers): go on while any rank has work.
      at::Tensor flag = at::full({1}, more ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(lockstep->device()));
      lockstep->all_reduce(flag);
      more = flag.item<float>() > 0;
    }
    if (!more) break;

    // One token per row: a live row feeds its newest token at its next position; a finished row
    // feeds pad_id at position 0, hidden as a key (its own query still sees itself).
    at::Tensor live = at::empty({b, 1}, longs);
    input = at::tensor(next, longs).view({b, 1});
    input_positions = at::zeros({b, 1}, longs);
    for (int64_t r = 0; r < b; ++r) {
      live[r][0] = done[r] ? 0 : 1;
      if (!done[r]) input_positions[r][0] = length[r] - 1;
    }
    key_mask = at::cat({key_mask, live}, 1);
  }
  if (dummy) return GeneratedBatch{};
  return out;
}

}  // namespace mfsdp
