// How the rank supervisor works: one fork/exec per spec, each child in its own process group with
// stdout/stderr on pipes; a single poll() loop reads lines, reaps children with waitpid(WNOHANG)
// and runs the stop procedure (signal every running group, SIGKILL after the grace period) on the
// first failure, the deadline or a forwarded signal. Plain POSIX: no torch headers here.
#include "mfsdp/launch/rank_processes.h"

#include "launch/socket_fd.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <utility>

extern char** environ;

namespace mfsdp::launch {
namespace {

using Clock = std::chrono::steady_clock;
using LineSink = std::function<void(int rank, OutputStream stream, const std::string& line)>;

// Longer lines are handed to on_line in pieces of this size, so a child that never writes '\n'
// cannot make the supervisor buffer without bound.
constexpr size_t kMaxLineBytes = 64 * 1024;
constexpr size_t kReadChunk = 64 * 1024;
// poll() wakes at least this often to reap children: a child can exit while a grandchild still
// holds its pipes open, so EOF alone does not tell us it is gone.
constexpr int kReapIntervalMs = 50;
// After every child is reaped, at most this much more is read from each pipe that a grandchild
// keeps open (grandchildren are not waited for).
constexpr size_t kMaxFinalDrainBytes = 1 << 20;

std::string errno_text(const std::string& what) {
  return "mfsdp::launch: " + what + ": " + std::strerror(errno);
}

std::string signal_text(int sig) {
  const char* name = strsignal(sig);
  return std::to_string(sig) + " (" + (name != nullptr ? name : "unknown signal") + ")";
}


// Moves `fd` above 0/1/2 (keeping O_CLOEXEC): when the parent runs with a closed stdin or stdout,
// a new pipe can land on 0-2, and the child's dup2() onto 0-2 would then clobber it.
Fd above_stdio(Fd fd) {
  if (fd.get() > STDERR_FILENO) return fd;
  int moved = fcntl(fd.get(), F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
  if (moved < 0) throw std::runtime_error(errno_text("fcntl(F_DUPFD_CLOEXEC)"));
  return Fd(moved);
}

struct Pipe {
  Fd read_end;
  Fd write_end;
};

Pipe make_pipe() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(errno_text("pipe2"));
  Fd read_end(fds[0]);
  Fd write_end(fds[1]);
  return {above_stdio(std::move(read_end)), above_stdio(std::move(write_end))};
}

void set_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw std::runtime_error(errno_text("fcntl(O_NONBLOCK)"));
  }
}

void write_tagged_line(int rank, OutputStream stream, const std::string& line) {
  // One fwrite per line so lines from different ranks do not interleave mid-line.
  std::string text = "[rank" + std::to_string(rank) + "]: " + line + "\n";
  FILE* out = stream == OutputStream::kStdout ? stdout : stderr;
  std::fwrite(text.data(), 1, text.size(), out);
  std::fflush(out);
}

// ---- signal forwarding --------------------------------------------------------------------------

// Write end of the self-pipe of the run that forwards signals; -1 when none does.
std::atomic<int> g_signal_pipe_write{-1};

void forward_signal_handler(int sig) {
  int saved_errno = errno;
  int fd = g_signal_pipe_write.load();
  if (fd >= 0) {
    unsigned char byte = static_cast<unsigned char>(sig);
    ssize_t ignored = ::write(fd, &byte, 1);  // non-blocking; a full pipe already has a wake-up
    (void)ignored;
  }
  errno = saved_errno;
}

constexpr int kForwardedSignals[] = {SIGINT, SIGTERM};

