// Batched generation (include/mfsdp/models/batched_generate.h) against independent recomputations:
// every generated token is checked against a full forward (no KV cache, no padding) of its row's
// prompt and tokens so far: greedy tokens are that forward's argmax, sampled tokens the draw of
// the row's own generator from softmax(logits / temperature), log-probs its log_softmax at the
// token (fp32, <= 1e-5). Rows of a padded batch generate exactly what they generate alone; stop
// ids, truncation (max_new_tokens and max_position_embeddings), top-k 1 == greedy, determinism,
// bad arguments. Last, the lock-step mode on 2 real processes: a ZeRO-3 model, ranks with
// different numbers of prompts (one with none), gives the unsharded model's tokens.
#include "mfsdp/models/batched_generate.h"
#include "mfsdp/models/llama.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "harness/dist_test.h"
#include "mfsdp/comm/comm.h"

namespace {

using at::Tensor;
using mfsdp::GeneratedBatch;
using mfsdp::SamplingOptions;

struct SingleThread : ::testing::Environment {
  void SetUp() override { at::set_num_threads(1); }
};
[[maybe_unused]] const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new SingleThread);

// A Qwen2-shaped model (GQA, q/k/v biases): the biases are part of what the cache must get
// right. init_std 0.3: peaked, varied next-token distributions (0.02 gives near-uniform logits).
mfsdp::LlamaConfig tiny() {
  mfsdp::LlamaConfig c;
  c.vocab_size = 37;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 40;
  c.attention_bias = true;
  c.init_std = 0.3;
  return c;
}

mfsdp::LlamaForCausalLM make_model(uint64_t seed) {
  mfsdp::LlamaOptions o;
  o.init_seed = seed;
  mfsdp::LlamaForCausalLM model(tiny(), o);
  // Non-zero biases (they start at zero).
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
  for (auto& item : model->named_parameters())
    if (item.key().size() > 5 && item.key().compare(item.key().size() - 5, 5, ".bias") == 0)
      item.value().copy_(at::randn(item.value().sizes(), gen));
  return model;
}

const std::vector<std::vector<int64_t>> kPrompts = {{3, 9, 1, 30, 12}, {7}, {22, 5, 18}, {2, 2, 35, 14, 0, 8, 11}};
const std::vector<uint64_t> kSeeds = {101, 202, 303, 404};

// Full forward, no cache, no padding: the fp32 logits after every token of `seq` ([T, V]).
Tensor full_logits(mfsdp::LlamaForCausalLMImpl& model, const std::vector<int64_t>& seq) {
  torch::NoGradGuard no_grad;
  return model.forward(torch::tensor(seq, torch::kLong).unsqueeze(0))[0].to(at::kFloat);
}

// Checks row `r` of `out` token by token against full forwards: the token is the greedy argmax or
// the draw of a generator seeded `seed` (one draw per token, as documented) from
// softmax(logits / temperature) (no top-k/top-p here); the log-prob is log_softmax(logits / t).
void check_row_against_full_forward(mfsdp::LlamaForCausalLMImpl& model, const std::vector<int64_t>& prompt,
                                    const std::vector<int64_t>& tokens, const std::vector<float>& log_probs,
                                    const SamplingOptions& o, uint64_t seed, const std::string& what) {
  ASSERT_EQ(tokens.size(), log_probs.size()) << what;
  Tensor logits = full_logits(model, [&] {
    std::vector<int64_t> seq = prompt;
    seq.insert(seq.end(), tokens.begin(), tokens.end());
    return seq;
  }());
  const double t = o.greedy ? 1.0 : o.temperature;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (size_t i = 0; i < tokens.size(); ++i) {
    Tensor row = logits[static_cast<int64_t>(prompt.size() + i) - 1];  // predicts token i
    Tensor lp = at::log_softmax(row.to(at::kDouble) / t, -1);
    const int64_t want = o.greedy ? row.argmax().item<int64_t>()
                                  : at::multinomial((row / t).softmax(0), 1, false, gen).item<int64_t>();
    EXPECT_EQ(tokens[i], want) << what << ", token " << i;
    EXPECT_NEAR(log_probs[i], lp[tokens[i]].item<double>(), 1e-5) << what << ", log-prob of token " << i;
  }
}

