// Megatron's non-persistent checkpoints (--non-persistent-save-interval, --non-persistent-ckpt-type
// local / global), checked against an uninterrupted run of the same job (2 ranks, ZeRO-3):
//  - local: a rank killed after a local checkpoint; mfsdp-run --max-restarts 1 restarts the job,
//    which resumes from the local checkpoint (newer than any persistent one) and ends with the
//    uninterrupted run's losses and weights, bit for bit. A job killed for good, whose rank 1
//    lost its own files and whose rank 0's file was corrupted, resumes from the replicas each
//    peer kept (the corrupt file named in the log); a run of another layout never takes them.
//  - global: the same through <save>/non_persistent, which keeps only the newest checkpoint.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "harness/metrics_file.h"
#include "harness/same_weights.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/checkpoint/load_model.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;
using mfsdp::testing::expect_same_weights;
const auto losses = mfsdp::testing::losses_by_iteration;

const std::string kRun = MFSDP_RUN_BIN_PATH;
const std::string kPretrain = MFSDP_PRETRAIN_BIN_PATH;
const std::string kMfsdpRun = "env OMP_NUM_THREADS=1 " + kRun + " --nproc-per-node 2";
// ~0.15 s an iteration on 2 CPU ranks, so that a rank can be killed mid-run.
const std::string kModel =
    " --device cpu --tokenizer-type ByteLevelTokenizer --mock-data --num-layers 4 --hidden-size 128"
    " --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --log-interval 1"
    " --seed 3 --eval-interval 1000 --data-parallel-sharding-strategy optim_grads_params --save-interval 20";
const std::string kJob = kModel + " --train-iters 12";

// Runs `command` and, once a file matching the shell glob `ready` exists, SIGKILLs one of its
// mfsdp-pretrain processes (the last found: rank 1 of mfsdp-run's two); returns its outcome.
mfsdp::testing::CommandOutcome run_killed_when(const TempDir& dir, const std::string& command,
                                               const std::string& ready) {
  std::ofstream(dir.file("kill_once.sh")) << command << " &\n"
                                             "launcher=$!\n"
                                             "for _ in $(seq 1 2400); do\n"
                                             "  ls " << ready << " >/dev/null 2>&1 && break\n"
                                             "  sleep 0.05\n"
                                             "done\n"
                                             "victim=; frontier=$launcher\n"
                                             "while [ -n \"$frontier\" ]; do\n"
                                             "  frontier=$(for p in $frontier; do pgrep -P $p; done)\n"
                                             "  for p in $frontier; do\n"
                                             "    [ \"$(cat /proc/$p/comm 2>/dev/null)\" = mfsdp-pretrain ] && victim=$p\n"
                                             "  done\n"
                                             "done\n"
                                             "[ -n \"$victim\" ] || { echo 'no rank left to kill: the job ended first'; exit 99; }\n"
                                             "echo \"killing process $victim\"\n"
                                             "kill -KILL $victim\n"
                                             "wait $launcher\n";
  return run_command("bash " + dir.file("kill_once.sh"));
}

// The iteration named after `prefix` in `output` (-1: not there).
int64_t iteration_after(const std::string& output, const std::string& prefix) {
  const size_t at = output.find(prefix);
  return at == std::string::npos ? -1 : std::stoll(output.substr(at + prefix.size()));
}

// Flips one byte in the middle of `path`.
void corrupt(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f) << path;
  f.seekg(0, std::ios::end);
  const std::streamoff middle = f.tellg() / 2;
  f.seekg(middle);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(middle);
  f.write(&c, 1);
}

