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

namespace mfsdp {

// How a training step runs the model's units (CausalLM::unit_schedule): `micro_batches` per step
// and the optimizer's states per parameter.
StepShape training_step_shape(const CausalLM& model, const OptimizerSection& optimizer, int64_t micro_batches);

// The plan for `world` ranks of the model `config` describes, sharded with `shard` (the
// trainer's options, made without a communicator), under the validated sections' expert, tensor
// and HSDP layout (under tensor parallelism FSDP shards over world / TP), `micro_batches` per step.
MemoryPlan plan_training_memory(const ModelConfig& config, const MoeSection& moe, const OptimizerSection& optimizer,
                                const FsdpSection& fsdp, const FullyShardOptions& shard, int64_t micro_batches,
                                int world);

// --memory-plan: plan_training_memory for comm's world size, printed on rank 0 (every rank of a
// simulated run), ending with the line the end of a run prints, "memory per rank (MiB): model
// weights ..., transient peak ...", in the same format, prefixed "planned".
void print_memory_plan(const ModelConfig& config, const MoeSection& moe, const OptimizerSection& optimizer,
                       const FsdpSection& fsdp, const FullyShardOptions& shard, int64_t micro_batches,
                       const std::shared_ptr<Communicator>& comm, std::ostream& log);

}  // namespace mfsdp
