// mfsdp-run: our torchrun. Starts --nproc-per-node copies of PROGRAM with the torchrun variables
// set, tags their output with the rank, stops them all when one fails, restarts them all up to
// --max-restarts times (on several nodes together, through node 0's launcher), prints the job's
// goodput at the end, and exits with the failed rank's status. See docs/launcher.md.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "mfsdp/launch/goodput_summary.h"
#include "mfsdp/launch/launcher_rendezvous.h"
#include "mfsdp/launch/rank_processes.h"

namespace {

constexpr const char* kUsage = R"(usage: mfsdp-run [OPTIONS] PROGRAM [ARGS...]

Runs PROGRAM once per local rank with the torchrun variables set (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 when unset
and more than one process runs per node). Each output line is prefixed with "[rankN]: ". When a
rank fails, the others get 3 s to exit on their own (with their own error lines), then are stopped
(SIGTERM, then SIGKILL after 5 s), and mfsdp-run exits with the failed rank's exit code (128+N for
signal N). SIGINT or SIGTERM to mfsdp-run goes to every rank at once; what runs after 30 s is
killed, and when every rank exits 0 (a trainer's --exit-signal-handler saves and stops) so does
mfsdp-run. The job's /dev/shm segments are removed once every rank has exited.

With --max-restarts K (torchrun's), a failed job is started again, every rank, up to K times: a
new rendezvous round on a new port with a new job token (a rank of an earlier round can never join
it), TORCHELASTIC_RESTART_COUNT=1..K and TORCHELASTIC_MAX_RESTARTS=K in the ranks' environment,
so a trainer given --load resumes from its newest checkpoint. An interrupt (SIGINT, SIGTERM) is
never restarted. On several nodes, node 0's mfsdp-run serves the launchers' rendezvous on
MASTER_ADDR:--rdzv-port: every node's mfsdp-run joins each round there, a node whose rank fails
announces the next round, and the others stop their ranks within --monitor-interval and join it;
a node that does not join within join_timeout ends the job, named.

Each rank gets MFSDP_PROGRESS_FILE (and, on a restart, MFSDP_PREVIOUS_FAILURE_TIME); from what
the job's rank 0 writes there, mfsdp-run prints one goodput line at the end: wall time, kept and
lost iterations, and the time spent restarting.

options (also --flag=value, and torchrun's spellings with '_'):
  --nproc-per-node N   processes on this node (default 1)
  --nnodes M           number of nodes (default 1)
  --node-rank R        this node's index, 0 <= R < M (default 0)
  --master-addr H      address of node 0, where rank 0 listens (default 127.0.0.1; required
                       when M > 1)
  --master-port P      port on H (default: a free port when M == 1, else 29500)
  --standalone         single node with a free port (accepted for torchrun compatibility)
  --max-restarts K     start a failed job again, every rank on every node, up to K times
                       (default 0)
  --monitor-interval S with M > 1 and --max-restarts: how often each node's mfsdp-run asks node
                       0's whether the round ended elsewhere (default 0.1, torchrun's); a rank's
                       exit on this node is seen at once
  --rdzv-port P        with M > 1 and --max-restarts: where node 0's mfsdp-run serves the
                       launchers' rendezvous, on H (default: --master-port + 1)
  --rdzv-conf join_timeout=S
                       with M > 1 and --max-restarts: every node must join each round within S
                       seconds, or the job ends naming the missing nodes (default 600, torchrun's)
  --no-tag             pass output through without the "[rankN]: " prefix
  -h, --help           show this help
  --                   end of options: everything after it is PROGRAM and its arguments

Everything from PROGRAM onward is passed to the program untouched.

example: mfsdp-run --nproc-per-node 4 ./build/mfsdp-pretrain --micro-batch-size 2
)";

constexpr int kDefaultMultiNodePort = 29500;  // torchrun's default
constexpr int kUsageExitCode = 2;
constexpr int kFailureGraceMs = 3000;     // docs/launcher.md
constexpr int kInterruptGraceMs = 30000;  // torchrun's
constexpr double kDefaultJoinTimeoutS = 600;  // torchrun's --rdzv-conf join_timeout
// A launcher that cannot reach node 0's at all gives up this much after the join timeout, so
// that node 0's verdict (naming the missing nodes) comes first when node 0 is there.
constexpr auto kUnreachableMargin = std::chrono::seconds(5);

using Clock = std::chrono::steady_clock;
using mfsdp::launch::RendezvousClient;
using mfsdp::launch::RendezvousReply;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Arguments {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;  // empty: not given
  int master_port = 0;      // 0: not given
  bool standalone = false;
  int max_restarts = 0;
  double monitor_interval = 0.1;  // seconds
  int rdzv_port = 0;              // 0: not given
  double join_timeout = kDefaultJoinTimeoutS;
  bool tag = true;
  bool help = false;
  std::vector<std::string> program;  // PROGRAM ARGS...

  // Several nodes that restart together talk to each other (docs/launcher.md, "Restarts across
  // nodes"); otherwise each node's mfsdp-run is on its own, as before.
  bool across_nodes() const { return nnodes > 1 && max_restarts > 0; }
  std::string master_host() const { return master_addr.empty() ? "127.0.0.1" : master_addr; }
  int first_master_port() const { return master_port != 0 ? master_port : kDefaultMultiNodePort; }
  int rendezvous_port() const { return rdzv_port != 0 ? rdzv_port : first_master_port() + 1; }
  std::chrono::milliseconds interval() const {
    return std::chrono::milliseconds(std::max<long long>(1, static_cast<long long>(monitor_interval * 1000)));
  }
  std::chrono::milliseconds join_timeout_ms() const {
    return std::chrono::milliseconds(static_cast<long long>(join_timeout * 1000));
  }
};

int parse_int(const std::string& flag, const std::string& value) {
  int parsed = 0;
  const char* end = value.data() + value.size();
  auto [last, error] = std::from_chars(value.data(), end, parsed);
  if (value.empty() || error != std::errc() || last != end) {
    throw UsageError(flag + " expects an integer, got '" + value + "'");
  }
  return parsed;
}

double parse_seconds(const std::string& what, const std::string& value) {
  char* end = nullptr;
  const double seconds = std::strtod(value.c_str(), &end);
  if (value.empty() || end != value.c_str() + value.size() || !(seconds > 0) || seconds > 1e6)
    throw UsageError(what + " expects a positive number of seconds, got '" + value + "'");
  return seconds;
}

// torchrun's "--rdzv-conf key=value,key=value": mfsdp-run knows join_timeout.
double parse_rdzv_conf(const std::string& value) {
  double join_timeout = kDefaultJoinTimeoutS;
  std::istringstream entries(value);
  for (std::string entry; std::getline(entries, entry, ',');) {
    const size_t equals = entry.find('=');
    const std::string key = entry.substr(0, equals);
    if (key != "join_timeout" || equals == std::string::npos)
      throw UsageError("--rdzv-conf: mfsdp-run knows join_timeout=SECONDS only, got '" + entry + "'");
    join_timeout = parse_seconds("--rdzv-conf join_timeout", entry.substr(equals + 1));
  }
  return join_timeout;
}

int parse_port(const std::string& flag, const std::string& value) {
  const int port = parse_int(flag, value);
  if (port < 1 || port > 65535) throw UsageError(flag + " must be in 1..65535, got " + value);
  return port;
}

Arguments parse_arguments(int argc, char** argv) {
  Arguments args;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // PROGRAM: options end here
    if (arg == "-h" || arg == "--help") {
      args.help = true;
      continue;
    }
    if (arg.compare(0, 2, "--") != 0) throw UsageError("unknown option '" + arg + "'");

    // "--flag=value" or "--flag value"; torchrun's "--nproc_per_node" spells '-' as '_'.
    std::string flag = arg;
    std::optional<std::string> inline_value;
    if (size_t equals = arg.find('='); equals != std::string::npos) {
      flag = arg.substr(0, equals);
      inline_value = arg.substr(equals + 1);
    }
    for (size_t c = 2; c < flag.size(); ++c) {
      if (flag[c] == '_') flag[c] = '-';
    }

    if (flag == "--no-tag" || flag == "--standalone") {
      if (inline_value) throw UsageError(flag + " takes no value, got '" + arg + "'");
      if (flag == "--no-tag") args.tag = false;
      if (flag == "--standalone") args.standalone = true;
      continue;
    }
    if (flag != "--nproc-per-node" && flag != "--nnodes" && flag != "--node-rank" &&
        flag != "--master-addr" && flag != "--master-port" && flag != "--max-restarts" &&
        flag != "--monitor-interval" && flag != "--rdzv-port" && flag != "--rdzv-conf") {
      throw UsageError("unknown option '" + arg + "'");
    }
    std::string value;
    if (inline_value) {
      value = *inline_value;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw UsageError(flag + " needs a value");
    }

    if (flag == "--nproc-per-node") {
      args.nproc_per_node = parse_int(flag, value);
    } else if (flag == "--nnodes") {
      if (value.find(':') != std::string::npos) {
        throw UsageError("--nnodes expects a fixed number of nodes, got '" + value +
                         "' (elastic MIN:MAX ranges are not supported)");
      }
      args.nnodes = parse_int(flag, value);
    } else if (flag == "--node-rank") {
      args.node_rank = parse_int(flag, value);
    } else if (flag == "--max-restarts") {
      args.max_restarts = parse_int(flag, value);
    } else if (flag == "--monitor-interval") {
      args.monitor_interval = parse_seconds("--monitor-interval", value);
    } else if (flag == "--rdzv-conf") {
      args.join_timeout = parse_rdzv_conf(value);
    } else if (flag == "--rdzv-port") {
      args.rdzv_port = parse_port(flag, value);
    } else if (flag == "--master-addr") {
      if (value.empty()) throw UsageError("--master-addr expects a host name or address, got ''");
      args.master_addr = value;
    } else {
      args.master_port = parse_port(flag, value);
    }
  }
  for (; i < argc; ++i) args.program.emplace_back(argv[i]);
  return args;
}

void validate(const Arguments& args) {
  if (args.nproc_per_node < 1) {
    throw UsageError("--nproc-per-node must be >= 1, got " + std::to_string(args.nproc_per_node));
  }
  if (args.nnodes < 1) throw UsageError("--nnodes must be >= 1, got " + std::to_string(args.nnodes));
  if (args.node_rank < 0 || args.node_rank >= args.nnodes) {
    throw UsageError("--node-rank must be in 0.." + std::to_string(args.nnodes - 1) +
                     " for --nnodes " + std::to_string(args.nnodes) + ", got " +
                     std::to_string(args.node_rank));
  }
  if (args.standalone && args.nnodes > 1) {
    throw UsageError("--standalone runs a single node, but --nnodes is " +
                     std::to_string(args.nnodes));
  }
  if (args.max_restarts < 0 || args.max_restarts > 1000)
    throw UsageError("--max-restarts must be in 0..1000, got " + std::to_string(args.max_restarts));
  if (args.nnodes > 1 && args.master_addr.empty()) {
    throw UsageError("--master-addr is required when --nnodes > 1 (the address of node 0)");
  }
  if (args.across_nodes()) {
    if (args.rdzv_port == 0 && args.first_master_port() == 65535)
      throw UsageError("--master-port 65535 leaves no port for the launchers' rendezvous: give --rdzv-port");
    if (args.rendezvous_port() == args.first_master_port())
      throw UsageError("--rdzv-port must differ from --master-port (rank 0 serves the store there), got " +
                       std::to_string(args.rendezvous_port()));
  }
  if (args.program.empty()) throw UsageError("missing PROGRAM (the command every rank runs)");
}

// ---- the job's token ----------------------------------------------------------------------------

// The token every node's ranks prove to rank 0's store, before the restart suffix: on one node
// mfsdp-run's own (rank_environment) unless the environment has one; on several, the one the
// ranks read themselves, the same on every node (src/comm/rendezvous.cpp, job_token).
std::string base_job_token(const Arguments& args) {
  auto env = [](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') return std::nullopt;
    return std::string(value);
  };
  if (auto token = env("MFSDP_JOB_TOKEN")) return *token;
  if (args.nnodes == 1) return mfsdp::launch::launcher_job_token();
  if (auto run = env("TORCHELASTIC_RUN_ID"); run && *run != "none") return "torchrun:" + *run;
  if (auto job = env("SLURM_JOB_ID")) return "slurm:" + *job + "." + env("SLURM_STEP_ID").value_or("");
  return "";
}

// ---- interrupts outside a start ---------------------------------------------------------------

// SIGINT/SIGTERM while no start runs (between starts, waiting for the other nodes): noted here
// and acted on at the next check. During a start the supervisor forwards them to the ranks
// instead (it puts this handler back afterwards).
volatile std::sig_atomic_t g_interrupt = 0;

void note_interrupt(int sig) { g_interrupt = sig; }

void catch_interrupts() {
  struct sigaction action {};
  action.sa_handler = note_interrupt;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM}) {
    struct sigaction previous {};
    sigaction(sig, nullptr, &previous);
    if (previous.sa_handler != SIG_IGN) sigaction(sig, &action, nullptr);  // ignored stays ignored
  }
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", seconds);
  return text;
}

