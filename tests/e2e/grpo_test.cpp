// mfsdp-grpo end to end, through mfsdp-run, on generated arithmetic prompts from a random tiny
// model (an entropy bonus keeps the gradients non-zero when every reward is 0):
//  - a step is the same with 1 and 2 ranks and any micro-batch split (scores exactly: rollouts
//    are seeded per (step, prompt, sample); losses and gradient norms to fp32 rounding);
//  - the rollout's log-probs equal the training forward's on the same tokens (2 ranks, ZeRO-3,
//    fp32, <= 1e-4), in the full-copy and the sharded lock-step rollout, which agree;
//  - resuming from a checkpoint is bit-exact;
//  - the KL loss to a sharded reference policy is 0 at the start and grows;
//  - bad flags are named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/load_model.h"

namespace {

using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kRun = MFSDP_RUN_BIN_PATH;
const std::string kGrpo = MFSDP_GRPO_BIN_PATH;
// Rollout (KV-cache decoding of a padded batch) vs training forward log-probs: 1e-4, as the GPU test;
// fp32 rounding of other matmul shapes reaches 8.5e-5 on improbable tokens (docs/PERFORMANCE.md).
constexpr double kRolloutLogProbsTol = 1e-4;

const std::string kFlags =
    " --device cpu --tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 1 --num-layers 2"
    " --hidden-size 32 --num-attention-heads 4 --swiglu --ffn-hidden-size 48 --gen-task arith --gen-train-size 64"
    " --gen-val-size 8 --max-prompt-length 32 --max-response-length 8 --train-batch-size 4 --rollout-n 4"
    " --entropy-coeff 0.01 --optimizer sgd --lr 0.1 --sgd-momentum 0 --clip-grad 0 --seed 5 --log-interval 1"
    " --eval-interval 1000";

struct GrpoRun {
  std::vector<nlohmann::json> steps, validations;
  std::string output;
};

GrpoRun grpo(const TempDir& dir, int ranks, const std::string& flags, const std::string& tag) {
  const std::string metrics = dir.file(tag + ".jsonl");
  auto r = run_command(kRun + " --nproc-per-node " + std::to_string(ranks) + " " + kGrpo + kFlags +
                       " --metrics-file " + metrics + " " + flags);
  EXPECT_EQ(r.exit_code, 0) << tag << ":\n" << r.output;
  GrpoRun out;
  out.output = r.output;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    (j.contains("eval") ? out.validations : out.steps).push_back(j);
  }
  return out;
}

double metric(const nlohmann::json& record, const char* key) {
  EXPECT_TRUE(record.contains(key)) << "no " << key << " in " << record.dump();
  return record.contains(key) ? record[key].get<double>() : 0;
}

void expect_same_step(const nlohmann::json& a, const nlohmann::json& b, const std::string& what, double rtol) {
  EXPECT_EQ(metric(a, "critic/score/mean"), metric(b, "critic/score/mean")) << what;
  EXPECT_EQ(metric(a, "response_length/mean"), metric(b, "response_length/mean")) << what;
  for (const char* key : {"actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/advantages/max"}) {
    const double x = metric(a, key), y = metric(b, key);
    EXPECT_NEAR(x, y, rtol * std::max(1e-6, std::abs(y))) << what << " " << key;
  }
}

// The first `steps` steps of `got` are `one`'s (expect_same_step), with the KL to the reference
// within `kl_rtol` and the rollout's log-probs equal to the training forward's.
void expect_same_steps_with_kl(const GrpoRun& got, const GrpoRun& one, size_t steps, const std::string& what,
                               double kl_rtol) {
  for (size_t i = 0; i < steps; ++i) {
    const std::string step = what + ", step " + std::to_string(i + 1);
    expect_same_step(got.steps[i], one.steps[i], step, 1e-4);
    const double kl = metric(one.steps[i], "actor/kl_loss");
    EXPECT_NEAR(metric(got.steps[i], "actor/kl_loss"), kl, kl_rtol * std::abs(kl) + 1e-9) << step;
    EXPECT_LE(metric(got.steps[i], "training/rollout_log_probs_diff_max"), kRolloutLogProbsTol) << step;
  }
}