TEST(BatchedGenerate, TokensAndLogProbsEqualFullForwardsGreedyAndSampled) {
  mfsdp::LlamaForCausalLM model = make_model(7);
  for (bool greedy : {true, false}) {
    SamplingOptions o;
    o.greedy = greedy;
    o.temperature = 0.7;  // ignored when greedy (log-probs then at temperature 1)
    o.max_new_tokens = 9;
    GeneratedBatch out = mfsdp::generate_batch(*model, kPrompts, kSeeds, o);
    ASSERT_EQ(out.tokens.size(), kPrompts.size());
    ASSERT_EQ(out.truncated.size(), kPrompts.size());
    for (size_t r = 0; r < kPrompts.size(); ++r) {
      EXPECT_EQ(out.tokens[r].size(), 9u);
      EXPECT_EQ(out.truncated[r], 1) << "no stop ids: every row runs to max_new_tokens";
      check_row_against_full_forward(*model, kPrompts[r], out.tokens[r], out.log_probs[r], o, kSeeds[r],
                                     std::string(greedy ? "greedy" : "sampled") + " row " + std::to_string(r));
    }
  }
}

// SamplingOptions::vocab_size: a model whose vocabulary is padded past the tokenizer's (Megatron's
// --make-vocab-size-divisible-by) never generates a padded row's id. Without the limit the same
// draws do (a hot temperature spreads them over all 37 ids).
TEST(BatchedGenerate, VocabularyLimitKeepsPaddedIdsOut) {
  mfsdp::LlamaForCausalLM model = make_model(7);
  SamplingOptions o;
  o.temperature = 5.0;
  o.max_new_tokens = 30;
  const auto highest = [&](const SamplingOptions& options) {
    int64_t top = 0;
    for (const auto& row : mfsdp::generate_batch(*model, kPrompts, kSeeds, options).tokens)
      for (int64_t id : row) top = std::max(top, id);
    return top;
  };
  EXPECT_GE(highest(o), 20);
  o.vocab_size = 20;
  EXPECT_LT(highest(o), 20);
}

// Every row of a padded batch generates what it generates alone (greedy, and sampled with
// top-k and top-p filters), with the same log-probs; and the batch is deterministic.
TEST(BatchedGenerate, PaddedRowsGenerateWhatTheyGenerateAlone) {
  mfsdp::LlamaForCausalLM model = make_model(8);
  for (int mode = 0; mode < 2; ++mode) {
    SamplingOptions o;
    o.greedy = mode == 0;
    o.temperature = 1.3;
    o.top_k = 20;
    o.top_p = 0.9;
    o.max_new_tokens = 10;
    o.pad_id = 4;
    GeneratedBatch batch = mfsdp::generate_batch(*model, kPrompts, kSeeds, o);
    for (size_t r = 0; r < kPrompts.size(); ++r) {
      GeneratedBatch alone = mfsdp::generate_batch(*model, {kPrompts[r]}, {kSeeds[r]}, o);
      EXPECT_EQ(batch.tokens[r], alone.tokens[0]) << "mode " << mode << ", row " << r;
      ASSERT_EQ(batch.log_probs[r].size(), alone.log_probs[0].size());
      for (size_t i = 0; i < alone.log_probs[0].size(); ++i)
        EXPECT_NEAR(batch.log_probs[r][i], alone.log_probs[0][i], 1e-5) << "mode " << mode << ", row " << r;
    }
    GeneratedBatch again = mfsdp::generate_batch(*model, kPrompts, kSeeds, o);
    EXPECT_EQ(again.tokens, batch.tokens) << "same seeds, same tokens";
    EXPECT_EQ(again.log_probs, batch.log_probs);
  }
  // Other seeds draw other tokens (sampling at temperature 1.3 over 37 ids, 4 x 10 draws).
  SamplingOptions o;
  o.temperature = 1.3;
  o.max_new_tokens = 10;
  GeneratedBatch a = mfsdp::generate_batch(*model, kPrompts, kSeeds, o);
  GeneratedBatch b = mfsdp::generate_batch(*model, kPrompts, {1, 2, 3, 4}, o);
  EXPECT_NE(a.tokens, b.tokens);
}

