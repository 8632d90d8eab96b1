// Multi-rank GoogleTest harness: a test body runs in N real processes.
//
//   MFSDP_DIST_TEST(Collectives, AllReduce, {1, 2, 3, 4}) {
//     comm.all_reduce(t);   // `comm` is this rank's world Communicator (CPU backend)
//     EXPECT_TRUE(...);
//   }
//
// Under ctest the test runs in the parent process, which re-executes the same test binary once
// per rank (filtered to this test, with RANK/WORLD_SIZE/MASTER_PORT set and a fresh free port
// per world size) for every listed world size, supervises the ranks like mfsdp-run, and fails
// naming the world size, the rank that failed and how, followed by each rank's output. Inside a
// rank the body runs with a connected communicator; a failed EXPECT/ASSERT fails that rank.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"

namespace mfsdp::testing {

struct DistOptions {
  std::vector<int> world_sizes = {2};
  // Timeout of every collective in the ranks (short, so a broken test fails instead of hanging).
  std::chrono::milliseconds comm_timeout{60000};
  // Whole-run limit per world size, enforced by the parent.
  std::chrono::milliseconds deadline{240000};
  // Several run_distributed calls in one test (e.g. save with 3 ranks, then load with 2): give
  // each a distinct phase; a rank process runs only the call whose phase it was started for.
  std::string phase;
  // A directory the parent keeps across calls (created if missing, not removed); empty: a
  // fresh one per world size, removed after. Ranks see it as shared_temp_dir().
  std::string shared_dir;
  // The ranks' communicator: "gloo" (CPU tensors) or "nccl" (rank r on GPU r; tests/gpu/).
  std::string backend = "gloo";
  // CommOptions::shared_memory of the ranks' communicator (unset: MFSDP_SHM decides).
  std::optional<bool> shared_memory;
};

// Options for tests of failures: these world sizes, collectives time out after 3 s.
inline DistOptions short_timeout(std::vector<int> worlds) {
  DistOptions o;
  o.world_sizes = std::move(worlds);
  o.comm_timeout = std::chrono::milliseconds(3000);
  return o;
}

// True in a rank process started by the harness.
bool is_rank_process();

// Parent: runs the current test in real processes for every world size. Rank: connects and
// runs `body`.
void run_distributed(const DistOptions& options, const std::function<void(Communicator&)>& body);

// A directory every rank of the current run shares (created by the parent, removed after).
std::string shared_temp_dir();

}  // namespace mfsdp::testing

#define MFSDP_DIST_TEST(suite, name, ...)                                              \
  static void suite##_##name##_dist_body(::mfsdp::Communicator& comm);                 \
  TEST(suite, name) {                                                                  \
    ::mfsdp::testing::DistOptions options_;                                            \
    options_.world_sizes = std::vector<int> __VA_ARGS__;                               \
    ::mfsdp::testing::run_distributed(options_, suite##_##name##_dist_body);           \
  }                                                                                    \
  static void suite##_##name##_dist_body(::mfsdp::Communicator& comm)

// Same, with a full DistOptions expression.
#define MFSDP_DIST_TEST_OPTS(suite, name, opts)                                        \
  static void suite##_##name##_dist_body(::mfsdp::Communicator& comm);                 \
  TEST(suite, name) { ::mfsdp::testing::run_distributed(opts, suite##_##name##_dist_body); } \
  static void suite##_##name##_dist_body(::mfsdp::Communicator& comm)
