// Two guards around NCCL calls, kept free of NCCL and CUDA so that their logic is tested on the
// CPU (tests/unit/nccl_call_guards_test.cpp); src/comm/nccl_communicator.cpp instantiates them.
//
// IssueGate: the handshake between the caller's thread issuing collectives on a communicator
// and the watchdog aborting it. ncclCommAbort frees the communicator, so it must never run while
// another thread is inside an NCCL call on it (a use after free on the error path), and nothing
// may be issued once it ran. Issuing and aborting take one mutex; the abort happens once.
// Issuing never blocks inside NCCL for long: communicators are nonblocking and every call that
// returns ncclInProgress is polled with a deadline, so an abort waits at most that long.
//
// ScopedGroup: ncclGroupStart/ncclGroupEnd as RAII (c10d's AutoNcclGroup). A call that throws
// between the two would leave the thread's group open, and every later NCCL call on that thread
// would be deferred, never launched: a hang instead of an error. The destructor closes a group
// that end() did not.
#pragma once

#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace mfsdp::detail {

class IssueGate {
 public:
  // Runs `issue` unless the communicator was aborted, in which case throws `Aborted`, built from
  // the abort's reason. An abort requested meanwhile waits until `issue` returns.
  template <class Aborted, class Issue>
  auto issue(Issue&& issue_fn) -> decltype(issue_fn()) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) throw Aborted(reason_);
    return issue_fn();
  }

  // Runs `query` unless the communicator was aborted or a call is being issued right now (the
  // watchdog's look at NCCL's asynchronous error must not wait behind an issue that may poll
  // until its deadline, nor touch a communicator an abort freed). Returns whether it ran.
  template <class Query>
  bool try_query(Query&& query) {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock() || aborted_) return false;
    query();
    return true;
  }

  // Runs `abort` once, after any issue in progress has returned; later issues throw. Returns
  // whether this call aborted (false: an earlier one had).
  template <class Abort>
  bool abort(const std::string& reason, Abort&& abort_fn) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) return false;
    aborted_ = true;
    reason_ = reason;
    abort_fn();
    return true;
  }

  bool aborted() {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborted_;
  }
  std::string reason() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reason_;
  }

 private:
  std::mutex mutex_;
  bool aborted_ = false;
  std::string reason_;
};

// `start` and `end` are callables returning nothing that throw on failure (NCCL's group calls
// wrapped with their error check).
template <class End>
class ScopedGroup {
 public:
  template <class Start>
  ScopedGroup(Start&& start, End end) : end_(std::move(end)) {
    start();
  }
  ScopedGroup(const ScopedGroup&) = delete;
  ScopedGroup& operator=(const ScopedGroup&) = delete;

  // Closes the group, launching what was issued in it; throws what `end` throws.
  void end() {
    open_ = false;
    end_();
  }

  ~ScopedGroup() {
    if (!open_) return;
    try {
      end_();  // closing matters, not its result: the exception in flight says what failed
    } catch (...) {
    }
  }

 private:
  End end_;
  bool open_ = true;
};

template <class Start, class End>
ScopedGroup(Start&&, End) -> ScopedGroup<End>;

}  // namespace mfsdp::detail