// ---- the progress file --------------------------------------------------------------------------

// The job's progress file (MFSDP_PROGRESS_FILE): made empty at start, removed when mfsdp-run
// exits; the job's rank 0 appends to it, the goodput summary reads it.
class ProgressFile {
 public:
  ProgressFile() {
    const char* tmpdir = std::getenv("TMPDIR");
    for (std::string dir : {std::string(tmpdir != nullptr ? tmpdir : ""), std::string("/tmp")}) {
      if (dir.empty()) continue;
      std::string name = dir + "/mfsdp-progress-XXXXXX";
      const int fd = mkstemp(name.data());
      if (fd < 0) continue;
      ::close(fd);
      path_ = name;
      return;
    }
    std::fprintf(stderr, "mfsdp-run: warning: cannot create a progress file in $TMPDIR or /tmp; no goodput summary\n");
  }
  ~ProgressFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  ProgressFile(const ProgressFile&) = delete;
  ProgressFile& operator=(const ProgressFile&) = delete;

  const std::string& path() const { return path_; }  // empty when none could be made

  std::string read() const {
    std::ifstream in(path_, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  // A line a rank was cut off in (it died mid-line) ends here, marked so that it never parses,
  // and the next start's first line is a line of its own. No rank runs now.
  void end_cut_line() const {
    const std::string text = path_.empty() ? "" : read();
    if (text.empty() || text.back() == '\n') return;
    std::ofstream(path_, std::ios::app) << mfsdp::launch::kCutLineEnd;
  }

 private:
  std::string path_;
};

// What the goodput summary needs from the launcher itself.
struct JobRecord {
  mfsdp::launch::JobTimes times;  // begin, starts, failure_times; end filled in at the end

  // Start `start` failed, as the launcher learned at `when` (skipped starts: at the same moment).
  void record_failure(int start, double when) {
    if (static_cast<int>(times.failure_times.size()) <= start) times.failure_times.resize(start + 1, when);
  }
};

void print_goodput(const ProgressFile& progress, JobRecord& job) {
  if (progress.path().empty() || job.times.starts == 0) return;
  job.times.end = unix_now();
  const mfsdp::launch::GoodputSummary summary = mfsdp::launch::summarize_progress(progress.read(), job.times);
  if (summary.lines == 0) return;  // not rank 0's node, or a program that writes no progress
  std::fprintf(stderr, "%s\n", mfsdp::launch::format_goodput(summary).c_str());
}

// ---- one start ----------------------------------------------------------------------------------

// Exit status of mfsdp-run for a failed run: the failed rank's own status, as a shell reports it.
int failure_exit_code(const mfsdp::launch::SuperviseResult& result) {
  int code = 1;
  if (result.first_failed_rank) {
    for (const auto& exit : result.exits) {
      if (exit.rank != *result.first_failed_rank) continue;
      code = exit.signal != 0 ? 128 + exit.signal : exit.exit_code;
    }
  } else if (result.interrupt_signal != 0) {
    code = 128 + result.interrupt_signal;
  }
  return code > 0 && code < 256 ? code : 1;
}

void write_raw_line(int, mfsdp::launch::OutputStream stream, const std::string& line) {
  FILE* out = stream == mfsdp::launch::OutputStream::kStdout ? stdout : stderr;
  std::fwrite(line.data(), 1, line.size(), out);
  std::fputc('\n', out);
  std::fflush(out);
}

struct StartHooks {
  std::string progress_file;                  // MFSDP_PROGRESS_FILE, when not empty
  std::optional<double> previous_failure;     // MFSDP_PREVIOUS_FAILURE_TIME of a restart
  std::function<void()> on_first_failure;     // a rank of this node failed
  std::function<bool()> stop_requested;       // the round ended elsewhere
};

// One start of the job (restart 0 is the first): every rank of this node, on the round's port
// with the round's job token. A restart's token carries the restart's number, so no rank of an
// earlier round can join it.
mfsdp::launch::SuperviseResult start_ranks(const Arguments& args, int restart, int master_port,
                                           const StartHooks& hooks) {
  namespace launch = mfsdp::launch;
  std::vector<launch::RankProcessSpec> specs;
  for (int local_rank = 0; local_rank < args.nproc_per_node; ++local_rank) {
    launch::RankProcessSpec spec;
    spec.env = launch::rank_environment(args.node_rank, args.nnodes, args.nproc_per_node,
                                        local_rank, args.master_host(), master_port);
    spec.env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart);
    spec.env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(args.max_restarts);
    if (restart > 0) spec.env["MFSDP_JOB_TOKEN"] = base_job_token(args) + ".restart" + std::to_string(restart);
    if (!hooks.progress_file.empty()) spec.env["MFSDP_PROGRESS_FILE"] = hooks.progress_file;
    if (hooks.previous_failure) {
      char when[64];
      std::snprintf(when, sizeof when, "%.3f", *hooks.previous_failure);
      spec.env["MFSDP_PREVIOUS_FAILURE_TIME"] = when;
    }
    spec.rank = args.node_rank * args.nproc_per_node + local_rank;
    spec.argv = args.program;
    specs.push_back(std::move(spec));
  }

  launch::SuperviseOptions options;
  options.forward_signals = true;
  // Ranks that notice the failed one exit on their own with an error line naming it: let them
  // (docs/launcher.md, "Security and failures").
  options.failure_grace = std::chrono::milliseconds(kFailureGraceMs);
  // A forwarded SIGTERM or SIGINT may be a trainer's cue to save (--exit-signal-handler).
  options.interrupt_kill_grace = std::chrono::milliseconds(kInterruptGraceMs);
  // Every /dev/shm segment of the job is removed once the ranks have exited, however they died.
  options.shm_tag = launch::launcher_shm_tag();
  options.on_first_failure = hooks.on_first_failure;
  options.stop_requested = hooks.stop_requested;
  if (!args.tag) options.on_line = write_raw_line;
  return launch::run_rank_processes(specs, options);
}

// ---- rounds across nodes ------------------------------------------------------------------------

// While the ranks of round `round` run: asks node 0's launcher every --monitor-interval whether
// the round ended elsewhere (torchrun's agents poll their store so), and tells it at once when a
// rank here failed.
class RoundMonitor {
 public:
  RoundMonitor(RendezvousClient& client, int round, std::chrono::milliseconds interval)
      : client_(client), round_(round), interval_(interval), thread_([this] { watch(); }) {}
  ~RoundMonitor() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  RoundMonitor(const RoundMonitor&) = delete;
  RoundMonitor& operator=(const RoundMonitor&) = delete;

