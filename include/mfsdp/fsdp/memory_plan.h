// Per-rank memory of a model under fully_shard, planned without allocating anything
// (mfsdp-pretrain --memory-plan, bench/scale_plan.sh; docs/fully_shard.md "Memory plan").
//
//   mfsdp::StepShape step;                       // how a training step runs the units
//   step.forward_order = {{""}, {"embed"}, {"blocks.0"}, {"blocks.1"}, {"head"}};
//   mfsdp::MemoryPlan plan = mfsdp::plan_memory(*model, step, options, /*world=*/512);
//   std::cout << mfsdp::format_memory_plan(plan);
//
// The model may hold deferred parameters (full sizes, no memory: --init-model-with-meta-device):
// only names, shapes, dtypes and requires_grad are read. Each unit's parameter groups and their
// buffers come from the code fully_shard itself runs (src/fsdp/unit_parameters.h: ownership and
// grouping; src/fsdp/group_plan.h: layout, padding, placements, dtypes), so the persistent bytes
// are exactly what FsdpHandle::memory() and the optimizer's state report on every rank (all
// ranks hold the same sizes; padding sits at the end of the last shard but every shard has S
// elements). The transient peak is measured by running the runtime itself (UnitState's
// prefetch, which units stay gathered, the reductions in flight) for two steps over a meta-tensor
// copy of the model and a simulated communicator on the meta device; it is exact when StepShape
// describes the model, and an upper bound when root_gradients_after is left unknown. A 1-D
// shard group (no HSDP mesh), and under expert parallelism the experts' own group
// (PlannedUnit::expert_group).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp {

// A unit as fully_shard makes it: its module path under the root ("" for the root itself) and
// its FsdpHandle::set_unshard_in_backward.
struct PlannedUnit {
  std::string path;
  bool unshard_in_backward = true;
  // Sharded over StepShape::expert_data_parallel ranks instead of every rank, and run inside the
  // forward of the unit listed before it (an MoE layer's experts under expert parallelism).
  bool expert_group = false;
};

// How one training step runs the units.
struct StepShape {
  // The root first, then its child units in the order the forward calls them, each child's
  // forward over before the next begins (a layer stack). Backward runs the children in reverse.
  std::vector<PlannedUnit> forward_order;
  // How many children (in backward order) finish their backward before the root's own
  // parameters have all their gradients; -1: unknown, taken as after all of them (the latest the
  // runtime reduces them), which bounds the peak from above.
  int root_gradients_after = -1;
  // Micro-batches per step; all but the last run without gradient sync (their unsharded
  // gradients, or fp32 accumulators of them, stay alive until the synced backward reduces them).
  int64_t micro_batches = 1;
  // Optimizer state tensors per main-weight element, each in the main weights' dtype (AdamW 2,
  // SGD with momentum 1, plain SGD 0).
  int optimizer_states = 2;
  // Bytes of optimizer state per main-weight element when the states are not all in the main
  // weights' dtype (bf16 moments: 4); 0: optimizer_states x the main weights' element size.
  int optimizer_state_bytes = 0;
  // Ranks of the expert_group units' shard group (world / expert-parallel size); 0: none. Under
  // HSDP (plan_memory's `replicas`) the experts have as many replicas as the dense units.
  int expert_data_parallel = 0;
};

// One parameter group's buffers on one rank, in bytes (sizes in elements).
struct GroupMemory {
  std::string unit;           // module path ("" for the root)
  std::string first_param;    // name of the group's first parameter (relative to the root)
  at::ScalarType compute_dtype = at::kFloat;
  int64_t parameters = 0;     // tensors in the group
  int64_t used = 0;           // elements of the parameters (with row-alignment gaps)
  int64_t padded = 0;         // P: the flat size, padded to world x S
  int64_t shard = 0;          // S: elements per rank
  int64_t model_weights = 0, main_weights = 0, main_grads = 0, optimizer_state = 0;
  int64_t gathered_weights = 0;    // transient: all-gathered [P] weights (sharded model weights only)
  int64_t unsharded_grads = 0;     // transient: the [P] gradient buffer of its backward
  int64_t grad_accumulator = 0;    // transient: [P] micro-batch accumulator (compute != grad dtype)
};

struct MemoryPlan {
  int world = 1;     // ranks of a shard group
  int replicas = 1;  // HSDP copies of each shard group
  FullyShardOptions options;  // what it was planned for (comm unused)
  StepShape step;
  std::vector<GroupMemory> groups;  // units in forward order, each unit's groups in its order
  // Per rank, summed over groups, as FsdpHandle::memory() and the optimizer's state() report.
  int64_t model_weights = 0, main_weights = 0, main_grads = 0, optimizer_state = 0;
  int64_t transient_peak = 0;  // FsdpHandle::memory().transient_peak of a step (from the second on)
  std::string transient_peak_at;  // the event that reaches it ("backward of lm_head")
  int64_t persistent() const { return model_weights + main_weights + main_grads + optimizer_state; }
  int64_t total() const { return persistent() + transient_peak; }
};

// Throws std::invalid_argument for a unit path that is no module under `root`, a root that is
// not first, an expert_group unit first or after another, or without an expert_data_parallel
// size dividing `world`, an HSDP mesh, or a world size < 1. `world`: the ranks a shard group
// holds; `replicas`: HSDP's copies of each shard group (options.mesh stays unset: the plan makes
// a simulated [replicas, world] mesh, and [replicas, expert_data_parallel] for the experts), which
// hold less only under outer_strategy kOptim.
MemoryPlan plan_memory(const torch::nn::Module& root, const StepShape& step, const FullyShardOptions& options,
                       int world, int replicas = 1);

// Every group's buffers (a table, one line per group), then the per-rank totals and where the
// transient peak is reached.
std::string format_memory_plan(const MemoryPlan& plan);

}  // namespace mfsdp
