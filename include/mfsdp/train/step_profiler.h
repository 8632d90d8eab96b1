// Megatron's --profile: iterations --profile-step-start + 1 .. --profile-step-end (1-based, as
// logged; Megatron's schedule of the same flags) on the ranks in --profile-ranks.
//   --use-pytorch-profiler: PyTorch's profiler (Kineto: CPU ops with their input shapes, and on
//     CUDA every kernel, copy and NCCL call) into <tensorboard-dir>/<host>_<pid>.<ms>.pt.trace.json,
//     the file torch.profiler.tensorboard_trace_handler writes; each iteration is a
//     "ProfilerStep#N" range, as torch.profiler's step() makes it.
//   otherwise: nsys's capture range, cudaProfilerStart/Stop, with an NVTX range per op
//     (torch.autograd.profiler.emit_nvtx), for `nsys profile --capture-range=cudaProfilerApi`.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "mfsdp/train/config/sections.h"

namespace at {
class RecordFunction;
}

namespace mfsdp {

class StepProfiler {
 public:
  // Profiles only when profiling.profile and `rank` is one of profiling.profile_ranks; Kineto's
  // trace goes to logging.tensorboard_dir. `device` is the run's (the communicator's), which
  // CUDA's profiler calls and the final sync act on.
  StepProfiler(const ProfilingSection& profiling, const LoggingSection& logging, int64_t rank, c10::Device device,
               std::ostream& log);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Around TrainingRun::step of `iteration` (1-based).
  void before_step(int64_t iteration);
  void after_step(int64_t iteration);
  // The end of the run (`last_iteration`): inside the range, stops and writes what was
  // recorded; before it, says that nothing was profiled.
  void finish(int64_t last_iteration);

 private:
  void start();
  void stop();

  bool enabled_ = false;
  bool kineto_ = false;
  c10::Device device_ = c10::kCPU;
  bool cuda_ = false;
  bool running_ = false;
  int64_t first_ = 0, last_ = 0;  // the 1-based iterations profiled
  int64_t rank_ = 0;
  int64_t recorded_last_ = 0;     // the last iteration inside the range so far
  std::string folder_;
  std::ostream& log_;
  std::unique_ptr<at::RecordFunction> step_range_;
};

}  // namespace mfsdp