// top_k = 1 keeps only the argmax: greedy's tokens, at any temperature; the log-probs are the
// unfiltered log_softmax(logits / temperature), so not 0 and not greedy's (temperature 1).
TEST(BatchedGenerate, TopKOneEqualsGreedyWithUnfilteredLogProbs) {
  mfsdp::LlamaForCausalLM model = make_model(9);
  SamplingOptions g;
  g.greedy = true;
  g.max_new_tokens = 8;
  GeneratedBatch greedy = mfsdp::generate_batch(*model, kPrompts, kSeeds, g);
  SamplingOptions k = g;
  k.greedy = false;
  k.top_k = 1;
  k.temperature = 2.0;
  GeneratedBatch top1 = mfsdp::generate_batch(*model, kPrompts, kSeeds, k);
  EXPECT_EQ(top1.tokens, greedy.tokens);
  for (size_t r = 0; r < kPrompts.size(); ++r) {
    Tensor logits = full_logits(*model, kPrompts[r]);
    const double want = at::log_softmax(logits[-1].to(at::kDouble) / 2.0, -1)[top1.tokens[r][0]].item<double>();
    EXPECT_NEAR(top1.log_probs[r][0], want, 1e-5) << "row " << r;
    EXPECT_LT(top1.log_probs[r][0], -1e-3) << "row " << r << ": a filtered log-prob would be 0";
  }
  SamplingOptions p = k;  // a nucleus of one token: also greedy
  p.top_k = 0;
  p.top_p = 1e-6;
  EXPECT_EQ(mfsdp::generate_batch(*model, kPrompts, kSeeds, p).tokens, greedy.tokens);
}

// A row ends at its first stop id (kept, truncated 0); the others run on to max_new_tokens
// (truncated 1); a row near max_position_embeddings ends where its next token would not fit.
TEST(BatchedGenerate, StopIdsAndTruncation) {
  mfsdp::LlamaForCausalLM model = make_model(10);
  SamplingOptions o;
  o.greedy = true;
  o.max_new_tokens = 12;
  GeneratedBatch free_run = mfsdp::generate_batch(*model, kPrompts, kSeeds, o);
  // Stop ids: the token row 0 produces 4th, and one no row produces before its end.
  const int64_t stop = free_run.tokens[0][3];
  std::set<int64_t> produced;
  for (const auto& row : free_run.tokens) produced.insert(row.begin(), row.end());
  int64_t never = 0;
  while (produced.count(never)) ++never;
  ASSERT_LT(never, tiny().vocab_size) << "every id was produced; pick another model seed";
  o.stop_ids = {never, stop};
  GeneratedBatch out = mfsdp::generate_batch(*model, kPrompts, kSeeds, o);
  for (size_t r = 0; r < kPrompts.size(); ++r) {
    const auto& full = free_run.tokens[r];
    auto first = std::find(full.begin(), full.end(), stop);
    if (first == full.end()) {
      EXPECT_EQ(out.tokens[r], full) << "row " << r << " never stops";
      EXPECT_EQ(out.truncated[r], 1) << "row " << r;
    } else {
      EXPECT_EQ(out.tokens[r], std::vector<int64_t>(full.begin(), first + 1)) << "row " << r << ": up to its stop id";
      EXPECT_EQ(out.truncated[r], 0) << "row " << r;
    }
    EXPECT_EQ(out.log_probs[r].size(), out.tokens[r].size());
  }
  EXPECT_LE(out.tokens[0].size(), 4u);

  // max_position_embeddings 40: a 37-token prompt has room for tokens at positions 37, 38, 39.
  std::vector<int64_t> longp(37);
  for (size_t i = 0; i < longp.size(); ++i) longp[i] = static_cast<int64_t>(i % 37);
  o.stop_ids.clear();
  GeneratedBatch edge = mfsdp::generate_batch(*model, {longp, {5}}, {1, 2}, o);
  EXPECT_EQ(edge.tokens[0].size(), 3u);
  EXPECT_EQ(edge.truncated[0], 1);
  EXPECT_EQ(edge.tokens[1].size(), 12u);

  o.max_new_tokens = 0;
  GeneratedBatch none = mfsdp::generate_batch(*model, kPrompts, kSeeds, o);
  for (size_t r = 0; r < kPrompts.size(); ++r) {
    EXPECT_TRUE(none.tokens[r].empty());
    EXPECT_EQ(none.truncated[r], 1);
  }
  EXPECT_TRUE(mfsdp::generate_batch(*model, {}, {}, o).tokens.empty());
}