std::map<std::string, at::Tensor> weights(const std::string& dir) {
  std::map<std::string, at::Tensor> out;
  auto loaded = mfsdp::load_model(dir);
  for (const auto& p : loaded.model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

}  // namespace

TEST(Grpo, SameStepOnOneAndTwoRanksAndAnyMicroBatchSplit) {
  TempDir dir("mfsdp-grpo-split");
  GrpoRun one = grpo(dir, 1, "--train-iters 2 --micro-batch-size 16", "one");
  GrpoRun two = grpo(dir, 2, "--train-iters 2 --micro-batch-size 4 --data-parallel-sharding-strategy optim_grads_params", "two");
  GrpoRun small = grpo(dir, 2, "--train-iters 2 --micro-batch-size 1 --data-parallel-sharding-strategy optim", "small");
  ASSERT_EQ(one.steps.size(), 2u) << one.output;
  ASSERT_EQ(two.steps.size(), 2u) << two.output;
  ASSERT_EQ(small.steps.size(), 2u) << small.output;
  EXPECT_GT(metric(one.steps[0], "actor/grad_norm"), 0);
  for (size_t i = 0; i < 2; ++i) {
    expect_same_step(two.steps[i], one.steps[i], "2 ranks x 4 vs 1 x 16, step " + std::to_string(i + 1), 1e-4);
    expect_same_step(small.steps[i], one.steps[i], "2 ranks x 1 vs 1 x 16, step " + std::to_string(i + 1), 1e-4);
  }
  // verl's metric names, and the greedy validation before and after.
  for (const char* key : {"critic/score/max", "critic/advantages/mean", "response_length/max",
                          "response_length/clip_ratio", "actor/pg_clipfrac", "actor/ppo_kl", "frac_reward_zero_std",
                          "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/update_weights",
                          "training/rollout_probs_diff_mean"})
    metric(one.steps[0], key);
  EXPECT_EQ(one.validations.size(), 2u) << one.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("one.reward.svg")));
}

TEST(Grpo, RolloutLogProbsEqualTheTrainingForward) {
  TempDir dir("mfsdp-grpo-logp");
  const std::string flags = "--train-iters 2 --micro-batch-size 4 --data-parallel-sharding-strategy optim_grads_params";
  GrpoRun full = grpo(dir, 2, flags, "full");
  GrpoRun sharded = grpo(dir, 2, flags + " --rollout-mode sharded", "sharded");
  ASSERT_EQ(full.steps.size(), 2u) << full.output;
  ASSERT_EQ(sharded.steps.size(), 2u) << sharded.output;
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_LE(metric(full.steps[i], "training/rollout_log_probs_diff_max"), kRolloutLogProbsTol) << "full, step " << i + 1;
    EXPECT_LE(metric(sharded.steps[i], "training/rollout_log_probs_diff_max"), kRolloutLogProbsTol) << "sharded, step " << i + 1;
    expect_same_step(sharded.steps[i], full.steps[i], "sharded vs full rollout, step " + std::to_string(i + 1), 1e-4);
  }
}

