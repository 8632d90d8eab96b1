// Reference test (ctest label "reference"): fsdp_dtensor checkpoints cross between mfsdp and the
// real PyTorch FSDP2 (torch.distributed.fsdp.fully_shard + torch.distributed.checkpoint, the
// environment's torch, Gloo on CPU) in both directions, with the AdamW state. The Python side is
// tests/reference/dcp_fsdp2_reference.py; the training recipe (batches, AdamW hyperparameters,
// 6 sequences per step over the ranks) is written out on both sides and must stay in sync.
//
//   mfsdp -> FSDP2: mfsdp trains two AdamW steps on 2 ranks under ZeRO-3 and saves; FSDP2 on 3
//     ranks loads the checkpoint with dcp.load, and its logits and its weights after one more
//     step equal mfsdp's (which mfsdp took after saving).
//   FSDP2 -> mfsdp: FSDP2 on 3 ranks trains two steps and saves with dcp.save, under
//     Megatron-FSDP's names (a save folder) and under PyTorch's own (a bare dcp.save folder: no
//     latest file, no iteration, no model config); mfsdp loads each on 2 ranks (ZeRO-3 and
//     no_shard), and its logits and weights after one more step equal FSDP2's. The bare folder
//     through the tools: mfsdp-ckpt inspect shows what it holds, mfsdp-generate (given the
//     model's config.json) and its mfsdp-ckpt export-hf give FSDP2's logits, mfsdp-pretrain and
//     mfsdp-sft start from it with the model the flags describe.
//
// A missing reference Python, torch or transformers is a failure (not a skip).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "harness/dist_test.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/llama.h"

namespace {

namespace fs = std::filesystem;

const std::string kPython = MFSDP_PYTHON_PATH;
const std::string kScript = MFSDP_REFERENCE_SCRIPT;
constexpr int64_t kRows = 6, kSeq = 9;
constexpr double kLr = 1e-3;
constexpr double kLogitTol = 2e-5, kWeightTol = 1e-6;  // as in the Python side

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

mfsdp::LlamaConfig config() {
  mfsdp::LlamaConfig c;
  c.vocab_size = 320;  // a byte-level tokenizer's 257 ids fit: mfsdp-sft loads FSDP2's checkpoint below
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  return c;
}

at::Tensor batch(int64_t k) {
  return (at::arange(kRows * kSeq, at::kLong) * (2 * k + 3) + k).remainder(config().vocab_size).view({kRows, kSeq});
}
at::Tensor eval_ids() { return (at::arange(16, at::kLong) * 5 + 1).remainder(config().vocab_size).view({2, 8}); }

struct Trainer {
  mfsdp::LlamaForCausalLM model;
  mfsdp::FsdpHandle root;
  std::unique_ptr<mfsdp::DistributedOptimizer> optimizer;

