// The launcher, tested as real processes: run_rank_processes directly (RankProcesses.*), and the
// built mfsdp-run binary, whose path comes from MFSDP_RUN_BIN (set by CMake), end to end
// (MfsdpRun.*). Children are `sh -c` scripts; where a test needs a child to be at a certain point
// it waits for a file the child writes, never for a fixed time.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include <gtest/gtest.h>

#include "harness/temp_dir.h"
#include "mfsdp/base/directory_tree.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mfsdp/launch/goodput_summary.h"
#include "mfsdp/launch/rank_processes.h"

namespace mfsdp::launch {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

// ---- helpers ------------------------------------------------------------------------------------

using mfsdp::testing::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Waits until every file exists and is non-empty (children write "value\n" in one go).
bool wait_for_files(const std::vector<std::string>& paths, milliseconds timeout = milliseconds(60000)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    bool all = true;
    for (const auto& path : paths) all = all && !read_file(path).empty();
    if (all) return true;
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
}

// True when `pid` no longer runs. A zombie counts as gone: orphans are reparented to PID 1, which
// in a container may never reap them.
bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return true;  // exited meanwhile
  return stat[paren + 2] == 'Z' || stat[paren + 2] == 'X';
}

// SIGKILL after the grace period is asynchronous: give a dying process a moment.
bool wait_until_gone(pid_t pid, milliseconds timeout = milliseconds(10000)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!process_gone(pid)) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return true;
}

// True when this process has no child left, not even a zombie.
bool no_children_left() { return waitpid(-1, nullptr, WNOHANG) < 0 && errno == ECHILD; }

pid_t read_pid(const std::string& path) { return static_cast<pid_t>(std::stol(read_file(path))); }

RankProcessSpec sh_rank(int rank, const std::string& script,
                        std::map<std::string, std::string> env = {}) {
  RankProcessSpec spec;
  spec.rank = rank;
  spec.argv = {"sh", "-c", script};
  spec.env = std::move(env);
  return spec;
}

// Lines captured through on_line, per rank and stream.
struct Captured {
  std::map<int, std::vector<std::string>> out;
  std::map<int, std::vector<std::string>> err;
};

SuperviseOptions capture_into(Captured& captured) {
  SuperviseOptions options;
  options.on_line = [&captured](int rank, OutputStream stream, const std::string& line) {
    (stream == OutputStream::kStdout ? captured.out : captured.err)[rank].push_back(line);
  };
  return options;
}

const RankExit& exit_of(const SuperviseResult& result, int rank) {
  for (const auto& exit : result.exits) {
    if (exit.rank == rank) return exit;
  }
  throw std::runtime_error("no exit for rank " + std::to_string(rank));
}

// ---- running mfsdp-run --------------------------------------------------------------------------

std::string launcher_binary() {
  const char* path = std::getenv("MFSDP_RUN_BIN");
  if (path == nullptr || *path == '\0') {
    throw std::runtime_error(
        "MFSDP_RUN_BIN is not set: it must name the built mfsdp-run binary (ctest sets it; by "
        "hand: MFSDP_RUN_BIN=build/mfsdp-run ./build/tests/e2e_tests --gtest_filter='MfsdpRun*:RankProcesses*')");
  }
  return path;
}

struct Launched {
  pid_t pid = -1;
  std::string out_path;
  std::string err_path;
};

struct Finished {
  int status = 0;
  std::string out;
  std::string err;
  // The exit code, or -signal when mfsdp-run itself was killed.
  int code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status); }
};

// Starts mfsdp-run with `args`, its stdout and stderr going to files in `dir`.
Launched start_launcher(const std::vector<std::string>& args, const TempDir& dir) {
  const std::string binary = launcher_binary();
  std::vector<char*> argv = {const_cast<char*>(binary.c_str())};
  for (const auto& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  Launched launched;
  launched.out_path = dir.file("launcher.out");
  launched.err_path = dir.file("launcher.err");
  int out = open(launched.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int err = open(launched.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0 || err < 0) throw std::runtime_error("cannot create the launcher output files");
  launched.pid = fork();
  if (launched.pid == 0) {
    dup2(out, STDOUT_FILENO);
    dup2(err, STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(126);
  }
  close(out);
  close(err);
  if (launched.pid < 0) throw std::runtime_error("fork failed");
  return launched;
}

Finished wait_launcher(const Launched& launched) {
  Finished finished;
  while (waitpid(launched.pid, &finished.status, 0) < 0 && errno == EINTR) {
  }
  finished.out = read_file(launched.out_path);
  finished.err = read_file(launched.err_path);
  return finished;
}

Finished run_launcher(const std::vector<std::string>& args, const TempDir& dir) {
  return wait_launcher(start_launcher(args, dir));
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The first line of `text` that starts with `prefix` ("" if none).
std::string line_starting_with(const std::string& text, const std::string& prefix) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.compare(0, prefix.size(), prefix) == 0) return line;
  }
  return "";
}

std::string describe(const Finished& finished) {
  return "exit " + std::to_string(finished.code()) + "\n--- stdout ---\n" + finished.out +
         "--- stderr ---\n" + finished.err;
}

// ---- run_rank_processes -------------------------------------------------------------------------

TEST(RankProcesses, CapturesLinesPerStreamIncludingAPartialLastLine) {
  Captured captured;
  auto result = run_rank_processes(
      {sh_rank(0, "echo out-a; echo err-a >&2; printf 'out-b'"),
       sh_rank(1, "echo out-c; printf 'err-b\\nerr-c' >&2")},
      capture_into(captured));
  ASSERT_TRUE(result.ok()) << result.summary();
  EXPECT_EQ(captured.out[0], (std::vector<std::string>{"out-a", "out-b"}));
  EXPECT_EQ(captured.err[0], (std::vector<std::string>{"err-a"}));
  EXPECT_EQ(captured.out[1], (std::vector<std::string>{"out-c"}));
  EXPECT_EQ(captured.err[1], (std::vector<std::string>{"err-b", "err-c"}));
  ASSERT_EQ(result.exits.size(), 2u);
  EXPECT_EQ(result.exits[0].rank, 0);
  EXPECT_EQ(result.exits[1].rank, 1);
  for (const auto& exit : result.exits) {
    EXPECT_FALSE(exit.failed());
    EXPECT_FALSE(exit.stopped_by_supervisor);
    EXPECT_GT(exit.pid, 0);
  }
  EXPECT_EQ(result.summary(), "all 2 ranks succeeded");
}

TEST(RankProcesses, SplitsVeryLongLinesAndPassesBinaryBytesThrough) {
  Captured captured;
  auto result = run_rank_processes(
      {sh_rank(0, "head -c 200000 /dev/zero | tr '\\000' x; echo; printf '\\001\\000\\377junk'")},
      capture_into(captured));
  ASSERT_TRUE(result.ok()) << result.summary();
  const auto& lines = captured.out[0];
  ASSERT_GE(lines.size(), 2u);
  std::string joined;
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    EXPECT_LE(lines[i].size(), 64u * 1024) << "a long line must be handed over in pieces";
    joined += lines[i];
  }
  EXPECT_EQ(joined, std::string(200000, 'x'));
  EXPECT_EQ(lines.back(), std::string("\001\000\377junk", 7));
}

TEST(RankProcesses, ChildEnvironmentIsParentPlusSpec) {
  setenv("MFSDP_LAUNCHER_TEST_INHERITED", "from-parent", 1);
  setenv("MFSDP_LAUNCHER_TEST_OVERRIDDEN", "from-parent", 1);
  Captured captured;
  auto result = run_rank_processes(
      {sh_rank(0, "echo \"$MFSDP_LAUNCHER_TEST_INHERITED $MFSDP_LAUNCHER_TEST_OVERRIDDEN $EXTRA\"",
               {{"MFSDP_LAUNCHER_TEST_OVERRIDDEN", "from-spec"}, {"EXTRA", "x y"}})},
      capture_into(captured));
  unsetenv("MFSDP_LAUNCHER_TEST_INHERITED");
  unsetenv("MFSDP_LAUNCHER_TEST_OVERRIDDEN");
  ASSERT_TRUE(result.ok()) << result.summary();
  EXPECT_EQ(captured.out[0], (std::vector<std::string>{"from-parent from-spec x y"}));
}

