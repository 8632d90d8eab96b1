// Jobs that survive: a 2-rank ZeRO-3 mfsdp-pretrain job under `mfsdp-run --max-restarts 5`, saving
// and loading one folder, takes a seeded random schedule of failures while it trains:
//  - SIGKILLs of a random rank at random moments (after a random number of iterations of the
//    current start, then a random part of an iteration);
//  - one SIGKILL that lands while a checkpoint is being written: as soon as a `*.tmp` folder
//    appears under the save folder (a save writes SAVE/iter_NNNNNNN.tmp and renames it when every
//    rank's file is on disk, include/mfsdp/checkpoint/checkpoint.h), both ranks are frozen with
//    SIGSTOP, the folder is checked to be still there (the save has not committed, and cannot
//    while they are frozen), one rank is killed and the other continued (which then completes
//    the commit if the victim had already written its share, and otherwise fails);
//  - one SIGSTOP: the stopped rank hangs without dying; its peer's collective times out
//    (--distributed-timeout-minutes 0.1), it exits naming the stopped rank, and mfsdp-run stops the
//    hung one (SIGTERM, then SIGKILL) and restarts the job.
// Every failure hits a live rank of the current start (never one of a start that is already
// going down), and the next one waits for the restart and for training to go on, so each costs
// one restart. The job must still finish, with one restart per failure, every start after the
// first resuming from the latest checkpoint, every logged loss equal to an uninterrupted run's,
// and the final checkpoint (weights, optimizer state, generators) equal to its bit for bit.
//
// The seed is printed; CHAOS_SEED=<n> replays a schedule (its choices; the moments are as exact
// as the processes' timing allows).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mfsdp/base/directory_tree.h"
#include "harness/metrics_file.h"
#include "harness/spawn_with_files.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using mfsdp::testing::TempDir;

const std::string kRun = MFSDP_RUN_BIN_PATH;
const std::string kPretrain = MFSDP_PRETRAIN_BIN_PATH;

// How often the job checkpoints: the one place this test names it. Whatever it is, the run's last
// iteration saves a persistent checkpoint (SAVE/iter_<kIterations>), which the comparison reads.
const std::vector<std::string> kCheckpointCadence = {"--non-persistent-save-interval", "3", "--non-persistent-ckpt-type",
                                                     "global", "--save-interval", "20"};

constexpr int kIterations = 60;
constexpr int kMaxRestarts = 5;
constexpr uint64_t kDefaultSeed = 20250611;
// A rank that stops answering is named after this long (0.1 minutes).
const std::string kTimeoutMinutes = "0.1";
constexpr int kTimeoutMs = 6000;
// The whole chaos run, restarts included, takes well under a minute; past this it hangs.
constexpr auto kJobDeadline = std::chrono::seconds(300);

// restart_test.cpp's tiny model (~0.15 s an iteration on 2 CPU ranks), ZeRO-3, a short final
// evaluation.
std::vector<std::string> job_flags() {
  std::vector<std::string> flags = {
      "--device", "cpu", "--tokenizer-type", "ByteLevelTokenizer", "--mock-data", "--num-layers", "4",
      "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "4",
      "--global-batch-size", "16", "--log-interval", "1", "--seed", "3", "--eval-interval", "1000",
      "--eval-iters", "2", "--train-iters", std::to_string(kIterations),
      "--data-parallel-sharding-strategy", "optim_grads_params",
      "--distributed-timeout-minutes", kTimeoutMinutes};
  flags.insert(flags.end(), kCheckpointCadence.begin(), kCheckpointCadence.end());
  return flags;
}

uint64_t chaos_seed() {
  const char* v = std::getenv("CHAOS_SEED");
  return v != nullptr && *v != '\0' ? std::stoull(v) : kDefaultSeed;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The last `n` lines of `text`.
std::string tail(const std::string& text, size_t n) {
  const auto lines = lines_of(text);
  std::string out;
  for (size_t i = lines.size() > n ? lines.size() - n : 0; i < lines.size(); ++i) out += lines[i] + "\n";
  return out;
}

// ---- processes ------------------------------------------------------------------------------

struct ProcInfo {
  pid_t ppid = 0;
  char state = '?';
  std::string comm;
};

std::optional<ProcInfo> proc_info(pid_t pid) {
  const std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  const size_t open = stat.find('('), close = stat.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close + 4 > stat.size()) return std::nullopt;
  ProcInfo info;
  info.comm = stat.substr(open + 1, close - open - 1);
  std::istringstream rest(stat.substr(close + 2));
  rest >> info.state >> info.ppid;
  return info;
}

