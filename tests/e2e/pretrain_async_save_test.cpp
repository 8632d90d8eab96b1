// mfsdp-pretrain --async-save end to end, through mfsdp-run, with the synchronous save of the same
// run as the independent reference: every checkpoint holds the same values (the rank files without
// the run's arguments byte for byte), resuming from one is bit-exact, the last save is committed
// before the process exits (also at an --exit-interval stop), and the flag is refused, naming
// it, where it does not apply.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "harness/file_bytes.h"
#include "harness/metrics_file.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/base/directory_tree.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::CommandOutcome;
using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kModel =
    " --device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu"
    " --ffn-hidden-size 48 --seq-length 16 --micro-batch-size 2 --global-batch-size 8"
    " --train-iters 8 --lr 3e-3 --lr-warmup-iters 2 --lr-decay-style cosine --min-lr 3e-4"
    " --clip-grad 1.0 --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 7";

CommandOutcome pretrain(int ranks, const std::string& flags) {
  return run_command(std::string(MFSDP_RUN_BIN_PATH) + " --nproc-per-node " + std::to_string(ranks) + " " +
                     MFSDP_PRETRAIN_BIN_PATH + kModel + flags);
}

std::string latest_of(const std::string& save) {
  return mfsdp::testing::slurp(save + "/latest_checkpointed_iteration.txt");
}

// Two checkpoints of one state: the same tensors with the same bits, the same record apart from
// the run's arguments, and rank 1's file (which holds no arguments) the same bytes.
void expect_same_checkpoint(const std::string& a, const std::string& b) {
  mfsdp::CheckpointReader ra(a), rb(b);
  ASSERT_EQ(ra.tensor_names(), rb.tensor_names()) << a << " vs " << b;
  for (const std::string& name : ra.tensor_names())
    EXPECT_TRUE(ra.read(name).equal(rb.read(name))) << name << " differs between " << a << " and " << b;
  nlohmann::json ma = ra.metadata(), mb = rb.metadata();
  for (auto* m : {&ma, &mb}) m->erase("args");
  EXPECT_EQ(ma, mb);
  EXPECT_TRUE(mfsdp::testing::slurp(a + "/__1_0.distcp") == mfsdp::testing::slurp(b + "/__1_0.distcp"));
  EXPECT_GT(rb.verify_checksums().first, 0);
}

}  // namespace

TEST(PretrainAsyncSave, CheckpointsEqualTheSyncOnesAndResumeBitExactly) {
  TempDir dir("mfsdp-async-save");
  const std::string sync = dir.file("sync"), async = dir.file("async");
  CommandOutcome reference = pretrain(2, " --save " + sync + " --save-interval 4 --metrics-file " + dir.file("whole.jsonl"));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  CommandOutcome run = pretrain(2, " --save " + async + " --save-interval 4 --async-save");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("checkpoint of iteration 4 staged in"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("committed checkpoint of iteration 4"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("committed checkpoint of iteration 8"), std::string::npos)
      << "the last save must be committed before the exit\n" << run.output;
  EXPECT_EQ(latest_of(async), "8\n");
  for (const char* iter : {"/iter_0000004", "/iter_0000008"}) expect_same_checkpoint(sync + iter, async + iter);
  EXPECT_EQ(mfsdp::list_directory(async), mfsdp::list_directory(sync)) << "no leftovers of the background saves";

  CommandOutcome resumed = pretrain(2, " --load " + async + " --ckpt-step 4 --metrics-file " + dir.file("resumed.jsonl"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  auto whole = mfsdp::testing::losses_by_iteration(dir.file("whole.jsonl"));
  auto second = mfsdp::testing::losses_by_iteration(dir.file("resumed.jsonl"));
  ASSERT_EQ(second.size(), 4u) << "the resumed run must start at iteration 5";
  for (const auto& [it, loss] : second) EXPECT_EQ(loss, whole.at(it)) << "iteration " << it;

  // An --exit-interval stop is the end of the process too: its save is committed first.
  const std::string stop = dir.file("stop");
  CommandOutcome stopped = pretrain(2, " --save " + stop + " --save-interval 2 --exit-interval 4 --async-save");
  ASSERT_EQ(stopped.exit_code, 0) << stopped.output;
  EXPECT_EQ(latest_of(stop), "4\n");
  expect_same_checkpoint(sync + "/iter_0000004", stop + "/iter_0000004");
  EXPECT_TRUE(fs::is_directory(stop + "/iter_0000002"));
}

TEST(PretrainAsyncSave, IsRefusedNamingTheFlagWhereItDoesNotApply) {
  TempDir dir("mfsdp-async-flags");
  CommandOutcome legacy = pretrain(1, " --save " + dir.file("c") + " --async-save --ckpt-format mfsdp");
  EXPECT_EQ(legacy.exit_code, 2) << legacy.output;
  EXPECT_NE(legacy.output.find("--async-save: needs --ckpt-format fsdp_dtensor (got --ckpt-format mfsdp)"),
            std::string::npos) << legacy.output;
  CommandOutcome no_save = pretrain(1, " --async-save");
  EXPECT_EQ(no_save.exit_code, 2) << no_save.output;
  EXPECT_NE(no_save.output.find("--async-save: needs --save"), std::string::npos) << no_save.output;
}
