// Every path --load (and mfsdp-generate --model, mfsdp-ckpt's CKPT) may name, through the tools as
// a user runs them: a save folder (its latest iteration, or --ckpt-step N), an iteration folder of
// either format with or without a trailing slash. What a loaded run computes is checked against an
// independent record: the losses the original run logged after that iteration (a resume is bit
// exact), the validation loss it logged at that iteration, and the same weights reached through a
// Hugging Face export of that iteration. Paths that hold nothing exit 2 before any work where
// something must be loaded (--finetune, mfsdp-sft, mfsdp-grpo); mfsdp-pretrain starts afresh
// with a warning, as Megatron does. A bare PyTorch dcp.save folder: tests/reference
// (dcp_fsdp2_reference_test.cpp), which needs torch.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::CommandOutcome;
using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kRun = std::string(MFSDP_RUN_BIN_PATH) + " --nproc-per-node 1 ";

const std::string kPretrain =
    kRun + MFSDP_PRETRAIN_BIN_PATH +
    " --device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32"
    " --num-attention-heads 4 --ffn-hidden-size 48 --seq-length 16 --micro-batch-size 2 --global-batch-size 4"
    " --train-iters 6 --lr 3e-3 --lr-warmup-iters 1 --clip-grad 1.0 --log-interval 1 --eval-interval 1000"
    " --eval-iters 1 --seed 7";

const std::string kTinyChatModel =
    " --device cpu --tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 1 --num-layers 2"
    " --hidden-size 32 --num-attention-heads 4 --swiglu --ffn-hidden-size 48 --seed 5 --log-interval 1 --gen-task arith"
    " --gen-train-size 64 --gen-seed 3";
const std::string kSft = kRun + MFSDP_SFT_BIN_PATH + kTinyChatModel +
                         " --max-length 64 --micro-batch-size 8 --lr 3e-3 --gen-val-size 16 --eval-iters 1"
                         " --val-generate-samples 4 --max-new-tokens 4 --eval-interval 2";
const std::string kGrpo = kRun + MFSDP_GRPO_BIN_PATH + kTinyChatModel +
                          " --gen-val-size 0 --max-prompt-length 32 --max-response-length 6 --train-batch-size 4"
                          " --rollout-n 4 --optimizer sgd --lr 0.1 --sgd-momentum 0 --clip-grad 0"
                          " --eval-interval 1000 --train-iters 1";

// The records of a metrics file: training ones by iteration, and validation ones.
struct Records {
  std::map<int64_t, nlohmann::json> steps, evals;
};
Records records(const std::string& metrics) {
  Records out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    (j.contains("eval") ? out.evals : out.steps)[j["iteration"].get<int64_t>()] = j;
  }
  return out;
}

CommandOutcome expect_ok(const std::string& command) {
  CommandOutcome r = run_command(command);
  EXPECT_EQ(r.exit_code, 0) << command << "\n" << r.output;
  return r;
}

// Exit 2 naming `needle`, before the run started.
void expect_refused(const std::string& command, const std::string& needle) {
  const CommandOutcome r = run_command(command);
  EXPECT_EQ(r.exit_code, 2) << command << "\n" << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << command << "\n" << r.output;
  EXPECT_EQ(r.output.find(" device:"), std::string::npos) << "the run started: " << command << "\n" << r.output;
}

void expect_contains(const CommandOutcome& r, const std::string& needle, const std::string& what) {
  EXPECT_NE(r.output.find(needle), std::string::npos) << what << ": no '" << needle << "' in\n" << r.output;
}

}  // namespace