bool alive(pid_t pid) {
  const auto info = proc_info(pid);
  return info && info->state != 'Z' && info->state != 'X' && info->comm == "mfsdp-pretrain";
}

// The RANK variable a process was started with, -1 when it cannot be read.
int rank_of(pid_t pid) {
  const std::string env = slurp("/proc/" + std::to_string(pid) + "/environ");
  for (size_t at = 0; at < env.size();) {
    const size_t end = std::min(env.find('\0', at), env.size());
    if (env.compare(at, 5, "RANK=") == 0) return std::atoi(env.c_str() + at + 5);
    at = end + 1;
  }
  return -1;
}

// The live mfsdp-pretrain processes among `root`'s descendants, by their RANK.
std::map<int, pid_t> rank_processes(pid_t root) {
  std::map<pid_t, std::vector<pid_t>> children;
  std::map<pid_t, ProcInfo> infos;
  for (const std::string& name : mfsdp::list_directory("/proc")) {
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    if (auto info = proc_info(pid)) {
      children[info->ppid].push_back(pid);
      infos[pid] = *info;
    }
  }
  std::map<int, pid_t> out;
  std::vector<pid_t> frontier = {root};
  while (!frontier.empty()) {
    std::vector<pid_t> next;
    for (pid_t p : frontier) {
      for (pid_t c : children[p]) {
        next.push_back(c);
        const ProcInfo& info = infos[c];
        if (info.comm == "mfsdp-pretrain" && info.state != 'Z' && info.state != 'X') {
          const int rank = rank_of(c);
          if (rank >= 0) out[rank] = c;
        }
      }
    }
    frontier = std::move(next);
  }
  return out;
}

// Waits until `pid` is stopped (state T), at most a second.
bool wait_stopped(pid_t pid) {
  const auto end = Clock::now() + milliseconds(1000);
  while (Clock::now() < end) {
    const auto info = proc_info(pid);
    if (!info || info->state == 'T' || info->state == 't') return info.has_value();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return false;
}

bool is_committed_iteration(const std::string& name) {
  return name.size() == 12 && name.rfind("iter_", 0) == 0 &&
         name.find_first_not_of("0123456789", 5) == std::string::npos;
}

// A folder `*.tmp` anywhere under `dir` (a save being written), or "". Committed iteration
// folders are not looked into (they hold the ranks' files only), so that a scan every
// millisecond stays cheap.
std::string save_in_progress(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> names;
  try {
    names = mfsdp::list_directory(dir);
  } catch (const std::runtime_error&) {
    return "";  // not there yet, or gone
  }
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    if (!fs::is_directory(path, ec)) continue;
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0) return path;
    if (is_committed_iteration(name)) continue;
    if (std::string inner = save_in_progress(path); !inner.empty()) return inner;
  }
  return "";
}

// True once a committed iteration folder (iter_NNNNNNN) is anywhere under `dir`.
bool has_a_checkpoint(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> names;
  try {
    names = mfsdp::list_directory(dir);
  } catch (const std::runtime_error&) {
    return false;
  }
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    if (!fs::is_directory(path, ec)) continue;
    if (is_committed_iteration(name) || has_a_checkpoint(path)) return true;
  }
  return false;
}

// Follows rank 0's lines of mfsdp-run's stdout as they are written: which start of the job is
// running (the trainer's "restart k of at most K") and how many iterations it has logged.
class LogFollower {
 public:
  explicit LogFollower(std::string path) : path_(std::move(path)) {}