TEST(RankProcesses, FirstFailureStopsTheOthers) {
  TempDir dir;
  const std::string ready = dir.file("ready");
  Captured captured;
  // Rank 2 fails once rank 0 is surely running; ranks 0 and 1 would sleep for a minute.
  auto result = run_rank_processes(
      {sh_rank(0, "echo 1 > " + ready + "; exec sleep 60"), sh_rank(1, "exec sleep 60"),
       sh_rank(2, "while [ ! -s " + ready + " ]; do sleep 0.01; done; echo bye >&2; exit 3")},
      capture_into(captured));
  EXPECT_FALSE(result.ok());
  ASSERT_TRUE(result.first_failed_rank.has_value());
  EXPECT_EQ(*result.first_failed_rank, 2);
  EXPECT_FALSE(result.timed_out);
  EXPECT_EQ(exit_of(result, 2).exit_code, 3);
  EXPECT_FALSE(exit_of(result, 2).stopped_by_supervisor);
  for (int rank : {0, 1}) {
    EXPECT_TRUE(exit_of(result, rank).stopped_by_supervisor) << rank;
    EXPECT_EQ(exit_of(result, rank).signal, SIGTERM) << rank;
  }
  EXPECT_EQ(captured.err[2], (std::vector<std::string>{"bye"}));
  EXPECT_TRUE(no_children_left());
  EXPECT_TRUE(contains(result.summary(), "rank 2 (pid ")) << result.summary();
  EXPECT_TRUE(contains(result.summary(), "exited with code 3; stopped 2 running ranks"))
      << result.summary();
}

TEST(RankProcesses, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  TempDir dir;
  const std::string ready = dir.file("ready");
  SuperviseOptions options;
  options.on_line = [](int, OutputStream, const std::string&) {};
  options.kill_grace = milliseconds(200);
  // `sleep` inherits the ignored SIGTERM, so only SIGKILL to the group ends rank 0.
  auto result = run_rank_processes(
      {sh_rank(0, "trap '' TERM; echo 1 > " + ready + "; sleep 60; exit 0"),
       sh_rank(1, "while [ ! -s " + ready + " ]; do sleep 0.01; done; exit 1")},
      options);
  ASSERT_EQ(result.first_failed_rank, std::optional<int>(1));
  EXPECT_EQ(exit_of(result, 0).signal, SIGKILL);
  EXPECT_TRUE(exit_of(result, 0).stopped_by_supervisor);
  EXPECT_TRUE(contains(exit_of(result, 0).describe(), "was killed by signal 9 (Killed)"))
      << exit_of(result, 0).describe();
}

// A rank that notices the failed one exits on its own during failure_grace, its error line
// whole, and is not reported as stopped; one that goes on is stopped after the grace.
TEST(RankProcesses, FailureGraceLetsTheOthersExitWithTheirOwnLines) {
  TempDir dir;
  const std::string pid1 = dir.file("pid1");
  Captured captured;
  SuperviseOptions options = capture_into(captured);
  options.failure_grace = milliseconds(3000);
  // Rank 0 watches rank 1 and, once it is gone, takes a moment before its error line: a SIGTERM
  // right after rank 1's failure (no grace) would end it first.
  auto result = run_rank_processes(
      {sh_rank(0, "while [ ! -s " + pid1 + " ]; do sleep 0.01; done; p=$(cat " + pid1 +
                      "); while kill -0 $p 2>/dev/null; do sleep 0.01; done; sleep 0.5; "
                      "echo \"rank 0: peer rank 1 is gone\" >&2; exit 1"),
       sh_rank(1, "echo $$ > " + pid1 + "; exit 3"), sh_rank(2, "exec sleep 60")},
      options);
  ASSERT_EQ(result.first_failed_rank, std::optional<int>(1)) << result.summary();
  EXPECT_EQ(exit_of(result, 0).exit_code, 1) << exit_of(result, 0).describe();
  EXPECT_EQ(exit_of(result, 0).signal, 0) << exit_of(result, 0).describe();
  EXPECT_FALSE(exit_of(result, 0).stopped_by_supervisor);
  EXPECT_EQ(captured.err[0], (std::vector<std::string>{"rank 0: peer rank 1 is gone"}));
  EXPECT_TRUE(exit_of(result, 2).stopped_by_supervisor);
  EXPECT_EQ(exit_of(result, 2).signal, SIGTERM);
  EXPECT_TRUE(contains(result.summary(), "exited with code 3; stopped 1 running rank"))
      << result.summary();
}

// The /dev/shm entries "mfsdp-TAG-..." of the run's tag go once its ranks have exited, also
// those of a rank killed with SIGKILL; another tag's stay.
TEST(RankProcesses, RemovesTheRunsShmSegmentsOnceItsRanksExited) {
  const std::string tag = "t" + launcher_shm_tag() + "x";
  const std::string other = "/dev/shm/mfsdp-" + tag + "other-1-1";
  { std::ofstream(other) << "keep"; }
  ASSERT_TRUE(fs::exists(other)) << "no /dev/shm here";
  SuperviseOptions options;
  options.on_line = [](int, OutputStream, const std::string&) {};
  options.shm_tag = tag;
  auto result = run_rank_processes(
      {sh_rank(0, ": > /dev/shm/mfsdp-" + tag + "-$$-ab; kill -KILL $$"),
       sh_rank(1, ": > /dev/shm/mfsdp-" + tag + "-$$-cd; exit 0")},
      options);
  EXPECT_EQ(exit_of(result, 0).signal, SIGKILL);
  for (const std::string& name : mfsdp::list_directory("/dev/shm"))
    EXPECT_NE(name.rfind("mfsdp-" + tag + "-", 0), 0u) << "/dev/shm/" << name << " was left behind";
  EXPECT_TRUE(fs::exists(other)) << "another tag's segment was removed";
  fs::remove(other);
  EXPECT_TRUE(remove_shm_segments("").empty());
}

TEST(RankProcesses, StopReachesWhatARankStarted) {
  TempDir dir;
  const std::string grandchild = dir.file("grandchild");
  SuperviseOptions options;
  options.on_line = [](int, OutputStream, const std::string&) {};
  auto result = run_rank_processes(
      {sh_rank(0, "sleep 60 & echo $! > " + grandchild + "; wait"),
       sh_rank(1, "while [ ! -s " + grandchild + " ]; do sleep 0.01; done; exit 1")},
      options);
  ASSERT_EQ(result.first_failed_rank, std::optional<int>(1));
  EXPECT_TRUE(wait_until_gone(read_pid(grandchild))) << "the background sleep of rank 0 survived";
}

TEST(RankProcesses, DeadlineStopsEveryRank) {
  Captured captured;
  SuperviseOptions options = capture_into(captured);
  options.deadline = milliseconds(300);
  auto result = run_rank_processes({sh_rank(0, "exec sleep 60"), sh_rank(1, "exec sleep 60")},
                                   options);
  EXPECT_TRUE(result.timed_out);
  EXPECT_FALSE(result.first_failed_rank.has_value());
  EXPECT_FALSE(result.ok());
  for (const auto& exit : result.exits) {
    EXPECT_TRUE(exit.stopped_by_supervisor);
    EXPECT_EQ(exit.signal, SIGTERM);
  }
  EXPECT_EQ(result.summary(), "the deadline passed; stopped 2 running ranks");
  EXPECT_TRUE(no_children_left());
}