// Tensor parallelism: the policy's log-probs and entropy from vocabulary slices, the prompts split
// over the data-parallel replicas only (a replica's TP ranks generate the same rollouts from the
// same seeds). The same steps as one rank (scores exactly, losses and norms to fp32 rounding), with
// the rollout from a gathered full copy (TP 2, TP 2 x DP 2 with sequence parallelism) and from the
// tensor-parallel shards themselves (TP 2, --rollout-mode sharded). The one-rank run pads the
// vocabulary to 258 as TP 2 does.
TEST(Grpo, TensorParallelStepsLikeOneRank) {
  TempDir dir("mfsdp-grpo-tp");
  const std::string flags = "--train-iters 2 --make-vocab-size-divisible-by 2";
  const std::string tp = " --tensor-model-parallel-size 2 --make-vocab-size-divisible-by 1";
  GrpoRun one = grpo(dir, 1, flags + " --micro-batch-size 16", "one");
  ASSERT_EQ(one.steps.size(), 2u) << one.output;
  EXPECT_GT(metric(one.steps[0], "actor/grad_norm"), 0);
  struct Layout {
    int ranks;
    const char* flags;
  };
  int n = 0;
  for (const Layout l : {Layout{2, " --micro-batch-size 8"}, Layout{2, " --micro-batch-size 4 --rollout-mode sharded"},
                         Layout{4, " --micro-batch-size 4 --sequence-parallel"}}) {
    const std::string tag = "tp" + std::to_string(n++);
    GrpoRun got = grpo(dir, l.ranks, flags + l.flags + tp, tag);
    ASSERT_EQ(got.steps.size(), 2u) << tag << "\n" << got.output;
    EXPECT_NE(got.output.find(" parallelism: " + std::to_string(l.ranks) + " ranks = data-parallel " +
                              std::to_string(l.ranks / 2) + " x context-parallel 1 x tensor-parallel 2"),
              std::string::npos)
        << got.output;
    for (size_t i = 0; i < 2; ++i) {
      expect_same_step(got.steps[i], one.steps[i], tag + l.flags + ", step " + std::to_string(i + 1), 1e-4);
      EXPECT_LE(metric(got.steps[i], "training/rollout_log_probs_diff_max"), kRolloutLogProbsTol) << tag << ", step " << i + 1;
    }
  }
  // The reference policy (--use-kl-loss) is split like the policy; both read a 1-rank
  // checkpoint into their tensor-parallel slices.
  GrpoRun start = grpo(dir, 1, "--train-iters 1 --make-vocab-size-divisible-by 2 --micro-batch-size 16 --save " +
                                   dir.file("start"), "start");
  ASSERT_EQ(start.steps.size(), 1u) << start.output;
  const std::string kl = " --load " + dir.file("start") + " --finetune --use-kl-loss --kl-loss-coef 0.1 --kl-loss-type k3";
  GrpoRun kl_one = grpo(dir, 1, flags + " --micro-batch-size 16" + kl, "kl_one");
  GrpoRun kl_tp = grpo(dir, 2, flags + " --micro-batch-size 8" + kl + tp, "kl_tp");
  ASSERT_EQ(kl_one.steps.size(), 2u) << kl_one.output;
  ASSERT_EQ(kl_tp.steps.size(), 2u) << kl_tp.output;
  EXPECT_EQ(metric(kl_tp.steps[0], "actor/kl_loss"), 0.0);  // the policy is the reference
  for (size_t i = 0; i < 2; ++i) {
    expect_same_step(kl_tp.steps[i], kl_one.steps[i], "kl_tp, step " + std::to_string(i + 1), 1e-4);
    const double want = metric(kl_one.steps[i], "actor/kl_loss");
    EXPECT_NEAR(metric(kl_tp.steps[i], "actor/kl_loss"), want, 1e-3 * std::abs(want) + 1e-9) << "step " << i + 1;
  }
}

// The fused loss (the default; here chunks of 300 logits elements) steps as the loss from the
// full logits: the log-probs at a sampling temperature, the entropy bonus and the KL to a
// reference, on one rank and tensor-parallel 2.
TEST(Grpo, FusedLossStepsLikeTheFullLogits) {
  TempDir dir("mfsdp-grpo-fused");
  GrpoRun start = grpo(dir, 1, "--train-iters 1 --make-vocab-size-divisible-by 2 --micro-batch-size 16 --save " +
                                   dir.file("start"), "start");
  ASSERT_EQ(start.steps.size(), 1u) << start.output;
  const std::string common = "--train-iters 2 --temperature 0.8 --load " + dir.file("start") +
                             " --finetune --use-kl-loss --kl-loss-coef 0.1 --kl-loss-type k3";
  int n = 0;
  for (const std::string layout : {std::string(" --micro-batch-size 16 --make-vocab-size-divisible-by 2"),
                                   std::string(" --micro-batch-size 8 --tensor-model-parallel-size 2"
                                               " --make-vocab-size-divisible-by 1")}) {
    const int ranks = n == 0 ? 1 : 2;
    const std::string tag = "layout" + std::to_string(n++);
    GrpoRun plain = grpo(dir, ranks, common + layout + " --no-cross-entropy-loss-fusion", tag + "_plain");
    GrpoRun fused = grpo(dir, ranks, common + layout + " --cross-entropy-chunk-elements 300", tag + "_fused");
    EXPECT_NE(fused.output.find(" loss: the output layer fused with it in chunks of 300 logits elements"),
              std::string::npos) << fused.output;
    ASSERT_EQ(plain.steps.size(), 2u) << plain.output;
    ASSERT_EQ(fused.steps.size(), 2u) << fused.output;
    expect_same_steps_with_kl(fused, plain, 2, tag, 1e-3);
  }
}

