// mfsdp-pretrain end to end, through mfsdp-run: the same 20 iterations with 1, 2 and 4 ranks
// (same global batch) give the same losses under ZeRO-3 and no_shard; recompute and deferred
// init do not change them; bad flags and values stop before any work, naming the flag; NaN
// losses and gradients stop every rank naming the iteration and the parameters, and no
// checkpoint of NaN weights is written; --distributed-timeout-minutes bounds how long a stopped
// rank keeps the others waiting; --log-params-norm and --log-num-zeros-in-grad agree across
// rank counts and with the exported weights.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness/metrics_file.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/data/indexed_dataset.h"

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
  // A folder of its own: tests running side by side (ctest -j) train the same flags too.
  mfsdp::testing::TempDir dir("mfsdp-pretrain");
  fs::path metrics = dir.path() / "metrics.jsonl";
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
  expect_same(train_losses(2, " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
              base, "full recompute");
  expect_same(train_losses(2, " --recompute-activations"), base, "selective recompute (core_attn)");
  // Deferred init is the default; eager init gives the same values.
  expect_same(train_losses(2, " --no-init-model-with-meta-device"), base, "eager init");
  // SDPA (the default) against the explicit math path.
  expect_same(train_losses(2, " --attention-backend unfused"), base, "unfused attention");
  // The environment's options as flags: collectives over TCP on the loopback interface, glibc's
  // malloc defaults.
  expect_same(train_losses(2, " --cpu-comm-shared-memory off --socket-ifname lo --keep-freed-cpu-memory off"), base,
              "TCP on lo");
}

// --optimizer-implementation fused (at::_fused_adamw_) trains the same model as the default
// separate ops, on one rank and on two (its own kernel is checked in tests/unit/optim_test.cpp).
TEST(Pretrain, FusedAdamWKeepsTheLosses) {
  auto base = train_losses(2, "");
  ASSERT_FALSE(base.empty());
  // The default, auto, is the unfused path on the CPU, bit for bit.
  EXPECT_EQ(train_losses(2, " --optimizer-implementation unfused"), base);
  const auto fused = train_losses(2, " --optimizer-implementation fused");
  expect_same(fused, base, "fused AdamW, 2 ranks");
  // Rounding apart, the same numbers: were they equal to the last bit, the flag did not reach
  // the optimizer (both runs are deterministic, so this cannot flake).
  EXPECT_NE(fused, base) << "--optimizer-implementation fused gave the unfused run's losses bit for bit";
  expect_same(train_losses(1, " --optimizer-implementation fused --weight-decay 0.1"),
              train_losses(1, " --weight-decay 0.1"), "fused AdamW with weight decay, 1 rank");
}

// --cross-entropy-loss-fusion (the default): the output layer and the loss in chunks of the
// vocabulary give the losses of the full logits (--no-cross-entropy-loss-fusion). 100-element
// chunks: 3 of the 64 vocabulary rows a chunk for 32 tokens, 1 a chunk under tensor parallelism
// for the 64 tokens of the whole sequence; under ZeRO-3, tensor-parallel 2 with sequence
// parallelism and the per-token loss, and pipeline-parallel 2 with an untied output layer.
TEST(Pretrain, FusedLossKeepsTheLosses) {
  for (const std::string layout : {"", " --tensor-model-parallel-size 2 --sequence-parallel --calculate-per-token-loss",
                                   " --pipeline-model-parallel-size 2 --untie-embeddings-and-output-weights"}) {
    const auto plain = train_losses(2, layout + " --no-cross-entropy-loss-fusion");
    ASSERT_FALSE(plain.empty()) << layout;
    expect_same(train_losses(2, layout + " --cross-entropy-chunk-elements 100"), plain, "fused loss" + layout);
  }
}

