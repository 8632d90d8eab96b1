// mfsdp-pretrain end to end, through mfsdp-run: the same 20 iterations with 1, 2 and 4 ranks
// (same global batch) give the same losses under ZeRO-3 and no_shard; recompute and deferred
// init do not change them; bad flags stop before any work, naming the flag.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/run_command.h"

namespace {

using Outcome = mfsdp::testing::CommandOutcome;
using mfsdp::testing::run_command;
Outcome run(const std::string& command) { return run_command(command); }

// Paths of the built tools: the environment overrides the ones CMake compiled in.
std::string bin(const char* var) {
  if (const char* v = std::getenv(var)) return v;
  if (std::string(var) == "MFSDP_RUN_BIN") return MFSDP_RUN_BIN_PATH;
  return MFSDP_PRETRAIN_BIN_PATH;
}

const std::string kModel =
    " --device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu"
    " --ffn-hidden-size 48 --seq-length 16 --micro-batch-size 2 --global-batch-size 8"
    " --train-iters 20 --lr 3e-3 --lr-warmup-iters 2 --lr-decay-style cosine --min-lr 3e-4"
    " --clip-grad 1.0 --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 7";

std::vector<double> train_losses(int ranks, const std::string& extra) {
  namespace fs = std::filesystem;
  fs::path metrics = fs::temp_directory_path() /
                     ("mfsdp_pretrain_" + std::to_string(ranks) + "_" +
                      std::to_string(std::hash<std::string>{}(extra)) + ".jsonl");
  Outcome r = run(bin("MFSDP_RUN_BIN") + " --nproc-per-node " + std::to_string(ranks) + " " +
              bin("MFSDP_PRETRAIN_BIN") + kModel + " --metrics-file " + metrics.string() + extra);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<double> losses;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("eval")) continue;
    for (const char* key : {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm",
                            "iter_time_s", "tokens_per_sec", "tflops_per_rank", "mem_bytes"})
      EXPECT_TRUE(j.contains(key)) << "metrics record without " << key << ": " << line;
    losses.push_back(j["lm_loss"].get<double>());
  }
  EXPECT_EQ(losses.size(), 20u) << r.output;
  fs::path svg = metrics;
  svg.replace_extension(".svg");
  EXPECT_TRUE(fs::exists(svg)) << "no loss curve at " << svg;
  return losses;
}

void expect_same(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], 1e-5 * std::abs(b[i])) << what << " iteration " << i + 1;
}

}  // namespace

TEST(Pretrain, SameLossesWithOneTwoAndFourRanks) {
  for (const char* strategy : {"optim_grads_params", "no_shard"}) {
    std::string flags = std::string(" --data-parallel-sharding-strategy ") + strategy;
    auto one = train_losses(1, flags);
    ASSERT_FALSE(one.empty());
    EXPECT_LT(one.back(), one.front()) << "loss did not fall";
    expect_same(train_losses(2, flags), one, std::string(strategy) + " 2 ranks vs 1");
    expect_same(train_losses(4, flags), one, std::string(strategy) + " 4 ranks vs 1");
  }
}

TEST(Pretrain, RecomputeAndDeferredInitKeepTheLosses) {
  auto base = train_losses(2, "");
  expect_same(train_losses(2, " --recompute-activations --recompute-granularity full"), base,
              "recompute");
  expect_same(train_losses(2, " --init-model-with-meta-device"), base, "deferred init");
  // SDPA (the default) against the explicit math path.
  expect_same(train_losses(2, " --attention-backend unfused"), base, "unfused attention");
}

// The per-rank bytes of "memory per rank (MiB): model weights ..., transient peak ..." (without
// the process RSS, which differs between processes).
std::string buffer_bytes_line(const std::string& output) {
  const auto begin = output.find("memory per rank (MiB):");
  const auto end = output.find(", process peak RSS", begin);
  return begin == std::string::npos || end == std::string::npos ? "" : output.substr(begin, end - begin);
}

