// Streaming Hugging Face loads (docs/checkpoints.md, "Hugging Face"), against values transformers
// wrote: tests/reference/make_hf_llama.py saves a random Llama in bf16 with save_pretrained, split
// into several safetensors files and an index, and writes every parameter again as fp32 by torch's
// own conversion (the independent reference).
//
//   EveryRanksShardHoldsTransformersValues: in 1 and 3 real processes, under ZeRO-3, ZeRO-1 and
//     no_shard, with and without bf16 model weights, the model built with deferred init and
//     loaded by load_hf_shards holds in every rank's shard (main weights, and model weights after
//     the refresh) exactly the reference's elements, and the full state dict equals the
//     reference; the bytes each rank read are its share, not the model.
//   SftHfLoadSavesTransformersValues: mfsdp-sft --hf-load on 3 ranks, one step at lr 0, --save:
//     every tensor of the checkpoint (each element written by the rank that loaded it) equals the
//     reference.
//   ImportHfWritesTransformersValues: mfsdp-ckpt import-hf of the same folder holds the reference's
//     values in the folder's dtype.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "harness/dist_test.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/checkpoint/tensor_source.h"
#include "mfsdp/train/training_run.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::CommandOutcome;
using mfsdp::testing::run_command;

const std::string kPython = MFSDP_PYTHON_PATH;
const std::string kFixture = MFSDP_FIXTURE_SCRIPT;

