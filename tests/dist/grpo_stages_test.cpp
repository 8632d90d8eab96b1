// mfsdp-grpo's stages (include/mfsdp/train/grpo_trainer.h) driven one by one on 1 and 2 ranks, each
// checked against what it must hand the next, computed here independently:
//   rollout:   --rollout-n responses per prompt of this rank, each within --max-response-length,
//              with one sampler log-prob per token;
//   score:     every rank holds every rank's scores (the all-reduce), this rank's rows are its
//              rollouts' rewards, advantages are verl's (r - group mean) / (unbiased std + 1e-6);
//   log_probs: the training forward (no KV cache) gives the sampler's log-probs of the same
//              tokens (the generation path, with a KV cache) to fp32 rounding;
//   update:    the first mini-batch sees the old policy (ppo_kl 0, nothing clipped) and the
//              optimizer step moves the weights.
// (tests/e2e/grpo_test.cpp runs the whole loop through mfsdp-grpo.)
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "harness/dist_test.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/train/grpo_trainer.h"

namespace {

mfsdp::GrpoArgs tiny_grpo_args(int world) {
  const std::vector<std::string> argv = {
      "mfsdp-grpo", "--device", "cpu", "--tokenizer-type", "ByteLevelTokenizer", "--make-vocab-size-divisible-by",
      "1", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--swiglu",
      "--ffn-hidden-size", "48", "--gen-task", "arith", "--gen-train-size", "64", "--gen-val-size", "0",
      "--max-prompt-length", "32", "--max-response-length", "8", "--train-batch-size", "4", "--rollout-n", "4",
      "--micro-batch-size", "4", "--optimizer", "sgd", "--lr", "0.5", "--sgd-momentum", "0", "--clip-grad", "0",
      "--seed", "5", "--train-iters", "10", "--lr-decay-style", "constant", "--temperature", "1.0", "--entropy-coeff", "0.01", "--weight-decay", "0"};
  mfsdp::GrpoArgs g = mfsdp::parse_grpo_args(argv);
  mfsdp::validate_grpo_args(g, world, mfsdp::tokenizer_vocab_size({"ByteLevelTokenizer", "", "", ""}));
  return g;
}

}  // namespace

MFSDP_DIST_TEST(GrpoStages, EachStageHandsTheNextWhatItMust, {1, 2}) {
  const int world = comm.size(), rank = comm.rank();
  std::ostringstream log;
  std::shared_ptr<mfsdp::Communicator> shared(&comm, [](mfsdp::Communicator*) {});
  mfsdp::GrpoTrainer trainer(tiny_grpo_args(world), shared, log);
  const int64_t prompts = 4, n = 4, per_rank = prompts / world * n;

  mfsdp::GrpoStep step = trainer.rollout(1);
  ASSERT_EQ(static_cast<int64_t>(step.rollouts.size()), per_rank);
  for (size_t i = 0; i < step.rollouts.size(); ++i) {
    const mfsdp::Rollout& r = step.rollouts[i];
    EXPECT_EQ(r.prompt, rank * prompts / world + static_cast<int64_t>(i) / n) << "rollouts are prompt-major";
    EXPECT_FALSE(r.response_ids.empty());
    EXPECT_LE(r.response_ids.size(), 8u);
    EXPECT_EQ(r.rollout_log_probs.size(), r.response_ids.size());
  }

  trainer.score(step);
  ASSERT_EQ(step.scores.size(0), prompts * n);
  for (int64_t i = 0; i < per_rank; ++i)
    EXPECT_EQ(step.scores[rank * per_rank + i].item<double>(), step.rollouts[static_cast<size_t>(i)].score);
  at::Tensor summed = step.scores.clone();
  comm.all_reduce(summed);
  EXPECT_TRUE(at::allclose(summed, step.scores * world)) << "ranks hold different scores";
  for (int64_t i = 0; i < per_rank; ++i) {
    const int64_t row = rank * per_rank + i, first = row / n * n;
    const at::Tensor group = step.scores.narrow(0, first, n);
    const double mean = group.mean().item<double>(), std = group.std(/*unbiased=*/true).item<double>();
    const double expected = std < 1e-12 ? 0.0 : (step.scores[row].item<double>() - mean) / (std + 1e-6);
    EXPECT_NEAR(step.advantages[i].item<double>(), expected, 1e-5) << "row " << row;
  }

  trainer.log_probs(step);
  ASSERT_EQ(step.micro.size(), static_cast<size_t>(per_rank / 4));
  ASSERT_EQ(step.old_log_probs.size(), step.micro.size());
  for (size_t k = 0; k < step.micro.size(); ++k) {
    const mfsdp::RolloutBatch& b = step.micro[k];
    EXPECT_GT(b.response.sum().item<double>(), 0);
    const double diff = ((step.old_log_probs[k].cpu() - b.rollout_log_probs).abs() * b.response).max().item<double>();
    EXPECT_LT(diff, 1e-4) << "micro-batch " << k << ": training forward vs sampler log-probs";
  }

  std::map<std::string, at::Tensor> before;  // copies: a full tensor may share the live storage
  for (const auto& [name, t] : trainer.run().root().full_state_dict(/*all_ranks=*/true)) before[name] = t.clone();
  trainer.update(step);
  EXPECT_NEAR(step.metric("actor/ppo_kl"), 0.0, 1e-6) << "the first mini-batch is the old policy";
  EXPECT_EQ(step.metric("actor/pg_clipfrac"), 0.0);
  // The entropy bonus (--entropy-coeff) gives a gradient even when every advantage is 0.
  const auto after = trainer.run().root().full_state_dict(/*all_ranks=*/true);
  double moved = 0;
  for (const auto& [name, t] : before) moved += (after.at(name) - t).abs().sum().item<double>();
  EXPECT_GT(moved, 0) << "the optimizer step left the weights as they were";
  trainer.record(step);
  EXPECT_FALSE(std::isnan(step.metric("timing_s/step")));
}