TEST(RankProcesses, ExecFailureIsReportedOnTheRanksStderr) {
  Captured captured;
  RankProcessSpec missing;
  missing.rank = 0;
  missing.argv = {"mfsdp-no-such-program"};
  auto result = run_rank_processes({missing}, capture_into(captured));
  ASSERT_EQ(result.first_failed_rank, std::optional<int>(0));
  EXPECT_TRUE(result.exits[0].spawn_failed);
  EXPECT_EQ(result.exits[0].exit_code, 127);
  EXPECT_EQ(captured.err[0], (std::vector<std::string>{
                                 "mfsdp-run: cannot execute 'mfsdp-no-such-program': No such "
                                 "file or directory"}));
  EXPECT_TRUE(contains(result.summary(), "could not execute its program (exit code 127)"))
      << result.summary();
}

TEST(RankProcesses, EmptyArgvIsRejectedBeforeAnyRankStarts) {
  TempDir dir;
  RankProcessSpec empty;
  empty.rank = 1;
  EXPECT_THROW(run_rank_processes({sh_rank(0, "echo 1 > " + dir.file("ran")), empty}),
               std::invalid_argument);
  EXPECT_FALSE(fs::exists(dir.file("ran")));
  EXPECT_TRUE(no_children_left());
}

TEST(RankProcesses, ChildrenInheritNoStrayDescriptors) {
  int leak[2];
  ASSERT_EQ(pipe(leak), 0);  // deliberately without O_CLOEXEC
  Captured captured;
  const std::string check = "for fd in " + std::to_string(leak[0]) + " " +
                            std::to_string(leak[1]) +
                            "; do if [ -e /proc/$$/fd/$fd ]; then echo leaked $fd; fi; done; "
                            "echo done";
  auto result = run_rank_processes({sh_rank(0, check), sh_rank(1, check)}, capture_into(captured));
  close(leak[0]);
  close(leak[1]);
  ASSERT_TRUE(result.ok()) << result.summary();
  EXPECT_EQ(captured.out[0], (std::vector<std::string>{"done"}));
  EXPECT_EQ(captured.out[1], (std::vector<std::string>{"done"}));
}

TEST(RankProcesses, SixtyFourRanks) {
  Captured captured;
  std::vector<RankProcessSpec> specs;
  for (int rank = 0; rank < 64; ++rank) {
    specs.push_back(sh_rank(rank, "i=0; while [ $i -lt 50 ]; do echo \"$R $i\"; i=$((i+1)); done",
                            {{"R", std::to_string(rank)}}));
  }
  auto result = run_rank_processes(specs, capture_into(captured));
  ASSERT_TRUE(result.ok()) << result.summary();
  ASSERT_EQ(result.exits.size(), 64u);
  for (int rank = 0; rank < 64; ++rank) {
    ASSERT_EQ(captured.out[rank].size(), 50u) << "rank " << rank;
    EXPECT_EQ(captured.out[rank][49], std::to_string(rank) + " 49");
  }
  EXPECT_TRUE(no_children_left());
}

TEST(RankProcesses, ForwardedSignalStopsTheRanksAndHandlersAreRestored) {
  struct sigaction before {};
  sigaction(SIGTERM, nullptr, &before);
  SuperviseOptions options;
  options.forward_signals = true;
  // The supervisor's own process gets SIGTERM once rank 0 runs; the forwarding handler must turn
  // it into a stop of the ranks instead of killing this test.
  options.on_line = [](int, OutputStream, const std::string& line) {
    if (line == "ready") kill(getpid(), SIGTERM);
  };
  auto result = run_rank_processes({sh_rank(0, "echo ready; exec sleep 60")}, options);
  EXPECT_EQ(result.interrupt_signal, SIGTERM);
  EXPECT_FALSE(result.ok());
  EXPECT_TRUE(result.exits[0].stopped_by_supervisor);
  EXPECT_EQ(result.exits[0].signal, SIGTERM);
  EXPECT_EQ(result.summary(), "interrupted by signal 15 (Terminated); stopped 1 running rank");
  struct sigaction after {};
  sigaction(SIGTERM, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
}

// A stop request (mfsdp-run's: another node's ranks failed) stops every rank as a failure does,
// after the failure grace, and the result says so; no rank failed, so no first-failure hook runs.
TEST(RankProcesses, StopRequestStopsEveryRankAfterTheGrace) {
  TempDir dir;
  const std::string ready = dir.file("ready");
  SuperviseOptions options;
  options.on_line = [](int, OutputStream, const std::string&) {};
  options.failure_grace = milliseconds(200);
  int failures = 0;
  options.on_first_failure = [&] { ++failures; };
  options.stop_requested = [&] { return fs::exists(ready); };
  const auto begin = std::chrono::steady_clock::now();
  auto result = run_rank_processes(
      {sh_rank(0, "echo 1 > " + ready + "; exec sleep 60"), sh_rank(1, "exec sleep 60")}, options);
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(20));
  EXPECT_TRUE(result.stop_requested);
  EXPECT_FALSE(result.ok());
  EXPECT_FALSE(result.first_failed_rank.has_value());
  for (const auto& exit : result.exits) {
    EXPECT_TRUE(exit.stopped_by_supervisor);
    EXPECT_EQ(exit.signal, SIGTERM);
  }
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(result.summary(), "stopped on request; stopped 2 running ranks");
  EXPECT_TRUE(no_children_left());
}

// on_first_failure runs once, for the first failure only, while the others still run.
TEST(RankProcesses, FirstFailureHookRunsOnceAtTheFailure) {
  SuperviseOptions options;
  options.on_line = [](int, OutputStream, const std::string&) {};
  options.failure_grace = milliseconds(1000);  // rank 1 fails too meanwhile: no second call
  int failures = 0;
  options.on_first_failure = [&] { ++failures; };
  auto result = run_rank_processes(
      {sh_rank(0, "exit 3"), sh_rank(1, "sleep 0.2; exit 4"), sh_rank(2, "exec sleep 60")}, options);
  EXPECT_EQ(failures, 1);
  EXPECT_EQ(exit_of(result, 1).exit_code, 4);
  EXPECT_EQ(result.first_failed_rank, std::optional<int>(0));
  EXPECT_FALSE(result.stop_requested);
}

TEST(RankProcesses, DescribeTexts) {
  RankExit exit;
  exit.rank = 1;
  exit.pid = 4242;
  exit.exit_code = 3;
  EXPECT_EQ(exit.describe(), "rank 1 (pid 4242) exited with code 3");
  exit.exit_code = 0;
  exit.signal = SIGSEGV;
  EXPECT_EQ(exit.describe(), "rank 1 (pid 4242) was killed by signal 11 (Segmentation fault)");
  exit.signal = SIGTERM;
  exit.stopped_by_supervisor = true;
  EXPECT_EQ(exit.describe(), "rank 1 (pid 4242) was killed by signal 15 (Terminated) after being stopped");
  SuperviseResult empty;
  EXPECT_TRUE(empty.ok());
  EXPECT_EQ(empty.summary(), "all 0 ranks succeeded");
}

