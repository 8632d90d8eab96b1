#include "mfsdp/train/step_profiler.h"

#include <unistd.h>

#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <stdexcept>

#ifdef MFSDP_WITH_CUDA
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>
#endif

namespace mfsdp {
namespace {

namespace prof = torch::profiler::impl;

// torch.profiler.tensorboard_trace_handler's name: <host>_<pid>.<milliseconds>.pt.trace.json.
std::string trace_file_name() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch()).count();
  return std::string(host) + "_" + std::to_string(getpid()) + "." + std::to_string(ms) + ".pt.trace.json";
}

#ifdef MFSDP_WITH_CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("--profile: ") + what + ": " + cudaGetErrorString(e));
}
#endif

}  // namespace

StepProfiler::StepProfiler(const ProfilingSection& profiling, const LoggingSection& logging, int64_t rank,
                           c10::Device device, std::ostream& log)
    : enabled_(profiling.profile && std::find(profiling.profile_ranks.begin(), profiling.profile_ranks.end(), rank) !=
                                        profiling.profile_ranks.end()),
      kineto_(profiling.use_pytorch_profiler),
      device_(device),
      cuda_(device.is_cuda()),
      first_(profiling.profile_step_start + 1),
      last_(profiling.profile_step_end),
      rank_(rank),
      folder_(logging.tensorboard_dir),
      log_(log) {
  if (enabled_ && !kineto_ && !cuda_)
    throw std::invalid_argument("--profile: without --use-pytorch-profiler it is nsys's CUDA capture range, and this "
                                "run is on the CPU; add --use-pytorch-profiler --tensorboard-dir DIR");
}

StepProfiler::~StepProfiler() {
  step_range_.reset();
  if (running_) {
    try {
      torch::autograd::profiler::disableProfiler();
    } catch (...) {  // unwinding already: the run's own error is the one to report
    }
  }
}

void StepProfiler::before_step(int64_t iteration) {
  if (!enabled_ || iteration < first_ || iteration > last_) return;
  if (!running_) start();
  if (kineto_) {
    step_range_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (step_range_->isActive()) step_range_->before("ProfilerStep#" + std::to_string(iteration));
  }
  recorded_last_ = iteration;
}

void StepProfiler::after_step(int64_t iteration) {
  step_range_.reset();  // ends the ProfilerStep range
  if (running_ && iteration >= last_) stop();
}

void StepProfiler::finish(int64_t last_iteration) {
  step_range_.reset();
  if (running_) {
    stop();
  } else if (enabled_ && recorded_last_ == 0) {
    // Before the range, or (resumed with --load) after it.
    log_ << " rank " << rank_ << ": --profile: nothing profiled, the run ended at iteration " << last_iteration
         << (last_iteration < first_ ? ", before iteration " + std::to_string(first_) + " (--profile-step-start " +
                                          std::to_string(first_ - 1) + ")"
                                    : " and ran none of iterations " + std::to_string(first_) + ".." +
                                          std::to_string(last_))
         << "\n";
  }
}

void StepProfiler::start() {
  using torch::autograd::profiler::enableProfiler;
  if (kineto_) {
    // Megatron's record_shapes=True; its with_stack=True records Python stacks, which a C++
    // program has none of.
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
    std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
    if (cuda_) activities.insert(prof::ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(config, activities);
    enableProfiler(config, activities);
  } else {
#ifdef MFSDP_WITH_CUDA
    // CUDA's runtime calls act on the thread's current device: make it the run's.
    const c10::DeviceGuard guard(device_);
    cuda_check(cudaProfilerStart(), "cudaProfilerStart");
#endif
    enableProfiler(prof::ProfilerConfig(prof::ProfilerState::NVTX, /*report_input_shapes=*/true),
                   {prof::ActivityType::CPU});
  }
  running_ = true;
}

void StepProfiler::stop() {
  running_ = false;
#ifdef MFSDP_WITH_CUDA
  // The step's kernels may still run; torch.profiler waits for them the same way before it stops.
  if (cuda_) {
    const c10::DeviceGuard guard(device_);
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
#endif
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
  const std::string range = "iterations " + std::to_string(first_) + ".." + std::to_string(recorded_last_);
  if (!kineto_) {
#ifdef MFSDP_WITH_CUDA
    const c10::DeviceGuard guard(device_);
    cuda_check(cudaProfilerStop(), "cudaProfilerStop");
#endif
    log_ << " rank " << rank_ << ": nsys capture range of " << range << " ended\n";
    return;
  }
  std::error_code ec;
  std::filesystem::create_directories(folder_, ec);
  if (ec) throw std::runtime_error("--tensorboard-dir: cannot create '" + folder_ + "': " + ec.message());
  const std::string path = folder_ + "/" + trace_file_name();
  result->save(path);
  log_ << " rank " << rank_ << ": profile of " << range << " written to " << path << "\n";
}

}  // namespace mfsdp