  void report_failure() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failure_ = true;
    }
    wake_.notify_all();
  }
  bool round_ended() const { return ended_.load(); }
  // What node 0's launcher said when the round ended elsewhere.
  RendezvousReply ending() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return ending_;
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    bool unreachable = false;  // wait a whole interval before asking again
    while (!stop_ && !ended_) {
      wake_.wait_for(lock, interval_, [&] { return stop_ || (failure_ && !unreachable); });
      if (stop_) break;
      const bool failing = failure_;
      lock.unlock();
      std::optional<RendezvousReply> reply;
      try {
        reply = client_.request(failing ? "fail" : "poll", round_);
      } catch (const std::runtime_error&) {
        // Node 0's launcher is gone or out of reach: its ranks are then gone too, so ours fail and
        // the failure's own report (which waits for an answer) says so.
      }
      lock.lock();
      unreachable = !reply.has_value();
      if (!reply) continue;
      if (failing) failure_ = false;
      if (reply->kind == RendezvousReply::kAbort || (reply->kind == RendezvousReply::kRound && reply->round > round_)) {
        ending_ = *reply;
        ended_ = true;
      }
    }
  }

  RendezvousClient& client_;
  const int round_;
  const std::chrono::milliseconds interval_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  bool failure_ = false;
  std::atomic<bool> ended_{false};
  RendezvousReply ending_;
  std::thread thread_;  // last: started once everything it uses exists
};