TEST(RankProcesses, RankEnvironment) {
  const char* saved = std::getenv("OMP_NUM_THREADS");
  const std::string saved_value = saved != nullptr ? saved : "";
  unsetenv("OMP_NUM_THREADS");
  auto env = rank_environment(1, 2, 4, 3, "node0", 29500);
  EXPECT_EQ(env["RANK"], "7");
  EXPECT_EQ(env["WORLD_SIZE"], "8");
  EXPECT_EQ(env["LOCAL_RANK"], "3");
  EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "4");
  EXPECT_EQ(env["GROUP_RANK"], "1");
  EXPECT_EQ(env["NODE_RANK"], "1");
  EXPECT_EQ(env["MASTER_ADDR"], "node0");
  EXPECT_EQ(env["MASTER_PORT"], "29500");
  EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
  EXPECT_EQ(rank_environment(0, 1, 1, 0, "127.0.0.1", 1).count("OMP_NUM_THREADS"), 0u)
      << "one process per node keeps its OpenMP threads, as with torchrun";
  setenv("OMP_NUM_THREADS", "6", 1);
  EXPECT_EQ(rank_environment(0, 1, 2, 0, "127.0.0.1", 1).count("OMP_NUM_THREADS"), 0u)
      << "the user's OMP_NUM_THREADS is inherited, not overridden";
  if (saved != nullptr) {
    setenv("OMP_NUM_THREADS", saved_value.c_str(), 1);
  } else {
    unsetenv("OMP_NUM_THREADS");
  }
  EXPECT_THROW(rank_environment(2, 2, 1, 0, "h", 1), std::invalid_argument);
  EXPECT_THROW(rank_environment(0, 1, 2, 2, "h", 1), std::invalid_argument);
}

TEST(RankProcesses, PickFreePortCanBeBound) {
  const int port = pick_free_port();
  ASSERT_GE(port, 1);
  ASSERT_LE(port, 65535);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0) << port;
  close(fd);
}

// ---- mfsdp-run ----------------------------------------------------------------------------------

// (a) Tags and the torchrun variables.
TEST(MfsdpRun, TagsOutputAndSetsRankVariables) {
  TempDir dir;
  auto finished = run_launcher(
      {"--nproc-per-node", "3", "sh", "-c",
       "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $MASTER_PORT $MASTER_ADDR $LOCAL_WORLD_SIZE\"; "
       "echo \"err $RANK\" >&2"},
      dir);
  ASSERT_EQ(finished.code(), 0) << describe(finished);
  std::set<int> tags;
  std::set<int> ports;
  std::istringstream out(finished.out);
  for (std::string line; std::getline(out, line);) {
    int tag, rank, world_size, local_rank, port, local_world_size, consumed = 0;
    char addr[64];
    const int fields = std::sscanf(line.c_str(), "[rank%d]: %d %d %d %d %63s %d%n", &tag, &rank,
                                   &world_size, &local_rank, &port, addr, &local_world_size,
                                   &consumed);
    ASSERT_TRUE(fields == 7 && consumed == static_cast<int>(line.size()))
        << "untagged or odd line: " << line;
    EXPECT_EQ(rank, tag) << line;
    EXPECT_EQ(world_size, 3) << line;
    EXPECT_EQ(local_rank, tag) << line;  // single node
    EXPECT_STREQ(addr, "127.0.0.1") << line;
    EXPECT_EQ(local_world_size, 3) << line;
    EXPECT_GE(port, 1);
    EXPECT_LE(port, 65535);
    ports.insert(port);
    EXPECT_TRUE(tags.insert(tag).second) << "rank " << tag << " printed twice";
  }
  EXPECT_EQ(tags, (std::set<int>{0, 1, 2})) << describe(finished);
  EXPECT_EQ(ports.size(), 1u) << "all ranks must share one MASTER_PORT";
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE(contains(finished.err, "[rank" + std::to_string(rank) + "]: err " +
                                           std::to_string(rank) + "\n"))
        << describe(finished);
  }
}

// (b) One failing rank stops the sleeping others; mfsdp-run exits with its code.
TEST(MfsdpRun, FailingRankStopsTheOthers) {
  TempDir dir;
  auto finished = run_launcher(
      {"--nproc-per-node", "3", "sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60"},
      dir);
  EXPECT_EQ(finished.code(), 3) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "mfsdp-run: rank 1 (pid ")) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "exited with code 3")) << describe(finished);
  // Had the others been waited for rather than stopped, they would have exited 0 after 60 s.
  for (int rank : {0, 2}) {
    const std::string line = line_starting_with(finished.err, "mfsdp-run:   rank " + std::to_string(rank) + " (pid ");
    EXPECT_TRUE(contains(line, "after being stopped")) << describe(finished);
  }
}

// (c) A rank killed by a signal.
TEST(MfsdpRun, ReportsTheSignalThatKilledARank) {
  TempDir dir;
  auto finished = run_launcher(
      {"--nproc-per-node", "2", "sh", "-c", "if [ \"$RANK\" = 0 ]; then kill -SEGV $$; fi; sleep 60"},
      dir);
  EXPECT_EQ(finished.code(), 128 + SIGSEGV) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "rank 0 (pid ")) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "killed by signal 11 (Segmentation fault)"))
      << describe(finished);
}

// (d) Bad flags: an error naming the flag, usage exit code, and nothing runs.
TEST(MfsdpRun, RejectsBadFlagsWithoutRunningAnything) {
  TempDir dir;
  const std::string ran = dir.file("ran");
  const std::vector<std::string> program = {"sh", "-c", "echo 1 > " + ran};
  struct Case {
    std::vector<std::string> flags;
    std::string expected;  // in the error message
    bool with_program = true;
  };
  const std::vector<Case> cases = {
      {{"--nproc-per-node", "0"}, "--nproc-per-node must be >= 1, got 0"},
      {{"--nproc-per-node", "two"}, "--nproc-per-node expects an integer, got 'two'"},
      {{"--node-rank", "2", "--nnodes", "2"}, "--node-rank must be in 0..1 for --nnodes 2, got 2"},
      {{"--nnodes", "0"}, "--nnodes must be >= 1"},
      {{"--nnodes", "2"}, "--master-addr is required when --nnodes > 1"},
      {{"--master-port", "70000"}, "--master-port must be in 1..65535, got 70000"},
      {{"--master_port=0"}, "--master-port must be in 1..65535, got 0"},
      {{"--no-such-flag", "1"}, "unknown option '--no-such-flag'"},
      {{"--nproc-per-node", "2"}, "missing PROGRAM", /*with_program=*/false},
      {{"--nproc-per-node"}, "--nproc-per-node needs a value", /*with_program=*/false},
      {{"--max-restarts", "-1"}, "--max-restarts must be in 0..1000, got -1"},
      {{"--monitor-interval", "0"}, "--monitor-interval expects a positive number of seconds, got '0'"},
      {{"--rdzv-conf", "read_timeout=3"}, "--rdzv-conf: mfsdp-run knows join_timeout=SECONDS only, got 'read_timeout=3'"},
      {{"--rdzv-conf", "join_timeout=0"}, "--rdzv-conf join_timeout expects a positive number of seconds, got '0'"},
      {{"--rdzv-port", "0"}, "--rdzv-port must be in 1..65535, got 0"},
      {{"--max-restarts", "1", "--nnodes", "2", "--master-addr", "h", "--master-port", "23456", "--rdzv-port", "23456"},
       "--rdzv-port must differ from --master-port (rank 0 serves the store there), got 23456"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.flags;
    if (c.with_program) args.insert(args.end(), program.begin(), program.end());
    SCOPED_TRACE(::testing::PrintToString(args));
    auto finished = run_launcher(args, dir);
    EXPECT_EQ(finished.code(), 2) << describe(finished);
    EXPECT_TRUE(contains(finished.err, "mfsdp-run: error: " + c.expected)) << describe(finished);
    EXPECT_FALSE(fs::exists(ran)) << "a rank ran despite the bad flags";
  }
}

// --max-restarts: rank 1 fails in the first start; every rank starts again, in a new round (a new
// port and job token, TORCHELASTIC_RESTART_COUNT 1), and the job succeeds. Each start's ranks
// write their round to a file of their own.
TEST(MfsdpRun, MaxRestartsStartsEveryRankAgainInANewRound) {
  TempDir dir;
  const std::string script =
      "echo \"$MASTER_PORT $MFSDP_JOB_TOKEN $TORCHELASTIC_MAX_RESTARTS\" > " + dir.path().string() +
      "/start$TORCHELASTIC_RESTART_COUNT.rank$RANK; "
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then exit 3; fi; "
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 60; fi";
  auto finished = run_launcher({"--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval", "0.1", "sh",
                                "-c", script},
                               dir);
  EXPECT_EQ(finished.code(), 0) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "mfsdp-run: rank 1 (pid ")) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "mfsdp-run: restarting every rank (restart 1 of 2)")) << describe(finished);
  EXPECT_FALSE(contains(finished.err, "restart 2 of 2")) << describe(finished);
  std::map<int, std::set<std::string>> rounds;  // start -> what its ranks saw
  for (int start : {0, 1})
    for (int rank : {0, 1}) {
      const std::string seen = read_file(dir.file("start" + std::to_string(start) + ".rank" + std::to_string(rank)));
      ASSERT_FALSE(seen.empty()) << "start " << start << " rank " << rank << "\n" << describe(finished);
      rounds[start].insert(seen);
    }
  // Within a start every rank meets on one port with one token; the restart with a token of its own
  // (and a free port of its own, which may by chance be the first start's again).
  ASSERT_EQ(rounds[0].size(), 1u);
  ASSERT_EQ(rounds[1].size(), 1u);
  std::istringstream first(*rounds[0].begin()), second(*rounds[1].begin());
  std::string port0, token0, max0, port1, token1, max1;
  first >> port0 >> token0 >> max0;
  second >> port1 >> token1 >> max1;
  EXPECT_FALSE(port1.empty());
  EXPECT_NE(token0, token1);
  EXPECT_EQ(token1, token0 + ".restart1");
  EXPECT_EQ(max0, "2");
  EXPECT_FALSE(fs::exists(dir.file("start2.rank0")));
}