// Context parallelism: the rollouts from the gathered full copy (whole sequences, the same on a
// replica's CP ranks), the log-probs, entropy, KL and the update on each rank's load-balanced
// chunks, the losses weighted with whole rows' token counts. The same steps as one rank: CP 2
// (token-mean and seq-mean-token-mean) and CP 2 x DP 2, with the reference policy.
TEST(Grpo, ContextParallelStepsLikeOneRank) {
  TempDir dir("mfsdp-grpo-cp");
  GrpoRun start = grpo(dir, 1, "--train-iters 1 --micro-batch-size 16 --save " + dir.file("start"), "start");
  ASSERT_EQ(start.steps.size(), 1u) << start.output;
  const std::string flags = "--train-iters 2 --load " + dir.file("start") +
                            " --finetune --use-kl-loss --kl-loss-coef 0.1 --kl-loss-type k3";
  int n = 0;
  for (const std::string agg : {"token-mean", "seq-mean-token-mean"}) {
    GrpoRun one = grpo(dir, 1, flags + " --micro-batch-size 16 --loss-agg-mode " + agg, "one" + std::to_string(n));
    ASSERT_EQ(one.steps.size(), 2u) << one.output;
    struct Layout {
      int ranks;
      const char* flags;
    };
    for (const Layout l : {Layout{2, " --micro-batch-size 8 --context-parallel-size 2"},
                           Layout{4, " --micro-batch-size 4 --context-parallel-size 2 --cp-comm-type p2p"}}) {
      const std::string tag = "cp" + std::to_string(n++);
      GrpoRun got = grpo(dir, l.ranks, flags + l.flags + " --loss-agg-mode " + agg, tag);
      ASSERT_EQ(got.steps.size(), 2u) << tag << "\n" << got.output;
      EXPECT_NE(got.output.find(" parallelism: " + std::to_string(l.ranks) + " ranks = data-parallel " +
                                std::to_string(l.ranks / 2) + " x context-parallel 2 x tensor-parallel 1"),
                std::string::npos)
          << got.output;
      for (size_t i = 0; i < 2; ++i) {
        const std::string what = tag + l.flags + " " + agg + ", step " + std::to_string(i + 1);
        expect_same_step(got.steps[i], one.steps[i], what, 1e-4);
        const double kl = metric(one.steps[i], "actor/kl_loss");
        EXPECT_NEAR(metric(got.steps[i], "actor/kl_loss"), kl, 1e-3 * std::abs(kl) + 1e-9) << what;
        const double clipfrac = metric(one.steps[i], "actor/pg_clipfrac");
        EXPECT_NEAR(metric(got.steps[i], "actor/pg_clipfrac"), clipfrac, 1e-6) << what;
        EXPECT_LE(metric(got.steps[i], "training/rollout_log_probs_diff_max"), kRolloutLogProbsTol) << what;
      }
    }
  }
}

