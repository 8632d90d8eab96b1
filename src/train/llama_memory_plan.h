// mfsdp-pretrain --memory-plan: the per-rank memory of the Llama the flags describe, planned
// (include/mfsdp/fsdp/memory_plan.h) from the model built with deferred parameters (nothing is
// allocated) and the units shard_llama makes, then printed; nothing trains.
#pragma once

#include <memory>
#include <ostream>

#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/memory_plan.h"
#include "mfsdp/models/llama.h"
#include "train/pretrain_args.h"

namespace mfsdp {

// How a training step runs the units build_sharded_llama and shard_llama_root
// (src/models/llama.cpp) make: the forward enters the root, then embed_tokens (a unit when
// untied, not gathered for its backward), every decoder layer, lm_head (a unit when untied). The
// root's own gradients (the final norm) are complete right after lm_head's backward when untied;
// tied, the root also holds the embedding, whose gradient comes last. Tests compare plans with
// what runs (tests/dist/memory_plan_test.cpp), so the two cannot part silently.
StepShape llama_step_shape(const LlamaForCausalLMImpl& model, const PretrainArgs& args);

// The plan for `world` ranks of the model and flags in `args` (validated).
MemoryPlan plan_llama_memory(const PretrainArgs& args, int world);

// --memory-plan: the plan for comm's world size, printed on rank 0 (every rank of a simulated
// run), ending with the line the end of a run prints, "memory per rank (MiB): model weights ...,
// transient peak ...", in the same format, prefixed "planned".
void print_memory_plan(const PretrainArgs& args, const std::shared_ptr<Communicator>& comm, std::ostream& log);

}  // namespace mfsdp