// Installs SIGINT/SIGTERM handlers that write the signal number into a self-pipe for the lifetime
// of one run (when enabled), and restores the previous handlers afterwards. A self-pipe rather than
// signalfd: signalfd needs the signals blocked in every thread of the process, which a library
// cannot arrange.
class SignalForwarding {
 public:
  explicit SignalForwarding(bool enabled) {
    if (!enabled) return;
    Pipe pipe = make_pipe();
    set_nonblocking(pipe.read_end.get());
    set_nonblocking(pipe.write_end.get());
    int expected = -1;
    if (!g_signal_pipe_write.compare_exchange_strong(expected, pipe.write_end.get())) {
      throw std::logic_error(
          "run_rank_processes: forward_signals is already in use by another run in this process");
    }
    read_end_ = std::move(pipe.read_end);
    write_end_ = std::move(pipe.write_end);
    struct sigaction action {};
    action.sa_handler = forward_signal_handler;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;  // other threads' system calls should not see EINTR
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      // A signal the parent was started with ignored (a background job of a script, nohup-like
      // wrappers) stays ignored, as shells and Python do.
      sigaction(kForwardedSignals[i], nullptr, &previous_[i]);
      if (previous_[i].sa_handler != SIG_IGN) sigaction(kForwardedSignals[i], &action, nullptr);
    }
    installed_ = true;
  }

  ~SignalForwarding() {
    if (!installed_) return;
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      sigaction(kForwardedSignals[i], &previous_[i], nullptr);
    }
    g_signal_pipe_write.store(-1);
  }

  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

  int read_fd() const { return read_end_.get(); }  // -1 when not enabled

  // In a forked child (async-signal-safe): disarms the handler and puts back the dispositions
  // from before the run, so a SIGTERM that arrives before exec acts as it would have.
  void restore_in_child() const {
    if (!installed_) return;
    g_signal_pipe_write.store(-1);
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      sigaction(kForwardedSignals[i], &previous_[i], nullptr);
    }
  }

  // The signals received since the last call, in order.
  std::vector<int> take_signals() {
    std::vector<int> signals;
    unsigned char buffer[64];
    ssize_t n;
    while ((n = ::read(read_end_.get(), buffer, sizeof buffer)) > 0) {
      signals.insert(signals.end(), buffer, buffer + n);
    }
    return signals;
  }

 private:
  bool installed_ = false;
  Fd read_end_;
  Fd write_end_;
  struct sigaction previous_[std::size(kForwardedSignals)] {};
};

// Blocks SIGINT/SIGTERM in the calling thread around fork(), so that the child cannot run the
// parent's forwarding handler (and report a signal into the parent's self-pipe) before it has
// disarmed it.
class BlockForwardedSignals {
 public:
  BlockForwardedSignals() {
    sigset_t block;
    sigemptyset(&block);
    for (int sig : kForwardedSignals) sigaddset(&block, sig);
    pthread_sigmask(SIG_BLOCK, &block, &previous_);
  }
  ~BlockForwardedSignals() { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  const sigset_t& previous() const { return previous_; }
  BlockForwardedSignals(const BlockForwardedSignals&) = delete;
  BlockForwardedSignals& operator=(const BlockForwardedSignals&) = delete;

 private:
  sigset_t previous_;
};

// ---- spawning -----------------------------------------------------------------------------------

// Everything the child needs between fork and exec, built before fork: after fork only
// async-signal-safe calls are allowed (the parent may have other threads holding malloc locks).
// `argv` points into the spec and `envp` into `env_strings` (moving a vector keeps its elements in
// place, so an ExecPlan may be moved but not copied).
struct ExecPlan {
  ExecPlan() = default;
  ExecPlan(ExecPlan&&) = default;
  ExecPlan(const ExecPlan&) = delete;