void expect_invalid(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error naming '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(BatchedGenerate, BadArgumentsAreNamed) {
  mfsdp::LlamaForCausalLM model = make_model(11);
  SamplingOptions o;
  o.max_new_tokens = 2;
  auto run = [&](const std::vector<std::vector<int64_t>>& prompts, const std::vector<uint64_t>& seeds,
                 const SamplingOptions& opt) { return [&model, prompts, seeds, opt] { mfsdp::generate_batch(*model, prompts, seeds, opt); }; };
  expect_invalid(run({{1, 2}, {}}, {1, 2}, o), "prompt 1 is empty");
  expect_invalid(run({{1, 2}, {3}}, {1}, o), "row_seeds has 1 seeds for 2 prompts");
  for (double t : {0.0, -1.0, std::nan("")}) {
    SamplingOptions bad = o;
    bad.temperature = t;
    expect_invalid(run({{1}}, {1}, bad), "temperature");
  }
  for (double p : {0.0, 1.5, std::nan("")}) {
    SamplingOptions bad = o;
    bad.top_p = p;
    expect_invalid(run({{1}}, {1}, bad), "top_p");
  }
  SamplingOptions bad = o;
  bad.max_new_tokens = -1;
  expect_invalid(run({{1}}, {1}, bad), "max_new_tokens");
  bad = o;
  bad.pad_id = 37;
  expect_invalid(run({{1}}, {1}, bad), "pad_id 37");
  expect_invalid(run({{1, 37}}, {1}, o), "prompt 0, token 1: id 37");
  expect_invalid(run({std::vector<int64_t>(40, 1)}, {1}, o), "prompt 0 has 40 tokens");
  SamplingOptions greedy = o;  // greedy ignores the temperature
  greedy.greedy = true;
  greedy.temperature = 0;
  EXPECT_NO_THROW(mfsdp::generate_batch(*model, {{1}}, {1}, greedy));
}

TEST(BatchedGenerate, SampleSeedsAreDeterministicAndDistinct) {
  std::set<uint64_t> seen;
  for (int64_t step = 0; step < 4; ++step)
    for (int64_t p = 0; p < 8; ++p)
      for (int64_t s = 0; s < 8; ++s) {
        const uint64_t x = mfsdp::sample_seed(1234, step, p, s);
        EXPECT_EQ(x, mfsdp::sample_seed(1234, step, p, s));
        seen.insert(x);
      }
  EXPECT_EQ(seen.size(), 4u * 8u * 8u) << "swapping or changing any argument must change the seed";
  EXPECT_NE(mfsdp::sample_seed(1, 0, 0, 0), mfsdp::sample_seed(2, 0, 0, 0));
  EXPECT_NE(mfsdp::sample_seed(0, 1, 2, 3), mfsdp::sample_seed(0, 3, 2, 1));
}