  void poll() {
    std::ifstream in(path_, std::ios::binary);
    in.seekg(offset_);
    std::string chunk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    offset_ += static_cast<std::streamoff>(chunk.size());
    partial_ += chunk;
    static const std::regex restart_line(R"(^\[rank0\]:  restart (\d+) of at most \d+)");
    static const std::regex iteration_line(R"(^\[rank0\]:  iteration +(\d+)/)");
    for (size_t nl; (nl = partial_.find('\n')) != std::string::npos; partial_.erase(0, nl + 1)) {
      const std::string line = partial_.substr(0, nl);
      std::smatch m;
      if (std::regex_search(line, m, restart_line)) {
        start = std::stoi(m[1]);
        iterations_in_start = 0;
      } else if (std::regex_search(line, m, iteration_line)) {
        ++iterations_in_start;
        last_iteration = std::stoll(m[1]);
      }
    }
  }

  int start = -1;
  int64_t iterations_in_start = 0;
  int64_t last_iteration = 0;

 private:
  std::string path_;
  std::streamoff offset_ = 0;
  std::string partial_;
};

// ---- the schedule ---------------------------------------------------------------------------

enum class Kind { kKill, kKillDuringSave, kStop };

struct Event {
  Kind kind = Kind::kKill;
  int rank = 0;                // the victim
  int iterations = 1;          // iterations the start logs before it (kKillDuringSave: before
                               // it watches for the next save)
  milliseconds extra{0};       // then this long (a random moment within an iteration)
  milliseconds into_save{0};   // kKillDuringSave: how long after the save folder appeared (a
                               // save takes some 20 ms here); 0 after a save it missed
  // Filled in when delivered.
  pid_t pid = 0, survivor_pid = 0;
  int64_t at_iteration = 0;
  std::string tmp_folder;      // kKillDuringSave: the save it interrupted

  std::string describe() const {
    std::string s = kind == Kind::kStop ? "SIGSTOP" : "SIGKILL";
    s += " rank " + std::to_string(rank);
    if (pid != 0) s += " (pid " + std::to_string(pid) + ") after iteration " + std::to_string(at_iteration);
    if (kind == Kind::kKillDuringSave) {
      s += (tmp_folder.empty() ? " during a save" : " while " + tmp_folder + " was written") + std::string(", ") +
           std::to_string(into_save.count()) + " ms after it appeared";
    }
    return s;
  }
};

std::vector<Event> make_schedule(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Event> events(kMaxRestarts);
  events[0].kind = Kind::kKillDuringSave;
  events[1].kind = Kind::kStop;
  std::shuffle(events.begin(), events.end(), rng);
  for (auto& e : events) {
    e.rank = static_cast<int>(rng() % 2);
    e.iterations = 1 + static_cast<int>(rng() % 4);
    e.extra = milliseconds(rng() % 200);
    e.into_save = milliseconds(rng() % 11);
  }
  return events;
}

// ---- running a job --------------------------------------------------------------------------

struct JobOutcome {
  int exit_code = -1;  // 128 + signal when killed by one
  std::string out, err;      // mfsdp-run's stdout and stderr
  std::string problem;       // why the schedule could not be delivered, if it could not
};

class Job {
 public:
  Job(const TempDir& dir, const std::string& tag) {
    save = dir.file(tag + "_ckpt");
    metrics = dir.file(tag + ".jsonl");
    out_path = dir.file(tag + ".out");
    err_path = dir.file(tag + ".err");
    fs::create_directories(save);  // an empty save folder: how a resumable job starts
    std::vector<std::string> argv = {"/usr/bin/env", "OMP_NUM_THREADS=1", kRun, "--nproc-per-node", "2",
                                     "--max-restarts", std::to_string(kMaxRestarts), kPretrain};
    for (auto& f : job_flags()) argv.push_back(f);
    for (const std::string& f : {std::string("--save"), save, std::string("--load"), save,
                                 std::string("--metrics-file"), metrics}) {
      argv.push_back(f);
    }
    deadline_ = Clock::now() + kJobDeadline;
    launcher_ = mfsdp::testing::spawn_with_files(argv, out_path, err_path);
  }
  ~Job() {
    if (launcher_ > 0) {
      kill(launcher_, SIGKILL);  // its ranks, stopped or not, die with it (PR_SET_PDEATHSIG SIGKILL)
      waitpid(launcher_, nullptr, 0);
    }
  }

  pid_t launcher() const { return launcher_; }

