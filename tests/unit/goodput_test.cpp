// The trainer's side of goodput (include/mfsdp/train/goodput.h): the progress lines rank 0
// appends for mfsdp-run's summary, and what a restart reads back from them. Expected values are
// counted by hand from the files written here.
#include "mfsdp/train/goodput.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <fstream>
#include <sstream>
#include <string>

#include "harness/temp_dir.h"

namespace {

using mfsdp::ProgressFile;

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Goodput, ProgressLinesAndTheIterationsARestartLoses) {
  mfsdp::testing::TempDir dir("mfsdp-goodput");
  const std::string path = dir.file("progress");
  setenv("MFSDP_PROGRESS_FILE", path.c_str(), 1);
  unsetenv("MFSDP_PREVIOUS_FAILURE_TIME");
  {
    ProgressFile first(/*writer=*/true);
    EXPECT_FALSE(first.last_done_before());
    first.started(0, 0);
    for (int64_t i = 1; i <= 10; ++i) first.finished(i);
    ProgressFile not_rank0(/*writer=*/false);
    not_rank0.finished(99);  // only rank 0 writes
  }
  {
    // Restart 1 resumed after 6 and died after 8: the last start's 8, not the first's 10, is what
    // a restart from 6 loses up to. A line the death cut short counts for nothing.
    std::ofstream(path, std::ios::app) << "start 1 6 1.0\niteration 7 2.0\niteration 8 3.0\niteration 9";
  }
  ProgressFile third(true);
  ASSERT_TRUE(third.last_done_before());
  EXPECT_EQ(*third.last_done_before(), 8);
  setenv("MFSDP_PREVIOUS_FAILURE_TIME", std::to_string(mfsdp::unix_seconds() - 2.5).c_str(), 1);
  const mfsdp::RestartCost cost = mfsdp::restart_cost(2, 6, third);
  EXPECT_EQ(cost.lost_iterations, 2);
  ASSERT_TRUE(cost.seconds_since_failure);
  EXPECT_GE(*cost.seconds_since_failure, 2.5);
  EXPECT_NE(cost.text().find(" restart 2: resumed after iteration 6; 2 iteration(s) done before the failure are "
                             "done again; "),
            std::string::npos)
      << cost.text();
  const std::string text = slurp(path);
  EXPECT_EQ(text.rfind("start 0 0 ", 0), 0u) << text;
  EXPECT_NE(text.find("\niteration 10 "), std::string::npos) << text;
  EXPECT_EQ(text.find("iteration 99"), std::string::npos) << text;
  unsetenv("MFSDP_PROGRESS_FILE");
  unsetenv("MFSDP_PREVIOUS_FAILURE_TIME");
  ProgressFile none(true);  // no file named: nothing read, nothing written
  EXPECT_FALSE(none.last_done_before());
  none.finished(1);
}

}  // namespace