  std::vector<std::string> env_strings;
  std::vector<char*> argv;
  std::vector<char*> envp;
  int max_fd = 0;  // fallback bound for closing inherited descriptors
};

ExecPlan make_exec_plan(const RankProcessSpec& spec) {
  if (spec.argv.empty() || spec.argv[0].empty()) {
    throw std::invalid_argument("run_rank_processes: rank " + std::to_string(spec.rank) +
                                " has an empty argv");
  }
  ExecPlan plan;
  // Parent environment without the names the spec overrides, then the spec's variables.
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string text = *entry;
    std::string name = text.substr(0, text.find('='));
    if (spec.env.count(name) == 0) plan.env_strings.push_back(std::move(text));
  }
  for (const auto& [name, value] : spec.env) plan.env_strings.push_back(name + "=" + value);
  for (std::string& text : plan.env_strings) plan.envp.push_back(text.data());
  plan.envp.push_back(nullptr);
  for (const std::string& arg : spec.argv) plan.argv.push_back(const_cast<char*>(arg.c_str()));
  plan.argv.push_back(nullptr);
  rlimit limit{};
  plan.max_fd = getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY
                    ? static_cast<int>(std::min<rlim_t>(limit.rlim_cur, 1 << 16))
                    : 1 << 16;
  return plan;
}

// Closes every descriptor >= 3 except `keep` (async-signal-safe).
void close_inherited_fds(int keep, int max_fd) {
#ifdef SYS_close_range
  bool closed = true;
  if (keep > 3) closed = syscall(SYS_close_range, 3u, static_cast<unsigned>(keep - 1), 0u) == 0;
  if (closed) closed = syscall(SYS_close_range, static_cast<unsigned>(keep + 1), ~0u, 0u) == 0;
  if (closed) return;
#endif
  for (int fd = 3; fd < max_fd; ++fd) {
    if (fd != keep) ::close(fd);
  }
}

// Runs in the child after fork; never returns. On exec failure it sends errno through
// `report_fd` (the parent then writes the error line on this rank's stderr; strerror is not
// async-signal-safe, so the child does not format it) and exits 127 like a shell.
[[noreturn]] void exec_child(const ExecPlan& plan, int stdin_fd, int stdout_fd, int stderr_fd,
                             int report_fd, pid_t supervisor, const SignalForwarding& forwarding,
                             const sigset_t& signal_mask) {
  forwarding.restore_in_child();
  // Own process group: the supervisor signals the group, reaching what the rank starts too.
  setpgid(0, 0);
  // Die with the supervisor instead of running on unsupervised (the race with its death is
  // closed by the getppid check).
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != supervisor) _exit(127);

  // Programs expect the default SIGPIPE; the parent (Gloo, say) may ignore it, and an ignored
  // signal would survive exec.
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  sigemptyset(&default_action.sa_mask);
  sigaction(SIGPIPE, &default_action, nullptr);
  sigprocmask(SIG_SETMASK, &signal_mask, nullptr);  // the caller's mask from before the fork

  if (dup2(stdin_fd, STDIN_FILENO) < 0 || dup2(stdout_fd, STDOUT_FILENO) < 0 ||
      dup2(stderr_fd, STDERR_FILENO) < 0) {
    int err = errno;
    ssize_t ignored = ::write(report_fd, &err, sizeof err);
    (void)ignored;
    _exit(127);
  }
  close_inherited_fds(report_fd, plan.max_fd);

  // execvp searches the PATH of `environ`, so point it at the child's environment first.
  environ = const_cast<char**>(plan.envp.data());
  execvp(plan.argv[0], plan.argv.data());
  int err = errno;
  ssize_t ignored = ::write(report_fd, &err, sizeof err);
  (void)ignored;
  _exit(127);
}

// ---- supervision --------------------------------------------------------------------------------

struct StreamReader {
  OutputStream stream = OutputStream::kStdout;
  Fd fd;
  std::string pending;  // bytes after the last '\n'
};

struct Child {
  RankExit exit;
  StreamReader out;
  StreamReader err;
  bool reaped = false;
  bool signalled = false;  // was running when a rank failed or the stop procedure started
};

enum class ReadResult { kMore, kClosed };

class Supervisor {
 public:
  Supervisor(const std::vector<RankProcessSpec>& specs, const SuperviseOptions& options)
      : specs_(specs),
        options_(options),
        sink_(options.on_line ? options.on_line : LineSink(write_tagged_line)),
        forwarding_(options.forward_signals),
        start_(Clock::now()) {}

