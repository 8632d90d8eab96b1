// mfsdp-pretrain --memory-plan: the per-rank memory of the model the flags describe, planned
// (include/mfsdp/fsdp/memory_plan.h) from the model built with deferred parameters (nothing is
// allocated) and the units its family makes (CausalLM::unit_schedule), then printed; nothing
// trains.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>

#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/memory_plan.h"
#include "mfsdp/models/causal_lm.h"
#include "mfsdp/models/model_spec.h"
#include "mfsdp/train/config/sections.h"
#include "mfsdp/train/parallel_dims.h"

namespace mfsdp {

// How a training step runs the model's units (CausalLM::unit_schedule): `micro_batches` per step
// and the optimizer's states per parameter.
StepShape training_step_shape(const CausalLM& model, const OptimizerSection& optimizer, int64_t micro_batches);

// The plan for one rank of the layout `dims` (parallel_dims of the flags) of the model `config`
// describes, sharded with `shard` (the trainer's options, made without a communicator): FSDP's
// shard group of dp_shard x cp ranks, HSDP's replicas, one tensor-parallel rank's slices and one
// expert-parallel rank's experts; `micro_batches` per step.
// Under pipeline parallelism, of pipeline stage `stage` (its layers, its ends' embedding and
// output layer).
MemoryPlan plan_training_memory(const ModelConfig& config, const OptimizerSection& optimizer, const ParallelDims& dims,
                                const FullyShardOptions& shard, int64_t micro_batches, int stage = 0);

// --memory-plan: plan_training_memory, printed on rank 0 (every rank of a
// simulated run), ending with the line the end of a run prints, "memory per rank (MiB): model
// weights ..., transient peak ...", in the same format, prefixed "planned". Under pipeline
// parallelism every stage's plan, then that line for the stage of `comm`'s rank.
void print_memory_plan(const ModelConfig& config, const OptimizerSection& optimizer, const ParallelDims& dims,
                       const FullyShardOptions& shard, int64_t micro_batches, const std::shared_ptr<Communicator>& comm,
                       std::ostream& log);

}  // namespace mfsdp
