// The one training loop of mfsdp-pretrain, mfsdp-sft and mfsdp-grpo (docs/design.md, "Trainers"),
// as TorchTitan's Trainer.train: the iterations from the resumed one on, a log step every
// --log-interval, validation every --eval-interval, checkpoints and --exit-interval through
// TrainingRun::after_iteration, the last checkpoint at the end. A trainer supplies its data and
// loss through one override point, forward_backward (MicroBatchTrainer; GRPO, whose iteration is
// several stages and optimizer steps, supplies train_step), its log line, and its validation.
//
// Nothing in a step is read on the host: each step's loss and gradient norm stay tensors on the
// device until a log step reads the window's values in one copy (read_on_host, which counts its
// calls: the seam the tests use). --check-for-nan-in-loss-and-grad reads them with its flags
// once per step instead (TrainingRun::step), and the log step then reads nothing more.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "mfsdp/train/training_run.h"

namespace mfsdp {

// `values` (each of one element, any device and dtype) as fp64 on the host, in one copy.
// Every call adds one to host_reads().
std::vector<double> read_on_host(const std::vector<at::Tensor>& values);
// The number of read_on_host calls in this process so far (a test seam).
int64_t host_reads();

// A log step's view of the steps since the previous log step.
struct LogWindow {
  int64_t iteration = 0;        // this log step
  int64_t steps = 0;            // steps in the window (this one included)
  int64_t resumed_after = 0;    // the iteration the run resumed after (0: a new run)
  double seconds = 0;           // wall time of the window's steps
  double elapsed = 0;           // wall time since the loop started
  std::vector<double> losses;   // each step's loss as TrainingRun::step summed it on this rank
  double grad_norm = 0;         // the last step's global gradient norm
  TrainingRun::StepStats last;  // the last step's statistics (lr, norms, MoE)
};

class Trainer {
 public:
  explicit Trainer(TrainingRun& run) : run_(run) {}
  virtual ~Trainer() = default;

  // One iteration: its optimizer step(s). Returns the (last) step's statistics.
  virtual TrainingRun::StepStats train_step(int64_t iteration) = 0;
  // The log line and the metrics record of a log step. Collective (every rank calls it).
  virtual void log(const LogWindow& window) = 0;
  // Validation after `iteration` (every --eval-interval). Collective.
  virtual void evaluate(int64_t iteration) = 0;

  // Runs the iterations after `resume` up to --train-iters (see the file comment). Returns the
  // last iteration: the one --exit-interval stopped at (`stopped` set), else the last one trained
  // (or the checkpoint's, when it reaches --train-iters already), whose checkpoint is then
  // saved. Collective.
  struct Outcome {
    int64_t last = 0;
    bool stopped = false;
  };
  Outcome train(const ResumePoint& resume);

 protected:
  TrainingRun& run_;
};

// A trainer whose iteration is one optimizer step over --global-batch-size's micro-batches
// (mfsdp-pretrain, mfsdp-sft): it supplies forward_backward, TorchTitan's override point.
class MicroBatchTrainer : public Trainer {
 public:
  using Trainer::Trainer;
  // One micro-batch of `iteration`: its forward and backward; returns the loss it reports on
  // this rank, a scalar on the device (not read: TrainingRun::step sums them there).
  virtual at::Tensor forward_backward(int64_t iteration, int64_t micro_batch) = 0;
  // Under pipeline parallelism (TrainingRun::pipeline_step): this stage's forward of model chunk
  // `chunk` for one micro-batch of `iteration`, from `input` (the previous stage's hidden
  // states; undefined on the first stage); the last stage returns the loss. The default refuses:
  // a trainer that runs pipelines overrides it.
  virtual ChunkOutput forward_chunk(int64_t iteration, int chunk, int64_t micro_batch, const at::Tensor& input);
  TrainingRun::StepStats train_step(int64_t iteration) override;
};

}  // namespace mfsdp