TEST(Pretrain, SimulatedRankHoldsTheBytesOfTheRealRank) {
  const std::string flags = kModel + " --train-iters 3";
  for (const char* strategy : {"optim_grads_params", "optim"}) {
    const std::string s = std::string(" --data-parallel-sharding-strategy ") + strategy;
    Outcome real = run(bin("MFSDP_RUN_BIN") + " --nproc-per-node 4 " + bin("MFSDP_PRETRAIN_BIN") + flags + s);
    ASSERT_EQ(real.exit_code, 0) << real.output;
    Outcome simulated = run(bin("MFSDP_PRETRAIN_BIN") + flags + s + " --simulate-world-size 4 --simulate-rank 0");
    ASSERT_EQ(simulated.exit_code, 0) << simulated.output;
    EXPECT_NE(simulated.output.find("SIMULATED: this process plays rank 0 of 4"), std::string::npos)
        << simulated.output;
    EXPECT_FALSE(buffer_bytes_line(real.output).empty()) << real.output;
    EXPECT_EQ(buffer_bytes_line(simulated.output), buffer_bytes_line(real.output)) << strategy;
  }
  Outcome bad = run(bin("MFSDP_PRETRAIN_BIN") + flags + " --simulate-world-size 4 --simulate-rank 4");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--simulate-rank: 4 is not a rank of --simulate-world-size 4"), std::string::npos)
      << bad.output;
}

// The planned "memory per rank (MiB): ..." line of --memory-plan, in the end-of-run format.
std::string planned_bytes_line(const std::string& output) {
  const std::string key = "planned memory per rank (MiB):";
  const auto begin = output.find(key);
  const auto end = output.find('\n', begin);
  return begin == std::string::npos ? "" : output.substr(begin + 8, end - begin - 8);
}

// --memory-plan prints, before allocating anything, the bytes the end of a real run reports
// (model weights, main weights, main grads, optimizer state, transient peak), planned for a
// simulated and for a launched 2-rank job (2 micro-batches per step), ZeRO-3 fp32 and ZeRO-1 bf16.
TEST(Pretrain, MemoryPlanPrintsWhatTheRunHolds) {
  const std::string flags = kModel + " --train-iters 3";
  const std::string launch = bin("MFSDP_RUN_BIN") + " --nproc-per-node 2 " + bin("MFSDP_PRETRAIN_BIN");
  for (const char* extra : {" --data-parallel-sharding-strategy optim_grads_params",
                            " --data-parallel-sharding-strategy optim --bf16"}) {
    Outcome real = run(launch + flags + extra);
    ASSERT_EQ(real.exit_code, 0) << real.output;
    std::string measured = buffer_bytes_line(real.output);
    ASSERT_FALSE(measured.empty()) << real.output;
    measured = measured.substr(0, measured.find(", buffer pool"));
    for (const std::string& plan_command :
         {bin("MFSDP_PRETRAIN_BIN") + flags + extra + " --memory-plan --simulate-world-size 2", launch + flags + extra + " --memory-plan"}) {
      Outcome plan = run(plan_command);
      ASSERT_EQ(plan.exit_code, 0) << plan_command << "\n" << plan.output;
      EXPECT_EQ(plan.output.find("iteration"), std::string::npos) << "training started: " << plan.output;
      EXPECT_NE(plan.output.find(" model.layers.1 "), std::string::npos) << plan.output;
      EXPECT_EQ(planned_bytes_line(plan.output), measured) << plan_command << "\n" << plan.output;
    }
  }
  // No data and no --train-iters needed for a plan.
  Outcome bare = run(bin("MFSDP_PRETRAIN_BIN") + " --vocab-size 64 --memory-plan --simulate-world-size 512");
  EXPECT_EQ(bare.exit_code, 0) << bare.output;
  EXPECT_FALSE(planned_bytes_line(bare.output).empty()) << bare.output;
}

TEST(Pretrain, BadFlagsStopBeforeAnyWorkNamingTheFlag) {
  const std::string pretrain = bin("MFSDP_PRETRAIN_BIN");
  struct Case {
    std::string flags, expected;
  } cases[] = {
      {kModel + " --no-such-flag", "--no-such-flag"},
      {kModel + " --global-batch-size 7", "--global-batch-size"},
      {kModel + " --data-parallel-sharding-strategy zero9", "--data-parallel-sharding-strategy"},
      {" --vocab-size 64 --train-iters 5", "--data-path"},
      {kModel + " --num-attention-heads 5", "--hidden-size"},
      {kModel + " --device tpu", "--device"},
      {kModel + " --attention-backend flash", "--attention-backend"},
  };
  for (const auto& c : cases) {
    Outcome r = run("env RANK=0 WORLD_SIZE=1 " + pretrain + c.flags);
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.flags << "\n" << r.output;
    EXPECT_EQ(r.output.find("iteration"), std::string::npos) << "training started: " << r.output;
  }
}