// The GPU path: the model on CUDA gives the CPU's tokens (sampling happens on the CPU either way).
TEST(BatchedGenerate, CudaModelGivesTheCpuTokens) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  mfsdp::LlamaForCausalLM model = make_model(12);
  SamplingOptions o;
  o.temperature = 0.9;
  o.max_new_tokens = 8;
  GeneratedBatch cpu = mfsdp::generate_batch(*model, kPrompts, kSeeds, o);
  model->to(torch::kCUDA);
  GeneratedBatch gpu = mfsdp::generate_batch(*model, kPrompts, kSeeds, o);
  EXPECT_EQ(gpu.tokens, cpu.tokens);
  for (size_t r = 0; r < kPrompts.size(); ++r)
    for (size_t i = 0; i < cpu.log_probs[r].size() && i < gpu.log_probs[r].size(); ++i)
      EXPECT_NEAR(gpu.log_probs[r][i], cpu.log_probs[r][i], 1e-4) << "row " << r;
}

// Sharded rollout: the model is a ZeRO-3 fully_shard root over 2 ranks (every forward
// all-gathers), each rank generates its own prompts with lockstep = the communicator. Rank 0 has
// 3 prompts and rank 1 none (a dummy row), then 1 and 3: the tokens and log-probs equal the
// unsharded model's for the same prompts and seeds. The stop id makes rows end at different
// steps, so one rank finishes first and must keep joining the other's forwards.
MFSDP_DIST_TEST(BatchedGenerate, LockstepOnFullyShardedModelMatchesUnsharded, {2}) {
  at::set_num_threads(1);
  const int rank = comm.rank();
  SamplingOptions o;
  o.temperature = 0.8;
  o.max_new_tokens = 10;
  mfsdp::LlamaForCausalLM reference = make_model(13);
  // The stop id: what row 1 draws third, so that at least that row ends early.
  o.stop_ids = {mfsdp::generate_batch(*reference, kPrompts, kSeeds, o).tokens[1][2]};
  GeneratedBatch want = mfsdp::generate_batch(*reference, kPrompts, kSeeds, o);
  std::set<size_t> lengths;
  for (const auto& row : want.tokens) lengths.insert(row.size());
  EXPECT_GT(lengths.size(), 1u) << "rows should end at different steps";

  mfsdp::LlamaForCausalLM model = make_model(13);
  mfsdp::FullyShardOptions options;
  options.comm = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
  options.strategy = mfsdp::ShardingStrategy::kOptimGradsParams;
  mfsdp::shard_llama(model, options);
  // Which of kPrompts each rank generates: {rank 0's, rank 1's}.
  const std::vector<std::vector<std::vector<size_t>>> splits = {{{0, 1, 2}, {}}, {{3}, {0, 1, 2}}, {{}, {}}};
  for (const auto& split : splits) {
    std::vector<std::vector<int64_t>> prompts;
    std::vector<uint64_t> seeds;
    for (size_t i : split[rank]) {
      prompts.push_back(kPrompts[i]);
      seeds.push_back(kSeeds[i]);
    }
    GeneratedBatch got = mfsdp::generate_batch(*model, prompts, seeds, o, &comm);
    ASSERT_EQ(got.tokens.size(), prompts.size());
    for (size_t j = 0; j < prompts.size(); ++j) {
      const size_t i = split[rank][j];
      EXPECT_EQ(got.tokens[j], want.tokens[i]) << "rank " << rank << ", prompt " << i;
      EXPECT_EQ(got.truncated[j], want.truncated[i]) << "rank " << rank << ", prompt " << i;
      ASSERT_EQ(got.log_probs[j].size(), want.log_probs[i].size());
      for (size_t k = 0; k < got.log_probs[j].size(); ++k)
        EXPECT_NEAR(got.log_probs[j][k], want.log_probs[i][k], 1e-5) << "rank " << rank << ", prompt " << i;
    }
  }
}

}  // namespace