// The end of a job that cannot go on, or of a wait given up: mfsdp-run's exit code.
struct Ended {
  int exit_code;
};

struct Joined {
  int round = 0;
  int master_port = 0;
};

// Joins round `round` until every node has joined it: then the round's MASTER_PORT; or the round
// moved on (another node's ranks failed before ours started: join that one); or the job ended
// (printed here, with `failure_code` as the exit code).
std::variant<Joined, Ended> join_round(RendezvousClient& client, const Arguments& args, int round, JobRecord& job,
                                       int failure_code) {
  const auto deadline = Clock::now() + args.join_timeout_ms() + kUnreachableMargin;
  std::string unreachable;
  for (;;) {
    if (g_interrupt != 0) {
      try {
        client.request("interrupt", round, g_interrupt);
      } catch (const std::runtime_error&) {
      }
      std::fprintf(stderr, "mfsdp-run: interrupted by signal %d while joining round %d\n", static_cast<int>(g_interrupt),
                   round);
      return Ended{128 + g_interrupt};
    }
    try {
      const RendezvousReply reply = client.request("join", round);
      unreachable.clear();
      if (reply.kind == RendezvousReply::kGo) return Joined{round, reply.master_port};
      if (reply.kind == RendezvousReply::kAbort) {
        std::fprintf(stderr, "mfsdp-run: the job ends: %s\n", reply.text.c_str());
        return Ended{failure_code};
      }
      if (reply.kind == RendezvousReply::kError) {
        std::fprintf(stderr, "mfsdp-run: error: %s\n", reply.text.c_str());
        return Ended{failure_code};
      }
      if (reply.kind == RendezvousReply::kRound && reply.round > round) {
        job.record_failure(reply.round - 1, unix_now());
        const std::string failed =
            "mfsdp-run: round " + std::to_string(reply.round - 1) + " failed on node " + std::to_string(reply.failed_by) +
            " before this node's ranks started";
        round = reply.round;
        if (round > args.max_restarts) {
          std::fprintf(stderr, "%s; no restart left (--max-restarts %d)\n", failed.c_str(), args.max_restarts);
          return Ended{failure_code};
        }
        std::fprintf(stderr, "%s; restarting every rank (restart %d of %d)\n", failed.c_str(), round,
                     args.max_restarts);
        continue;
      }
    } catch (const std::runtime_error& error) {
      unreachable = error.what();
    }
    if (Clock::now() >= deadline) {
      std::fprintf(stderr, "mfsdp-run: error: round %d did not start within %s: %s\n", round,
                   seconds_text(args.join_timeout).c_str(),
                   unreachable.empty() ? "node 0's launcher gave no verdict" : unreachable.c_str());
      return Ended{failure_code};
    }
    std::this_thread::sleep_for(args.interval());
  }
}