// Restarts run out: the last start's failure is mfsdp-run's exit code; without --max-restarts a
// failure is never restarted.
TEST(MfsdpRun, MaxRestartsRunOutWithTheLastFailure) {
  TempDir dir;
  auto finished = run_launcher(
      {"--nproc-per-node", "2", "--max-restarts", "1", "sh", "-c", "exit $((4 + TORCHELASTIC_RESTART_COUNT))"}, dir);
  EXPECT_EQ(finished.code(), 5) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "restarting every rank (restart 1 of 1)")) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "mfsdp-run: no restart left (--max-restarts 1)")) << describe(finished);
  auto once = run_launcher({"--nproc-per-node", "2", "sh", "-c", "exit $((4 + TORCHELASTIC_RESTART_COUNT))"}, dir);
  EXPECT_EQ(once.code(), 4) << describe(once);
  EXPECT_FALSE(contains(once.err, "restart")) << describe(once);
}

// ---- goodput ------------------------------------------------------------------------------------

// Two starts: iteration 3 of the first is redone by the second (it resumed after 2); a line cut
// mid-way (marked by the launcher before the restart) and a last line without '\n' are skipped.
TEST(MfsdpRun, GoodputSummaryOfTwoStartsWithALostIteration) {
  const std::string progress =
      "start 0 0 100.0\n"
      "iteration 1 102.0\n"     // 2.0 s, kept
      "iteration 2 103.5\n"     // 1.5 s, kept
      "iteration 3 105.0\n"     // 1.5 s, lost: start 1 resumed after 2
      "iteration 4 10#cut\n"    // cut when the rank died
      "start 1 2 120.0\n"
      "iteration 3 121.0\n"     // 1.0 s, kept
      "iteration 4 122.5\n"     // 1.5 s, kept
      "iteration 5 12";         // being written at the end: skipped
  JobTimes job;
  job.begin = 98;
  job.end = 125;
  job.starts = 2;
  job.failure_times = {110};
  const GoodputSummary summary = summarize_progress(progress, job);
  EXPECT_EQ(summary.lines, 7);  // 2 starts, 5 iterations
  EXPECT_DOUBLE_EQ(summary.wall, 27);
  EXPECT_EQ(summary.starts, 2);
  EXPECT_EQ(summary.kept, 4);
  EXPECT_EQ(summary.lost, 1);
  EXPECT_DOUBLE_EQ(summary.productive, 6.0);
  EXPECT_DOUBLE_EQ(summary.lost_time, 1.5);
  EXPECT_DOUBLE_EQ(summary.restarting, 10.0);  // failure at 110 to start 1's loop at 120
  EXPECT_DOUBLE_EQ(summary.goodput, 6.0 / 27);
  EXPECT_EQ(format_goodput(summary),
            "mfsdp-run: goodput: wall 27.0 s, 2 starts (1 restart), 4 iterations kept, 1 lost and redone; "
            "productive 6.0 s (time in kept iterations), lost 1.5 s, restarting 10.0 s (failure to the next "
            "start's loop), goodput 22.2%");
}

// A start that died before its loop (no `start` line) counts whole as restarting; a later start
// that went back further makes every iteration after its resume point lost, in every earlier start.
TEST(MfsdpRun, GoodputSummaryOfAStartThatNeverReachedItsLoop) {
  const std::string progress =
      "start 0 0 10\n"
      "iteration 1 11\n"
      "iteration 2 12\n"
      "stray text\n"
      "iteration 3 13\n"
      "start 2 1 40\n"
      "iteration 2 42\n"
      "iteration 3 43\n";
  JobTimes job;
  job.begin = 0;
  job.end = 50;
  job.starts = 3;
  job.failure_times = {20, 30};  // start 1 failed at 30 without a `start` line
  const GoodputSummary summary = summarize_progress(progress, job);
  EXPECT_EQ(summary.lines, 7);
  EXPECT_EQ(summary.kept, 3);  // 1 of start 0, 2 and 3 of start 2
  EXPECT_EQ(summary.lost, 2);  // 2 and 3 of start 0
  EXPECT_DOUBLE_EQ(summary.productive, 1 + 2 + 1);
  EXPECT_DOUBLE_EQ(summary.lost_time, 2);
  EXPECT_DOUBLE_EQ(summary.restarting, (30 - 20) + (40 - 30));
  EXPECT_TRUE(contains(format_goodput(summary), "3 starts (2 restarts), 3 iterations kept, 2 lost"))
      << format_goodput(summary);
  EXPECT_EQ(summarize_progress("", job).lines, 0);
  EXPECT_EQ(summarize_progress("start 0 0 1", job).lines, 0) << "a line without its newline is cut";
}