TEST(LoadPaths, PretrainResumesFromEveryPathThatNamesACheckpoint) {
  TempDir dir("mfsdp-load-paths");
  const std::string save = dir.file("save"), earlier = dir.file("earlier");
  expect_ok(kPretrain + " --save " + save + " --save-interval 2 --metrics-file " + dir.file("whole.jsonl"));
  expect_ok(kPretrain + " --ckpt-format mfsdp --save " + earlier + " --save-interval 2");
  const Records whole = records(dir.file("whole.jsonl"));
  ASSERT_EQ(whole.steps.size(), 6u);

  struct Case {
    std::string load;
    int64_t after;        // the iteration the run resumes after
    std::string origin;   // what the start-up line says was loaded
  };
  const Case cases[] = {
      {save + " --ckpt-step 2", 2, "fsdp_dtensor saved by mfsdp on 1 ranks, iteration 2"},
      {save + "/iter_0000002", 2, "fsdp_dtensor saved by mfsdp on 1 ranks, iteration 2"},
      {save + "/iter_0000004/", 4, "fsdp_dtensor saved by mfsdp on 1 ranks, iteration 4"},
      {earlier + "/iter_0000002", 2, "mfsdp's earlier format saved by mfsdp on 1 ranks, iteration 2"},
      {earlier + " --ckpt-step 4", 4, "mfsdp's earlier format saved by mfsdp on 1 ranks, iteration 4"},
      {save, 6, "iteration 6"},
  };
  int tag = 0;
  for (const Case& c : cases) {
    const std::string metrics = dir.file("resumed" + std::to_string(++tag) + ".jsonl");
    const CommandOutcome r = expect_ok(kPretrain + " --load " + c.load + " --metrics-file " + metrics);
    expect_contains(r, c.origin + ") in ", c.load);
    expect_contains(r, "resuming after iteration " + std::to_string(c.after), c.load);
    const Records resumed = records(metrics);
    EXPECT_EQ(resumed.steps.size(), static_cast<size_t>(6 - c.after)) << c.load;
    // A resume is bit exact: the losses are the ones the uninterrupted run logged.
    for (const auto& [it, step] : resumed.steps)
      EXPECT_EQ(step["lm_loss"].get<double>(), whole.steps.at(it)["lm_loss"].get<double>())
          << c.load << ", iteration " << it;
  }

  // Paths that name no checkpoint of the asked step are errors before any work.
  expect_refused(kPretrain + " --load " + save + " --ckpt-step 3", "no checkpoint of step 3");
  expect_refused(kPretrain + " --load " + save + "/iter_0000002 --ckpt-step 4", "step 4 needs the save folder");
  expect_refused(kPretrain + " --ckpt-step 2", "--ckpt-step: needs --load");
  expect_refused(kPretrain + " --load " + save + "/latest_checkpointed_iteration.txt", "is a file, not a folder");
  fs::create_directories(dir.file("empty"));
  expect_refused(kPretrain + " --load " + dir.file("empty") + " --finetune",
                 "--finetune: --load " + dir.file("empty") + " holds no checkpoint");
  expect_refused(kPretrain + " --load " + dir.file("missing") + " --finetune", "does not exist");
  // Without --finetune, pretraining starts afresh from a folder with nothing saved yet (Megatron).
  for (const std::string& path : {dir.file("empty"), dir.file("missing")}) {
    const CommandOutcome r = expect_ok(kPretrain + " --load " + path + " --train-iters 1");
    expect_contains(r, "WARNING: --load " + path, path);
    expect_contains(r, "training starts from scratch", path);
  }
}

// kPretrain has no --swiglu: Megatron's GeLU MLP (up_proj, down_proj; the math is checked in
// tests/unit/megatron_model_flags_test.cpp). Its checkpoint says so, a run whose flags describe
// the SwiGLU model is refused naming --swiglu, and it has no Hugging Face export.
TEST(LoadPaths, AModelWithoutSwigluKeepsItsGeluMlpThroughItsCheckpoint) {
  TempDir dir("mfsdp-gelu");
  const std::string save = dir.file("save");
  expect_ok(kPretrain + " --train-iters 2 --save " + save);
  const CommandOutcome listed = expect_ok(std::string(MFSDP_CKPT_BIN_PATH) + " inspect " + save);
  expect_contains(listed, "model.layers.0.mlp.up_proj.weight", "inspect");
  expect_contains(listed, "model.layers.0.mlp.down_proj.weight", "inspect");
  EXPECT_EQ(listed.output.find("gate_proj"), std::string::npos) << listed.output;

  const CommandOutcome swiglu = run_command(kPretrain + " --swiglu --load " + save);
  EXPECT_NE(swiglu.exit_code, 0) << swiglu.output;
  expect_contains(swiglu, "model_config.hidden_act is \"gelu\", this run has \"silu\" (--swiglu", "--swiglu");

  const std::string hf = dir.file("hf");
  const CommandOutcome exported = run_command(std::string(MFSDP_CKPT_BIN_PATH) + " export-hf " + save + " " + hf);
  EXPECT_NE(exported.exit_code, 0) << exported.output;
  expect_contains(exported, "Megatron's GeLU MLP (trained without --swiglu)", "export-hf");
  EXPECT_FALSE(fs::exists(hf)) << "a refused export wrote " << hf;
  expect_refused(kPretrain + " --export-hf " + hf, "--export-hf: needs --swiglu");
}