  // On any exit path (including an exception from on_line), no child is left running or unreaped.
  ~Supervisor() {
    for (Child& child : children_) {
      if (child.reaped) continue;
      kill(-child.exit.pid, SIGKILL);
      int status;
      while (waitpid(child.exit.pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
    // Every rank has exited: what a rank killed before it unlinked its segment left in /dev/shm
    // goes now.
    remove_shm_segments(options_.shm_tag);
  }

  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  SuperviseResult run() {
    // Ranks read no input: in their own process groups they are background jobs of the terminal,
    // and reading it would stop them (SIGTTIN).
    Fd dev_null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!dev_null.valid()) throw std::runtime_error(errno_text("open /dev/null"));
    dev_null = above_stdio(std::move(dev_null));
    // Every spec is checked (make_exec_plan throws on an empty argv) before any rank starts.
    std::vector<ExecPlan> plans;
    plans.reserve(specs_.size());
    for (const RankProcessSpec& spec : specs_) plans.push_back(make_exec_plan(spec));
    children_.reserve(specs_.size());
    for (size_t i = 0; i < specs_.size(); ++i) spawn(specs_[i], plans[i], dev_null.get());
    supervise();
    drain_after_exit();
    if (stopping_ || result_.first_failed_rank || result_.stop_requested) {
      // Whatever survived in the stopped groups (a grandchild that ignored the stop signal while
      // its parent exited) is killed now rather than orphaned.
      for (const Child& child : children_) {
        if (child.signalled) kill(-child.exit.pid, SIGKILL);
      }
    }
    result_.exits.clear();
    for (const Child& child : children_) result_.exits.push_back(child.exit);
    return std::move(result_);
  }

 private:
  void spawn(const RankProcessSpec& spec, const ExecPlan& plan, int stdin_fd) {
    Pipe out = make_pipe();
    Pipe err = make_pipe();
    Pipe report = make_pipe();
    const pid_t supervisor = getpid();
    pid_t pid;
    {
      BlockForwardedSignals block;
      pid = fork();
      if (pid == 0) {
        exec_child(plan, stdin_fd, out.write_end.get(), err.write_end.get(),
                   report.write_end.get(), supervisor, forwarding_, block.previous());
      }
    }
    if (pid < 0) throw std::runtime_error(errno_text("fork for rank " + std::to_string(spec.rank)));
    setpgid(pid, pid);  // also here, so the group exists before we might signal it

    Child child;
    child.exit.rank = spec.rank;
    child.exit.pid = pid;
    child.out.stream = OutputStream::kStdout;
    child.err.stream = OutputStream::kStderr;
    child.out.fd = std::move(out.read_end);
    child.err.fd = std::move(err.read_end);
    children_.push_back(std::move(child));  // from here on the destructor reaps it

    out.write_end.reset();
    err.write_end.reset();
    report.write_end.reset();
    set_nonblocking(children_.back().out.fd.get());
    set_nonblocking(children_.back().err.fd.get());

    // EOF: exec succeeded (the report pipe is O_CLOEXEC). An int: exec failed with that errno.
    int exec_errno = 0;
    ssize_t n;
    while ((n = ::read(report.read_end.get(), &exec_errno, sizeof exec_errno)) < 0 &&
           errno == EINTR) {
    }
    if (n == static_cast<ssize_t>(sizeof exec_errno)) {
      children_.back().exit.spawn_failed = true;
      sink_(spec.rank, OutputStream::kStderr,
            "mfsdp-run: cannot execute '" + spec.argv[0] + "': " + std::strerror(exec_errno));
    }
  }

  void supervise() {
    std::vector<pollfd> fds;
    std::vector<Child*> owners;          // parallel to fds (nullptr for the signal pipe)
    std::vector<StreamReader*> readers;  // parallel to fds (nullptr for the signal pipe)
    while (std::any_of(children_.begin(), children_.end(), [](const Child& c) { return !c.reaped; })) {
      fds.clear();
      owners.clear();
      readers.clear();
      if (forwarding_.read_fd() >= 0) {
        fds.push_back({forwarding_.read_fd(), POLLIN, 0});
        owners.push_back(nullptr);
        readers.push_back(nullptr);
      }
      for (Child& child : children_) {
        for (StreamReader* reader : {&child.out, &child.err}) {
          if (!reader->fd.valid()) continue;
          fds.push_back({reader->fd.get(), POLLIN, 0});
          owners.push_back(&child);
          readers.push_back(reader);
        }
      }

      if (poll(fds.data(), fds.size(), poll_timeout_ms()) < 0 && errno != EINTR) {
        throw std::runtime_error(errno_text("poll"));
      }
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        if (readers[i] == nullptr) {
          for (int sig : forwarding_.take_signals()) on_forwarded_signal(sig);
          continue;
        }
        const int rank = owners[i]->exit.rank;
        if (read_some(rank, *readers[i]) == ReadResult::kClosed) close_reader(rank, *readers[i]);
      }
      reap_and_check();
    }
  }

  int poll_timeout_ms() const {
    auto timeout = std::chrono::milliseconds(kReapIntervalMs);
    const auto now = Clock::now();
    auto until = [&](Clock::time_point when) {
      return std::chrono::duration_cast<std::chrono::milliseconds>(when - now) +
             std::chrono::milliseconds(1);  // round up: waking early would just spin once more
    };
    if (!stopping_ && options_.deadline) timeout = std::min(timeout, until(start_ + *options_.deadline));
    if (!stopping_ && (result_.first_failed_rank || result_.stop_requested))
      timeout = std::min(timeout, until(failure_time_ + options_.failure_grace));
    if (stopping_ && !killed_) timeout = std::min(timeout, until(stop_start_ + stop_grace_));
    return static_cast<int>(std::max<std::chrono::milliseconds::rep>(timeout.count(), 0));
  }

  // One read (poll is level-triggered, so the rest comes on the next round and a chatty rank
  // cannot starve the others).
  ReadResult read_some(int rank, StreamReader& reader) {
    char buffer[kReadChunk];
    ssize_t n = ::read(reader.fd.get(), buffer, sizeof buffer);
    if (n > 0) {
      feed(rank, reader, buffer, static_cast<size_t>(n));
      return ReadResult::kMore;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return ReadResult::kMore;
    return ReadResult::kClosed;  // EOF, or an error we cannot do anything about
  }

  void feed(int rank, StreamReader& reader, const char* data, size_t size) {
    std::string& pending = reader.pending;
    pending.append(data, size);
    size_t start = 0;
    for (;;) {
      const size_t newline = pending.find('\n', start);
      const size_t end = newline == std::string::npos ? pending.size() : newline;
      if (end - start > kMaxLineBytes) {
        // Strictly longer than the limit: the piece is never followed by an empty remainder.
        sink_(rank, reader.stream, pending.substr(start, kMaxLineBytes));
        start += kMaxLineBytes;
        continue;
      }
      if (newline == std::string::npos) break;
      sink_(rank, reader.stream, pending.substr(start, newline - start));
      start = newline + 1;
    }
    pending.erase(0, start);
  }

  // Hands over a last line without '\n' and closes the pipe.
  void close_reader(int rank, StreamReader& reader) {
    reader.fd.reset();
    if (!reader.pending.empty()) {
      std::string last = std::move(reader.pending);
      reader.pending.clear();
      sink_(rank, reader.stream, last);
    }
  }

  void reap_and_check() {
    // Reap everything that exited before judging, so that ranks which failed on their own in the
    // same round are not reported as stopped by the supervisor.
    const Child* first_failure = nullptr;
    for (Child& child : children_) {
      if (child.reaped || !try_reap(child)) continue;
      if (child.exit.failed() && first_failure == nullptr) first_failure = &child;
    }
    const auto now = Clock::now();
    if (!result_.first_failed_rank && !stopping_ && first_failure != nullptr) {
      result_.first_failed_rank = first_failure->exit.rank;
      if (!result_.stop_requested) {
        failure_time_ = now;
        if (options_.on_first_failure) options_.on_first_failure();
      }
      // What these ranks started is killed at the end, also when they exit during the grace.
      for (Child& child : children_) child.signalled = child.signalled || !child.reaped;
    }
    // Another node's failure: stopped like after a failure of our own, grace included (our ranks
    // are likely failing on their own already, naming the dead peer).
    if (!result_.first_failed_rank && !result_.stop_requested && !stopping_ && options_.stop_requested &&
        options_.stop_requested()) {
      result_.stop_requested = true;
      failure_time_ = now;
      for (Child& child : children_) child.signalled = child.signalled || !child.reaped;
    }
    // The others may still exit on their own (with their own error lines) during failure_grace.
    const bool ending = result_.first_failed_rank || result_.stop_requested;
    if (!stopping_ && ending && now >= failure_time_ + options_.failure_grace &&
        std::any_of(children_.begin(), children_.end(), [](const Child& c) { return !c.reaped; })) {
      start_stop(SIGTERM);
    }
    if (!stopping_ && options_.deadline && now >= start_ + *options_.deadline) {
      result_.timed_out = true;
      start_stop(SIGTERM);
    }
    if (stopping_ && !killed_ && now >= stop_start_ + stop_grace_) {
      killed_ = true;
      for (Child& child : children_) {
        if (!child.reaped) kill(-child.exit.pid, SIGKILL);
      }
    }
  }

  bool try_reap(Child& child) {
    int status = 0;
    pid_t got = waitpid(child.exit.pid, &status, WNOHANG);
    if (got == 0 || (got < 0 && errno == EINTR)) return false;
    child.reaped = true;
    if (got < 0) {
      // ECHILD: someone else reaped it (e.g. SIGCHLD set to SIG_IGN); the status is lost.
      child.exit.exit_code = -1;
    } else if (WIFSIGNALED(status)) {
      child.exit.signal = WTERMSIG(status);
    } else {
      child.exit.exit_code = WEXITSTATUS(status);
    }
    return true;
  }

  void on_forwarded_signal(int sig) {
    if (!stopping_) {
      result_.interrupt_signal = sig;
      start_stop(sig);
      stop_grace_ = options_.interrupt_kill_grace;
      return;
    }
    // Already stopping: pass a repeated signal on as well (the grace period keeps running), and
    // remember an interrupt that came during a failure's stop (mfsdp-run never restarts one).
    if (result_.interrupt_signal == 0) result_.interrupt_signal = sig;
    for (Child& child : children_) {
      if (!child.reaped) kill(-child.exit.pid, sig);
    }
  }

  // The stop procedure: `sig` to every running group now, SIGKILL after kill_grace
  // (reap_and_check).
  void start_stop(int sig) {
    stopping_ = true;
    stop_start_ = Clock::now();
    stop_grace_ = options_.kill_grace;
    for (Child& child : children_) {
      if (child.reaped) continue;
      child.signalled = true;
      // A rank whose exec failed is exiting 127 on its own, not because it was stopped.
      child.exit.stopped_by_supervisor = !child.exit.spawn_failed;
      kill(-child.exit.pid, sig);
    }
  }

  // Every child is reaped: read what is still buffered in the pipes without waiting for
  // grandchildren that may hold them open, then close them.
  void drain_after_exit() {
    for (Child& child : children_) {
      for (StreamReader* reader : {&child.out, &child.err}) {
        size_t drained = 0;
        char buffer[kReadChunk];
        while (reader->fd.valid() && drained < kMaxFinalDrainBytes) {
          ssize_t n = ::read(reader->fd.get(), buffer, sizeof buffer);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) break;
          feed(child.exit.rank, *reader, buffer, static_cast<size_t>(n));
          drained += static_cast<size_t>(n);
        }
        close_reader(child.exit.rank, *reader);
      }
    }
  }

  const std::vector<RankProcessSpec>& specs_;
  const SuperviseOptions& options_;
  LineSink sink_;
  SignalForwarding forwarding_;
  const Clock::time_point start_;
  std::vector<Child> children_;  // reserved up front: children are referred to by address
  SuperviseResult result_;
  bool stopping_ = false;
  bool killed_ = false;  // SIGKILL sent after the grace period
  Clock::time_point stop_start_;
  std::chrono::milliseconds stop_grace_{0};  // between the stop signal and SIGKILL
  Clock::time_point failure_time_;  // when first_failed_rank was reaped, or the stop requested
};

}  // namespace