// End to end: rank 0 writes the progress file mfsdp-run gives it, dies after iteration 4 in the
// middle of a line, and the restart resumes after iteration 2: mfsdp-run's summary counts 5
// iterations kept and 2 lost (3 and 4 of the first start), and the file is gone afterwards.
TEST(MfsdpRun, PrintsTheGoodputOfARestartedJob) {
  TempDir dir;
  const std::string script =
      "echo \"$MFSDP_PROGRESS_FILE $MFSDP_PREVIOUS_FAILURE_TIME\" > " + dir.path().string() +
      "/start$TORCHELASTIC_RESTART_COUNT.rank$RANK; [ \"$RANK\" = 0 ] || exit 0; "
      "c=$TORCHELASTIC_RESTART_COUNT; r=0; [ $c = 0 ] || r=2; "
      "echo \"start $c $r $(date +%s.%N)\" >> \"$MFSDP_PROGRESS_FILE\"; i=$((r + 1)); "
      "while [ $i -le 5 ]; do sleep 0.05; echo \"iteration $i $(date +%s.%N)\" >> \"$MFSDP_PROGRESS_FILE\"; "
      "if [ $c = 0 ] && [ $i = 4 ]; then printf 'iteration 5 17' >> \"$MFSDP_PROGRESS_FILE\"; exit 1; fi; "
      "i=$((i + 1)); done";
  const double before = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  auto finished = run_launcher({"--nproc-per-node", "2", "--max-restarts", "1", "sh", "-c", script}, dir);
  const double after = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  ASSERT_EQ(finished.code(), 0) << describe(finished);
  const std::string line = line_starting_with(finished.err, "mfsdp-run: goodput: ");
  EXPECT_TRUE(contains(line, "2 starts (1 restart), 5 iterations kept, 2 lost and redone")) << describe(finished);
  double wall = 0, productive = 0, lost = 0, restarting = 0, goodput = 0;
  ASSERT_EQ(std::sscanf(line.c_str(),
                        "mfsdp-run: goodput: wall %lf s, 2 starts (1 restart), 5 iterations kept, 2 lost and redone; "
                        "productive %lf s (time in kept iterations), lost %lf s, restarting %lf s (failure to the "
                        "next start's loop), goodput %lf%%",
                        &wall, &productive, &lost, &restarting, &goodput),
            5)
      << line;
  EXPECT_GT(productive, 0.2);  // 5 iterations of at least 0.05 s
  EXPECT_GT(lost, 0.08);       // 2 of them
  EXPECT_GE(restarting, 0.0);
  EXPECT_LE(productive + lost + restarting, wall + 0.05);
  EXPECT_LE(wall, after - before + 0.05);
  // Every rank of every start got the same file; the restart also the first start's failure time.
  std::istringstream first(read_file(dir.file("start0.rank1"))), second(read_file(dir.file("start1.rank0")));
  std::string path0, path1;
  double failure_time = 0;
  first >> path0;
  second >> path1 >> failure_time;
  EXPECT_FALSE(path0.empty());
  EXPECT_EQ(path0, path1);
  EXPECT_GE(failure_time, before);
  EXPECT_LE(failure_time, after);
  EXPECT_FALSE(fs::exists(path0)) << "the progress file outlived mfsdp-run";
}

// ---- restarts across nodes: two launchers on this host ------------------------------------------

// The flags of node `node` of a two-node job on 127.0.0.1, one rank each.
std::vector<std::string> node_flags(int node, int master_port, int rdzv_port, const std::vector<std::string>& more,
                                    const std::string& script) {
  std::vector<std::string> args = {"--nnodes", "2", "--node-rank", std::to_string(node), "--master-addr", "127.0.0.1",
                                   "--master-port", std::to_string(master_port), "--rdzv-port",
                                   std::to_string(rdzv_port), "--max-restarts", "2"};
  args.insert(args.end(), more.begin(), more.end());
  args.insert(args.end(), {"sh", "-c", script});
  return args;
}

// Two free ports, for the store and the launchers' rendezvous.
std::pair<int, int> two_ports() {
  const int first = pick_free_port();
  int second = pick_free_port();
  while (second == first) second = pick_free_port();
  return {first, second};
}

// Sets MFSDP_JOB_TOKEN for the launchers started while it lives.
struct ScopedToken {
  explicit ScopedToken(const std::string& token) { setenv("MFSDP_JOB_TOKEN", token.c_str(), 1); }
  ~ScopedToken() { unsetenv("MFSDP_JOB_TOKEN"); }
};

// Node 1's rank fails in round 0 while node 0's runs on: node 0's launcher learns of it through
// node 0's rendezvous, stops its rank, and both start round 1 together, on one new port with the
// token of restart 1. Only node 0 (rank 0's) prints the goodput.
TEST(MfsdpRun, MaxRestartsAcrossNodesRestartEveryNodeTogether) {
  TempDir shared, node0, node1;
  const ScopedToken token("across-nodes-test");
  const auto [port, rdzv] = two_ports();
  const std::string s = shared.path().string();
  const std::string script =
      "c=$TORCHELASTIC_RESTART_COUNT; echo \"$MASTER_PORT $MFSDP_JOB_TOKEN $c\" > " + s + "/start$c.rank$RANK; "
      "if [ $RANK = 0 ]; then echo \"start $c 0 $(date +%s.%N)\" >> \"$MFSDP_PROGRESS_FILE\"; fi; "
      "if [ $c = 0 ] && [ $RANK = 1 ]; then n=0; while [ ! -s " + s + "/start0.rank0 ] && [ $n -lt 3000 ]; do "
      "sleep 0.01; n=$((n + 1)); done; exit 3; fi; "
      "if [ $c = 0 ]; then exec sleep 60; fi; "
      "if [ $RANK = 0 ]; then echo \"iteration 1 $(date +%s.%N)\" >> \"$MFSDP_PROGRESS_FILE\"; fi";
  const auto begin = std::chrono::steady_clock::now();
  Launched launched0 = start_launcher(node_flags(0, port, rdzv, {"--monitor-interval", "0.1"}, script), node0);
  Launched launched1 = start_launcher(node_flags(1, port, rdzv, {"--monitor-interval", "0.1"}, script), node1);
  auto finished1 = wait_launcher(launched1);
  auto finished0 = wait_launcher(launched0);
  const auto took = std::chrono::steady_clock::now() - begin;
  ASSERT_EQ(finished0.code(), 0) << describe(finished0) << describe(finished1);
  ASSERT_EQ(finished1.code(), 0) << describe(finished0) << describe(finished1);
  EXPECT_LT(took, std::chrono::seconds(30)) << "node 0's sleeping rank was not stopped";
  EXPECT_TRUE(contains(finished0.err, "mfsdp-run: round 0 failed on node 1; stopped 1 running rank here"))
      << describe(finished0);
  EXPECT_TRUE(contains(finished1.err, "mfsdp-run: rank 1 (pid ")) << describe(finished1);
  EXPECT_TRUE(contains(finished1.err, "exited with code 3")) << describe(finished1);
  for (const Finished* finished : {&finished0, &finished1}) {
    EXPECT_TRUE(contains(finished->err, "mfsdp-run: restarting every rank (restart 1 of 2)")) << describe(*finished);
    EXPECT_FALSE(contains(finished->err, "restart 2")) << describe(*finished);
  }
  const std::string round1 = read_file(shared.file("start1.rank0"));
  EXPECT_EQ(round1, read_file(shared.file("start1.rank1"))) << "the nodes started round 1 apart";
  std::istringstream fields(round1);
  int round1_port = 0, count = -1;
  std::string round1_token;
  fields >> round1_port >> round1_token >> count;
  EXPECT_NE(round1_port, port) << "round 1 reused round 0's MASTER_PORT";
  EXPECT_NE(round1_port, rdzv);
  EXPECT_EQ(round1_token, "across-nodes-test.restart1");
  EXPECT_EQ(count, 1);
  EXPECT_TRUE(contains(read_file(shared.file("start0.rank0")), " across-nodes-test 0"));
  EXPECT_TRUE(contains(finished0.err, "mfsdp-run: goodput: ")) << describe(finished0);
  EXPECT_TRUE(contains(finished0.err, "2 starts (1 restart), 1 iteration kept")) << describe(finished0);
  EXPECT_FALSE(contains(finished1.err, "goodput")) << describe(finished1);
}

// A node that never joins: node 0's launcher ends the round after join_timeout, naming it, and no
// rank starts; a node whose node 0 never comes names node 0's address.
TEST(MfsdpRun, AcrossNodesARoundFailsNamingTheNodeThatNeverJoined) {
  TempDir shared, node0, node1;
  const ScopedToken token("across-nodes-test");
  const std::string script = "echo ran > " + shared.file("ran") + "$RANK";
  {
    const auto [port, rdzv] = two_ports();
    const auto begin = std::chrono::steady_clock::now();
    auto finished = run_launcher(node_flags(0, port, rdzv, {"--rdzv-conf", "join_timeout=1"}, script), node0);
    EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(10));
    EXPECT_EQ(finished.code(), 1) << describe(finished);
    EXPECT_TRUE(contains(finished.err, "mfsdp-run: the job ends: node 1 did not join round 0 within 1 s "
                                       "(--rdzv-conf join_timeout)"))
        << describe(finished);
  }
  {
    const auto [port, rdzv] = two_ports();
    auto finished = run_launcher(node_flags(1, port, rdzv, {"--rdzv-conf", "join_timeout=1"}, script), node1);
    EXPECT_EQ(finished.code(), 1) << describe(finished);
    EXPECT_TRUE(contains(finished.err, "mfsdp-run: error: round 0 did not start within 1 s: cannot reach node 0's "
                                       "launcher at 127.0.0.1:" + std::to_string(rdzv)))
        << describe(finished);
  }
  EXPECT_FALSE(fs::exists(shared.file("ran0")));
  EXPECT_FALSE(fs::exists(shared.file("ran1")));
}