// Pipeline stages: rollouts from the whole policy gathered over the stages, the old and the
// reference log-probs through the forward pipeline, the update by 1F1B; rows of each micro-batch's
// own length cross the stages with their shapes. PP 2, PP 2 x DP 2, PP 2 x TP 2 with sequence
// parallelism, PP 2 x CP 2 and interleaved PP 2 x V 2 (4 layers) take the same 3 steps as one
// rank, with a learning rate large enough that the KL to the reference grows from 0 to ~1e-2.
TEST(Grpo, PipelineStagesStepLikeOneRank) {
  TempDir dir("mfsdp-grpo-pp");
  const std::string vocab = " --make-vocab-size-divisible-by 2";  // 258 rows, as TP 2's 1 x 2
  for (const int layers : {2, 4}) {
    const std::string model = vocab + " --num-layers " + std::to_string(layers);
    const std::string start = dir.file("start" + std::to_string(layers));
    GrpoRun made = grpo(dir, 1, "--train-iters 1 --micro-batch-size 16 --save " + start + model, "start");
    ASSERT_EQ(made.steps.size(), 1u) << made.output;
    const std::string flags = "--train-iters 3 --load " + start + " --finetune --use-kl-loss --kl-loss-coef 0.1"
                              " --kl-loss-type k3 --lr 300 --micro-batch-size 4 --num-layers " + std::to_string(layers);
    GrpoRun one = grpo(dir, 1, flags + vocab, "one" + std::to_string(layers));
    ASSERT_EQ(one.steps.size(), 3u) << one.output;
    EXPECT_GT(metric(one.steps[2], "actor/kl_loss"), 1e-3);  // not vacuous
    const std::string pp = " --pipeline-model-parallel-size 2";
    std::vector<std::pair<int, std::string>> layouts;
    if (layers == 2) {
      layouts = {{2, pp + vocab},
                 {4, pp + vocab},
                 {4, pp + " --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 1"},
                 {4, pp + " --context-parallel-size 2" + vocab}};
    } else {
      layouts = {{2, pp + " --num-virtual-stages-per-pipeline-rank 2" + vocab}};
    }
    int n = 0;
    for (const auto& [ranks, layout] : layouts) {
      const std::string tag = "pp" + std::to_string(layers) + "_" + std::to_string(n++);
      GrpoRun got = grpo(dir, ranks, flags + layout, tag);
      ASSERT_EQ(got.steps.size(), 3u) << tag << "\n" << got.output;
      EXPECT_NE(got.output.find("pipeline-parallel 2"), std::string::npos) << got.output;
      expect_same_steps_with_kl(got, one, 3, tag + layout, 1e-4);
    }
  }
}

// An MoE policy and its reference (--use-kl-loss, both from a 1-rank checkpoint) under TP 2 x EP 2
// with the experts whole (each TP rank routes its sequence slice) and CP 2 x EP 2: the rollouts
// from the gathered copy, the log-probs, KL and the update on the split model; the same steps as
// one rank.
TEST(Grpo, MoeStepsLikeOneRankUnderTensorExpertAndContextParallelism) {
  TempDir dir("mfsdp-grpo-moe");
  const std::string moe = " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-aux-loss-coeff 1e-2"
                          " --moe-z-loss-coeff 1e-3 --make-vocab-size-divisible-by 2";
  GrpoRun start = grpo(dir, 1, "--train-iters 1 --micro-batch-size 16 --save " + dir.file("start") + moe, "start");
  ASSERT_EQ(start.steps.size(), 1u) << start.output;
  const std::string flags = "--train-iters 2 --load " + dir.file("start") +
                            " --finetune --use-kl-loss --kl-loss-coef 0.1 --kl-loss-type k3" + moe;
  // The balancing losses are over each micro-batch's rows: every run groups the rows in fours.
  GrpoRun one = grpo(dir, 1, flags + " --micro-batch-size 4", "one");
  ASSERT_EQ(one.steps.size(), 2u) << one.output;
  int n = 0;
  for (const std::string layout : {std::string(" --micro-batch-size 4 --tensor-model-parallel-size 2 --sequence-parallel"
                                               " --expert-model-parallel-size 2 --expert-tensor-parallel-size 1"
                                               " --make-vocab-size-divisible-by 1"),
                                   std::string(" --micro-batch-size 4 --context-parallel-size 2"
                                               " --expert-model-parallel-size 2")}) {
    const std::string tag = "moe" + std::to_string(n++);
    GrpoRun got = grpo(dir, 4, flags + layout, tag);
    ASSERT_EQ(got.steps.size(), 2u) << tag << "\n" << got.output;
    expect_same_steps_with_kl(got, one, 2, tag + layout, 1e-3);
  }
}