  // Reaps the launcher if it has exited; true while it runs.
  bool running() {
    if (launcher_ <= 0) return false;
    int status = 0;
    if (waitpid(launcher_, &status, WNOHANG) == launcher_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      launcher_ = -1;
      return false;
    }
    return true;
  }
  bool past_deadline() const { return Clock::now() > deadline_; }

  // Polls `ready` every `period` while the job runs; false when the job ended or hung first.
  template <class F>
  bool wait_until(F&& ready, milliseconds period = milliseconds(10)) {
    while (running() && !past_deadline()) {
      if (ready()) return true;
      std::this_thread::sleep_for(period);
    }
    return false;
  }

  std::map<int, pid_t> ranks() const { return rank_processes(launcher_); }

  JobOutcome finish() {
    while (running() && !past_deadline()) std::this_thread::sleep_for(milliseconds(20));
    JobOutcome o;
    if (launcher_ > 0) {  // hung: stop it, and say so
      kill(launcher_, SIGKILL);
      waitpid(launcher_, nullptr, 0);
      launcher_ = -1;
      o.problem = "the job did not finish within " + std::to_string(kJobDeadline.count()) + " s";
    }
    o.exit_code = exit_code_;
    o.out = slurp(out_path);
    o.err = slurp(err_path);
    return o;
  }

  std::string save, metrics, out_path, err_path;

 private:
  pid_t launcher_ = -1;
  int exit_code_ = -1;
  Clock::time_point deadline_;
};

// Runs the job, delivering `events` in order; each one's fields pid/at_iteration/... are filled in.
JobOutcome run_job(const TempDir& dir, const std::string& tag, std::vector<Event>& events) {
  Job job(dir, tag);
  LogFollower log(job.out_path);
  std::set<pid_t> earlier_starts;
  std::string problem;
  for (size_t i = 0; i < events.size() && problem.empty(); ++i) {
    Event& e = events[i];
    const std::string which = "event " + std::to_string(i + 1) + " (" + e.describe() + ")";
    // 1. The current start: both ranks alive and none of an earlier start, rank 0 has said which
    //    start it is, and the start has trained `e.iterations` iterations (and, before the first
    //    event, the job holds a checkpoint, so that every restart resumes from one).
    std::map<int, pid_t> ranks;
    const bool ready = job.wait_until([&] {
      log.poll();
      if (log.start != static_cast<int>(i) || log.iterations_in_start < e.iterations) return false;
      if (i == 0 && !has_a_checkpoint(job.save)) return false;
      ranks = job.ranks();
      if (ranks.size() != 2) return false;
      for (auto& [rank, pid] : ranks) {
        if (earlier_starts.count(pid)) return false;
      }
      return true;
    });
    if (!ready) {
      problem = "the job ended (or hung) before " + which + " could be delivered";
      break;
    }
    std::this_thread::sleep_for(e.extra);
    // 2. For the save event: the next save folder being written, caught with both ranks frozen.
    if (e.kind == Kind::kKillDuringSave) {
      const bool caught = job.wait_until(
          [&] {
            if (save_in_progress(job.save).empty()) return false;
            std::this_thread::sleep_for(e.into_save);
            for (auto& [rank, pid] : ranks) kill(pid, SIGSTOP);
            bool frozen = true;
            for (auto& [rank, pid] : ranks) frozen = wait_stopped(pid) && frozen;
            e.tmp_folder = save_in_progress(job.save);
            if (frozen && !e.tmp_folder.empty()) return true;  // stays frozen: killed below
            for (auto& [rank, pid] : ranks) kill(pid, SIGCONT);  // it committed meanwhile
            e.tmp_folder.clear();
            e.into_save = milliseconds(0);
            return false;
          },
          milliseconds(1));
      if (!caught) {
        problem = "the job ended (or hung) before " + which + " found a save being written";
        break;
      }
    }
    // 3. The victim must be a live rank of this start.
    const pid_t victim = ranks.at(e.rank), survivor = ranks.at(1 - e.rank);
    if (!alive(victim) || !alive(survivor) || !job.running()) {
      for (auto& [rank, pid] : ranks) kill(pid, SIGCONT);
      problem = "the start was already going down when " + which + " was due (a failure the test did not cause)";
      break;
    }
    log.poll();
    e.pid = victim;
    e.survivor_pid = survivor;
    e.at_iteration = log.last_iteration;
    kill(victim, e.kind == Kind::kStop ? SIGSTOP : SIGKILL);
    if (e.kind == Kind::kKillDuringSave) kill(survivor, SIGCONT);
    std::cout << "chaos: " << e.describe() << std::endl;
    earlier_starts.insert(victim);
    earlier_starts.insert(survivor);
  }
  JobOutcome o = job.finish();
  if (o.problem.empty()) o.problem = problem;
  return o;
}