std::string RankExit::describe() const {
  std::string text = "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ")";
  if (spawn_failed) {
    text += " could not execute its program (exit code " + std::to_string(exit_code) + ")";
  } else if (signal != 0) {
    text += " was killed by signal " + signal_text(signal);
  } else if (exit_code < 0) {
    text += " exited with an unknown status (reaped elsewhere)";
  } else {
    text += " exited with code " + std::to_string(exit_code);
  }
  if (stopped_by_supervisor) text += " after being stopped";
  return text;
}

std::string SuperviseResult::summary() const {
  size_t stopped = 0;
  for (const RankExit& exit : exits) stopped += exit.stopped_by_supervisor ? 1 : 0;
  const std::string stopped_text =
      "; stopped " + std::to_string(stopped) + (stopped == 1 ? " running rank" : " running ranks");
  if (first_failed_rank) {
    for (const RankExit& exit : exits) {
      if (exit.rank == *first_failed_rank) {
        return exit.describe() + (stopped > 0 ? stopped_text : "");
      }
    }
    return "rank " + std::to_string(*first_failed_rank) + " failed" + stopped_text;
  }
  if (timed_out) return "the deadline passed" + stopped_text;
  if (interrupt_signal != 0) return "interrupted by signal " + signal_text(interrupt_signal) + stopped_text;
  if (stop_requested) return "stopped on request" + stopped_text;
  return "all " + std::to_string(exits.size()) + (exits.size() == 1 ? " rank" : " ranks") +
         " succeeded";
}

