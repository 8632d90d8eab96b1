// The order in which one pipeline rank runs its forward and backward steps, as Megatron-LM's
// schedules run them (megatron/core/pipeline_parallel/schedules.py): the non-interleaved 1F1B of
// forward_backward_pipelining_without_interleaving, and the interleaved 1F1B of
// forward_backward_pipelining_with_interleaving with its helpers get_pp_rank_microbatches (warm-up
// count) and get_schedule_table (micro-batch and model chunk of each step, in groups of
// microbatch_group_size_per_vp_stage). Pure logic: the actions only, no communication; a rank runs
// its list in order, each send not waiting, each receive waiting for its tensor.
#pragma once

#include <cstdint>
#include <vector>

namespace mfsdp {

enum class PipelineStep { kForward, kBackward };

// chunk: model chunk (virtual stage) index on this rank, 0 without interleaving.
struct PipelineAction {
  PipelineStep step;
  int64_t micro_batch;
  int chunk;
};

// Megatron's non-interleaved 1F1B for `stage` of `stages` over `micro_batches`: warm-up forwards
// (min(stages - stage - 1, micro_batches)), the steady pairs (forward of micro-batch i + warm-up,
// then backward of micro-batch i), the cool-down backwards. Throws std::invalid_argument for a stage
// outside [0, stages) or a negative micro-batch count.
std::vector<PipelineAction> one_f_one_b(int stages, int stage, int64_t micro_batches);

// Megatron's interleaved 1F1B (virtual_stages model chunks per rank). Forward step k runs entry k
// of get_schedule_table (micro-batches in groups of microbatch_group_size per chunk, chunk by
// chunk); backward step k runs the same micro-batch on chunk virtual_stages - 1 - (entry k's chunk).
// Warm-up forwards: (stages - stage - 1) * 2 + (virtual_stages - 1) * group size, all of them when
// that reaches micro_batches * virtual_stages; then steady (forward, backward) pairs, then the
// cool-down backwards. microbatch_group_size 0 means `stages` (Megatron's default). virtual_stages
// 1 is Megatron's non-interleaved schedule (arguments.py turns a virtual size of 1 into none).
// Throws std::invalid_argument as Megatron refuses: group size outside [stages, micro_batches],
// micro_batches % group size in (0, stages) -- with the default group size: micro_batches (from
// --global-batch-size / (--micro-batch-size x data-parallel size)) not a multiple of stages -- and
// virtual stages with a single stage.
std::vector<PipelineAction> interleaved_one_f_one_b(int stages, int stage, int virtual_stages, int64_t micro_batches,
                                                    int microbatch_group_size = 0 /*0: stages*/);

// The most micro-batches' activations the schedule keeps at once on this rank (for the memory
// plan): forwards done whose backward has not run, maximum over the schedule. With interleaving it
// counts (micro-batch, chunk) pairs, each one chunk's activations.
int64_t in_flight_peak(const std::vector<PipelineAction>& schedule);

}  // namespace mfsdp
