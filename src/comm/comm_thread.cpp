#include "comm/comm_thread.h"

#include <torch/csrc/autograd/grad_mode.h>

namespace mfsdp {

void ThreadWork::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool ThreadWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void ThreadWork::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  done_cv_.notify_all();
}

CommThread::CommThread() : thread_([this] { loop(); }) {}

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  thread_.join();
}

std::shared_ptr<ThreadWork> CommThread::submit(std::function<void()> job) {
  auto work = std::make_shared<ThreadWork>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.emplace_back(work, std::move(job));
  }
  queue_cv_.notify_one();
  return work;
}

void CommThread::run(std::function<void()> job) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!busy_ && queue_.empty()) {
      busy_ = true;
      lock.unlock();
      struct Done {
        CommThread* self;
        ~Done() {
          {
            std::lock_guard<std::mutex> lock(self->mutex_);
            self->busy_ = false;
          }
          self->queue_cv_.notify_all();  // the thread may be waiting to start queued work
        }
      } done{this};
      at::NoGradGuard no_grad;
      job();
      return;
    }
  }
  submit(std::move(job))->wait();
}

void CommThread::loop() {
  // Collectives write into gradient and parameter buffers; they are not part of any graph.
  at::NoGradGuard no_grad;
  for (;;) {
    std::pair<std::shared_ptr<ThreadWork>, std::function<void()>> item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queue_cv_.wait(lock, [&] { return (stopping_ || !queue_.empty()) && !busy_; });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    std::exception_ptr error;
    try {
      item.second();
    } catch (...) {
      error = std::current_exception();
    }
    // Drop the job (and the tensors it holds) before anyone can see the work finished, so a
    // waiter that frees a buffer really frees it.
    item.second = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
    }
    item.first->finish(error);
  }
}

}  // namespace mfsdp