SuperviseResult run_rank_processes(const std::vector<RankProcessSpec>& specs,
                                   const SuperviseOptions& options) {
  Supervisor supervisor(specs, options);
  return supervisor.run();
}

namespace {
std::string random_hex(size_t bytes_count) {
  unsigned char bytes[32];
  if (bytes_count > sizeof bytes ||
      ::getrandom(bytes, bytes_count, 0) != static_cast<ssize_t>(bytes_count))
    throw std::runtime_error(errno_text("getrandom"));
  static const char kHex[] = "0123456789abcdef";
  std::string hex;
  for (size_t i = 0; i < bytes_count; ++i) {
    hex += kHex[bytes[i] >> 4];
    hex += kHex[bytes[i] & 15];
  }
  return hex;
}
}  // namespace

const std::string& launcher_job_token() {
  static const std::string token = random_hex(16);
  return token;
}

const std::string& launcher_shm_tag() {
  // Independent of the job token: segment names are visible to every user of the host.
  static const std::string tag = random_hex(8);
  return tag;
}

std::vector<std::string> remove_shm_segments(const std::string& tag) {
  std::vector<std::string> removed;
  if (tag.empty()) return removed;
  const std::string prefix = "mfsdp-" + tag + "-";
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return removed;
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    if (name.compare(0, prefix.size(), prefix) == 0) names.push_back(std::move(name));
  }
  ::closedir(dir);
  for (const std::string& name : names) {
    if (::shm_unlink(("/" + name).c_str()) == 0) removed.push_back(name);
  }
  return removed;
}