// Tells node 0's launcher that round `round` failed here (or ended elsewhere) and returns its
// answer: the next round, or why the job ends. Asks until the join timeout.
std::optional<RendezvousReply> announce_failure(RendezvousClient& client, const Arguments& args, int round) {
  const auto deadline = Clock::now() + args.join_timeout_ms() + kUnreachableMargin;
  for (;;) {
    try {
      return client.request("fail", round);
    } catch (const std::runtime_error& error) {
      if (Clock::now() >= deadline || g_interrupt != 0) {
        std::fprintf(stderr, "mfsdp-run: error: no next round: %s\n", error.what());
        return std::nullopt;
      }
    }
    std::this_thread::sleep_for(args.interval());
  }
}

// Every rank here exited 0 in `round`. Node 0's launcher serves the rendezvous, so it stays until
// every node has said so (or the join timeout): none is then left asking a launcher that is gone.
void finish_round(RendezvousClient& client, const Arguments& args, int round) {
  try {
    RendezvousReply reply = client.request("done", round);
    if (args.node_rank != 0) return;
    const auto deadline = Clock::now() + args.join_timeout_ms();
    for (;;) {
      if (reply.kind == RendezvousReply::kAbort) {
        std::fprintf(stderr, "mfsdp-run: every rank here exited 0, but the job ends: %s\n", reply.text.c_str());
        return;
      }
      if (reply.kind != RendezvousReply::kRound || reply.round != round || reply.done >= args.nnodes) return;
      if (Clock::now() >= deadline || g_interrupt != 0) {
        std::fprintf(stderr, "mfsdp-run: %d of %d nodes said their ranks finished round %d within %s; exiting\n",
                     reply.done, args.nnodes, round, seconds_text(args.join_timeout).c_str());
        return;
      }
      std::this_thread::sleep_for(args.interval());
      reply = client.request("poll", round);
    }
  } catch (const std::runtime_error& error) {
    std::fprintf(stderr, "mfsdp-run: warning: %s\n", error.what());
  }
}