TEST(Grpo, ResumeIsBitExact) {
  TempDir dir("mfsdp-grpo-resume");
  const std::string flags = "--micro-batch-size 4 --train-iters 4 --optimizer adam --lr 1e-3";
  GrpoRun straight = grpo(dir, 2, flags + " --save " + dir.file("straight"), "straight");
  GrpoRun first = grpo(dir, 2, flags + " --save " + dir.file("ckpt") + " --exit-interval 2", "first");
  GrpoRun second = grpo(dir, 2, flags + " --load " + dir.file("ckpt") + " --save " + dir.file("resumed"), "second");
  ASSERT_EQ(straight.steps.size(), 4u) << straight.output;
  ASSERT_EQ(first.steps.size(), 2u) << first.output;
  ASSERT_EQ(second.steps.size(), 2u) << second.output;
  for (size_t i = 0; i < 2; ++i)
    for (const char* key : {"critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"})
      EXPECT_EQ(metric(second.steps[i], key), metric(straight.steps[i + 2], key)) << key << " step " << i + 3;
  auto a = weights(dir.file("straight")), b = weights(dir.file("resumed"));
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
}

TEST(Grpo, KlToAShardedReferenceStartsAtZero) {
  TempDir dir("mfsdp-grpo-kl");
  GrpoRun start = grpo(dir, 2, "--micro-batch-size 4 --train-iters 1 --save " + dir.file("start"), "start");
  GrpoRun kl = grpo(dir, 2,
                "--micro-batch-size 4 --train-iters 3 --lr 0.5 --load " + dir.file("start") +
                    " --finetune --use-kl-loss --kl-loss-coef 0.1 --kl-loss-type k3",
                "kl");
  ASSERT_EQ(kl.steps.size(), 3u) << kl.output;
  EXPECT_EQ(metric(kl.steps[0], "actor/kl_loss"), 0.0);  // the policy is the reference
  EXPECT_GT(metric(kl.steps[2], "actor/kl_loss"), 0.0);
  EXPECT_NE(kl.output.find("reference policy per rank"), std::string::npos) << kl.output;
}

TEST(Grpo, BadFlagsAreNamed) {
  auto expect_error = [](const std::string& flags, const std::string& needle) {
    auto r = run_command(kGrpo + kFlags + " " + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << flags << "\n" << r.output;
  };
  expect_error("--train-iters 1 --train-batch-size 4 --ppo-mini-batch-size 3", "--ppo-mini-batch-size");
  expect_error("--train-iters 1 --train-files x.jsonl", "--train-files: conflicts with --gen-task");
  expect_error("--train-iters 1 --use-kl-loss", "--use-kl-loss: needs the reference policy");
  expect_error("--train-iters 1 --kl-loss-type k9", "--kl-loss-type");
  expect_error("--train-iters 1 --global-batch-size 8",
               "--global-batch-size: mfsdp-grpo does not take it: a step trains on --train-batch-size prompts");
  expect_error("--train-iters 1 --top-p 0", "--top-p");
  expect_error("--train-iters 1 --save-final-model x", "--save-final-model: was removed");
  // Sizes that used to run on for hours or end in an allocator error.
  expect_error("--train-iters 1 --rollout-n 4294967296", "--rollout-n: must be at most 1048576, got 4294967296");
  expect_error("--train-iters 1 --train-batch-size 1024 --rollout-n 2048",
               "--rollout-n: --train-batch-size 1024 x 2048 responses per step is more than 1048576");
  expect_error("--train-iters 1 --max-response-length 4294967296", "--max-response-length: must be at most 4194304");
  expect_error("--train-iters 1 --gen-train-size 4294967296", "--gen-train-size: must be at most 4194304");
  // Tensor, context and pipeline parallelism with what is not built for them.
  expect_error("--train-iters 1 --context-parallel-size 2 --rollout-mode sharded",
               "--rollout-mode: sharded with --context-parallel-size 2: decoding with a KV cache");
  expect_error("--train-iters 1 --tensor-model-parallel-size 2 --sequence-parallel --rollout-mode sharded",
               "--rollout-mode: sharded with --sequence-parallel");
  expect_error("--train-iters 1 --pipeline-model-parallel-size 2 --rollout-mode sharded",
               "--rollout-mode: sharded with --pipeline-model-parallel-size 2");
}