// A launcher of another job (another token) is refused by node 0's, and says why.
TEST(MfsdpRun, AcrossNodesALauncherWithAnotherTokenIsRefused) {
  TempDir shared, node0, node1;
  const auto [port, rdzv] = two_ports();
  const std::string script = "echo ran > " + shared.file("ran") + "$RANK";
  Launched launched0 = [&] {
    const ScopedToken token("job-a");
    return start_launcher(node_flags(0, port, rdzv, {"--rdzv-conf", "join_timeout=3"}, script), node0);
  }();
  Finished finished1 = [&] {
    const ScopedToken token("job-b");
    return run_launcher(node_flags(1, port, rdzv, {"--rdzv-conf", "join_timeout=3"}, script), node1);
  }();
  auto finished0 = wait_launcher(launched0);
  EXPECT_EQ(finished1.code(), 1) << describe(finished1);
  EXPECT_TRUE(contains(finished1.err, "refused by node 0's launcher: node 1 has another job token than node 0"))
      << describe(finished1);
  EXPECT_EQ(finished0.code(), 1) << describe(finished0);
  EXPECT_TRUE(contains(finished0.err, "refused a request from 127.0.0.1:")) << describe(finished0);
  EXPECT_TRUE(contains(finished0.err, "node 1 did not join round 0")) << describe(finished0);
  EXPECT_FALSE(fs::exists(shared.file("ran0")));
}

// SIGTERM to one node's launcher ends the job on every node: node 0's stops its rank and does not
// restart, naming the interrupted node.
TEST(MfsdpRun, AcrossNodesAnInterruptIsNeverRestartedOnAnyNode) {
  TempDir shared, node0, node1;
  const ScopedToken token("across-nodes-test");
  const auto [port, rdzv] = two_ports();
  const std::string script = "echo $$ > " + shared.file("rank") + "$RANK; exec sleep 60";
  Launched launched0 = start_launcher(node_flags(0, port, rdzv, {}, script), node0);
  Launched launched1 = start_launcher(node_flags(1, port, rdzv, {}, script), node1);
  const bool started = wait_for_files({shared.file("rank0"), shared.file("rank1")});
  kill(launched1.pid, SIGTERM);
  auto finished1 = wait_launcher(launched1);
  auto finished0 = wait_launcher(launched0);
  ASSERT_TRUE(started) << describe(finished0) << describe(finished1);
  EXPECT_EQ(finished1.code(), 128 + SIGTERM) << describe(finished1);
  EXPECT_NE(finished0.code(), 0) << describe(finished0);
  EXPECT_TRUE(contains(finished0.err, "node 1's mfsdp-run was interrupted by signal 15 (an interrupt is never "
                                      "restarted)"))
      << describe(finished0);
  for (const Finished* finished : {&finished0, &finished1})
    EXPECT_FALSE(contains(finished->err, "restarting every rank")) << describe(*finished);
}

// (e) A program that cannot be executed.
TEST(MfsdpRun, ReportsAProgramThatCannotBeExecuted) {
  TempDir dir;
  auto finished = run_launcher({"--nproc-per-node", "2", "mfsdp-no-such-program"}, dir);
  EXPECT_EQ(finished.code(), 127) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "cannot execute 'mfsdp-no-such-program'")) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "could not execute its program (exit code 127)"))
      << describe(finished);
}

// (f) Ranks of the second node of a two-node job (no rendezvous happens: the ranks only print).
TEST(MfsdpRun, SecondNodeOfTwoGetsRanksTwoAndThree) {
  TempDir dir;
  auto finished = run_launcher(
      {"--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
       "--master-port", "12345", "sh", "-c",
       "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $NODE_RANK $GROUP_RANK $MASTER_ADDR $MASTER_PORT\""},
      dir);
  ASSERT_EQ(finished.code(), 0) << describe(finished);
  EXPECT_TRUE(contains(finished.out, "[rank2]: 2 4 0 1 1 127.0.0.1 12345\n")) << describe(finished);
  EXPECT_TRUE(contains(finished.out, "[rank3]: 3 4 1 1 1 127.0.0.1 12345\n")) << describe(finished);
  EXPECT_FALSE(contains(finished.out, "[rank0]")) << describe(finished);
}

// Torchrun's spellings, --flag=value, --no-tag, and arguments after PROGRAM passed through.
TEST(MfsdpRun, AcceptsTorchrunSpellingsAndPassesArgumentsThrough) {
  TempDir dir;
  auto finished = run_launcher({"--nproc_per_node=2", "--master_port=23456", "--no-tag", "--",
                                "sh", "-c", "echo \"$RANK $MASTER_PORT $*\"", "sh",
                                "--nproc-per-node", "5", "--help"},
                               dir);
  ASSERT_EQ(finished.code(), 0) << describe(finished);
  EXPECT_TRUE(contains(finished.out, "0 23456 --nproc-per-node 5 --help\n")) << describe(finished);
  EXPECT_TRUE(contains(finished.out, "1 23456 --nproc-per-node 5 --help\n")) << describe(finished);
  EXPECT_FALSE(contains(finished.out, "[rank")) << describe(finished);
}

TEST(MfsdpRun, HelpPrintsUsage) {
  TempDir dir;
  auto finished = run_launcher({"--help"}, dir);
  EXPECT_EQ(finished.code(), 0) << describe(finished);
  EXPECT_TRUE(contains(finished.out, "usage: mfsdp-run")) << describe(finished);
  EXPECT_TRUE(contains(finished.out, "--nproc-per-node")) << describe(finished);
}

// (g) SIGTERM to mfsdp-run stops the ranks and what they started: no orphans.
TEST(MfsdpRun, SigtermStopsRanksAndTheirChildren) {
  TempDir dir;
  const std::string script = "echo $$ > " + dir.file("rank") + "$RANK; sleep 60 & echo $! > " +
                             dir.file("child") + "$RANK; wait";
  Launched launched = start_launcher({"--nproc-per-node", "2", "sh", "-c", script}, dir);
  const std::vector<std::string> pid_files = {dir.file("rank0"), dir.file("rank1"),
                                              dir.file("child0"), dir.file("child1")};
  const bool started = wait_for_files(pid_files);
  kill(launched.pid, SIGTERM);
  auto finished = wait_launcher(launched);
  ASSERT_TRUE(started) << "the ranks did not write their pids\n" << describe(finished);
  EXPECT_EQ(finished.code(), 128 + SIGTERM) << describe(finished);
  EXPECT_TRUE(contains(finished.err, "interrupted by signal 15 (Terminated)")) << describe(finished);
  for (const auto& file : pid_files) {
    const pid_t pid = read_pid(file);
    EXPECT_TRUE(wait_until_gone(pid)) << file << ": pid " << pid << " outlived mfsdp-run";
  }
}

// ---- deaths and what they leave: real rank programs ---------------------------------------------

// The processes whose parent is `parent`, with their RANK and MFSDP_SHM_TAG (from
// /proc/PID/environ).
struct RankProcess {
  pid_t pid = 0;
  std::string rank;
  std::string shm_tag;
};