// --optimizer muon (its update is checked against torch.optim.Muon in tests/reference/): the
// loss falls, and ZeRO-3 over 2 ranks (each matrix put together on its owner) and
// tensor-parallel 2 (the row- and column-parallel slices put together whole, --muon-tp-mode
// duplicated) train as one rank; blockwise orthogonalises the slices and trains differently.
// The layouts are compared with the Newton-Schulz iteration in fp32 (--muon-fp32-matmul-prec
// high): in bf16 (the default) a gradient summed in another order rounds differently there.
// Megatron's --muon-* flags this build cannot honour are refused, naming the flag.
TEST(Pretrain, MuonTrainsAlikeOnEveryLayout) {
  const std::string muon = " --optimizer muon --lr 2e-2 --min-lr 2e-3 --muon-momentum 0.9 --muon-nesterov";
  const auto bf16 = train_losses(1, muon);
  ASSERT_FALSE(bf16.empty());
  EXPECT_LT(bf16.back(), bf16.front() - 0.5) << "loss did not fall";
  const std::string fp32 = muon + " --muon-fp32-matmul-prec high";
  const auto one = train_losses(1, fp32);
  expect_same(train_losses(2, fp32), one, "muon, ZeRO-3 over 2 ranks");
  // 32 x TP 2: the 64 rows of one rank (Megatron pads to a multiple of the divisor x TP).
  const std::string tp = " --tensor-model-parallel-size 2 --make-vocab-size-divisible-by 32";
  expect_same(train_losses(2, fp32 + tp), one, "muon, tensor-parallel 2");
  const auto blockwise = train_losses(2, fp32 + tp + " --muon-tp-mode blockwise");
  ASSERT_EQ(blockwise.size(), one.size());
  EXPECT_GT(std::abs(blockwise.back() - one.back()), 1e-4) << "blockwise gave the whole-matrix update";
  // Experts: each expert's matrices by themselves, over expert parallelism and, under TP 2
  // (expert-TP 2, Megatron's default), put together whole from their slices by an owner that
  // may hold none of them (an expert of the other expert-parallel rank).
  const std::string moe = " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-grouped-gemm";
  const auto moe_one = train_losses(1, fp32 + moe);
  expect_same(train_losses(2, fp32 + moe + " --expert-model-parallel-size 2"), moe_one, "muon, expert-parallel 2");
  expect_same(train_losses(4, fp32 + moe + tp + " --sequence-parallel --expert-model-parallel-size 2"), moe_one,
              "muon, TP 2 x EP 2 (expert-TP 2)");
  EXPECT_NE(train_losses(1, " --optimizer adam --lr 2e-2 --min-lr 2e-3"), bf16) << "--optimizer muon did not reach the run";
  for (const auto& [flags, expected] : std::vector<std::pair<std::string, std::string>>{
           {muon + " --muon-no-split-qkv", "--muon-no-split-qkv: is not supported"},
           {muon + " --muon-scalar-optimizer lion", "--muon-scalar-optimizer: lion is not supported"},
           {muon + " --muon-fp32-matmul-prec low", "--muon-fp32-matmul-prec: low is not supported"}}) {
    Outcome r = run("env RANK=0 WORLD_SIZE=1 " + bin("MFSDP_PRETRAIN_BIN") + kModel + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << flags << "\n" << r.output;
  }
}

// --socket-ifname reaches the communicator: an interface this host lacks is named.
TEST(Pretrain, SocketInterfaceFlagNamesAMissingInterface) {
  Outcome r = run(bin("MFSDP_RUN_BIN") + " --nproc-per-node 2 " + bin("MFSDP_PRETRAIN_BIN") + kModel +
                  " --train-iters 2 --socket-ifname nosuch0");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("socket_ifname=nosuch0: no network interface of that name"), std::string::npos) << r.output;
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
    // The run prints every unit's buffers at start-up, before its first iteration.
    const size_t table = real.output.find("bytes per rank of each parameter group");
    const size_t row = real.output.find(" model.layers.1 ");
    EXPECT_TRUE(table != std::string::npos && row != std::string::npos && row < real.output.find(" iteration "))
        << real.output;
    measured = measured.substr(0, measured.find(", buffer pool"));
    for (const std::string& plan_command :
         {bin("MFSDP_PRETRAIN_BIN") + flags + extra + " --memory-plan --simulate-world-size 2", launch + flags + extra + " --memory-plan"}) {
      Outcome plan = run(plan_command);
      ASSERT_EQ(plan.exit_code, 0) << plan_command << "\n" << plan.output;
      EXPECT_EQ(plan.output.find("iteration"), std::string::npos) << "training started: " << plan.output;
      EXPECT_NE(plan.output.find(" model.layers.1 "), std::string::npos) << plan.output;
      EXPECT_EQ(planned_bytes_line(plan.output), measured) << plan_command << "\n" << plan.output;
      // The activations beside the buffers (their formula is tests/dist/activation_plan_test.cpp's).
      EXPECT_NE(plan.output.find(" activations of one micro-batch (32 tokens on this rank"), std::string::npos)
          << plan.output;
    }
  }
  // No data and no --train-iters needed for a plan.
  Outcome bare = run(bin("MFSDP_PRETRAIN_BIN") + " --vocab-size 64 --memory-plan --simulate-world-size 512");
  EXPECT_EQ(bare.exit_code, 0) << bare.output;
  EXPECT_FALSE(planned_bytes_line(bare.output).empty()) << bare.output;
}

