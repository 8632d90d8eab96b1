// Megatron's result validation through mfsdp-pretrain under mfsdp-run (2 ranks): --rerun-mode,
// --check-for-spiky-loss, --error-injection-rate/-type. References: Megatron's exit codes (17 for
// a result its rerun does not reproduce), and a run without validation, whose losses and
// gradient norms a run whose steps are rerun must equal exactly (a rerun that did not start from
// the step's state, gradients zeroed, would change them).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "harness/metrics_file.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"

namespace {

using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kLaunch = "env OMP_NUM_THREADS=1 " + std::string(MFSDP_RUN_BIN_PATH) + " --nproc-per-node 2 " +
                            MFSDP_PRETRAIN_BIN_PATH +
                            " --device cpu --tokenizer-type ByteLevelTokenizer --mock-data --num-layers 2"
                            " --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2"
                            " --global-batch-size 8 --log-interval 1 --seed 3 --eval-interval 1000 --train-iters 4";

// iteration -> (lm loss, grad norm)
std::map<int64_t, std::pair<double, double>> steps(const std::string& metrics) {
  std::map<int64_t, std::pair<double, double>> out;
  for (const auto& r : mfsdp::testing::training_records(metrics))
    out[r["iteration"].get<int64_t>()] = {r["lm_loss"].get<double>(), r["grad_norm"].get<double>()};
  return out;
}

TEST(ResultValidation, AResultItsRerunDoesNotReproduceExits17NamingTheRank) {
  const auto r = run_command(kLaunch + " --error-injection-rate 1 --error-injection-type transient_error");
  EXPECT_EQ(r.exit_code, 17) << r.output;
  // Megatron validates from the second step; the injected failure is rank 0's (checked first).
  EXPECT_NE(r.output.find("[rank0]: Rank 0, node "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("iteration #2: unexpected result is not reproducible"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank1]: mfsdp-pretrain: iteration 2: the loss of rank 0 failed validation (injected: "
                          "--error-injection-type transient_error"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("a suspected faulty device: exit 17"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(" iteration        2/"), std::string::npos) << "stepped on: " << r.output;
}

TEST(ResultValidation, AResultItsRerunReproducesStopsAsARealDivergence) {
  // Injected, and real: an lr of 1e15 makes iteration 2's loss NaN on every rerun.
  for (const std::string flags : {" --error-injection-rate 1 --error-injection-type correct_result",
                                  " --lr 1e15 --clip-grad 0"}) {
    const auto r = run_command(kLaunch + flags);
    EXPECT_EQ(r.exit_code, 1) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("iteration 2: the loss of rank "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(", the same: a real divergence, not a device fault (--rerun-mode validate_results)"),
              std::string::npos)
        << r.output;
  }
  // Disabled: nothing is injected, nothing rerun; the NaN stops the run as the NaN check does.
  const auto off = run_command(kLaunch + " --rerun-mode disabled --error-injection-rate 1");
  EXPECT_EQ(off.exit_code, 0) << off.output;
  const auto nan = run_command(kLaunch + " --rerun-mode disabled --lr 1e15 --clip-grad 0");
  EXPECT_EQ(nan.exit_code, 1) << nan.output;
  EXPECT_NE(nan.output.find("iteration 2: the loss is NaN or Inf on rank "), std::string::npos) << nan.output;
}

TEST(ResultValidation, RerunStepsTrainAsStepsRunOnce) {
  TempDir dir("mfsdp-rerun");
  const auto plain = run_command(kLaunch + " --rerun-mode disabled --metrics-file " + dir.file("plain.jsonl"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const auto want = steps(dir.file("plain.jsonl"));
  ASSERT_EQ(want.size(), 4u);

  // report_stats: steps 2..4 each run twice; the second run's results are the step's.
  const auto stats = run_command(kLaunch + " --rerun-mode report_stats --metrics-file " + dir.file("stats.jsonl"));
  ASSERT_EQ(stats.exit_code, 0) << stats.output;
  EXPECT_NE(stats.output.find(" result validation (--rerun-mode report_stats): loss of 3 rerun step(s): 0 differed, "
                              "largest relative difference 0, mean 0"),
            std::string::npos)
      << stats.output;
  EXPECT_EQ(steps(dir.file("stats.jsonl")), want);

  // A spike (here injected; the NaN check off, so the injection lands on the spike rule, which is
  // not fatal): every step from the second reruns, warns and trains on with the rerun's result.
  const auto spiky = run_command(kLaunch + " --no-check-for-nan-in-loss-and-grad --check-for-spiky-loss"
                                 " --error-injection-rate 1 --metrics-file " + dir.file("spiky.jsonl"));
  ASSERT_EQ(spiky.exit_code, 0) << spiky.output;
  EXPECT_NE(spiky.output.find("iteration 2: the loss of rank 0 failed validation (injected: --error-injection-type "
                              "transient_error; loss "),
            std::string::npos)
      << spiky.output;
  EXPECT_NE(spiky.output.find("not reproducible, a possible transient error of rank 1's device; training goes on "
                              "with the rerun's result"),
            std::string::npos)
      << spiky.output;
  EXPECT_EQ(steps(dir.file("spiky.jsonl")), want);
}

}  // namespace