TEST(NonPersistent, LocalCheckpointsResumeAKilledJobFromItsRanksOrTheirReplicas) {
  TempDir dir("mfsdp-np-local");
  const auto ref = run_command(kMfsdpRun + " " + kPretrain + kJob + " --metrics-file " + dir.file("ref.jsonl") +
                               " --save " + dir.file("ref"));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const auto want = losses(dir.file("ref.jsonl"));
  ASSERT_EQ(want.size(), 12u);

  // Restarted by mfsdp-run: the newest local checkpoint, with no persistent one to compete.
  const std::string local = dir.file("local");
  const std::string np = " --non-persistent-save-interval 3 --non-persistent-ckpt-type local"
                         " --non-persistent-local-ckpt-dir " + local;
  const std::string save = dir.file("ck");
  const auto r = run_killed_when(dir,
                                 kMfsdpRun + " --max-restarts 1 " + kPretrain + kJob + np + " --metrics-file " +
                                     dir.file("restarted.jsonl") + " --save " + save + " --load " + save,
                                 local + "/*/iter_0000006/rank_00001.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const int64_t resumed = iteration_after(r.output, " loaded the non-persistent local checkpoint of iteration ");
  EXPECT_GE(resumed, 6) << r.output;
  EXPECT_LT(resumed, 12) << "the kill came after the run ended: the test proves nothing\n" << r.output;
  EXPECT_NE(r.output.find(" restart 1: resumed after iteration " + std::to_string(resumed)), std::string::npos)
      << r.output;
  EXPECT_EQ(losses(dir.file("restarted.jsonl")), want);
  expect_same_weights(save + "/iter_0000012", dir.file("ref/iter_0000012"));
  // Only the newest is kept (iteration 12's: the run's last iteration is a multiple of 3).
  int folders = 0;
  for (const std::string& job : mfsdp::list_directory(local))
    for (const std::string& it : mfsdp::list_directory(local + "/" + job)) {
      EXPECT_EQ(it, "iter_0000012");
      ++folders;
    }
  EXPECT_EQ(folders, 1);

  // Killed for good (no restart left): the local checkpoint is all there is.
  const std::string local2 = dir.file("local2"), save2 = dir.file("ck2");
  const std::string np2 = " --non-persistent-save-interval 3 --non-persistent-ckpt-type local"
                          " --non-persistent-local-ckpt-dir " + local2;
  const auto killed = run_killed_when(dir, kMfsdpRun + " " + kPretrain + kJob + np2 + " --save " + save2,
                                      local2 + "/*/iter_0000006/rank_00001.json");
  ASSERT_NE(killed.exit_code, 0) << killed.output;
  fs::path newest;
  for (const std::string& job : mfsdp::list_directory(local2))
    for (const std::string& it : mfsdp::list_directory(local2 + "/" + job))
      if (const fs::path p = fs::path(local2) / job / it;
          fs::exists(p / "replica_00000.json") && fs::exists(p / "replica_00001.json"))
        newest = p;
  ASSERT_FALSE(newest.empty());
  const int64_t kept = std::stoll(newest.filename().string().substr(5));

  // Another layout (one rank) never takes it: each rank's shards would not fit.
  const auto other = run_command("env OMP_NUM_THREADS=1 " + kRun + " " + kPretrain + kModel + " --train-iters 1" +
                                 " --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir " + local2 +
                                 " --load " + save2 + " --save " + dir.file("other"));
  ASSERT_EQ(other.exit_code, 0) << other.output;
  EXPECT_NE(other.output.find("was saved in another layout"), std::string::npos) << other.output;
  EXPECT_EQ(other.output.find(" loaded the non-persistent local checkpoint"), std::string::npos) << other.output;

  // Rank 1's own files lost, rank 0's corrupted: both resume from the replica the other kept.
  fs::remove(newest / "rank_00001.safetensors");
  fs::remove(newest / "rank_00001.json");
  corrupt((newest / "rank_00000.safetensors").string());
  const auto resumed2 = run_command(kMfsdpRun + " " + kPretrain + kJob + np2 + " --metrics-file " +
                                    dir.file("resumed2.jsonl") + " --save " + save2 + " --load " + save2);
  ASSERT_EQ(resumed2.exit_code, 0) << resumed2.output;
  EXPECT_NE(resumed2.output.find("rank_00000.safetensors: the bytes do not match their checksum"), std::string::npos)
      << resumed2.output;
  EXPECT_EQ(iteration_after(resumed2.output, " loaded the non-persistent local checkpoint of iteration "), kept)
      << resumed2.output;
  auto got = losses(dir.file("resumed2.jsonl"));
  ASSERT_EQ(got.size(), static_cast<size_t>(12 - kept));
  for (const auto& [it, loss] : got) EXPECT_EQ(loss, want.at(it)) << "iteration " << it;
  expect_same_weights(save2 + "/iter_0000012", dir.file("ref/iter_0000012"));
}

TEST(NonPersistent, GlobalCheckpointIsTakenWhenNewerAndOnlyTheNewestIsKept) {
  TempDir dir("mfsdp-np-global");
  const auto ref = run_command(kMfsdpRun + " " + kPretrain + kJob + " --metrics-file " + dir.file("ref.jsonl") +
                               " --save " + dir.file("ref"));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string save = dir.file("ck");
  const auto r = run_killed_when(dir,
                                 kMfsdpRun + " --max-restarts 1 " + kPretrain + kJob +
                                     " --non-persistent-save-interval 3 --non-persistent-ckpt-type global"
                                     " --metrics-file " + dir.file("restarted.jsonl") + " --save " + save +
                                     " --load " + save,
                                 save + "/non_persistent/iter_0000006");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const int64_t taken = iteration_after(r.output, "taking the non-persistent (global) checkpoint in " + save +
                                                      "/non_persistent (iteration ");
  EXPECT_GE(taken, 6) << r.output;
  EXPECT_LT(taken, 12) << "the kill came after the run ended: the test proves nothing\n" << r.output;
  EXPECT_NE(r.output.find(" loaded checkpoint " + save + "/non_persistent/iter_"), std::string::npos) << r.output;
  EXPECT_EQ(losses(dir.file("restarted.jsonl")), losses(dir.file("ref.jsonl")));
  expect_same_weights(save + "/iter_0000012", dir.file("ref/iter_0000012"));
  // The persistent folder has only the final save; the non-persistent one only its newest.
  std::vector<std::string> kept;
  for (const std::string& e : mfsdp::list_directory(save + "/non_persistent"))
    if (fs::is_directory(save + "/non_persistent/" + e)) kept.push_back(e);
  EXPECT_EQ(kept, std::vector<std::string>{"iter_0000012"});
  EXPECT_FALSE(fs::exists(save + "/iter_0000006"));
}

}  // namespace
