// The communication thread of a CPU communicator: runs submitted collectives one at a time in
// submission order (the order every rank issued them in), so the caller's thread keeps computing
// while they progress. Each submission returns a Work handle completed by the thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "mfsdp/comm/comm.h"

namespace mfsdp {

// A Work completed by another thread; wait() blocks on a condition variable.
class ThreadWork : public Work {
 public:
  void wait() override;
  bool is_completed() override;
  // Called once by the thread that ran the collective; `error` is null on success.
  void finish(std::exception_ptr error);

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;            // guarded by mutex_
  std::exception_ptr error_;     // guarded by mutex_
};

class CommThread {
 public:
  CommThread();
  // Drains the queue: already submitted work still runs, so every rank stays in step.
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  // Queues `job`; the returned handle completes when it returned or threw.
  std::shared_ptr<ThreadWork> submit(std::function<void()> job);

  // Runs `job` on the calling thread when nothing is queued or running (saving two thread
  // hand-offs, which dominate small synchronous collectives), else queues it behind the
  // pending work and waits. Either way jobs run one at a time in submission order.
  void run(std::function<void()> job);

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::pair<std::shared_ptr<ThreadWork>, std::function<void()>>> queue_;  // guarded
  bool stopping_ = false;                                                             // guarded
  bool busy_ = false;  // a job is running (on either thread); guarded by mutex_
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace mfsdp