  Trainer(mfsdp::Communicator& comm, mfsdp::ShardingStrategy strategy) : model(config(), options()) {
    mfsdp::FullyShardOptions o;
    o.comm = borrow(comm);
    o.strategy = strategy;
    root = mfsdp::shard_llama(model, o);
    mfsdp::AdamWOptions a;
    a.beta2 = 0.95;
    a.weight_decay = 0.1;
    optimizer = mfsdp::make_adamw(root, a);
  }
  static mfsdp::LlamaOptions options() {
    mfsdp::LlamaOptions o;
    o.init_seed = 11;
    return o;
  }
  void step(int64_t k, int rank, int world) {
    at::Tensor ids = batch(k).narrow(0, rank * kRows / world, kRows / world);
    mfsdp::lm_loss(model->call(ids.narrow(1, 0, kSeq - 1)), ids.narrow(1, 1, kSeq - 1)).backward();
    optimizer->step(kLr);
    root.zero_grad();
  }
  at::Tensor logits() {
    torch::NoGradGuard no_grad;
    return model->call(eval_ids());
  }
};

std::string q(const std::string& s) { return "'" + s + "'"; }

void run_python(const std::string& mode, const std::string& path, const std::string& config_json,
                const std::string& expected) {
  const std::string cmd = "env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 " + q(kPython) + " " + q(kScript) + " " + mode +
                          " " + q(path) + " " + q(config_json) + " " + q(expected) + " 3";
  const auto outcome = mfsdp::testing::run_command(cmd);
  std::cout << outcome.output;
  ASSERT_EQ(outcome.exit_code, 0) << cmd << "\n" << outcome.output;
}

void write_config(const std::string& path) {
  std::ofstream(path) << mfsdp::llama_hf_config(config(), at::kFloat).dump(1);
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// The logits mfsdp-generate --logits-out writes for the first row of eval_ids.
at::Tensor generated_logits(const std::string& model_flags, const std::string& out) {
  std::string ids;
  for (int64_t i = 0; i < eval_ids().size(1); ++i) {
    if (i > 0) ids += ",";
    ids += std::to_string(eval_ids()[0][i].item<int64_t>());
  }
  const auto r = mfsdp::testing::run_command(std::string(MFSDP_GENERATE_BIN_PATH) + " --device cpu --greedy " +
                                             "--max-new-tokens 1 --prompt-ids " + ids + " --logits-out " + out + " " +
                                             model_flags);
  EXPECT_EQ(r.exit_code, 0) << model_flags << "\n" << r.output;
  return r.exit_code == 0 ? mfsdp::SafetensorsFile(out).load("logits") : at::Tensor();
}

void expect_output(const std::string& command, int exit_code, std::initializer_list<std::string> needles,
                   std::initializer_list<std::string> absent = {}) {
  const auto r = mfsdp::testing::run_command(command);
  EXPECT_EQ(r.exit_code, exit_code) << command << "\n" << r.output;
  for (const std::string& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << n << " in\n" << r.output;
  for (const std::string& n : absent) EXPECT_EQ(r.output.find(n), std::string::npos) << n << " in\n" << r.output;
}

// What dcp.save alone wrote, through every tool that takes a checkpoint path.
void expect_tools_read_bare_fsdp2_folder(const std::string& bare, const std::string& config_json,
                                         const std::string& expected, const mfsdp::testing::TempDir& dir) {
  ASSERT_TRUE(fs::exists(bare + "/.metadata"));
  ASSERT_FALSE(fs::exists(bare + "/latest_checkpointed_iteration.txt"));
  const std::string ckpt = MFSDP_CKPT_BIN_PATH;
  expect_output(ckpt + " inspect " + bare, 0, {"CHECKPOINT METADATA", "no mfsdp_metadata entry", "K ("},
                {"Metadata file not found", "Total Elements: 0.00B"});

  // Generation needs the model: the checkpoint records none, so it is given as config.json.
  expect_output(std::string(MFSDP_GENERATE_BIN_PATH) + " --prompt-ids 1,2 --model " + bare, 1,
                {"records no model_config", "--model-config"});
  const at::Tensor want = mfsdp::SafetensorsFile(expected).load("logits")[0];
  const double scale = std::max(1.0, want.abs().max().item<double>());
  const at::Tensor from_bare = generated_logits("--model " + bare + " --model-config " + config_json,
                                                dir.file("bare_logits.safetensors"));
  ASSERT_TRUE(from_bare.defined());
  EXPECT_LE(max_diff(from_bare[0], want), kLogitTol * scale) << "mfsdp-generate of the bare FSDP2 folder";
  const std::string hf = dir.file("bare_hf");
  expect_output(ckpt + " export-hf " + bare + " " + hf + " --model-config " + config_json, 0, {"wrote"});
  const at::Tensor from_export = generated_logits("--model " + hf, dir.file("export_logits.safetensors"));
  ASSERT_TRUE(from_export.defined());
  EXPECT_LE(max_diff(from_export[0], want), kLogitTol * scale) << "its Hugging Face export";

  // The trainers start from it with the model their flags describe (config(): untied, GQA 4/2).
  const std::string model = " --device cpu --num-layers 2 --hidden-size 16 --swiglu --ffn-hidden-size 24"
                            " --num-attention-heads 4 --group-query-attention --num-query-groups 2"
                            " --max-position-embeddings 64 --untie-embeddings-and-output-weights --log-interval 1"
                            " --train-iters 1 --eval-interval 1000 --seed 3";
  const std::string run = std::string(MFSDP_RUN_BIN_PATH) + " --nproc-per-node 1 ";
  expect_output(run + MFSDP_PRETRAIN_BIN_PATH + model + " --mock-data --vocab-size 320 "
                    "--make-vocab-size-divisible-by 1 --seq-length 8 --micro-batch-size 2 --load " + bare,
                0, {"loaded checkpoint " + bare + " (a PyTorch Distributed Checkpoint not written by mfsdp, no iteration "
                    "recorded (taken as 0))", "model weights, optimizer state", "resuming after iteration 0"});
  const std::string sft = run + MFSDP_SFT_BIN_PATH + model +
                          " --tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 64 --max-length 64"
                          " --micro-batch-size 4 --gen-task arith --gen-train-size 16 --gen-val-size 0";
  expect_output(sft + " --load " + bare + " --finetune", 0,
                {"model: checkpoint " + bare + " (iteration 0; no model_config recorded: the model from the flags)",
                 "weights only (--finetune)"});
  // Flags that describe another model fail on the first tensor that differs, naming it.
  expect_output(sft + " --load " + bare + " --finetune --ffn-hidden-size 32", 1, {"mlp"});
}

TEST(DcpFsdp2Reference, MfsdpCheckpointLoadsInFsdp2) {
  mfsdp::testing::TempDir dir("mfsdp-dcp-ref");
  const std::string save = dir.file("ckpt"), expected = dir.file("expected.safetensors");
  mfsdp::testing::DistOptions options;
  options.world_sizes = {2};
  options.phase = "save";
  options.shared_dir = dir.path().string();
  mfsdp::testing::run_distributed(options, [&](mfsdp::Communicator& comm) {
    const std::string shared = mfsdp::testing::shared_temp_dir();
    const std::string save = shared + "/ckpt", expected = shared + "/expected.safetensors";
    Trainer t(comm, mfsdp::ShardingStrategy::kOptimGradsParams);
    for (int64_t k : {0, 1}) t.step(k, comm.rank(), comm.size());
    mfsdp::CheckpointInfo info;
    info.iteration = 2;
    info.model_config = mfsdp::llama_hf_config(config(), at::kFloat);
    mfsdp::save_checkpoint(save, borrow(comm), t.root, t.optimizer.get(), info);
    at::Tensor logits = t.logits();
    t.step(2, comm.rank(), comm.size());
    auto full = t.root.full_state_dict(/*all_ranks=*/true);
    if (comm.rank() == 0) {
      std::vector<std::pair<std::string, at::Tensor>> out = {{"logits", logits}};
      for (const auto& [name, value] : full) out.emplace_back("weights." + name, value);
      mfsdp::write_safetensors(expected, out);
    }
  });
  if (mfsdp::testing::is_rank_process()) return;
  ASSERT_TRUE(fs::exists(save + "/iter_0000002/.metadata"));
  write_config(dir.file("config.json"));
  run_python("load", save + "/iter_0000002", dir.file("config.json"), expected);
}

TEST(DcpFsdp2Reference, Fsdp2CheckpointLoadsInMfsdp) {
  mfsdp::testing::TempDir dir("mfsdp-dcp-ref");
  const std::string save = dir.file("fsdp2"), expected = dir.file("expected.safetensors");
  if (!mfsdp::testing::is_rank_process()) {
    write_config(dir.file("config.json"));
    run_python("save", save, dir.file("config.json"), expected);
  }
  for (const char* layout : {"megatron", "plain"})
    for (auto strategy : {mfsdp::ShardingStrategy::kOptimGradsParams, mfsdp::ShardingStrategy::kNoShard}) {
      mfsdp::testing::DistOptions options;
      options.world_sizes = {2};
      options.phase = std::string(layout) + std::to_string(static_cast<int>(strategy));
      options.shared_dir = dir.path().string();
      mfsdp::testing::run_distributed(options, [&](mfsdp::Communicator& comm) {
        const std::string shared = mfsdp::testing::shared_temp_dir();
        const std::string save = shared + "/fsdp2", expected = shared + "/expected.safetensors";
        const std::string where = std::string(layout) + " checkpoint, strategy " + std::to_string(static_cast<int>(strategy));
        Trainer t(comm, strategy);
        const mfsdp::LoadedCheckpoint got =
            mfsdp::load_checkpoint(save + "/" + layout, borrow(comm), t.root, t.optimizer.get());
        EXPECT_EQ(got.iteration, std::string(layout) == "megatron" ? 2 : 0) << where;  // plain: no "iteration"
        EXPECT_TRUE(got.optimizer_loaded) << where;
        EXPECT_EQ(t.optimizer->steps(), 2) << where;
        const mfsdp::SafetensorsFile want(expected);
        at::Tensor logits = t.logits(), want_logits = want.load("logits");
        const double logit_diff = max_diff(logits, want_logits);
        EXPECT_LE(logit_diff, kLogitTol * std::max(1.0, want_logits.abs().max().item<double>())) << where;
        t.step(2, comm.rank(), comm.size());
        double worst = 0;
        for (const auto& [name, value] : t.root.full_state_dict(/*all_ranks=*/true)) {
          const double d = max_diff(value, want.load("weights." + name));
          EXPECT_LE(d, kWeightTol) << where << ": " << name;
          worst = std::max(worst, d);
        }
        if (comm.rank() == 0)
          std::cout << where << ": logits max |diff| " << logit_diff << ", weights after one more step max |diff| "
                    << worst << "\n";
      });
    }
  if (mfsdp::testing::is_rank_process()) return;
  expect_tools_read_bare_fsdp2_folder(save + "/plain", dir.file("config.json"), expected, dir);
}

}  // namespace
