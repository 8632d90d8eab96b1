#include "mfsdp/train/train_loop.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>

namespace mfsdp {
namespace {

std::atomic<int64_t> g_host_reads{0};

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

std::vector<double> read_on_host(const std::vector<at::Tensor>& values) {
  ++g_host_reads;
  std::vector<at::Tensor> flat;
  for (const at::Tensor& v : values) flat.push_back(v.detach().reshape({-1}).to(at::kDouble));
  const at::Tensor host = at::cat(flat).cpu();
  const double* p = host.data_ptr<double>();
  return std::vector<double>(p, p + host.numel());
}

int64_t host_reads() { return g_host_reads.load(); }

TrainingRun::StepStats MicroBatchTrainer::train_step(int64_t iteration) {
  if (run_.pipeline().forward)
    return run_.pipeline_step(iteration, run_.args().num_micro_batches,
                              [&](int chunk, int64_t m, const at::Tensor& input) {
                                return forward_chunk(iteration, chunk, m, input);
                              });
  return run_.step(iteration, run_.args().num_micro_batches,
                   [&](int64_t m) { return forward_backward(iteration, m); });
}

ChunkOutput MicroBatchTrainer::forward_chunk(int64_t, int, int64_t, const at::Tensor&) {
  throw std::logic_error("this trainer does not run under pipeline parallelism");
}

Trainer::Outcome Trainer::train(const ResumePoint& resume) {
  const PretrainArgs& a = run_.args();
  const auto start = Clock::now();
  auto window_start = start;
  // The window's steps: their losses and norms stay on the device until its log step, unless
  // the step read them already (the NaN check).
  std::vector<TrainingRun::StepStats> window;
  int64_t it = resume.iteration + 1;
  if (it > a.train_iters && run_.prints())
    run_.log() << " checkpoint iteration " << resume.iteration << " reaches --train-iters " << a.train_iters
               << ": nothing to train\n";
  for (; it <= a.train_iters; ++it) {
    window.push_back(train_step(it));
    if (it % a.log_interval == 0 || it == a.train_iters) {
      LogWindow w;
      w.iteration = it;
      w.steps = static_cast<int64_t>(window.size());
      w.resumed_after = resume.iteration;
      const auto now = Clock::now();
      w.seconds = seconds_between(window_start, now);
      w.elapsed = seconds_between(start, now);
      // One copy for every value the steps did not read: the losses, then the last norm.
      std::vector<at::Tensor> unread;
      for (const TrainingRun::StepStats& s : window)
        if (!s.loss_on_host && s.loss.defined()) unread.push_back(s.loss);
      const TrainingRun::StepStats& last = window.back();
      const bool norm_unread = !last.grad_norm_on_host && last.grad_norm.defined();
      if (norm_unread) unread.push_back(last.grad_norm);
      const std::vector<double> read = unread.empty() ? std::vector<double>{} : read_on_host(unread);
      size_t next = 0;
      for (const TrainingRun::StepStats& s : window)
        if (s.loss_on_host) w.losses.push_back(*s.loss_on_host);
        else if (s.loss.defined()) w.losses.push_back(read[next++]);
      w.grad_norm = last.grad_norm_on_host ? *last.grad_norm_on_host : norm_unread ? read[next] : 0.0;
      w.last = last;
      log(w);
      window.clear();
      window_start = Clock::now();
    }
    if (it % a.eval_interval == 0 && it != a.train_iters) evaluate(it);
    if (run_.after_iteration(it)) return {it, /*stopped=*/true};
  }
  const int64_t last = std::max(a.train_iters, resume.iteration);
  run_.finish_checkpoint(last);
  return {last, /*stopped=*/false};
}

}  // namespace mfsdp