// ---- what the runs left ---------------------------------------------------------------------

// What rank 0 logged in one start of the job.
struct Start {
  int restart = -1;
  std::optional<int64_t> loaded;   // the iteration of the checkpoint it resumed from
  std::string loaded_from;         // that checkpoint's folder
  std::optional<int64_t> first_iteration;
  std::vector<int64_t> saved;      // iterations whose save it reported
};

std::vector<Start> starts_of(const std::string& out) {
  static const std::regex restart_line(R"(^\[rank0\]:  restart (\d+) of at most \d+)");
  static const std::regex loaded_line(R"(^\[rank0\]:  loaded checkpoint (\S*iter_(\d+)) )");
  static const std::regex iteration_line(R"(^\[rank0\]:  iteration +(\d+)/)");
  static const std::regex saved_line(R"(^\[rank0\]:  saved [a-z -]*checkpoint at iteration (\d+))");
  std::vector<Start> starts;
  for (const auto& line : lines_of(out)) {
    std::smatch m;
    if (std::regex_search(line, m, restart_line)) {
      starts.emplace_back();
      starts.back().restart = std::stoi(m[1]);
    } else if (starts.empty()) {
      continue;
    } else if (std::regex_search(line, m, loaded_line)) {
      starts.back().loaded = std::stoll(m[2]);
      starts.back().loaded_from = m[1];
    } else if (std::regex_search(line, m, iteration_line)) {
      if (!starts.back().first_iteration) starts.back().first_iteration = std::stoll(m[1]);
    } else if (std::regex_search(line, m, saved_line)) {
      starts.back().saved.push_back(std::stoll(m[1]));
    }
  }
  return starts;
}

struct Record {
  double loss = 0, grad_norm = 0;
};
// Every training record of a metrics file (a restarted job logs some iterations more than once).
std::vector<std::pair<int64_t, Record>> records(const std::string& metrics) {
  std::vector<std::pair<int64_t, Record>> out;
  for (const auto& r : mfsdp::testing::training_records(metrics)) {
    out.push_back({r["iteration"].get<int64_t>(), {r["lm_loss"].get<double>(), r["grad_norm"].get<double>()}});
  }
  return out;
}

// Every tensor of the checkpoint at `dir` (weights, optimizer state, generator states) has the
// bytes of `want`'s, and the two record the same progress.
void expect_same_checkpoint(const std::string& dir, const std::string& want) {
  const mfsdp::CheckpointReader got(dir), ref(want);
  const auto names = ref.tensor_names();
  ASSERT_EQ(got.tensor_names(), names) << dir;
  int weights = 0, optimizer = 0;
  std::vector<std::string> differ;
  for (const auto& name : names) {
    const at::Tensor a = got.read(name).contiguous(), b = ref.read(name).contiguous();
    ASSERT_EQ(a.scalar_type(), b.scalar_type()) << name;
    ASSERT_EQ(a.sizes(), b.sizes()) << name;
    if (std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) != 0) differ.push_back(name);
    weights += name.rfind("model.", 0) == 0;
    optimizer += name.rfind("optimizer.", 0) == 0;
  }
  EXPECT_TRUE(differ.empty()) << dir << ": " << differ.size() << " of " << names.size()
                              << " tensors differ from the uninterrupted run's, first: " << differ.front();
  EXPECT_GT(weights, 10);
  EXPECT_GT(optimizer, 10);
  for (const char* key : {"iteration", "consumed_samples"}) {
    EXPECT_EQ(got.metadata().at(key), ref.metadata().at(key)) << key;
  }
  EXPECT_EQ(got.metadata().at("optimizer").at("step"), ref.metadata().at("optimizer").at("step"));
}