namespace {

// The kernel's ephemeral range [low, high]: outgoing connections take their local ports from it.
std::pair<int, int> ephemeral_port_range() {
  int low = 32768, high = 60999;
  if (FILE* file = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(file, "%d %d", &low, &high) != 2) low = 32768, high = 60999;
    std::fclose(file);
  }
  return {low, high};
}

bool can_bind_loopback(int port) {
  Fd socket_fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!socket_fd.valid()) throw std::runtime_error(errno_text("socket"));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  return bind(socket_fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
}

}  // namespace

// Why not bind port 0: the kernel hands out a port from the ephemeral range, and between our
// close and the store's bind any outgoing connection on the host (another job's ranks dialling
// their store) may take it as its local port. A random port below the ephemeral range is never
// taken that way, so only a listener picked in the same instant can collide.
int pick_free_port() {
  const auto [ephemeral_low, ephemeral_high] = ephemeral_port_range();
  const bool room_below = ephemeral_low > 20000 + 1000;
  const int low = room_below ? 20000 : ephemeral_high + 1;
  const int high = room_below ? ephemeral_low - 1 : 65535;
  for (int attempt = 0; attempt < 256 && low <= high; ++attempt) {
    uint32_t random = 0;
    if (::getrandom(&random, sizeof random, 0) != static_cast<ssize_t>(sizeof random)) break;
    const int port = low + static_cast<int>(random % static_cast<uint32_t>(high - low + 1));
    if (can_bind_loopback(port)) return port;
  }
  throw std::runtime_error("pick_free_port: no free TCP port on 127.0.0.1 in " + std::to_string(low) +
                           ".." + std::to_string(high) + " after 256 tries");
}

