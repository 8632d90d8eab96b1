// Runs one child process per rank and supervises them as a group: the engine behind mfsdp-run
// and the multi-rank test harness (tests/harness).
//
// Contract: every child's stdout and stderr are read through pipes line by line and handed to
// `on_line`; when a child exits non-zero or is killed by a signal, every other child still
// running gets SIGTERM and, after `kill_grace`, SIGKILL; the result names the first rank that
// failed and how. A child that exits 0 is a success even while others keep running.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mfsdp::launch {

struct RankProcessSpec {
  int rank = 0;                              // used in tags and reports
  std::vector<std::string> argv;             // argv[0] is looked up in PATH when it has no '/'
  std::map<std::string, std::string> env;    // set on top of the parent's environment
};

enum class OutputStream { kStdout, kStderr };

struct SuperviseOptions {
  // Called from the supervising thread for every complete line (without '\n') a child writes.
  // Default: writes "[rankN]: line" to the parent's stdout or stderr.
  std::function<void(int rank, OutputStream stream, const std::string& line)> on_line;
  // After the first failure, how long the others may run on before they are stopped: a rank
  // that notices its dead peer exits on its own with its error line, which a SIGTERM would cut
  // (mfsdp-run gives 3 s). A forwarded signal or the deadline stops them at once.
  std::chrono::milliseconds failure_grace{0};
  // After the first failure, how long the others get between SIGTERM and SIGKILL.
  std::chrono::milliseconds kill_grace{5000};
  // After a forwarded signal, how long the ranks get before SIGKILL: a rank that saves on SIGTERM
  // (a trainer's --exit-signal-handler) needs the time of a checkpoint (torchrun gives 30 s).
  std::chrono::milliseconds interrupt_kill_grace{5000};
  // Whole-run limit; when reached every child is stopped and the result says timed_out.
  std::optional<std::chrono::milliseconds> deadline;
  // Forward SIGINT/SIGTERM received by the parent to the children (mfsdp-run sets this), then
  // stop them as after a failure. Handlers are process-wide: one such run at a time.
  bool forward_signals = false;
  // When not empty: once every child has exited (whatever happened, also when the run throws),
  // remove_shm_segments(shm_tag) unlinks the segments the job's ranks left in /dev/shm.
  std::string shm_tag;
  // Called once, from the supervising thread, when the first failing rank is reaped: mfsdp-run
  // notes the time and tells the other nodes' launchers at once, before this node's ranks are
  // stopped (which takes up to failure_grace + kill_grace).
  std::function<void()> on_first_failure;
  // Asked on every wake-up of the supervising loop (at least every 50 ms) until a rank fails: when
  // it returns true, the ranks are stopped as after a failure (failure_grace, then SIGTERM, then
  // SIGKILL) and the result says stop_requested. mfsdp-run stops its node's ranks this way when
  // another node's launcher announced a new round. Must be cheap (an atomic load).
  std::function<bool()> stop_requested;
};

struct RankExit {
  int rank = 0;
  pid_t pid = 0;
  int exit_code = 0;       // valid when signal == 0
  int signal = 0;          // signal that killed it, 0 if it exited
  bool stopped_by_supervisor = false;  // signalled because another rank failed, the deadline
                                       // passed or the parent was interrupted
  bool spawn_failed = false;           // exec failed (exit_code 127)
  bool failed() const { return signal != 0 || exit_code != 0; }
  // e.g. "rank 1 (pid 4242) exited with code 3" / "... was killed by signal 11 (Segmentation fault)"
  std::string describe() const;
};

struct SuperviseResult {
  std::vector<RankExit> exits;          // one per spec, in spec order
  std::optional<int> first_failed_rank; // the rank whose failure stopped the group
  bool timed_out = false;
  int interrupt_signal = 0;  // SIGINT/SIGTERM the parent received and forwarded, 0 if none
  bool stop_requested = false;  // options.stop_requested returned true before any rank failed
  bool ok() const { return !first_failed_rank && !timed_out && interrupt_signal == 0 && !stop_requested; }
  // One line for the user: the first failure (or the timeout or interruption), or
  // "all N ranks succeeded".
  std::string summary() const;
};

// Starts every spec and supervises them until all have exited. Throws std::runtime_error only if
// the supervisor itself cannot work (pipe/fork failure); child failures are reported in the result.
SuperviseResult run_rank_processes(const std::vector<RankProcessSpec>& specs,
                                   const SuperviseOptions& options = {});

// A TCP port on 127.0.0.1 that is free right now, chosen at random below the kernel's ephemeral
// range so that no outgoing connection can take it before the store binds it.
int pick_free_port();

// A random job token (128 bits, hex), made once per process: the same in every call.
const std::string& launcher_job_token();

// A random tag (64 bits, hex, letters and digits only), made once per process. mfsdp-run gives it
// to its ranks as MFSDP_SHM_TAG; the communicator names its /dev/shm segments
// "mfsdp-TAG-PID-NONCE" with it (src/comm/shm_exchange.cpp).
const std::string& launcher_shm_tag();

// Unlinks every /dev/shm entry named "mfsdp-TAG-..." and returns the names removed. Ranks unlink
// their segment as soon as every rank mapped it; this removes what a rank killed before that
// point left behind. Mapped segments stay usable by whoever has them mapped.
std::vector<std::string> remove_shm_segments(const std::string& tag);

// The torchrun-style variables for one rank of a single- or multi-node job: RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT, and, like
// torchrun, OMP_NUM_THREADS=1 when the parent has none and nproc_per_node > 1. On a single node
// also MFSDP_JOB_TOKEN = launcher_job_token() unless the parent has one (which the ranks then
// inherit): the job's identity, which each rank proves to the rendezvous store
// (include/mfsdp/comm/rendezvous.h). Several nodes need a token from the environment. Always
// MFSDP_SHM_TAG = launcher_shm_tag(), this node's tag for its ranks' /dev/shm segments.
std::map<std::string, std::string> rank_environment(int node_rank, int nnodes, int nproc_per_node,
                                                    int local_rank, const std::string& master_addr,
                                                    int master_port);

}  // namespace mfsdp::launch
