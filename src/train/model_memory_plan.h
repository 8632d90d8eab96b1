// mfsdp-pretrain --memory-plan: the per-rank memory of the model the flags describe, planned
// (include/mfsdp/fsdp/memory_plan.h) from the model built with deferred parameters (nothing is
// allocated) and the units its family makes (CausalLM::unit_schedule), then printed; nothing
// trains.
#pragma once

#include <memory>
#include <ostream>

#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/memory_plan.h"
#include "mfsdp/models/causal_lm.h"
#include "train/pretrain_args.h"

namespace mfsdp {

// How a training step runs the model's units (CausalLM::unit_schedule), with the flags'
// micro-batches and optimizer states.
StepShape training_step_shape(const CausalLM& model, const PretrainArgs& args);

// The plan for `world` ranks (the job's; under tensor parallelism FSDP shards over world / TP) of
// the model and flags in `args` (validated).
MemoryPlan plan_training_memory(const PretrainArgs& args, int world);

// --memory-plan: the plan for comm's world size, printed on rank 0 (every rank of a simulated
// run), ending with the line the end of a run prints, "memory per rank (MiB): model weights ...,
// transient peak ...", in the same format, prefixed "planned".
void print_memory_plan(const PretrainArgs& args, const std::shared_ptr<Communicator>& comm, std::ostream& log);

}  // namespace mfsdp