TEST(LoadPaths, SftGrpoGenerateAndCkptTakeIterationFoldersAndRefuseNothingToLoad) {
  TempDir dir("mfsdp-load-paths");
  const std::string save = dir.file("sft");
  expect_ok(kSft + " --train-iters 4 --save " + save + " --save-interval 2 --metrics-file " + dir.file("sft.jsonl"));
  const Records sft = records(dir.file("sft.jsonl"));
  ASSERT_TRUE(sft.evals.count(2) && sft.evals.count(4)) << "validation at iterations 2 and 4";

  // SFT resumed from each path at the checkpoint's own iteration trains nothing and validates:
  // the validation loss the original run logged at that iteration.
  struct Case {
    std::string load;
    int64_t iteration;
  };
  int tag = 0;
  for (const Case& c : {Case{save + "/iter_0000002", 2}, Case{save + " --ckpt-step 2", 2}, Case{save, 4},
                        Case{save + "/iter_0000004/", 4}}) {
    const std::string metrics = dir.file("sft_resumed" + std::to_string(++tag) + ".jsonl");
    const CommandOutcome r = expect_ok(kSft + " --load " + c.load + " --train-iters " + std::to_string(c.iteration) +
                                       " --use-checkpoint-opt_param-scheduler --metrics-file " + metrics);
    expect_contains(r, "model: checkpoint " + save + "/iter_000000" + std::to_string(c.iteration), c.load);
    const Records resumed = records(metrics);
    ASSERT_TRUE(resumed.evals.count(c.iteration)) << c.load << "\n" << r.output;
    EXPECT_EQ(resumed.evals.at(c.iteration)["lm_loss"].get<double>(),
              sft.evals.at(c.iteration)["lm_loss"].get<double>())
        << c.load;
  }

  // GRPO from the iteration folder takes the same step as from a Hugging Face export of it, and
  // another one than from fresh weights.
  const std::string hf = dir.file("hf2");
  expect_ok(std::string(MFSDP_CKPT_BIN_PATH) + " export-hf " + save + "/iter_0000002 " + hf + " --dtype fp32");
  auto grpo_step = [&](const std::string& flags, const std::string& name) {
    const std::string metrics = dir.file(name + ".jsonl");
    const CommandOutcome r = expect_ok(kGrpo + flags + " --metrics-file " + metrics);
    const Records got = records(metrics);
    EXPECT_EQ(got.steps.size(), 1u) << r.output;
    return std::make_pair(r, got.steps.empty() ? nlohmann::json::object() : got.steps.begin()->second);
  };
  const auto [from_folder_log, from_folder] = grpo_step(" --load " + save + "/iter_0000002 --finetune", "grpo_folder");
  expect_contains(from_folder_log, "loaded checkpoint " + save + "/iter_0000002 (", "grpo --load iteration folder");
  expect_contains(from_folder_log, "weights only (--finetune)", "grpo --load iteration folder");
  const auto from_hf = grpo_step(" --hf-load " + hf, "grpo_hf").second;
  const auto fresh = grpo_step("", "grpo_fresh").second;
  for (const char* key : {"critic/score/mean", "response_length/mean", "actor/entropy", "actor/pg_loss"}) {
    ASSERT_TRUE(from_folder.contains(key) && from_hf.contains(key)) << key;
    EXPECT_NEAR(from_folder[key].get<double>(), from_hf[key].get<double>(),
                1e-5 * std::max(1.0, std::abs(from_hf[key].get<double>())))
        << key;
  }
  EXPECT_NE(from_folder["actor/entropy"].get<double>(), fresh["actor/entropy"].get<double>())
      << "the iteration folder's weights were not loaded";

  // mfsdp-generate reads the iteration folder as the export of it.
  const std::string gen = std::string(MFSDP_GENERATE_BIN_PATH) + " --prompt-ids 12,13,14 --greedy --print-ids "
                                                                   "--max-new-tokens 6 --device cpu --model ";
  const CommandOutcome from_iter = expect_ok(gen + save + "/iter_0000002");
  const CommandOutcome from_export = expect_ok(gen + hf);
  EXPECT_EQ(from_iter.output, from_export.output);

  // mfsdp-ckpt inspect of the iteration folder shows its metadata and a real element count.
  const CommandOutcome inspect = expect_ok(std::string(MFSDP_CKPT_BIN_PATH) + " inspect " + save + "/iter_0000002");
  expect_contains(inspect, "CHECKPOINT METADATA", "inspect");
  expect_contains(inspect, "\"iteration\": 2", "inspect");
  EXPECT_EQ(inspect.output.find("Metadata file not found"), std::string::npos) << inspect.output;
  EXPECT_EQ(inspect.output.find("Total Elements: 0.00B"), std::string::npos) << inspect.output;
  expect_contains(inspect, "K (", "inspect: a small model's elements in thousands");

  // Nothing to load: SFT and GRPO stop before any work, naming the path and what was expected.
  fs::create_directories(dir.file("empty"));
  for (const std::string& tool : {kSft + " --train-iters 2", kGrpo}) {
    expect_refused(tool + " --load " + dir.file("empty"),
                   "--load: " + dir.file("empty") + " holds no checkpoint");
    expect_refused(tool + " --load " + dir.file("missing"), "--load: " + dir.file("missing") + " does not exist");
    expect_refused(tool + " --load " + dir.file("empty") + " --finetune", "nothing to fine-tune from");
    expect_refused(tool + " --load " + save + " --ckpt-step 3", "no checkpoint of step 3");
  }
  const CommandOutcome no_model = run_command(gen + dir.file("empty"));
  EXPECT_NE(no_model.exit_code, 0);
  expect_contains(no_model, dir.file("empty"), "mfsdp-generate --model of an empty folder");
}
