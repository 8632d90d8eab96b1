// mfsdp-run: our torchrun. Starts --nproc-per-node copies of PROGRAM with the torchrun variables
// set, tags their output with the rank, stops them all when one fails, restarts them all up to
// --max-restarts times, and exits with the failed rank's status. See docs/launcher.md.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

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
never restarted.

options (also --flag=value, and torchrun's spellings with '_'):
  --nproc-per-node N   processes on this node (default 1)
  --nnodes M           number of nodes (default 1)
  --node-rank R        this node's index, 0 <= R < M (default 0)
  --master-addr H      address of node 0, where rank 0 listens (default 127.0.0.1; required
                       when M > 1)
  --master-port P      port on H (default: a free port when M == 1, else 29500)
  --standalone         single node with a free port (accepted for torchrun compatibility)
  --max-restarts K     start a failed job again, every rank, up to K times (default 0; single
                       node only)
  --monitor-interval S torchrun's polling period; accepted for compatibility (mfsdp-run learns of
                       a rank's exit at once, without polling)
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
  bool tag = true;
  bool help = false;
  std::vector<std::string> program;  // PROGRAM ARGS...
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
        flag != "--monitor-interval") {
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
      char* end = nullptr;
      const double seconds = std::strtod(value.c_str(), &end);
      if (value.empty() || end != value.c_str() + value.size() || !(seconds > 0))
        throw UsageError("--monitor-interval expects a positive number of seconds, got '" + value + "'");
    } else if (flag == "--master-addr") {
      if (value.empty()) throw UsageError("--master-addr expects a host name or address, got ''");
      args.master_addr = value;
    } else {
      args.master_port = parse_int(flag, value);
      if (args.master_port < 1 || args.master_port > 65535) {
        throw UsageError("--master-port must be in 1..65535, got " + value);
      }
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
  // Across nodes every node's launcher would have to join each new round: not built yet.
  if (args.max_restarts > 0 && args.nnodes > 1)
    throw UsageError("--max-restarts restarts the ranks of one node; with --nnodes " + std::to_string(args.nnodes) +
                     " every node's launcher would have to join the new round (use torchrun --max-restarts "
                     "with its c10d rendezvous across nodes)");
  if (args.nnodes > 1 && args.master_addr.empty()) {
    throw UsageError("--master-addr is required when --nnodes > 1 (the address of node 0)");
  }
  if (args.program.empty()) throw UsageError("missing PROGRAM (the command every rank runs)");
}

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

// One start of the job (restart 0 is the first): every rank of this node, its rendezvous round's
// port and job token. A restart takes a free port of its own and the job token with the restart's
// number, so no rank of an earlier round can join it.
mfsdp::launch::SuperviseResult start_ranks(const Arguments& args, int restart) {
  namespace launch = mfsdp::launch;
  const std::string master_addr = args.master_addr.empty() ? "127.0.0.1" : args.master_addr;
  int master_port = args.master_port;
  if (master_port == 0 || restart > 0)
    master_port = args.nnodes == 1 ? launch::pick_free_port() : kDefaultMultiNodePort;

  std::vector<launch::RankProcessSpec> specs;
  for (int local_rank = 0; local_rank < args.nproc_per_node; ++local_rank) {
    launch::RankProcessSpec spec;
    spec.env = launch::rank_environment(args.node_rank, args.nnodes, args.nproc_per_node,
                                        local_rank, master_addr, master_port);
    spec.env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart);
    spec.env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(args.max_restarts);
    if (restart > 0) {
      const char* inherited = std::getenv("MFSDP_JOB_TOKEN");
      spec.env["MFSDP_JOB_TOKEN"] =
          (inherited != nullptr ? std::string(inherited) : launch::launcher_job_token()) + ".restart" +
          std::to_string(restart);
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
  if (!args.tag) options.on_line = write_raw_line;
  return launch::run_rank_processes(specs, options);
}

int run(const Arguments& args) {
  for (int restart = 0;; ++restart) {
    const mfsdp::launch::SuperviseResult result = start_ranks(args, restart);
    if (result.ok()) return 0;
    // Ranks that took the signal as their cue to save and stop (--exit-signal-handler) and all
    // exited 0: the job ended as asked.
    if (result.interrupt_signal != 0 &&
        std::all_of(result.exits.begin(), result.exits.end(), [](const auto& e) { return !e.failed(); })) {
      std::fprintf(stderr, "mfsdp-run: interrupted by signal %d; every rank exited 0\n", result.interrupt_signal);
      return 0;
    }
    std::string report = "mfsdp-run: " + result.summary() + "\n";
    for (const auto& exit : result.exits) {
      if (result.first_failed_rank && exit.rank == *result.first_failed_rank) continue;
      if (exit.failed() || exit.stopped_by_supervisor) report += "mfsdp-run:   " + exit.describe() + "\n";
    }
    // An interrupt is the user's (or the scheduler's) decision: never restarted.
    const bool restarts_left = restart < args.max_restarts && result.interrupt_signal == 0;
    if (args.max_restarts > 0)
      report += restarts_left ? "mfsdp-run: restarting every rank (restart " + std::to_string(restart + 1) + " of " +
                                    std::to_string(args.max_restarts) + ")\n"
                              : "mfsdp-run: no restart left (--max-restarts " + std::to_string(args.max_restarts) +
                                    ")\n";
    std::fputs(report.c_str(), stderr);
    if (!restarts_left) return failure_exit_code(result);
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
  try {
    return run(args);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "mfsdp-run: error: %s\n", error.what());
    return 1;
  }
}
