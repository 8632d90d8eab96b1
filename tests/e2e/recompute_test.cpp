// Activation recompute through mfsdp-pretrain (Megatron's --recompute-* flags, ModelSection in
// src/train/config/sections.cpp): a few modes on two ranks train with the losses of no recompute,
// and the combinations Megatron refuses exit 2 before any work, naming the flag.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"

namespace {

using mfsdp::testing::run_command;

const std::string kRun = MFSDP_RUN_BIN_PATH;
const std::string kPretrain = MFSDP_PRETRAIN_BIN_PATH;

// Three layers (so uniform 2 has a short last group), an MoE model with a shared expert, so the
// MoE modules have something to recompute.
const std::string kModel =
    " --device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 3 --hidden-size 32"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu"
    " --ffn-hidden-size 48 --seq-length 16 --micro-batch-size 2 --global-batch-size 8"
    " --train-iters 6 --lr 3e-3 --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 7"
    " --num-experts 4 --moe-router-topk 2 --moe-shared-expert-intermediate-size 16 --moe-aux-loss-coeff 0.01"
    " --moe-grouped-gemm";

std::vector<double> train_losses(const std::string& extra) {
  mfsdp::testing::TempDir dir("mfsdp-recompute");
  const std::filesystem::path metrics = dir.path() / "metrics.jsonl";
  const auto r = run_command(kRun + " --nproc-per-node 2 " + kPretrain + kModel + " --metrics-file " +
                             metrics.string() + extra);
  EXPECT_EQ(r.exit_code, 0) << extra << "\n" << r.output;
  std::vector<double> losses;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("eval")) losses.push_back(j["lm_loss"].get<double>());
  }
  EXPECT_EQ(losses.size(), 6u) << extra << "\n" << r.output;
  return losses;
}

void expect_flag_error(const std::string& flags, const std::string& needle) {
  const auto r = run_command("env RANK=0 WORLD_SIZE=1 " + kPretrain + kModel + flags);
  EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << flags << "\n" << r.output;
  EXPECT_EQ(r.output.find(" device:"), std::string::npos) << "the run started: " << r.output;
}

}  // namespace

TEST(Recompute, ModesKeepTheLosses) {
  const std::vector<double> base = train_losses("");
  ASSERT_EQ(base.size(), 6u);
  for (const char* flags :
       {" --recompute-activations",  // Megatron: selective, core_attn
        " --recompute-granularity selective --recompute-modules core_attn layernorm moe_act shared_experts",
        " --recompute-granularity selective --recompute-modules moe mlp",
        " --recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
        " --recompute-granularity full --recompute-method block --recompute-num-layers 1"}) {
    const std::vector<double> got = train_losses(flags);
    ASSERT_EQ(got.size(), base.size()) << flags;
    for (size_t i = 0; i < base.size(); ++i)
      EXPECT_NEAR(got[i], base[i], 1e-5 * std::abs(base[i])) << flags << " iteration " << i + 1;
  }
}

TEST(Recompute, MegatronsRefusedCombinationsNameTheFlag) {
  expect_flag_error(" --recompute-granularity full", "--recompute-granularity: full needs --recompute-method");
  expect_flag_error(" --recompute-granularity full --recompute-method uniform",
                    "--recompute-num-layers: with --recompute-granularity full must be between 1 and --num-layers 3");
  expect_flag_error(" --recompute-granularity full --recompute-method block --recompute-num-layers 0",
                    "--recompute-num-layers: with --recompute-granularity full must be between 1");
  expect_flag_error(" --recompute-granularity full --recompute-method block --recompute-num-layers 4",
                    "got 4");
  expect_flag_error(" --recompute-granularity selective --recompute-method uniform",
                    "--recompute-method: is not supported with --recompute-granularity selective");
  expect_flag_error(" --recompute-activations --recompute-num-layers 1",
                    "--recompute-num-layers: must be unset with --recompute-granularity selective");
  expect_flag_error(" --recompute-method block", "--recompute-method: needs --recompute-granularity full");
  expect_flag_error(" --recompute-granularity full --recompute-method block --recompute-num-layers 1"
                    " --recompute-modules mlp",
                    "--recompute-modules: needs --recompute-granularity selective");
  expect_flag_error(" --recompute-granularity bogus", "--recompute-granularity: 'bogus' is not one of");
  expect_flag_error(" --recompute-granularity full --recompute-method zigzag --recompute-num-layers 1",
                    "--recompute-method: 'zigzag' is not one of");
  expect_flag_error(" --recompute-activations --recompute-modules core_attn attn",
                    "--recompute-modules: 'attn' is not one of");
  expect_flag_error(" --recompute-activations --recompute-modules mhc", "--recompute-modules: 'mhc' is Megatron's");
  expect_flag_error(" --recompute-activations --recompute-modules mla_up_proj",
                    "--recompute-modules: mla_up_proj is only supported with --multi-latent-attention");
}