std::vector<RankProcess> children_of(pid_t parent) {
  std::vector<RankProcess> found;
  for (const std::string& name : mfsdp::list_directory("/proc")) {
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_file("/proc/" + name + "/stat");
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(stat.substr(paren + 2));
    std::string state;
    pid_t ppid = 0;
    fields >> state >> ppid;
    if (ppid != parent) continue;
    RankProcess process;
    process.pid = static_cast<pid_t>(std::stol(name));
    std::istringstream environ(read_file("/proc/" + name + "/environ"));
    for (std::string var; std::getline(environ, var, '\0');) {
      if (var.rfind("RANK=", 0) == 0) process.rank = var.substr(5);
      if (var.rfind("MFSDP_SHM_TAG=", 0) == 0) process.shm_tag = var.substr(14);
    }
    found.push_back(process);
  }
  return found;
}

// /dev/shm names of the communicator's segments ("mfsdp-[TAG-]PID-NONCE") made by `pid`.
std::vector<std::string> shm_segments_of(pid_t pid) {
  std::vector<std::string> names;
  for (const std::string& name : mfsdp::list_directory("/dev/shm")) {
    if (name.rfind("mfsdp-", 0) != 0) continue;
    const size_t last = name.rfind('-');
    const size_t before = name.rfind('-', last - 1);
    if (name.substr(before + 1, last - before - 1) == std::to_string(pid)) names.push_back(name);
  }
  return names;
}

std::string shm_helper_binary() {
  if (const char* path = std::getenv("MFSDP_SHM_HELPER")) return path;
  return MFSDP_SHM_HELPER_PATH;
}

std::string pretrain_binary() {
  if (const char* path = std::getenv("MFSDP_PRETRAIN_BIN")) return path;
  return MFSDP_PRETRAIN_BIN_PATH;
}

// Waits until `ready` holds (polling every millisecond), at most `timeout`.
template <typename Ready>
bool wait_until(Ready ready, milliseconds timeout = milliseconds(120000)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!ready()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

// (h) A rank SIGKILLed right after it created its /dev/shm segment, before its peers mapped it
// (the moment ranks cannot clean up after themselves: tests/e2e/launcher_shm_helper.cpp holds
// it there): mfsdp-run removes the segment once the rank is gone.
TEST(MfsdpRun, NoShmSegmentLeftByARankKilledRightAfterCreatingIt) {
  int leaked = 0;
  constexpr int kTrials = 3;
  for (int trial = 0; trial < kTrials; ++trial) {
    TempDir dir;
    Launched launched = start_launcher({"--nproc-per-node", "1", shm_helper_binary()}, dir);
    pid_t rank = 0;
    std::vector<std::string> segments;
    bool created = false;
    wait_until([&] {
      if (process_gone(launched.pid)) return true;  // ended without a segment: reported below
      for (const RankProcess& child : children_of(launched.pid)) rank = child.pid;
      if (rank != 0) segments = shm_segments_of(rank);
      created = !segments.empty();
      return created;
    });
    if (rank != 0) kill(rank, SIGKILL);
    auto finished = wait_launcher(launched);
    ASSERT_TRUE(created) << "the rank made no segment\n" << describe(finished);
    EXPECT_EQ(finished.code(), 128 + SIGKILL) << describe(finished);
    for (const std::string& name : segments) {
      if (!fs::exists("/dev/shm/" + name)) continue;
      ++leaked;
      ADD_FAILURE() << "trial " << trial << ": /dev/shm/" << name << " outlived its job";
      fs::remove("/dev/shm/" + name);
    }
  }
  std::printf("segments left by %d ranks killed right after creating theirs: %d\n", kTrials, leaked);
}

// (i) mfsdp-pretrain on 2 ranks, rank 1 SIGKILLed at two moments: as soon as rank 0 created the
// segment (start-up), and mid-training (after rank 0 logged an iteration). No segment of the job
// is left in /dev/shm; mid-training, rank 0 notices, and its own error line naming rank 1 reaches
// mfsdp-run's output whole before mfsdp-run exits (the failure grace: no SIGTERM cuts it).
TEST(MfsdpRun, PretrainRankKilledAtStartUpOrMidTrainingLeavesNoSegmentAndSurvivorSaysWhy) {
  const std::string model =
      " --device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 1"
      " --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 48 --seq-length 16"
      " --micro-batch-size 2 --global-batch-size 4 --train-iters 100000 --lr 1e-3 --log-interval 1"
      " --eval-interval 100000 --eval-iters 1 --seed 7";
  constexpr int kTrials = 2;
  int survivor_lines = 0;
  int mid_training_trials = 0;
  int start_up_kills = 0;  // start-up trials that caught the segment before its unlink
  for (const bool mid_training : {false, true}) {
    for (int trial = 0; trial < kTrials; ++trial) {
      TempDir dir;
      std::vector<std::string> args = {"--nproc-per-node", "2", pretrain_binary()};
      std::istringstream words(model);
      for (std::string word; words >> word;) args.push_back(word);
      Launched launched = start_launcher(args, dir);
      RankProcess rank0, rank1;
      bool reached = false;
      wait_until([&] {
        if (process_gone(launched.pid)) return true;  // ended before the moment: reported below
        for (const RankProcess& child : children_of(launched.pid)) {
          if (child.rank == "0") rank0 = child;
          if (child.rank == "1") rank1 = child;
        }
        if (rank0.pid == 0 || rank1.pid == 0) return false;
        // Start-up: while rank 0's segment is still in /dev/shm (it is unlinked once every rank has
        // mapped it). That window can pass between two polls; then the kill lands at the first
        // iteration instead (counted below) rather than waiting for a moment that is gone.
        const bool training = contains(read_file(launched.out_path), "[rank0]:  iteration");
        reached = mid_training ? training : !shm_segments_of(rank0.pid).empty() || training;
        if (!mid_training && reached && !training) ++start_up_kills;
        return reached;
      });
      if (rank1.pid != 0) kill(rank1.pid, SIGKILL);
      auto finished = wait_launcher(launched);
      ASSERT_TRUE(reached) << "mid_training " << mid_training << "\n" << describe(finished);
      EXPECT_EQ(finished.code(), 128 + SIGKILL) << describe(finished);
      EXPECT_FALSE(rank0.shm_tag.empty()) << "mfsdp-run gave its ranks no MFSDP_SHM_TAG";
      for (const std::string& name : mfsdp::list_directory("/dev/shm")) {
        const bool ours = (!rank0.shm_tag.empty() && name.rfind("mfsdp-" + rank0.shm_tag + "-", 0) == 0) ||
                          !shm_segments_of(rank0.pid).empty();
        if (!ours) continue;
        ADD_FAILURE() << "mid_training " << mid_training << ": /dev/shm/" << name << " outlived its job";
        fs::remove("/dev/shm/" + name);
      }
      if (!mid_training) continue;
      ++mid_training_trials;
      // Rank 0's own line, e.g. "[rank0]: mfsdp-pretrain: ... rank 1 ...", not just its prefix.
      const std::string line = line_starting_with(finished.err, "[rank0]: mfsdp-pretrain: ");
      const bool whole = contains(line, "rank 1");
      survivor_lines += whole ? 1 : 0;
      EXPECT_TRUE(whole) << "rank 0's error line is missing or cut: '" << line << "'\n"
                         << describe(finished);
      EXPECT_TRUE(contains(finished.err, "mfsdp-run:   rank 0 (pid ")) << describe(finished);
      EXPECT_FALSE(contains(line_starting_with(finished.err, "mfsdp-run:   rank 0 (pid "),
                            "after being stopped"))
          << "rank 0 was stopped instead of exiting on its own\n" << describe(finished);
    }
  }
  std::printf("rank 0's whole error line in %d of %d mid-training kills; %d of %d start-up kills before the "
              "segment's unlink\n",
              survivor_lines, mid_training_trials, start_up_kills, kTrials);
}

}  // namespace
}  // namespace mfsdp::launch
