// Restarts of a training job whose rank died, by torchrun and by mfsdp-run --max-restarts, and
// mfsdp-pretrain under PyTorch's own torchrun (the project's torch), as Megatron-LM users launch
// it: torchrun's agent serves a c10d TCPStore on MASTER_PORT and says so
// (TORCHELASTIC_USE_AGENT_STORE=True), so every rank joins it as a client instead of serving one
// (src/comm/store.h). The references are mfsdp-run's own runs of the same job:
//  - 2 ranks train step for step as under mfsdp-run (losses and final weights bit-equal);
//  - with `torchrun --max-restarts 1`, a rank killed with SIGKILL after the first checkpoint makes
//    torchrun restart both ranks, which resume from that checkpoint (TORCHELASTIC_RESTART_COUNT
//    keeps the new start's store keys apart from the dead start's: without it the new start
//    meets the dead one's addresses and hangs) and finish with the uninterrupted run's losses and
//    weights, bit for bit; the metrics file keeps both starts' records;
//  - the same with mfsdp-run --max-restarts 1 (a new rendezvous round on a new port and token).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <fstream>
#include <map>
#include <string>

#include "harness/metrics_file.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/launch/rank_processes.h"

namespace {

using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kRun = MFSDP_RUN_BIN_PATH;
const std::string kPretrain = MFSDP_PRETRAIN_BIN_PATH;
const std::string kPython = MFSDP_PYTHON_PATH;
// torchrun is torch.distributed.run with its c10d rendezvous (what multi-node jobs use), whose
// store lives as long as torchrun, so a restart finds the dead start's keys there; one thread per
// rank under both launchers (torchrun's default), so the two compute alike. `timeout`: a start
// that cannot meet is a failure in minutes, not a hang.
std::string torchrun() {
  return "timeout 240 env OMP_NUM_THREADS=1 " + kPython +
         " -m torch.distributed.run --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" +
         std::to_string(mfsdp::launch::pick_free_port());
}
const std::string kMfsdpRun = "env OMP_NUM_THREADS=1 " + kRun + " --nproc-per-node 2";

// ~0.15 s an iteration on 2 CPU ranks, so that a rank can be killed mid-run.
const std::string kModel =
    " --device cpu --tokenizer-type ByteLevelTokenizer --mock-data --num-layers 4 --hidden-size 128"
    " --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --log-interval 1"
    " --seed 3 --eval-interval 1000";

// Each iteration's lm loss, the last record of each (a restarted run logs some iterations twice).
std::map<int64_t, double> losses(const std::string& metrics) {
  std::map<int64_t, double> out;
  for (const auto& r : mfsdp::testing::training_records(metrics))
    out[r["iteration"].get<int64_t>()] = r["lm_loss"].get<double>();
  return out;
}

// Every weight of the checkpoint at `dir` equals `want`'s, bit for bit.
void expect_same_weights(const std::string& dir, const std::string& want) {
  auto got = mfsdp::load_model(dir), ref = mfsdp::load_model(want);
  const auto ref_params = ref.model->named_parameters();
  int compared = 0;
  for (const auto& p : got.model->named_parameters()) {
    ASSERT_TRUE(ref_params.contains(p.key())) << p.key();
    EXPECT_TRUE(at::equal(p.value(), ref_params[p.key()])) << dir << ": " << p.key();
    ++compared;
  }
  EXPECT_GT(compared, 10);
}

TEST(Torchrun, TrainsAsMfsdpRunDoes) {
  TempDir dir("mfsdp-torchrun");
  const std::string job = kModel + " --train-iters 4";
  const auto ours = run_command(kMfsdpRun + " " + kPretrain + job + " --metrics-file " + dir.file("ours.jsonl") +
                                " --save " + dir.file("ours") + " --save-interval 4");
  ASSERT_EQ(ours.exit_code, 0) << ours.output;
  const auto theirs = run_command(torchrun() + " --no-python " + kPretrain + job + " --metrics-file " +
                                  dir.file("torchrun.jsonl") + " --save " + dir.file("torchrun") + " --save-interval 4");
  ASSERT_EQ(theirs.exit_code, 0) << theirs.output;
  EXPECT_NE(theirs.output.find(" rendezvous: torchrun's store at "), std::string::npos) << theirs.output;
  EXPECT_EQ(theirs.output.find("has no job token"), std::string::npos) << theirs.output;  // mfsdp's store's warning
  const auto want = losses(dir.file("ours.jsonl")), got = losses(dir.file("torchrun.jsonl"));
  ASSERT_EQ(want.size(), 4u);
  EXPECT_EQ(got, want);
  expect_same_weights(dir.file("torchrun/iter_0000004"), dir.file("ours/iter_0000004"));
}

// Runs `launcher` (a job with --save `save` --load `save`) in the background, SIGKILLs one of its
// ranks (the first mfsdp-pretrain among its descendants) once the first checkpoint's tracker
// appears, and returns the launcher's outcome.
mfsdp::testing::CommandOutcome run_killing_a_rank_after_the_first_save(const TempDir& dir, const std::string& launcher,
                                                                       const std::string& save) {
  std::ofstream(dir.file("kill_once.sh")) << "\"$@\" &\n"
                                             "launcher=$!\n"
                                             "for _ in $(seq 1 2400); do\n"
                                             "  [ -f " << save << "/latest_checkpointed_iteration.txt ] && break\n"
                                             "  sleep 0.05\n"
                                             "done\n"
                                             "victim=; frontier=$launcher\n"
                                             "while [ -n \"$frontier\" ] && [ -z \"$victim\" ]; do\n"
                                             "  frontier=$(for p in $frontier; do pgrep -P $p; done)\n"
                                             "  for p in $frontier; do\n"
                                             "    [ \"$(cat /proc/$p/comm 2>/dev/null)\" = mfsdp-pretrain ] && victim=$p && break\n"
                                             "  done\n"
                                             "done\n"
                                             "echo \"killing rank process $victim\"\n"
                                             "kill -KILL $victim\n"
                                             "wait $launcher\n";
  return run_command("bash " + dir.file("kill_once.sh") + " " + launcher + " --save " + save + " --load " + save);
}

// A 20-iteration job killed after its checkpoint at 5 and restarted by `launcher` (which takes
// the program and its flags after it) ends as the uninterrupted run does: every iteration's loss
// and the final weights bit-equal; the restarted start says so and loads the checkpoint.
void expect_restart_resumes(const std::string& launcher, const std::string& tag) {
  TempDir dir("mfsdp-restart-" + tag);
  const std::string job = kModel + " --train-iters 20 --save-interval 5";
  const auto ours = run_command(kMfsdpRun + " " + kPretrain + job + " --metrics-file " + dir.file("ours.jsonl") +
                                " --save " + dir.file("ours"));
  ASSERT_EQ(ours.exit_code, 0) << ours.output;
  const std::string save = dir.file("restarted");
  const auto r = run_killing_a_rank_after_the_first_save(
      dir, launcher + " " + kPretrain + job + " --metrics-file " + dir.file("restarted.jsonl"), save);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("killing rank process "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" restart 1 of at most 1 (TORCHELASTIC_RESTART_COUNT)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" loaded checkpoint " + save + "/iter_"), std::string::npos) << r.output;
  const auto want = losses(dir.file("ours.jsonl")), got = losses(dir.file("restarted.jsonl"));
  ASSERT_EQ(want.size(), 20u);
  EXPECT_EQ(got, want);
  expect_same_weights(save + "/iter_0000020", dir.file("ours/iter_0000020"));
}

TEST(Torchrun, MaxRestartsResumesFromTheCheckpointAfterAKilledRank) {
  expect_restart_resumes(torchrun() + " --max-restarts 1 --monitor-interval 0.1 --no-python", "torchrun");
}

TEST(MfsdpRun, MaxRestartsResumesFromTheCheckpointAfterAKilledRank) {
  expect_restart_resumes(kMfsdpRun + " --max-restarts 1", "mfsdp-run");
}

}  // namespace
