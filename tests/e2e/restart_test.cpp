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

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "harness/metrics_file.h"
#include "harness/same_weights.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/launch/rank_processes.h"

namespace {

using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;
using mfsdp::testing::expect_same_weights;
const auto losses = mfsdp::testing::losses_by_iteration;

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

// Runs `launcher` (a job with --save `save` --load `save`) in the background, sends `signal` once
// the first checkpoint's tracker appears, to one of its ranks (the first mfsdp-pretrain among its
// descendants) or with `to_launcher` to the launcher itself, and returns the launcher's outcome.
mfsdp::testing::CommandOutcome run_signalled_after_the_first_save(const TempDir& dir, const std::string& launcher,
                                                                  const std::string& save,
                                                                  const std::string& signal = "KILL",
                                                                  bool to_launcher = false) {
  std::ofstream(dir.file("signal_once.sh")) << "\"$@\" &\n"
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
                                            << (to_launcher ? "victim=$launcher\n" : "")
                                            << "[ -n \"$victim\" ] || { echo 'no rank left to signal: the job ended first'; exit 99; }\n"
                                               "echo \"signalling process $victim\"\n"
                                               "kill -" << signal << " $victim\n"
                                               "wait $launcher\n";
  return run_command("bash " + dir.file("signal_once.sh") + " " + launcher + " --save " + save + " --load " + save);
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
  const auto r = run_signalled_after_the_first_save(
      dir, launcher + " " + kPretrain + job + " --metrics-file " + dir.file("restarted.jsonl"), save);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("signalling process "), std::string::npos) << r.output;
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

// Megatron's --exit-signal-handler: SIGTERM to mfsdp-run (passed on to every rank) or to one rank
// alone makes every rank finish its iteration, save and exit 0, naming the iteration; mfsdp-run
// exits 0 too. Relaunched, the job ends with the uninterrupted run's losses and weights.
TEST(Preemption, SigtermSavesAndARelaunchContinuesBitExactly) {
  TempDir dir("mfsdp-preemption");
  const std::string job = kModel + " --train-iters 20 --save-interval 5 --exit-signal-handler";
  const auto ours = run_command(kMfsdpRun + " " + kPretrain + job + " --metrics-file " + dir.file("ours.jsonl") +
                                " --save " + dir.file("ours"));
  ASSERT_EQ(ours.exit_code, 0) << ours.output;
  for (const bool to_launcher : {true, false}) {
    const std::string tag = to_launcher ? "launcher" : "rank";
    const std::string save = dir.file(tag), metrics = " --metrics-file " + dir.file(tag + ".jsonl");
    const auto r = run_signalled_after_the_first_save(dir, kMfsdpRun + " " + kPretrain + job + metrics, save, "TERM",
                                                      to_launcher);
    ASSERT_EQ(r.exit_code, 0) << tag << "\n" << r.output;
    const size_t at = r.output.find(" exiting at iteration ");
    ASSERT_NE(at, std::string::npos) << r.output;
    const int64_t stopped = std::stoll(r.output.substr(at + 22));
    EXPECT_NE(r.output.find(" exiting at iteration " + std::to_string(stopped) +
                            " after receiving SIGTERM (--exit-signal-handler)"),
              std::string::npos)
        << r.output;
    EXPECT_GE(stopped, 5);
    EXPECT_LT(stopped, 20) << "the signal came after the run ended: the test proves nothing";
    std::ifstream tracker(save + "/latest_checkpointed_iteration.txt");
    int64_t latest = 0;
    tracker >> latest;
    EXPECT_EQ(latest, stopped) << r.output;
    if (to_launcher) {
      EXPECT_NE(r.output.find("mfsdp-run: interrupted by signal 15; every rank exited 0"), std::string::npos)
          << r.output;
    }
    // The relaunch (a new job: a metrics file of its own) takes iterations stopped + 1 to 20; the
    // two together are the uninterrupted run.
    const auto again = run_command(kMfsdpRun + " " + kPretrain + job + " --metrics-file " +
                                   dir.file(tag + "_again.jsonl") + " --save " + save + " --load " + save);
    ASSERT_EQ(again.exit_code, 0) << again.output;
    std::map<int64_t, double> both = losses(dir.file(tag + ".jsonl"));
    const std::map<int64_t, double> rest = losses(dir.file(tag + "_again.jsonl"));
    EXPECT_EQ(rest.begin()->first, stopped + 1) << tag;
    both.insert(rest.begin(), rest.end());
    EXPECT_EQ(both, losses(dir.file("ours.jsonl"))) << tag;
    expect_same_weights(save + "/iter_0000020", dir.file("ours/iter_0000020"));
  }
}

// --exit-duration-in-mins: past the limit (here at once) every rank saves after the iteration and
// exits 0; a limit not reached changes nothing.
TEST(Preemption, ExitDurationInMinsStopsAfterTheIterationThatPassedIt) {
  TempDir dir("mfsdp-exit-duration");
  const auto r = run_command(kMfsdpRun + " " + kPretrain + kModel + " --train-iters 5 --exit-duration-in-mins 1e-9 --save " +
                             dir.file("short"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" exiting at iteration 1 after "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" minutes (--exit-duration-in-mins 1e-09)"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("short/iter_0000001")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("short/iter_0000002")));
  const auto full = run_command(kMfsdpRun + " " + kPretrain + kModel + " --train-iters 3 --exit-duration-in-mins 1000");
  ASSERT_EQ(full.exit_code, 0) << full.output;
  EXPECT_EQ(full.output.find(" exiting at iteration"), std::string::npos) << full.output;
  EXPECT_NE(full.output.find(" iteration        3/       3"), std::string::npos) << full.output;
}

}  // namespace
