// Runs one rank's pipeline schedule (pipeline_schedule.h) for one optimizer step: each forward
// receives the previous model chunk's hidden states, runs this rank's chunk and sends its output
// on; each backward receives the gradient of that output, runs the chunk's backward and sends
// the gradient of its input back (Megatron's forward_step / backward_step with its p2p
// communication). Activations and gradients travel on two communicators over the pipeline
// ranks, so that with interleaving (where the last stage also feeds the first) a pair's forward
// and backward messages never have to be matched against each other.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/train/pipeline_schedule.h"

namespace mfsdp {

// One model chunk's forward of one micro-batch. `input` is the previous chunk's hidden states
// (requires grad), undefined for the chunk that holds the embedding. The chunk that holds the
// output layer returns `loss` (what its backward starts from) and `reported` (a scalar on the
// device, summed into the step's loss); every other chunk returns `output`, its hidden states.
struct ChunkOutput {
  at::Tensor output;
  at::Tensor loss;
  at::Tensor reported;
};
using ChunkForward = std::function<ChunkOutput(int chunk, int64_t micro_batch, const at::Tensor& input)>;

struct PipelineLayout {
  // The pipeline ranks (stage s is rank s of both): activations go over `forward`, gradients
  // over `backward` (two communicators over the same ranks).
  std::shared_ptr<Communicator> forward, backward;
  int stages = 1;
  int stage = 0;
  int virtual_stages = 1;  // model chunks per rank; chunk c of stage s is model chunk c * stages + s
  // Every chunk's hidden states between stages, known to both sides without a message (Megatron's
  // fixed tensor_shape: micro-batch x sequence (/ context- and, with sequence parallelism,
  // tensor-parallel ranks) x hidden): [B, T, H] in this repository's order.
  std::vector<int64_t> activation_shape;
  at::TensorOptions activation_options;
  // Megatron's --variable-seq-lengths: the shape is not fixed (the micro-batches' sequences
  // differ in length), so each activation's shape (activation_shape's rank of int64s) goes ahead
  // of it and the receiver reads it before its receive: a host-to-device copy per sent activation
  // and a device-to-host copy per received one. A gradient needs none: it has the shape of the
  // output its receiver sent.
  bool variable_shapes = false;
};

// Where a rank's time in run_pipeline went, on the host: all of it, and the part spent waiting
// for a receive (the pipeline bubble, plus the transfers). On the CPU the host is the device,
// so `waiting / seconds` is the stage's idle fraction; on a GPU the host does not wait for
// receives (the compute stream does), and the split says little.
struct PipelineTimes {
  double seconds = 0;
  double waiting = 0;
};

// Called before each backward with its chunk, whether it is that chunk's last backward of the
// step and whether it is the step's last: the caller turns gradient sync on for what finishes
// there (FsdpHandle::set_requires_gradient_sync), so each unit's gradients are reduced once per
// step. With one chunk: `handle.set_requires_gradient_sync(last_of_chunk)` on the root.
using BeforeBackward = std::function<void(int chunk, bool last_of_chunk, bool last_of_step)>;

// Runs `schedule` on this rank and returns the summed `reported` losses (fp64, 0-dim, on the
// activations' device; zero on ranks without the output layer). A schedule without backward
// steps runs the forwards only, without autograd (validation). A chunk output whose shape or
// dtype differs from the layout's (its rank and dtype with variable_shapes) is a
// std::logic_error naming both (the receiver could not know it). `times`, when given, receives the step's timings.
at::Tensor run_pipeline(const PipelineLayout& layout, const std::vector<PipelineAction>& schedule,
                        const BeforeBackward& before_backward, const ChunkForward& forward,
                        PipelineTimes* times = nullptr);

// Forwards only (validation, no gradients): every micro-batch through every chunk of this stage
// in the schedule's order. Returns the summed `reported` losses as run_pipeline does.
at::Tensor run_forward_pipeline(const PipelineLayout& layout, int64_t micro_batches, const ChunkForward& forward);

// The schedule of `layout` over `micro_batches`: Megatron's 1F1B, or its interleaved 1F1B with
// several chunks per stage (pipeline_schedule.h).
std::vector<PipelineAction> pipeline_schedule(const PipelineLayout& layout, int64_t micro_batches);

}  // namespace mfsdp
