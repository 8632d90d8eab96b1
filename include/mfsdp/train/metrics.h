// Training metrics: the --metrics-file JSON-lines contract (docs/pretrain.md), Megatron's
// FLOP count, and the loss-curve picture written at the end of training.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "mfsdp/train/pretrain_args.h"

namespace mfsdp {

struct IterationRecord {
  int64_t iteration = 0;
  int64_t consumed_samples = 0;
  double lm_loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double iter_time_s = 0;
  double tokens_per_sec = 0;
  double tflops_per_rank = 0;
  int64_t mem_bytes = 0;
  bool eval = false;
  // More values by name (mfsdp-sft's and mfsdp-grpo's metrics), written after the fixed ones.
  std::vector<std::pair<std::string, double>> extra;
};

// Appends one JSON object per record to `path` (created, or truncated unless `append`); no-op
// when path is empty.
class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path, bool append = false);
  void write(const IterationRecord& r);

 private:
  std::ofstream out_;
};

// Peak resident memory of this process (bytes).
int64_t peak_rss_bytes();
// What mem_bytes reports for a run on `device`: the process's peak RSS on the CPU; on a CUDA
// device the caching allocator's peak of allocated bytes there (host RSS says nothing of it).
int64_t peak_memory_bytes(const c10::Device& device);

// An SVG line chart of training (and evaluation) lm_loss against iteration, titled `title`.
void write_loss_curve_svg(const std::string& path, const std::vector<IterationRecord>& records,
                          const std::string& title = "lm loss");
// The same chart of any series: (iteration, value) points, train in blue and validation in red.
using CurvePoints = std::vector<std::pair<double, double>>;
void write_curve_svg(const std::string& path, const std::string& title, const CurvePoints& train,
                     const CurvePoints& validation);

}  // namespace mfsdp
