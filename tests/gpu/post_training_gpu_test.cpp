// mfsdp-sft and mfsdp-grpo on a GPU (label gpu; skipped, naming the missing GPU, elsewhere):
// SFT on --device cuda follows the CPU run's losses; GRPO on CUDA trains with the rollout's
// log-probs equal to the training forward's (fp32) in both rollout modes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/launch/rank_processes.h"
#include "harness/require_gpu.h"

namespace {

// One rank without the launcher, as tests/gpu/fsdp_gpu_test.cpp runs mfsdp-pretrain.
std::vector<nlohmann::json> run_tool(const std::string& binary, const std::string& flags,
                                     const mfsdp::testing::TempDir& dir, const std::string& tag) {
  const std::string metrics = dir.file(tag + ".jsonl");
  auto r = mfsdp::testing::run_command(
      "env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
      std::to_string(mfsdp::launch::pick_free_port()) + " " + binary + flags + " --metrics-file " + metrics);
  EXPECT_EQ(r.exit_code, 0) << tag << "\n" << r.output;
  std::vector<nlohmann::json> records;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
  return records;
}

const std::string kModel =
    " --tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 1 --num-layers 2 --hidden-size 32"
    " --num-attention-heads 4 --swiglu --ffn-hidden-size 48 --seed 3 --log-interval 1 --eval-interval 1000"
    " --gen-task arith --gen-train-size 64 --gen-val-size 8";

TEST(PostTrainingGpu, SftOnCudaFollowsTheCpuRun) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::TempDir dir("mfsdp-gpu-sft");
  const std::string flags = kModel + " --max-length 32 --micro-batch-size 8 --train-iters 5 --lr 3e-3";
  auto gpu = run_tool(MFSDP_SFT_BIN_PATH, " --device cuda" + flags, dir, "cuda");
  auto cpu = run_tool(MFSDP_SFT_BIN_PATH, " --device cpu" + flags, dir, "cpu");
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (gpu[i].contains("eval")) continue;
    const double g = gpu[i]["lm_loss"].get<double>(), c = cpu[i]["lm_loss"].get<double>();
    EXPECT_NEAR(g, c, 1e-3 * c) << "iteration " << i + 1;
  }
}

TEST(PostTrainingGpu, GrpoOnCudaRollsOutWhatItTrains) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::TempDir dir("mfsdp-gpu-grpo");
  const std::string flags = kModel + " --device cuda --max-prompt-length 32 --max-response-length 8"
                                     " --train-batch-size 4 --rollout-n 4 --micro-batch-size 8 --train-iters 2"
                                     " --entropy-coeff 0.01 --lr 1e-3";
  for (const char* mode : {"full", "sharded"}) {
    auto records = run_tool(MFSDP_GRPO_BIN_PATH, flags + " --rollout-mode " + mode, dir, mode);
    int steps = 0;
    for (const auto& r : records) {
      if (r.contains("eval")) continue;
      ++steps;
      EXPECT_LE(r["training/rollout_log_probs_diff_max"].get<double>(), 1e-4) << mode;
      EXPECT_GT(r["actor/grad_norm"].get<double>(), 0) << mode;
    }
    EXPECT_EQ(steps, 2) << mode;
  }
}

}  // namespace
