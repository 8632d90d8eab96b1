// mfsdp-pretrain --profile, through mfsdp-run on two ranks: with --use-pytorch-profiler the
// ranks in --profile-ranks, and only they, write one PyTorch trace each into --tensorboard-dir;
// it holds iterations --profile-step-start + 1 .. --profile-step-end as ProfilerStep#N ranges
// (Megatron's schedule of these flags), the forward and backward ops inside them with their
// input shapes, mfsdp's own ranges (mfsdp::all_gather, ...), and nothing of the other iterations
// (bench/trace_summary.py sums it); profiling changes no loss (against the
// same run unprofiled). The flags' bad values and combinations are in pretrain_test.cpp's table.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/base/directory_tree.h"

namespace {

using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kRun = std::string(MFSDP_RUN_BIN_PATH) + " --nproc-per-node 2 " + MFSDP_PRETRAIN_BIN_PATH +
                         " --device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64"
                         " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --swiglu --ffn-hidden-size 48"
                         " --seq-length 16 --micro-batch-size 2 --global-batch-size 4 --train-iters 5 --lr 3e-3"
                         " --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 7";

std::vector<double> losses_of(const std::string& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("eval")) out.push_back(j["lm_loss"].get<double>());
  }
  return out;
}

TEST(Profile, PytorchProfilerTracesTheNamedIterationsOnTheNamedRanks) {
  TempDir dir("mfsdp-profile");
  const std::string tb = dir.file("tb");
  auto plain = run_command(kRun + " --metrics-file " + dir.file("plain.jsonl"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  auto r = run_command(kRun + " --metrics-file " + dir.file("profiled.jsonl") +
                       " --profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 4"
                       " --profile-ranks 1 --tensorboard-dir " + tb);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(losses_of(dir.file("profiled.jsonl")), losses_of(dir.file("plain.jsonl")));
  ASSERT_EQ(losses_of(dir.file("plain.jsonl")).size(), 5u);

  std::vector<std::string> traces;
  for (const std::string& name : mfsdp::list_directory(tb))
    if (name.size() > 14 && name.substr(name.size() - 14) == ".pt.trace.json") traces.push_back(name);
  ASSERT_EQ(traces.size(), 1u) << "one trace, rank 1's; the folder has: " << ::testing::PrintToString(mfsdp::list_directory(tb));
  const std::string expected_line = "rank 1: profile of iterations 3..4 written to " + tb + "/" + traces[0];
  EXPECT_NE(r.output.find(expected_line), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("rank 0: profile"), std::string::npos) << r.output;

  std::ifstream in(tb + "/" + traces[0]);
  const nlohmann::json trace = nlohmann::json::parse(in);
  ASSERT_TRUE(trace.contains("traceEvents"));
  std::set<std::string> steps;
  std::map<std::string, int> ops, scopes;
  bool mm_with_shapes = false;
  for (const auto& e : trace["traceEvents"]) {
    if (!e.contains("name") || !e["name"].is_string()) continue;
    const std::string name = e["name"];
    if (name.rfind("ProfilerStep#", 0) == 0) steps.insert(name);
    if (e.value("cat", "") == "cpu_op") ++ops[name];
    if (e.value("cat", "") == "user_annotation") ++scopes[name];
    if (name == "aten::mm" && e.contains("args") && e["args"].contains("Input Dims")) mm_with_shapes = true;
  }
  EXPECT_EQ(steps, (std::set<std::string>{"ProfilerStep#3", "ProfilerStep#4"}));
  EXPECT_GT(ops["aten::mm"], 0) << "no matmul recorded";
  EXPECT_TRUE(mm_with_shapes) << "input shapes not recorded";
  // mfsdp's own ranges, per unit and step: 3 units (2 layers and the root) on 2 ranks.
  for (const char* scope : {"mfsdp::pre_forward", "mfsdp::all_gather", "mfsdp::wait_all_gather", "mfsdp::pre_backward",
                            "mfsdp::post_backward", "mfsdp::finish_backward", "mfsdp::clip_grad_norm",
                            "mfsdp::optimizer_step"})
    EXPECT_GT(scopes[scope], 0) << scope << " not in the trace";
  EXPECT_EQ(scopes["mfsdp::optimizer_step"], 2) << "one per profiled iteration";
  EXPECT_EQ(scopes["mfsdp::pre_forward"], 2 * 3) << "one per unit and iteration";
  // bench/trace_summary.py reads the same trace: both steps, and mfsdp's ranges once per step.
  auto summary = run_command(std::string(MFSDP_PYTHON_PATH) + " " + MFSDP_SOURCE_DIR + "/bench/trace_summary.py " + tb +
                             "/" + traces[0]);
  ASSERT_EQ(summary.exit_code, 0) << summary.output;
  for (const char* row : {"ProfilerStep#3", "ProfilerStep#4", "mfsdp's ranges, CPU ms per step", "aten::mm"})
    EXPECT_NE(summary.output.find(row), std::string::npos) << row << "\n" << summary.output;
  EXPECT_TRUE(std::regex_search(summary.output, std::regex(R"(mfsdp::optimizer_step +[0-9.]+ +1\.0\n)")))
      << summary.output;
  // The backward runs on autograd's threads: recorded too.
  EXPECT_TRUE(std::any_of(ops.begin(), ops.end(), [](const auto& op) {
    return op.first.find("MmBackward0") != std::string::npos;
  })) << "no backward op recorded";
}

TEST(Profile, ARunEndingBeforeTheRangeSaysNothingWasProfiled) {
  TempDir dir("mfsdp-profile");
  auto r = run_command(kRun + " --profile --use-pytorch-profiler --tensorboard-dir " + dir.file("tb"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0: --profile: nothing profiled, the run ended at iteration 5, before iteration 11 "
                          "(--profile-step-start 10)"),
            std::string::npos)
      << r.output;
}

}  // namespace
