// mfsdp-sft and mfsdp-grpo share mfsdp-pretrain's flag checks and step (src/train/): bad values
// exit 2 before any work, naming the flag (not an internal field); --log-params-norm and
// --log-num-zeros-in-grad reach their log lines and metrics.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"

namespace {

using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kRun = MFSDP_RUN_BIN_PATH;
const std::string kSft = MFSDP_SFT_BIN_PATH;
const std::string kGrpo = MFSDP_GRPO_BIN_PATH;

const std::string kModel =
    " --device cpu --tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 1 --num-layers 2"
    " --hidden-size 32 --num-attention-heads 4 --swiglu --ffn-hidden-size 48 --seed 5 --log-interval 1"
    " --eval-interval 1000 --train-iters 2";
const std::string kSftFlags = kModel + " --max-length 64 --gen-task arith --gen-train-size 32 --gen-val-size 0";
const std::string kGrpoFlags = kModel +
                               " --gen-task arith --gen-train-size 32 --gen-val-size 0 --max-prompt-length 32"
                               " --max-response-length 8 --train-batch-size 2 --rollout-n 2 --entropy-coeff 0.01";

// One rank without a launcher: the rendezvous variables are read before the values are checked.
void expect_flag_error(const std::string& command, const std::string& needle) {
  const auto r = run_command("env RANK=0 WORLD_SIZE=1 " + command);
  EXPECT_EQ(r.exit_code, 2) << command << "\n" << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << command << "\n" << r.output;
  EXPECT_EQ(r.output.find(" device:"), std::string::npos) << "the run started: " << r.output;
  for (const char* internal : {"AdamWOptions", "SGDOptions", "LlamaConfig", "LRSchedule"})
    EXPECT_EQ(r.output.find(internal), std::string::npos) << command << "\n" << r.output;
}

}  // namespace

TEST(TrainerFlags, SftAndGrpoRefuseBadValuesBeforeAnyWork) {
  for (const std::string& tool : {kSft + kSftFlags, kGrpo + kGrpoFlags}) {
    expect_flag_error(tool + " --clip-grad -1", "--clip-grad: must be >= 0");
    expect_flag_error(tool + " --seed -1", "--seed");
    expect_flag_error(tool + " --adam-beta2 1", "--adam-beta2: must be in [0, 1)");
    expect_flag_error(tool + " --lr nan", "--lr: expected a finite number");
    expect_flag_error(tool + " --ffn-hidden-size -1", "--ffn-hidden-size");
    expect_flag_error(tool + " --distributed-timeout-minutes 0", "--distributed-timeout-minutes");
    expect_flag_error(tool + " --hf-load /nonexistent/mfsdp-model", "--hf-load: '/nonexistent/mfsdp-model' is not");
    expect_flag_error(tool + " --save /etc/passwd/ckpt", "--save");
    // The MoE model of a --load checkpoint takes it too: bounded without --num-experts.
    expect_flag_error(tool + " --moe-expert-capacity-factor 1e300",
                      "--moe-expert-capacity-factor: must be at most 4096");
    expect_flag_error(tool + " --num-experts 4 --moe-layer-freq '[0,0]'", "--moe-layer-freq: [0,0] makes no layer");
  }
  std::string sft_files = kSftFlags;
  sft_files.replace(sft_files.find(" --gen-task arith"), 17, " --train-files /nonexistent/train.jsonl");
  expect_flag_error(kSft + sft_files, "--train-files: no such file: '/nonexistent/train.jsonl'");
  expect_flag_error(kGrpo + kGrpoFlags + " --temperature inf", "--temperature: expected a finite number");
  expect_flag_error(kGrpo + kGrpoFlags + " --ppo-epochs 4294967296", "--ppo-epochs: must be at most 1024");
  expect_flag_error(kGrpo + kGrpoFlags + " --ref-load /nonexistent/ref --use-kl-loss", "--ref-load");
}

TEST(TrainerFlags, SftAndGrpoLogNormsAndZeros) {
  TempDir dir("mfsdp-trainer-norms");
  for (const auto& [name, tool] : {std::pair{"sft", kSft + kSftFlags}, {"grpo", kGrpo + kGrpoFlags}}) {
    const std::string metrics = dir.file(std::string(name) + ".jsonl");
    const auto r = run_command(kRun + " --nproc-per-node 2 " + tool +
                               " --log-params-norm --log-num-zeros-in-grad --metrics-file " + metrics);
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    EXPECT_NE(r.output.find(" | num zeros: "), std::string::npos) << name << "\n" << r.output;
    EXPECT_NE(r.output.find(" | params norm: "), std::string::npos) << name << "\n" << r.output;
    std::ifstream in(metrics);
    std::string line;
    int records = 0;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("eval")) continue;
      ++records;
      ASSERT_TRUE(j.contains("params_norm") && j.contains("num_zeros_in_grad")) << name << ": " << line;
      EXPECT_GT(j["params_norm"].get<double>(), 0) << name;
      EXPECT_GE(j["num_zeros_in_grad"].get<double>(), 0) << name;
    }
    EXPECT_EQ(records, 2) << name << "\n" << r.output;
  }
}