// Prints what `what` returns when the test has failed by the time it goes out of scope.
class PrintOnFailure {
 public:
  explicit PrintOnFailure(std::function<std::string()> what) : what_(std::move(what)) {}
  ~PrintOnFailure() {
    if (::testing::Test::HasFailure()) std::cout << what_() << std::flush;
  }

 private:
  std::function<std::string()> what_;
};

TEST(Chaos, RandomKillsAndAStoppedRankEndBitExactWithAnUninterruptedRun) {
  const uint64_t seed = chaos_seed();
  std::cout << "chaos seed " << seed << " (set CHAOS_SEED to replay another)" << std::endl;
  std::vector<Event> events = make_schedule(seed);
  std::string plan;
  for (const auto& e : events) {
    plan += "  " + e.describe() + ", after " + std::to_string(e.iterations) + " iteration(s) of its start + " +
            std::to_string(e.extra.count()) + " ms\n";
  }
  std::cout << "chaos schedule:\n" << plan << std::flush;
  TempDir dir("mfsdp-chaos");

  std::vector<Event> none;
  const JobOutcome ref = run_job(dir, "uninterrupted", none);
  ASSERT_EQ(ref.exit_code, 0) << ref.problem << "\n" << tail(ref.out, 30) << tail(ref.err, 30);
  ASSERT_EQ(ref.err.find("restarting every rank"), std::string::npos) << "the reference was interrupted\n" << ref.err;

  const JobOutcome r = run_job(dir, "chaos", events);
  // On any failure below, once: what was done and what the launcher printed.
  const PrintOnFailure diagnose([&] {
    std::string s = "chaos seed " + std::to_string(seed) + "; events delivered:\n";
    for (const auto& e : events) s += "  " + e.describe() + "\n";
    return s + "mfsdp-run's stderr (last lines):\n" + tail(r.err, 60) + "mfsdp-run's stdout (last lines):\n" +
           tail(r.out, 40);
  });
  ASSERT_TRUE(r.problem.empty()) << r.problem;
  ASSERT_EQ(r.exit_code, 0);
  const std::string save = dir.file("chaos_ckpt");
  const std::string all = r.out + r.err;

  // One restart per failure, each named by mfsdp-run, and no more.
  std::vector<std::string> restart_lines;
  for (const auto& line : lines_of(r.err)) {
    if (line.rfind("mfsdp-run: restarting every rank", 0) == 0) restart_lines.push_back(line);
  }
  ASSERT_EQ(restart_lines.size(), events.size());
  for (size_t k = 1; k <= events.size(); ++k) {
    EXPECT_EQ(restart_lines[k - 1], "mfsdp-run: restarting every rank (restart " + std::to_string(k) + " of " +
                                        std::to_string(kMaxRestarts) + ")");
  }
  EXPECT_EQ(r.err.find("no restart left"), std::string::npos);

  // Each failure as mfsdp-run and the surviving rank report it.
  for (const auto& e : events) {
    const std::string victim = "rank " + std::to_string(e.rank) + " (pid " + std::to_string(e.pid) + ")";
    if (e.kind == Kind::kStop) {
      // The survivor's collective timed out, naming the stopped rank; it exited 1; the stopped one
      // was killed by mfsdp-run.
      const int s = 1 - e.rank;
      const std::regex named("\\[rank" + std::to_string(s) + "\\]: mfsdp-pretrain: .*failed on rank " +
                             std::to_string(s) + " while [a-z -]*rank " + std::to_string(e.rank) +
                             "\\b.*\\(timeout " + std::to_string(kTimeoutMs) + " ms\\)");
      EXPECT_TRUE(std::regex_search(all, named)) << "no line of rank " << s << " names the stopped rank " << e.rank;
      EXPECT_NE(r.err.find("rank " + std::to_string(s) + " (pid " + std::to_string(e.survivor_pid) +
                           ") exited with code 1"),
                std::string::npos);
      const std::string escaped = std::regex_replace(victim, std::regex(R"([()])"), R"(\$&)");
      EXPECT_TRUE(std::regex_search(
          r.err, std::regex(escaped + " was killed by signal [0-9]+ \\([A-Za-z]+\\) after being stopped")))
          << victim;
    } else {
      EXPECT_NE(r.err.find(victim + " was killed by signal 9 (Killed)"), std::string::npos) << victim;
    }
    if (e.kind == Kind::kKillDuringSave) {
      EXPECT_FALSE(e.tmp_folder.empty());
    }
  }

  // Every start after the first resumed from a checkpoint (the first failure came after the
  // first save), no older than the last one reported saved, and trained on from the iteration
  // after it.
  const auto starts = starts_of(r.out);
  ASSERT_EQ(starts.size(), events.size() + 1);
  int64_t last_saved = 0;
  for (size_t k = 0; k < starts.size(); ++k) {
    const Start& st = starts[k];
    std::cout << "chaos: start " << k << (st.loaded ? " resumed after iteration " + std::to_string(*st.loaded) : "")
              << ", saved " << st.saved.size() << " checkpoint(s)" << std::endl;
    EXPECT_EQ(st.restart, static_cast<int>(k));
    if (k > 0) {
      ASSERT_TRUE(st.loaded.has_value()) << "start " << k << " did not resume from a checkpoint";
      EXPECT_EQ(st.loaded_from.rfind(save + "/", 0), 0u) << st.loaded_from;
      EXPECT_GE(*st.loaded, last_saved) << "start " << k << " resumed from an older checkpoint than the last saved";
      ASSERT_TRUE(st.first_iteration.has_value()) << "start " << k;
      EXPECT_EQ(*st.first_iteration, *st.loaded + 1) << "start " << k;
    }
    for (int64_t it : st.saved) last_saved = std::max(last_saved, it);
  }
  // The save a kill cut short: committed when the victim had already written its share (the
  // other rank then completes the commit), else abandoned; either way the next start resumed from
  // the latest committed checkpoint (checked above).
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i].kind != Kind::kKillDuringSave || events[i].tmp_folder.empty()) continue;
    const std::string name = fs::path(events[i].tmp_folder).filename().string();
    const int64_t cut = std::stoll(name.substr(5, 7));
    const auto& saved = starts[i].saved;
    std::cout << "chaos: the save of iteration " << cut << " that the kill interrupted was "
              << (std::find(saved.begin(), saved.end(), cut) != saved.end() ? "committed by the surviving rank"
                                                                            : "abandoned")
              << "; the next start resumed after iteration " << starts[i + 1].loaded.value_or(-1) << std::endl;
  }
  // A save cut short leaves nothing behind once a later save of the job has committed.
  EXPECT_EQ(save_in_progress(save), "");

  // Every loss and gradient norm any start logged is the uninterrupted run's for that iteration,
  // and every iteration was logged.
  std::map<int64_t, Record> want;
  for (const auto& [it, rec] : records(dir.file("uninterrupted.jsonl"))) want[it] = rec;
  ASSERT_EQ(want.size(), static_cast<size_t>(kIterations));
  std::set<int64_t> seen;
  std::vector<std::string> differ;
  for (const auto& [it, rec] : records(dir.file("chaos.jsonl"))) {
    ASSERT_TRUE(want.count(it)) << "iteration " << it;
    if (rec.loss != want[it].loss || rec.grad_norm != want[it].grad_norm) {
      std::ostringstream d;
      d.precision(17);
      d << "iteration " << it << ": lm loss " << rec.loss << " grad norm " << rec.grad_norm << ", uninterrupted "
        << want[it].loss << " / " << want[it].grad_norm;
      differ.push_back(d.str());
    }
    seen.insert(it);
  }
  EXPECT_TRUE(differ.empty()) << differ.size() << " logged record(s) differ from the uninterrupted run's, first: "
                              << differ.front();
  EXPECT_EQ(seen.size(), static_cast<size_t>(kIterations));

  // The final checkpoint equals the uninterrupted run's, bit for bit.
  const std::string final_iter = "/iter_" + std::string(7 - std::to_string(kIterations).size(), '0') +
                                 std::to_string(kIterations);
  expect_same_checkpoint(save + final_iter, dir.file("uninterrupted_ckpt") + final_iter);
}

}  // namespace