// Megatron's precision-aware optimizer with bf16 moments (their update is checked against plain
// tensor ops in tests/unit/optim_test.cpp): the run reports its optimizer state at half the fp32
// moments' bytes (two bf16 moments = one fp32 main-gradient buffer) and --memory-plan plans the
// same bytes; it trains close to, not equal to, fp32 moments; a job stopped after iteration 3
// resumes bit-exactly from its checkpoint (the bf16 moments saved upcast to fp32, as Megatron saves
// them, and rounded back on loading); the
// dtypes this build cannot store, and the flags without --use-precision-aware-optimizer, are
// refused as Megatron refuses them.
TEST(Pretrain, PrecisionAwareOptimizerKeepsBf16Moments) {
  mfsdp::testing::TempDir dir("mfsdp-precision-aware");
  const std::string pa = " --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16";
  const std::string launch = bin("MFSDP_RUN_BIN") + " --nproc-per-node 2 " + bin("MFSDP_PRETRAIN_BIN") + kModel + pa;
  Outcome whole = run(launch + " --metrics-file " + dir.file("whole.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::string measured = buffer_bytes_line(whole.output);
  const auto field = [](const std::string& line, const std::string& name) {
    const auto at = line.find(name + " ");
    return at == std::string::npos ? -1.0 : std::stod(line.substr(at + name.size() + 1));
  };
  EXPECT_GT(field(measured, "optimizer state"), 0) << measured;
  EXPECT_DOUBLE_EQ(field(measured, "optimizer state"), field(measured, "main grads")) << measured;
  Outcome plan = run(launch + " --memory-plan");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_EQ(planned_bytes_line(plan.output), measured.substr(0, measured.find(", buffer pool"))) << plan.output;
  const auto bf16 = mfsdp::testing::losses_by_iteration(dir.file("whole.jsonl"));
  const auto fp32 = train_losses(2, "");
  ASSERT_EQ(bf16.size(), 20u);
  for (int64_t i = 1; i <= 20; ++i) EXPECT_NEAR(bf16.at(i), fp32[i - 1], 1e-2 * fp32[i - 1]) << "iteration " << i;
  EXPECT_NE(bf16.at(20), fp32[19]) << "bf16 moments gave fp32 moments' loss bit for bit";
  Outcome first = run(launch + " --exit-interval 10 --save " + dir.file("ckpt") + " --save-interval 10");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // Written upcast to fp32 as Megatron writes them, each value one a bf16 can hold.
  const mfsdp::CheckpointReader reader(dir.file("ckpt"));
  int moments = 0;
  for (const std::string& name : reader.tensor_names()) {
    if (name.find(".exp_avg") == std::string::npos) continue;
    ++moments;
    const at::Tensor t = reader.read(name);
    EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(at::equal(t, t.to(at::kBFloat16).to(at::kFloat))) << name;
  }
  EXPECT_GT(moments, 0);
  Outcome resumed = run(launch + " --load " + dir.file("ckpt") + " --metrics-file " + dir.file("resumed.jsonl"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto again = mfsdp::testing::losses_by_iteration(dir.file("resumed.jsonl"));
  ASSERT_EQ(again.size(), 10u) << resumed.output;
  for (const auto& [iteration, loss] : again) EXPECT_EQ(loss, bf16.at(iteration)) << "iteration " << iteration;
  for (const auto& [flags, expected] : std::vector<std::pair<std::string, std::string>>{
           {" --exp-avg-dtype bf16", "--exp-avg-dtype: can only be fp32 without --use-precision-aware-optimizer"},
           {" --use-precision-aware-optimizer --exp-avg-sq-dtype fp16", "--exp-avg-sq-dtype: fp16 is not supported"},
           {" --use-precision-aware-optimizer --main-grads-dtype bf16", "--main-grads-dtype: bf16 is not supported"},
           {" --use-precision-aware-optimizer --optimizer sgd",
            "--use-precision-aware-optimizer: is only supported with --optimizer adam"}}) {
    Outcome r = run("env RANK=0 WORLD_SIZE=1 " + bin("MFSDP_PRETRAIN_BIN") + kModel + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << flags << "\n" << r.output;
  }
}

// Every bad value exits 2 before the communicator, model or data exist (the " device:" line is
// printed once the communicator is up), naming the flag and the value, never an internal field
// of the model, optimizer or schedule.
// Files of a tokenizer the run does not use are accepted, as Megatron does, and said to do nothing.
TEST(Pretrain, FilesOfAnotherTokenizerAreNotedAsIgnored) {
  Outcome r = run(bin("MFSDP_RUN_BIN") + " --nproc-per-node 1 " + bin("MFSDP_PRETRAIN_BIN") + kModel +
                  " --train-iters 2 --vocab-file /nonexistent/vocab.json --merge-file /nonexistent/merges.txt"
                  " --tokenizer-model /nonexistent/tokenizer.model");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* note : {"note: --vocab-file has no effect: only GPT2BPETokenizer reads it (--tokenizer-type is none",
                           "note: --merge-file has no effect", "note: --tokenizer-model has no effect"})
    EXPECT_NE(r.output.find(note), std::string::npos) << note << "\n" << r.output;
}

TEST(Pretrain, BadFlagsStopBeforeAnyWorkNamingTheFlag) {
  const std::string pretrain = bin("MFSDP_PRETRAIN_BIN");
  std::string on_data = kModel;
  on_data.replace(on_data.find(" --mock-data"), 12, " --data-path /nonexistent/mfsdp_corpus_text_document");
  std::string no_swiglu = kModel;
  no_swiglu.replace(no_swiglu.find(" --swiglu"), 9, "");
  const std::string moe = kModel + " --num-experts 4 --moe-router-topk 2";
  struct Case {
    std::string flags, expected;
  } cases[] = {
      {kModel + " --no-such-flag", "--no-such-flag"},
      {kModel + " --global-batch-size 7", "--global-batch-size"},
      {kModel + " --data-parallel-sharding-strategy zero9", "--data-parallel-sharding-strategy"},
      {" --vocab-size 64 --train-iters 5", "--data-path"},
      {kModel + " --num-attention-heads 5", "--hidden-size"},
      {kModel + " --device tpu", "--device"},
      {kModel + " --optimizer sgd --optimizer-implementation fused", "--optimizer-implementation"},
      {kModel + " --optimizer-implementation foreach", "--optimizer-implementation"},
      {kModel + " --attention-backend flash", "--attention-backend"},
      {kModel + " --use-pytorch-profiler", "--use-pytorch-profiler: needs --profile"},
      {kModel + " --profile --use-pytorch-profiler", "--use-pytorch-profiler: needs --tensorboard-dir"},
      {kModel + " --profile", "--profile: without --use-pytorch-profiler is nsys's CUDA capture range"},
      {kModel + " --profile --use-pytorch-profiler --tensorboard-dir /tmp --profile-step-start 3 --profile-step-end 3",
       "--profile-step-end: must be greater than --profile-step-start (3), got 3"},
      {kModel + " --profile --use-pytorch-profiler --tensorboard-dir /tmp --profile-step-start -1",
       "--profile-step-start: must be >= 0"},
      {kModel + " --profile --use-pytorch-profiler --tensorboard-dir /tmp --profile-ranks 0 2",
       "--profile-ranks: rank 2 is not in this job of 1 ranks"},
      {kModel + " --profile --use-pytorch-profiler --tensorboard-dir /tmp --profile-ranks", "--profile-ranks: needs a value"},
      {kModel + " --profile --use-pytorch-profiler --tensorboard-dir /tmp --profile-ranks 0 x",
       "--profile-ranks: expected an integer, got 'x'"},
      {kModel + " --cpu-comm-shared-memory maybe", "--cpu-comm-shared-memory: 'maybe' is not one of: on, off"},
      {kModel + " --keep-freed-cpu-memory 0", "--keep-freed-cpu-memory"},
      // Values that used to pass parsing and fail (or do nothing) later.
      {kModel + " --clip-grad -1", "--clip-grad: must be >= 0, got -1"},
      {kModel + " --seed -1", "--seed: must be in [0, 4294967295], got -1"},
      {kModel + " --seed 4294967296", "--seed"},
      {kModel + " --adam-beta1 1.5", "--adam-beta1: must be in [0, 1), got 1.5"},
      {kModel + " --adam-beta2 -0.1", "--adam-beta2"},
      {kModel + " --adam-eps -1e-8", "--adam-eps"},
      {kModel + " --weight-decay -0.1", "--weight-decay"},
      {kModel + " --optimizer sgd --sgd-momentum -0.5", "--sgd-momentum"},
      {kModel + " --lr -0.001", "--lr: must be >= 0"},
      {kModel + " --lr nan", "--lr: expected a finite number, got 'nan'"},
      {kModel + " --lr inf", "--lr"},
      {kModel + " --lr 1e39", "--lr: 1e+39 is beyond fp32's range"},
      {kModel + " --min-lr -1", "--min-lr"},
      {kModel + " --lr-decay-iters -5", "--lr-decay-iters"},
      {kModel + " --ffn-hidden-size -1", "--ffn-hidden-size: must be >= 0, got -1"},
      {kModel + " --rotary-base 0", "--rotary-base"},
      {kModel + " --init-method-std -0.02", "--init-method-std"},
      {kModel + " --norm-epsilon -1", "--norm-epsilon"},
      {kModel + " --global-batch-size -8", "--global-batch-size"},
      {kModel + " --vocab-size -5", "--vocab-size"},
      {kModel + " --vocab-size 1", "--vocab-size: must be >= 2, got 1"},
      {kModel + " --vocab-size 2147483648", "--vocab-size: must be at most 16777216"},
      // Sizes that used to end in an allocator error, the OOM killer or an endless index build.
      {kModel + " --num-layers 100000000", "--num-layers: must be at most 1024"},
      {kModel + " --hidden-size 1000000000", "--hidden-size: must be at most 131072"},
      {kModel + " --ffn-hidden-size 10000000000", "--ffn-hidden-size: must be at most 1048576"},
      {kModel + " --seq-length 2147483648", "--seq-length: must be at most 4194304"},
      {kModel + " --micro-batch-size 1000000000 --global-batch-size 1000000000",
       "--micro-batch-size: 1000000000 x --seq-length 16 tokens per micro-batch"},
      {kModel + " --make-vocab-size-divisible-by 1099511627776", "--make-vocab-size-divisible-by: must be at most"},
      {kModel + " --vocab-size 16777215 --make-vocab-size-divisible-by 16777",
       "--make-vocab-size-divisible-by: pads the vocabulary of 16777215 to 16793777"},
      {kModel + " --eval-iters 2147483648", "--eval-iters: "},
      {kModel + " --train-iters 4294967296", "--train-iters: "},
      {kModel + " --simulate-world-size 2147483648", "--simulate-world-size: must be at most 1048576"},
      {kModel + " --load /etc/passwd", "--load: checkpoint '/etc/passwd' is a file, not a folder"},
      {kModel + " --max-position-embeddings -1", "--max-position-embeddings"},
      {kModel + " --hidden-size 36", "--num-attention-heads: gives an odd head size 9"},
      {kModel + " --sample-prompt hi --sample-tokens -1", "--sample-tokens"},
      // Mock data with no tokenizer: the sample would have been skipped after the whole run.
      {kModel + " --sample-prompt hi", "--sample-prompt: needs a tokenizer that encodes text"},
      {kModel + " --sample-prompt hi --sample-tokens 1000000000", "--sample-tokens: must be at most 4194304"},
      {kModel + " --swiglu --ffn-hidden-size 0 --hidden-size 16 --num-attention-heads 2",
       "--ffn-hidden-size: is needed: Megatron's default with --swiglu"},
      {kModel + " --split abc", "--split"},
      {on_data, "--data-path"},
      {kModel + " --distributed-timeout-minutes 0", "--distributed-timeout-minutes"},
      {kModel + " --distributed-timeout-minutes -1", "--distributed-timeout-minutes"},
      {kModel + " --save /etc/passwd/ckpt", "--save"},
      {kModel + " --export-hf /etc/passwd/hf", "--export-hf"},
      {kModel + " --metrics-file /etc/passwd/metrics.jsonl", "--metrics-file"},
      {kModel + " --check-for-nan-in-loss-and-grad=1", "--check-for-nan-in-loss-and-grad: takes no value"},
      {kModel + " --num-distributed-optimizer-instances 0", "--num-distributed-optimizer-instances: must be >= 1"},
      {kModel + " --num-distributed-optimizer-instances 2",
       "--num-distributed-optimizer-instances: 2 is more than the world size 1"},
      {kModel + " --simulate-world-size 4 --num-distributed-optimizer-instances 3",
       "--num-distributed-optimizer-instances: 3 does not divide the data-parallel size 4"},
      {kModel + " --outer-dp-sharding-strategy optim", "--outer-dp-sharding-strategy: optim shards across the instances"},
      {kModel + " --simulate-world-size 4 --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim"
                " --data-parallel-sharding-strategy optim",
       "--outer-dp-sharding-strategy: optim (HFSDP) needs --data-parallel-sharding-strategy optim_grads_params, got optim"},
      {kModel + " --outer-dp-sharding-strategy replicate", "--outer-dp-sharding-strategy"},
      {kModel + " --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --simulate-world-size 8"
                " --num-distributed-optimizer-instances 8",
       "--num-distributed-optimizer-instances: 8 does not divide the expert-data-parallel size 4"},
      // Sizes whose product wrapped to 0 (SIGFPE), and what the layout refuses in its one place.
      {kModel + " --tensor-model-parallel-size 4294967296 --context-parallel-size 4294967296",
       "--tensor-model-parallel-size: 4294967296 is more than the world size 1"},
      {kModel + " --simulate-world-size 4 --memory-plan --context-parallel-size 4294967296",
       "--context-parallel-size: 4294967296 is more than the world size 4"},
      {kModel + " --simulate-world-size 2 --memory-plan --pipeline-model-parallel-size 2 --num-layers 3",
       "--num-layers"},
      {kModel + " --simulate-world-size 4 --memory-plan --tensor-model-parallel-size 2 --expert-tensor-parallel-size 4",
       "--expert-tensor-parallel-size: 4: mfsdp splits experts over 1 rank or over the tensor-parallel ranks (2)"},
      {kModel + " --expert-tensor-parallel-size -1", "--expert-tensor-parallel-size: must be >= 1"},
      {kModel + " --tensor-model-parallel-size 0", "--tensor-model-parallel-size: must be >= 1"},
      {kModel + " --tensor-model-parallel-size 2", "--tensor-model-parallel-size: 2 is more than the world size 1"},
      {kModel + " --simulate-world-size 6 --memory-plan --tensor-model-parallel-size 2 --context-parallel-size 2",
       "--tensor-model-parallel-size: 2 x --context-parallel-size 2 does not divide the world size 6"},
      {kModel + " --simulate-world-size 3 --memory-plan --tensor-model-parallel-size 3",
       "--tensor-model-parallel-size: 3 does not divide the model (llama, 2 layers"},
      {kModel + " --simulate-world-size 4 --memory-plan --context-parallel-size 2 --seq-length 18",
       "--context-parallel-size: --seq-length 18 does not divide by 2 x 2"},
      {kModel + " --simulate-world-size 2 --memory-plan --tensor-model-parallel-size 2 --save /tmp/mfsdp-never"
                " --ckpt-format mfsdp",
       "--ckpt-format: mfsdp stores 1-D element ranges, which cannot hold a tensor-parallel slice"},
      {kModel + " --simulate-world-size 2 --tensor-model-parallel-size 2",
       "--simulate-world-size: with --tensor-model-parallel-size > 1 needs --memory-plan"},
      {kModel + " --simulate-world-size 4 --memory-plan --tensor-model-parallel-size 2 --num-experts 4"
                " --moe-router-topk 2 --expert-model-parallel-size 2",
       "MoE layers needs --sequence-parallel (each rank routes its slice of the sequence"},
      {kModel + " --cp-comm-type a2a", "--cp-comm-type"},
      // Values the model's config.json reader, its layer pattern or LibTorch refused only after
      // start-up, naming an internal field (exit 1), or that were taken and ignored.
      {kModel + " --num-experts 1000000", "--num-experts: must be at most 4096"},
      {kModel + " --kv-channels 1099511627776", "--kv-channels: must be at most 131072"},
      {kModel + " --kv-channels 2 --num-attention-heads 1000",
       "--num-attention-heads: must be at most --hidden-size 32"},
      {moe + " --moe-ffn-hidden-size 1099511627776", "--moe-ffn-hidden-size: must be at most 1048576"},
      {moe + " --moe-shared-expert-intermediate-size 1099511627776",
       "--moe-shared-expert-intermediate-size: must be at most 1048576"},
      {moe + " --moe-layer-freq '[0,0]'", "--moe-layer-freq: [0,0] makes no layer an MoE layer"},
      {moe + " --moe-layer-freq '[1]'", "--moe-layer-freq: lists 1 layers, --num-layers is 2"},
      {kModel + " --moe-layer-freq=", "--moe-layer-freq: expected a positive integer"},
      {moe + " --moe-expert-capacity-factor 1e300", "--moe-expert-capacity-factor: must be at most --num-experts 4"},
      {moe + " --moe-expert-capacity-factor 1e18", "--moe-expert-capacity-factor: must be at most --num-experts 4"},
      {kModel + " --split -2147483649", "--split: '-2147483649': '-' is not part of a weight"},
      {no_swiglu + " --num-experts 4 --moe-router-topk 2", "--num-experts: needs --swiglu"},
  };
  for (const auto& c : cases) {
    Outcome r = run("env RANK=0 WORLD_SIZE=1 " + pretrain + c.flags);
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.flags << "\n" << r.output;
    EXPECT_EQ(r.output.find(" device:"), std::string::npos) << "the run started: " << r.output;
    EXPECT_EQ(r.output.find("elapsed time per iteration"), std::string::npos) << "training started: " << r.output;
    for (const char* internal :
         {"AdamWOptions", "SGDOptions", "LlamaConfig", "LRSchedule", "HF config.json", "Megatron argument"})
      EXPECT_EQ(r.output.find(internal), std::string::npos) << c.flags << "\n" << r.output;
  }
}

// The metrics records of training iterations (not evaluations).
std::vector<nlohmann::json> train_records(const std::string& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("eval")) out.push_back(j);
  }
  return out;
}

// mfsdp-pretrain on `ranks` ranks with `flags`, its metrics in `metrics`: the training records
// (a failed run fails the test, its output shown); the run's outcome into `out` if given.
// One thread per rank, one rank's runs included: a 1-rank run would otherwise take every core
// (src/train/trainer_main.cpp), and kernels split their sums by thread count.
std::vector<nlohmann::json> launch_records(const std::string& metrics, int ranks, const std::string& flags,
                                           Outcome* out = nullptr) {
  Outcome r = run("OMP_NUM_THREADS=1 " + bin("MFSDP_RUN_BIN") + " --nproc-per-node " + std::to_string(ranks) + " " +
                  bin("MFSDP_PRETRAIN_BIN") + flags + " --metrics-file " + metrics);
  EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
  if (out) *out = r;
  return train_records(metrics);
}

// --log-params-norm and --log-num-zeros-in-grad: Megatron's " num zeros: N | params norm: X"
// after the grad norm, the same numbers with 1 rank and 2 ZeRO-3 ranks, the last params norm
// that of the exported weights (computed here from model.safetensors), and at least the zeros
// of the embedding's padding rows (--untie: no output layer sums into them), which no token hits.
TEST(Pretrain, ParamsNormAndNumZerosOverShards) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "mfsdp_pretrain_norms";
  mfsdp::remove_tree(dir);
  // AdamW eps 1e-3 and one thread per rank, as launch_records: 2 ranks sum in another order, and
  // with eps 1e-8 Adam turns a nearly cancelling gradient element into a step of up to lr.
  const std::string flags = kModel + " --train-iters 4 --untie-embeddings-and-output-weights"
                                     " --make-vocab-size-divisible-by 128 --log-params-norm --log-num-zeros-in-grad"
                                     " --adam-eps 1e-3";
  std::vector<std::vector<nlohmann::json>> runs;
  for (int ranks : {1, 2}) {
    const fs::path out = dir / std::to_string(ranks);
    Outcome r = run("OMP_NUM_THREADS=1 " + bin("MFSDP_RUN_BIN") + " --nproc-per-node " + std::to_string(ranks) + " " +
                    bin("MFSDP_PRETRAIN_BIN") + flags + " --metrics-file " + (out / "metrics.jsonl").string() +
                    " --export-hf " + (out / "hf").string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(" | grad norm: "), std::string::npos) << r.output;
    const auto zeros_at = r.output.find(" | num zeros: "), norm_at = r.output.find(" | params norm: ");
    EXPECT_TRUE(zeros_at != std::string::npos && norm_at != std::string::npos && zeros_at < norm_at) << r.output;
    runs.push_back(train_records((out / "metrics.jsonl").string()));
    ASSERT_EQ(runs.back().size(), 4u) << r.output;

    double squares = 0;
    for (const auto& [name, t] : mfsdp::read_safetensors_folder((out / "hf").string()))
      squares += t.to(at::kDouble).square().sum().item<double>();
    const double last = runs.back().back()["params_norm"].get<double>();
    EXPECT_NEAR(last, std::sqrt(squares), 1e-6 * last) << ranks << " ranks";
  }
  const int64_t padding_zeros = (128 - 64) * 32;  // padded rows x hidden size
  for (size_t i = 0; i < runs[0].size(); ++i) {
    const double norm1 = runs[0][i]["params_norm"].get<double>(), norm2 = runs[1][i]["params_norm"].get<double>();
    EXPECT_NEAR(norm2, norm1, 1e-6 * norm1) << "iteration " << i + 1;
    EXPECT_EQ(runs[1][i]["num_zeros_in_grad"].get<int64_t>(), runs[0][i]["num_zeros_in_grad"].get<int64_t>())
        << "iteration " << i + 1;
    EXPECT_GE(runs[0][i]["num_zeros_in_grad"].get<int64_t>(), padding_zeros);
  }
  mfsdp::remove_tree(dir);
}

// HSDP (--num-distributed-optimizer-instances): 4 ranks as 2 instances of 2 shards, and as 4
// instances of 1, train as one rank does (losses, grad norms, params norms and zero counts, each
// element counted once over the replicas), under ZeRO-3, ZeRO-1 and no_shard inside the
// instances, and with HFSDP (--outer-dp-sharding-strategy optim); the start-up line names the
// layout. The bytes a rank holds are those of FSDP over its instance, less the main weights,
// gradients and optimizer state HFSDP splits across the instances, as --memory-plan says first.
TEST(Pretrain, HybridShardingTrainsLikeOneRank) {
  mfsdp::testing::TempDir dir("mfsdp-hsdp");
  // AdamW eps 1e-3 (as TensorAndContextParallelTrainLikeOneRank): 4 ranks sum in another order, and
  // with eps 1e-8 Adam turns a nearly cancelling gradient element into a step of up to lr.
  const std::string flags = kModel + " --train-iters 6 --log-params-norm --log-num-zeros-in-grad --adam-eps 1e-3";
  auto records = [&](int ranks, const std::string& extra, const std::string& name, Outcome* out = nullptr) {
    return launch_records(dir.file(name + ".jsonl"), ranks, flags + extra, out);
  };
  const auto one = records(1, "", "one");
  ASSERT_EQ(one.size(), 6u);
  struct Layout {
    const char* strategy;
    int instances;
    const char* outer;
  };
  for (const Layout l : {Layout{"optim_grads_params", 2, "no_shard"}, Layout{"optim", 2, "no_shard"},
                         Layout{"no_shard", 2, "no_shard"}, Layout{"optim_grads_params", 4, "no_shard"},
                         Layout{"optim_grads_params", 2, "optim"}, Layout{"optim_grads_params", 4, "optim"}}) {
    const std::string extra = std::string(" --data-parallel-sharding-strategy ") + l.strategy +
                              " --num-distributed-optimizer-instances " + std::to_string(l.instances) +
                              " --outer-dp-sharding-strategy " + l.outer;
    Outcome r;
    const auto hsdp = records(4, extra, std::string(l.strategy) + std::to_string(l.instances) + l.outer, &r);
    ASSERT_EQ(hsdp.size(), one.size()) << extra << "\n" << r.output;
    EXPECT_NE(r.output.find(" HSDP: " + std::to_string(l.instances) + " instances of " +
                            std::to_string(4 / l.instances) + " consecutive data-parallel ranks"),
              std::string::npos)
        << r.output;
    for (size_t i = 0; i < one.size(); ++i) {
      for (const char* key : {"lm_loss", "grad_norm", "params_norm"}) {
        const double want = one[i][key].get<double>();
        EXPECT_NEAR(hsdp[i][key].get<double>(), want, 1e-5 * std::abs(want)) << extra << " " << key << " it " << i + 1;
      }
      EXPECT_EQ(hsdp[i]["num_zeros_in_grad"], one[i]["num_zeros_in_grad"]) << extra << " iteration " << i + 1;
    }
  }
  // A rank of 2 x 2 HSDP holds what a rank of a plain 2-rank job holds; HFSDP's main grads and
  // optimizer state are those of a 4-rank job, its model weights twice those (the shard of 2 of
  // the 4-rank packing). The plan says so first.
  Outcome hsdp, hfsdp, plain2, plain4;
  records(4, " --num-distributed-optimizer-instances 2", "bytes_hsdp", &hsdp);
  records(4, " --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim", "bytes_hfsdp", &hfsdp);
  records(2, "", "bytes2", &plain2);
  records(4, "", "bytes4", &plain4);
  auto field = [](const std::string& output, const std::string& name) {
    const std::string line = buffer_bytes_line(output);
    const auto at = line.find(name + " ");
    return at == std::string::npos ? std::string("missing") : line.substr(at, line.find(',', at) - at);
  };
  for (const char* name : {"model weights", "main grads", "optimizer state"}) {
    EXPECT_EQ(field(hsdp.output, name), field(plain2.output, name)) << hsdp.output;
    if (std::string(name) != "model weights") EXPECT_EQ(field(hfsdp.output, name), field(plain4.output, name)) << hfsdp.output;
  }
  const double hfsdp_model = std::stod(field(hfsdp.output, "model weights").substr(14)),
               plain4_model = std::stod(field(plain4.output, "model weights").substr(14));
  EXPECT_NEAR(hfsdp_model, 2 * plain4_model, 1e-4 * hfsdp_model) << hfsdp.output;
  for (const Outcome* real : {&hsdp, &hfsdp}) {
    const bool split = real == &hfsdp;
    Outcome plan = run(bin("MFSDP_PRETRAIN_BIN") + flags + " --num-distributed-optimizer-instances 2 --memory-plan" +
                       " --simulate-world-size 4" + (split ? " --outer-dp-sharding-strategy optim" : ""));
    ASSERT_EQ(plan.exit_code, 0) << plan.output;
    const std::string measured = buffer_bytes_line(real->output);
    ASSERT_FALSE(measured.empty()) << real->output;
    EXPECT_EQ(planned_bytes_line(plan.output), measured.substr(0, measured.find(", buffer pool"))) << plan.output;
  }
}

// Tensor parallelism (with and without sequence parallelism), context parallelism (all-gather
// and ring attention) and both together, with data parallelism or HSDP beside them, train like one rank:
// losses, gradient norms and parameter norms within 1e-5 over 6 iterations, mean and per-token
// losses (Megatron pads the vocabulary to --make-vocab-size-divisible-by x TP, so the TP runs
// halve that flag to train the one-rank model's 64 rows). AdamW's eps is 1e-3 in every run here, one rank's included: TP and CP sum some products
// in another order, and with eps 1e-8 Adam turns a gradient element that nearly cancels into a
// step of up to lr either way (tests/dist/parallel_llama_test.cpp measures it). A rank of a
// TP 2 x DP 2 job holds what its memory plan says.
TEST(Pretrain, TensorAndContextParallelTrainLikeOneRank) {
  mfsdp::testing::TempDir dir("mfsdp-ndp");
  const std::string flags = kModel + " --train-iters 6 --log-params-norm --adam-eps 1e-3";
  auto records = [&](int ranks, const std::string& extra, const std::string& name, Outcome* out = nullptr) {
    return launch_records(dir.file(name + ".jsonl"), ranks, flags + extra, out);
  };
  struct Layout {
    int ranks;
    const char* extra;
    const char* banner;  // the start-up line's sizes
  };
  for (const char* loss : {"", " --calculate-per-token-loss"}) {
    const auto one = records(1, loss, std::string("one") + (*loss ? "_tok" : ""));
    ASSERT_EQ(one.size(), 6u);
    int n = 0;
    for (const Layout l :
         {Layout{2, " --tensor-model-parallel-size 2 --make-vocab-size-divisible-by 32", "data-parallel 1 x context-parallel 1 x tensor-parallel 2"},
          Layout{4, " --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 32",
                 "data-parallel 2 x context-parallel 1 x tensor-parallel 2"},
          Layout{2, " --context-parallel-size 2 --cp-comm-type p2p",
                 "data-parallel 1 x context-parallel 2 x tensor-parallel 1"},
          Layout{4, " --context-parallel-size 2 --data-parallel-sharding-strategy optim",
                 "data-parallel 2 x context-parallel 2 x tensor-parallel 1"},
          Layout{4, " --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 --make-vocab-size-divisible-by 32",
                 "data-parallel 1 x context-parallel 2 x tensor-parallel 2"},
          // HSDP over the data- x context-parallel ranks: instances of the CP group (HFSDP), and
          // two replicas of each tensor-parallel rank's slices.
          Layout{4, " --context-parallel-size 2 --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim",
                 "data-parallel 2 x context-parallel 2 x tensor-parallel 1"},
          Layout{4, " --tensor-model-parallel-size 2 --num-distributed-optimizer-instances 2 --make-vocab-size-divisible-by 32",
                 "data-parallel 2 x context-parallel 1 x tensor-parallel 2"}}) {
      const std::string extra = std::string(l.extra) + loss;
      Outcome r;
      const auto got = records(l.ranks, extra, "layout" + std::to_string(n++) + (*loss ? "_tok" : ""), &r);
      ASSERT_EQ(got.size(), one.size()) << extra << "\n" << r.output;
      EXPECT_NE(r.output.find(std::string(" parallelism: ") + std::to_string(l.ranks) + " ranks = " + l.banner),
                std::string::npos)
          << r.output;
      for (size_t i = 0; i < one.size(); ++i)
        for (const char* key : {"lm_loss", "grad_norm", "params_norm"}) {
          const double want = one[i][key].get<double>();
          EXPECT_NEAR(got[i][key].get<double>(), want, 1e-5 * std::abs(want)) << extra << " " << key << " it " << i + 1;
        }
    }
  }
  Outcome real;
  records(4, " --tensor-model-parallel-size 2", "bytes_tp", &real);
  Outcome plan = run(bin("MFSDP_PRETRAIN_BIN") + flags +
                     " --tensor-model-parallel-size 2 --memory-plan --simulate-world-size 4");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const std::string measured = buffer_bytes_line(real.output);
  ASSERT_FALSE(measured.empty()) << real.output;
  EXPECT_EQ(planned_bytes_line(plan.output), measured.substr(0, measured.find(", buffer pool"))) << plan.output;
}

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Starts `command` through sh (exec'd, so the pid is the command's), output into `log`.
pid_t spawn(const std::string& command, const std::string& log) {
  const std::string line = "exec " + command + " > " + log + " 2>&1";
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// The child of `parent` whose environment holds `entry` (e.g. "RANK=1"); -1 when none (yet).
pid_t child_with_env(pid_t parent, const std::string& entry) {
  for (const std::string& name : mfsdp::list_directory("/proc")) {
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_text(std::filesystem::path("/proc") / name / "stat");
    const auto paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(stat.substr(paren + 2));
    std::string state;
    long ppid = 0;
    fields >> state >> ppid;
    if (ppid != parent) continue;
    const std::string env = read_text(std::filesystem::path("/proc") / name / "environ");
    for (size_t begin = 0; begin < env.size();) {
      const size_t end = env.find('\0', begin);
      if (env.compare(begin, (end == std::string::npos ? env.size() : end) - begin, entry) == 0 &&
          (end == std::string::npos ? env.size() : end) - begin == entry.size())
        return static_cast<pid_t>(std::stol(name));
      if (end == std::string::npos) break;
      begin = end + 1;
    }
  }
  return -1;
}

// waitpid with a deadline; the exit status, or -1 when `pid` still runs after `seconds`.
int wait_for_exit(pid_t pid, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (std::chrono::steady_clock::now() > end) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

// --distributed-timeout-minutes reaches the communicator: a rank stopped (SIGSTOP) in the middle
// of training is named by the other one after 0.2 minutes (12000 ms), not after the default 10.
TEST(Pretrain, DistributedTimeoutNamesAStoppedRank) {
  namespace fs = std::filesystem;
  const fs::path log = fs::temp_directory_path() / ("mfsdp_pretrain_timeout_" + std::to_string(getpid()) + ".log");
  const pid_t launcher = spawn(bin("MFSDP_RUN_BIN") + " --nproc-per-node 2 " + bin("MFSDP_PRETRAIN_BIN") + kModel +
                                   " --train-iters 100000 --distributed-timeout-minutes 0.2",
                               log.string());
  ASSERT_GT(launcher, 0);
  // Training runs once rank 0 logs an iteration.
  pid_t rank1 = -1;
  const auto start_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < start_deadline) {
    if (rank1 < 0) rank1 = child_with_env(launcher, "RANK=1");
    if (rank1 > 0 && read_text(log.string()).find(" iteration ") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (rank1 <= 0 || read_text(log.string()).find(" iteration ") == std::string::npos) {
    kill(launcher, SIGTERM);
    wait_for_exit(launcher, 30);
    FAIL() << "training did not start (rank 1 pid " << rank1 << "):\n" << read_text(log.string());
  }
  ASSERT_EQ(kill(rank1, SIGSTOP), 0);
  const auto stopped = std::chrono::steady_clock::now();
  // Rank 0's own error names the silent peer and the flag's timeout.
  double named = -1;
  while (std::chrono::steady_clock::now() < stopped + std::chrono::seconds(120)) {
    if (read_text(log.string()).find("12000 ms") != std::string::npos) {
      named = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const int code = wait_for_exit(launcher, 60);
  const double ended = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  kill(rank1, SIGKILL);  // already gone when the launcher stopped it
  if (code == -1) {
    kill(launcher, SIGKILL);
    wait_for_exit(launcher, 30);
  }
  const std::string output = read_text(log.string());
  fs::remove(log);
  std::printf("stopped rank named after %.1f s, job ended after %.1f s\n", named, ended);
  EXPECT_GE(named, 0) << "rank 1 not named within 120 s of stopping it:\n" << output;
  EXPECT_LT(named, 60) << output;  // the default timeout would take 10 minutes
  EXPECT_NE(output.find("rank 1"), std::string::npos) << output;
  EXPECT_NE(code, -1) << "the job did not end:\n" << output;
  EXPECT_NE(code, 0) << output;
}

// --check-for-nan-in-loss-and-grad (on by default), through the binary: every rank stops at the
// iteration whose loss or gradients are not finite, naming it (and the parameters), exit 1, and
// that iteration is neither stepped nor saved; --no-check-for-nan-in-loss-and-grad trains on.
TEST(Pretrain, NanLossOrGradientStopsNamingTheIteration) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("mfsdp_pretrain_nan_" + std::to_string(getpid()));
  mfsdp::remove_tree(dir);
  const std::string launch = bin("MFSDP_RUN_BIN") + " --nproc-per-node 2 " + bin("MFSDP_PRETRAIN_BIN") + kModel;

  // Weights of std 1e18: attention scores overflow, the loss of iteration 1 is NaN (here on rank
  // 1, whose samples hit it; rank 0 stops all the same, naming it).
  Outcome loss = run(launch + " --train-iters 4 --init-method-std 1e18");
  EXPECT_EQ(loss.exit_code, 1) << loss.output;
  EXPECT_NE(loss.output.find("[rank0]: mfsdp-pretrain: iteration 1: the loss is NaN or Inf on rank "),
            std::string::npos)
      << loss.output;
  EXPECT_EQ(loss.output.find(" iteration        1/"), std::string::npos) << "trained on: " << loss.output;

  // An --lr of 1e30 (5e29 at step 1, in warmup) leaves finite but huge weights: RMSNorm's squares
  // overflow, so iteration 2's loss is finite and its gradients are not. Checkpoint 1 is saved,
  // iteration 2 is not.
  const fs::path save = dir / "ckpt";
  Outcome grads = run(launch + " --train-iters 4 --lr 1e30 --save " + save.string() + " --save-interval 1");
  EXPECT_EQ(grads.exit_code, 1) << grads.output;
  EXPECT_NE(grads.output.find("iteration 2: the gradients are not finite (grad norm "), std::string::npos)
      << grads.output;
  EXPECT_NE(grads.output.find("model.layers.1.mlp.down_proj.weight ("), std::string::npos) << grads.output;
  EXPECT_EQ(grads.output.find("the loss is"), std::string::npos) << grads.output;
  EXPECT_TRUE(fs::exists(save / "iter_0000001")) << grads.output;
  EXPECT_FALSE(fs::exists(save / "iter_0000002")) << grads.output;

  // The check off: the old behaviour, NaN to the end.
  Outcome off = run(launch + " --train-iters 3 --lr 1e30 --no-check-for-nan-in-loss-and-grad");
  EXPECT_EQ(off.exit_code, 0) << off.output;
  EXPECT_NE(off.output.find(" iteration        3/"), std::string::npos) << off.output;
  EXPECT_NE(off.output.find("nan"), std::string::npos) << off.output;  // grad norm: -nan
  mfsdp::remove_tree(dir);
}

// A corpus holding an id the tokenizer cannot produce (between the real vocabulary, 60, and the
// padded one, 64: it would train silently on an embedding row no tokenizer emits) stops the run
// with the file, the sequence, the position and the id named.
TEST(Pretrain, TokenIdOutsideTheVocabularyNamesFileSequenceAndPosition) {
  mfsdp::testing::TempDir dir("mfsdp_pretrain_vocab");
  const std::string prefix = dir.file("corpus_text_document");
  {
    mfsdp::IndexedDatasetWriter w(prefix, mfsdp::TokenDType::kUInt16);
    for (int64_t d = 0; d < 20; ++d) {
      std::vector<int64_t> doc;
      for (int64_t k = 0; k < 30; ++k) doc.push_back((d * 7 + k) % 60);
      if (d == 5) doc[3] = 61;
      w.add_document(doc);
    }
    w.finalize();
  }
  std::string model = kModel;
  model.replace(model.find(" --mock-data --vocab-size 64"), 28, " --data-path " + prefix + " --split 1,0,0 --vocab-size 60");
  const Outcome r = run(bin("MFSDP_RUN_BIN") + " --nproc-per-node 1 " + bin("MFSDP_PRETRAIN_BIN") + model + " --eval-iters 0");
  EXPECT_NE(r.exit_code, 0) << r.output;
  for (const std::string& part : {prefix, std::string("token id 61 at position 3 of sequence 5"), std::string("[0, 60)")})
    EXPECT_NE(r.output.find(part), std::string::npos) << "no '" << part << "' in:\n" << r.output;
}