std::map<std::string, std::string> rank_environment(int node_rank, int nnodes, int nproc_per_node,
                                                    int local_rank, const std::string& master_addr,
                                                    int master_port) {
  if (nnodes < 1 || nproc_per_node < 1 || node_rank < 0 || node_rank >= nnodes ||
      local_rank < 0 || local_rank >= nproc_per_node || master_port < 1 || master_port > 65535) {
    throw std::invalid_argument(
        "rank_environment: expected 0 <= node_rank < nnodes, 0 <= local_rank < nproc_per_node "
        "and a port in 1..65535, got node_rank " + std::to_string(node_rank) + ", nnodes " +
        std::to_string(nnodes) + ", local_rank " + std::to_string(local_rank) +
        ", nproc_per_node " + std::to_string(nproc_per_node) + ", port " +
        std::to_string(master_port));
  }
  std::map<std::string, std::string> env = {
      {"RANK", std::to_string(node_rank * nproc_per_node + local_rank)},
      {"WORLD_SIZE", std::to_string(nnodes * nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(nproc_per_node)},
      {"GROUP_RANK", std::to_string(node_rank)},
      {"NODE_RANK", std::to_string(node_rank)},
      {"MASTER_ADDR", master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
  };
  // Several ranks each with one OpenMP thread per core would oversubscribe the machine.
  if (nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    env["OMP_NUM_THREADS"] = "1";
  }
  // The job's identity, proven to the store before a rank joins (src/comm/store_server.h). On
  // several nodes every node's launcher would make a different one: there it must come from
  // the environment (MFSDP_JOB_TOKEN, or Slurm's job id, read by the ranks themselves).
  if (nnodes == 1 && std::getenv("MFSDP_JOB_TOKEN") == nullptr) {
    env["MFSDP_JOB_TOKEN"] = launcher_job_token();
  }
  // Names this node's shared-memory segments, so the launcher can remove them after the ranks
  // exited (remove_shm_segments).
  env["MFSDP_SHM_TAG"] = launcher_shm_tag();
  return env;
}

}  // namespace mfsdp::launch