std::string q(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The fixture in `dir`: hf/ (bf16, 4 files and an index, untied; the embedding is the largest
// tensor, so the files split inside the model) and expected.safetensors (fp32).
void make_fixture(const std::string& dir) {
  const CommandOutcome r = run_command("env OMP_NUM_THREADS=1 " + q(kPython) + " " + q(kFixture) + " " +
                                       q(dir + "/hf") + " --layers 2 --hidden 64 --ffn 160 --heads 4 --kv-heads 2"
                                       " --vocab 300 --dtype bf16 --max-shard-size 60KB --expected " +
                                       q(dir + "/expected.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(fs::exists(dir + "/hf/model.safetensors.index.json")) << "expected several files:\n" << r.output;
}

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

mfsdp::PretrainArgs args_for(const std::string& strategy, bool bf16) {
  mfsdp::PretrainArgs a;
  a.data_parallel_sharding_strategy = strategy;
  a.bf16 = bf16;
  a.seed = 11;
  return a;
}


void check_every_shard(mfsdp::Communicator& comm) {
  const std::string dir = mfsdp::testing::shared_temp_dir(), hf = dir + "/hf";
  const std::map<std::string, at::Tensor> expected = mfsdp::SafetensorsFile(dir + "/expected.safetensors").load_all();
  const mfsdp::ModelConfig config = mfsdp::describe_hf_model(mfsdp::TensorSource(hf)).config;
  int64_t model_bytes = 0;
  for (const auto& [name, t] : expected) model_bytes += t.numel() * 2;  // bf16 in the files
  for (const std::string strategy : {"optim_grads_params", "optim", "no_shard"})
    for (const bool bf16 : {false, true}) {
      SCOPED_TRACE(strategy + (bf16 ? " bf16" : " fp32"));
      const mfsdp::PretrainArgs a = args_for(strategy, bf16);
      mfsdp::FullyShardOptions shard = mfsdp::shard_options_from_args(a, a, a, /*per_token_loss=*/true);
      shard.comm = borrow(comm);
      mfsdp::ShardedModel m = mfsdp::build_sharded_model(
          config, mfsdp::model_build_options(a, a, a, a, a, /*values_loaded=*/true), /*use_sdpa=*/true, shard);
      const int64_t read = mfsdp::load_hf_shards(hf, m.root, comm);
      if (strategy != "no_shard" && comm.size() > 1) EXPECT_LT(read, model_bytes) << "a rank read the whole model";
      for (const mfsdp::LocalShard& s : m.root.local_shards()) {
        ASSERT_TRUE(expected.count(s.name)) << s.name;
        const at::Tensor want = expected.at(s.name).reshape({-1}).narrow(0, s.offset, s.local.numel());
        EXPECT_TRUE(at::equal(s.local.to(at::kFloat), want))
            << "rank " << comm.rank() << ": '" << s.name << "' elements [" << s.offset << ", "
            << s.offset + s.local.numel() << ")";
      }
      // The full values, gathered from every rank's shard.
      const std::map<std::string, at::Tensor> full = m.root.full_state_dict(/*all_ranks=*/true);
      EXPECT_EQ(full.size(), expected.size());
      for (const auto& [name, t] : full) {
        ASSERT_TRUE(expected.count(name)) << name;
        EXPECT_TRUE(at::equal(t.to(at::kFloat), expected.at(name))) << "rank " << comm.rank() << ": '" << name << "'";
      }
      // Replicated model weights (ZeRO-1, no_shard) are whole on every rank: refreshed from the
      // loaded main weights (bf16 holds the file's bf16 values exactly).
      if (strategy != "optim_grads_params")
        for (const auto& p : m.model->named_parameters())
          EXPECT_TRUE(at::equal(p.value().detach().to(at::kFloat), expected.at(p.key())))
              << "rank " << comm.rank() << ": model weights of '" << p.key() << "'";
    }
}

}  // namespace

TEST(HfStreamLoad, EveryRanksShardHoldsTransformersValues) {
  mfsdp::testing::DistOptions o;
  o.world_sizes = {1, 3};
  std::unique_ptr<mfsdp::testing::TempDir> tmp;
  if (!mfsdp::testing::is_rank_process()) {
    tmp = std::make_unique<mfsdp::testing::TempDir>("hf-stream");
    make_fixture(tmp->path().string());
    if (HasFatalFailure()) return;
    o.shared_dir = tmp->path().string();
  }
  mfsdp::testing::run_distributed(o, check_every_shard);
}

TEST(HfStreamLoad, SftHfLoadSavesTransformersValues) {
  mfsdp::testing::TempDir tmp("hf-stream-sft");
  const std::string dir = tmp.path().string();
  make_fixture(dir);
  if (HasFatalFailure()) return;
  const CommandOutcome r = run_command(
      q(MFSDP_RUN_BIN_PATH) + " --nproc-per-node 3 " + q(MFSDP_SFT_BIN_PATH) +
      " --device cpu --tokenizer-type ByteLevelTokenizer --gen-task arith --gen-train-size 16 --gen-seed 3"
      " --hf-load " + q(dir + "/hf") + " --max-length 64 --micro-batch-size 1 --global-batch-size 3"
      " --train-iters 1 --lr 0 --min-lr 0 --log-interval 1 --save " + q(dir + "/ckpt") + " --save-interval 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const mfsdp::CheckpointReader reader(dir + "/ckpt");
  const std::map<std::string, at::Tensor> expected = mfsdp::SafetensorsFile(dir + "/expected.safetensors").load_all();
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(reader.contains("model." + name)) << name;
    EXPECT_TRUE(at::equal(reader.read("model." + name).to(at::kFloat), t)) << name;
  }
}

TEST(HfStreamLoad, ImportHfWritesTransformersValues) {
  mfsdp::testing::TempDir tmp("hf-stream-import");
  const std::string dir = tmp.path().string();
  make_fixture(dir);
  if (HasFatalFailure()) return;
  const CommandOutcome r =
      run_command(q(MFSDP_CKPT_BIN_PATH) + " import-hf " + q(dir + "/hf") + " " + q(dir + "/ckpt"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const mfsdp::CheckpointReader reader(dir + "/ckpt");
  const std::map<std::string, at::Tensor> expected = mfsdp::SafetensorsFile(dir + "/expected.safetensors").load_all();
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(reader.contains("model." + name)) << name;
    EXPECT_EQ(reader.dtype("model." + name), at::kBFloat16) << name;
    EXPECT_TRUE(at::equal(reader.read("model." + name).to(at::kFloat), t)) << name;
  }
}