// ---- the job ------------------------------------------------------------------------------------

// What mfsdp-run says about a failed start: the first failure here and what happened to the other
// ranks, or, when the round ended on node `failed_elsewhere`, that and how this node's ranks ended.
std::string failure_report(const mfsdp::launch::SuperviseResult& result, int round,
                           std::optional<int> failed_elsewhere) {
  std::string report;
  if (failed_elsewhere) {
    size_t stopped = 0;
    for (const auto& exit : result.exits) stopped += exit.stopped_by_supervisor ? 1 : 0;
    report = "mfsdp-run: round " + std::to_string(round) + " failed on node " + std::to_string(*failed_elsewhere);
    if (stopped > 0)
      report += "; stopped " + std::to_string(stopped) + (stopped == 1 ? " running rank" : " running ranks") + " here";
    report += "\n";
  } else {
    report = "mfsdp-run: " + result.summary() + "\n";
  }
  for (const auto& exit : result.exits) {
    if (!failed_elsewhere && result.first_failed_rank && exit.rank == *result.first_failed_rank) continue;
    if (exit.failed() || exit.stopped_by_supervisor) report += "mfsdp-run:   " + exit.describe() + "\n";
  }
  return report;
}

int run(const Arguments& args, const ProgressFile& progress, JobRecord& job) {
  namespace launch = mfsdp::launch;
  std::unique_ptr<launch::RendezvousServer> server;
  std::unique_ptr<RendezvousClient> client;
  if (args.across_nodes()) {
    const std::string token = base_job_token(args);
    if (token.find('\n') != std::string::npos) throw std::runtime_error("the job token holds a newline");
    if (token.empty())
      std::fprintf(stderr,
                   "mfsdp-run: warning: no job token (MFSDP_JOB_TOKEN, TORCHELASTIC_RUN_ID or SLURM_JOB_ID): any "
                   "process that reaches %s:%d can join the launchers' rendezvous\n",
                   args.master_host().c_str(), args.rendezvous_port());
    if (args.node_rank == 0) {
      launch::RendezvousServer::Config config;
      config.nnodes = args.nnodes;
      config.max_restarts = args.max_restarts;
      config.token = token;
      config.first_master_port = args.first_master_port();
      config.join_timeout = args.join_timeout_ms();
      server = std::make_unique<launch::RendezvousServer>(args.master_host(), args.rendezvous_port(), config);
    }
    launch::RendezvousIdentity identity;
    identity.nnodes = args.nnodes;
    identity.max_restarts = args.max_restarts;
    identity.node_rank = args.node_rank;
    identity.launcher_id = launch::launcher_shm_tag();  // random per process; not a secret
    identity.token = token;
    client = std::make_unique<RendezvousClient>(args.master_host(), args.rendezvous_port(), identity);
  }

  int master_port = args.master_port != 0 ? args.master_port
                    : args.nnodes == 1    ? launch::pick_free_port()
                                          : kDefaultMultiNodePort;
  int failure_code = 1;  // the exit code when the job ends between starts
  for (int restart = 0;;) {
    if (client) {
      auto joined = join_round(*client, args, restart, job, failure_code);
      if (auto* ended = std::get_if<Ended>(&joined)) return ended->exit_code;
      restart = std::get<Joined>(joined).round;
      master_port = std::get<Joined>(joined).master_port;
    } else if (restart > 0) {
      master_port = launch::pick_free_port();  // a user-given --master-port serves the first start only
    }
    if (g_interrupt != 0) {
      std::fprintf(stderr, "mfsdp-run: interrupted by signal %d before start %d\n", static_cast<int>(g_interrupt),
                   restart);
      if (client) {
        try {
          client->request("interrupt", restart, g_interrupt);
        } catch (const std::runtime_error&) {
        }
      }
      return 128 + g_interrupt;
    }

    // The time this node learned that the start failed, here or elsewhere (goodput's restarting).
    std::optional<double> learned_failure;
    std::unique_ptr<RoundMonitor> monitor;
    if (client) monitor = std::make_unique<RoundMonitor>(*client, restart, args.interval());
    StartHooks hooks;
    hooks.progress_file = progress.path();
    if (restart > 0 && static_cast<int>(job.times.failure_times.size()) >= restart)
      hooks.previous_failure = job.times.failure_times[restart - 1];
    hooks.on_first_failure = [&] {
      learned_failure = unix_now();
      if (monitor) monitor->report_failure();
    };
    hooks.stop_requested = [&] {
      const bool stop = g_interrupt != 0 || (monitor && monitor->round_ended());
      if (stop && !learned_failure) learned_failure = unix_now();
      return stop;
    };
    if (job.times.starts == 0) job.times.begin = unix_now();
    job.times.starts = restart + 1;
    if (restart > 0) progress.end_cut_line();
    mfsdp::launch::SuperviseResult result = start_ranks(args, restart, master_port, hooks);
    if (result.interrupt_signal == 0 && g_interrupt != 0) result.interrupt_signal = g_interrupt;  // before forwarding
    const bool ended_elsewhere = monitor && monitor->round_ended();
    const RendezvousReply ending = monitor ? monitor->ending() : RendezvousReply{};
    monitor.reset();  // no more polls for this round

    if (result.ok()) {
      if (client) finish_round(*client, args, restart);
      return 0;
    }
    const bool interrupted = result.interrupt_signal != 0;
    if (interrupted && client) {
      try {
        client->request("interrupt", restart, result.interrupt_signal);  // no node restarts it
      } catch (const std::runtime_error&) {
      }
    }
    // Ranks that took the signal as their cue to save and stop (--exit-signal-handler) and all
    // exited 0: the job ended as asked.
    if (interrupted &&
        std::all_of(result.exits.begin(), result.exits.end(), [](const auto& e) { return !e.failed(); })) {
      std::fprintf(stderr, "mfsdp-run: interrupted by signal %d; every rank exited 0\n", result.interrupt_signal);
      return 0;
    }
    job.record_failure(restart, learned_failure.value_or(unix_now()));
    failure_code = failure_exit_code(result);

    std::string report = failure_report(result, restart,
                                        ended_elsewhere && !interrupted && result.stop_requested &&
                                                ending.kind == RendezvousReply::kRound
                                            ? std::optional<int>(ending.failed_by)
                                            : std::nullopt);
    // An interrupt is the user's (or the scheduler's) decision: never restarted, on any node.
    if (interrupted) {
      std::fputs(report.c_str(), stderr);
      return failure_code;
    }
    int next = restart + 1;
    if (client) {
      std::fputs(report.c_str(), stderr);
      report.clear();
      const std::optional<RendezvousReply> reply = announce_failure(*client, args, restart);
      if (!reply) return failure_code;
      if (reply->kind == RendezvousReply::kAbort || reply->kind == RendezvousReply::kError) {
        std::fprintf(stderr, "mfsdp-run: the job ends: %s\n", reply->text.c_str());
        return failure_code;
      }
      if (reply->kind != RendezvousReply::kRound || reply->round <= restart) {
        std::fprintf(stderr, "mfsdp-run: error: node 0's launcher started no round after round %d\n", restart);
        return failure_code;
      }
      next = reply->round;
    }
    const bool restarts_left = next <= args.max_restarts;
    if (args.max_restarts > 0)
      report += restarts_left ? "mfsdp-run: restarting every rank (restart " + std::to_string(next) + " of " +
                                    std::to_string(args.max_restarts) + ")\n"
                              : "mfsdp-run: no restart left (--max-restarts " + std::to_string(args.max_restarts) +
                                    ")\n";
    std::fputs(report.c_str(), stderr);
    if (!restarts_left) return failure_code;
    restart = next;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Arguments args;
  try {
    args = parse_arguments(argc, argv);
    if (args.help) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    validate(args);
  } catch (const UsageError& error) {
    std::fprintf(stderr, "mfsdp-run: error: %s\nRun 'mfsdp-run --help' for usage.\n", error.what());
    return kUsageExitCode;
  }
  catch_interrupts();
  const ProgressFile progress;
  JobRecord job;
  int code = 1;
  try {
    code = run(args, progress, job);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "mfsdp-run: error: %s\n", error.what());
  }
  print_goodput(progress, job);
  return code;
}
