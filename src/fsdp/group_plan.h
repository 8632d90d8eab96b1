// GroupPlan: a parameter group's buffers as fully_shard makes them, decided from the parameters'
// shapes and dtype and the options alone (docs/fully_shard.md): the flat layout (packing,
// padding, shard size), each role's placement and dtype, and whether the main weights have memory
// of their own. ParamGroup allocates exactly what its plan says; plan_memory
// (include/mfsdp/fsdp/memory_plan.h) adds plans up without allocating anything, for jobs far larger
// than the machine it runs on. One function decides both, so the two cannot drift apart.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "fsdp/flat_buffer.h"
#include "fsdp/layout.h"
#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp::detail {

struct GroupPlan {
  FlatLayout layout;          // P = layout.total() padded elements, S = layout.shard per rank
  RolePlacements placement;   // the strategy's table (flat_buffer.h)
  at::ScalarType compute_dtype = at::kFloat;  // model weights, unsharded weights and gradients
  at::ScalarType main_dtype = at::kFloat;     // main weights (and optimizer state)
  at::ScalarType grad_dtype = at::kFloat;     // main grads
  bool requires_grad = true;  // frozen groups have no main weights, main grads or optimizer state
  // ZeRO-1 under HSDP: the reducer keeps this rank's region as of the last sync, [S] more main-grad
  // bytes (GradientReducer's `synced`).
  bool keeps_synced_region = false;

  // Elements a buffer of this placement holds on one rank: S sharded, S / R outer-sharded, P
  // replicated.
  int64_t elements(Placement p) const { return elements_of(layout, p); }
  // Main weights in the compute dtype are the model weights' memory (all of it, or this rank's
  // region of it); only another dtype (fp32 main weights under bf16 compute) needs its own.
  bool main_weights_own_memory() const { return requires_grad && main_dtype != compute_dtype; }

  // Persistent bytes per rank, as FsdpHandle::memory() reports them.
  int64_t model_weight_bytes() const;
  int64_t main_weight_bytes() const;  // 0 when sharing the model weights' memory
  int64_t main_grad_bytes() const;
  // Elements of the main weights (shared or not): what each optimizer state tensor holds.
  int64_t main_weight_elements() const;
  // Transient bytes: one [P] compute-dtype buffer, the gathered weights (ZeRO-3) or the unsharded
  // gradients; and the [P] main-grad-dtype accumulator of micro-batches without gradient sync
  // (only when compute and main-grad dtypes differ).
  int64_t unsharded_bytes() const;
  int64_t accumulator_bytes() const;
};

// The plan of a group of parameters with these shapes (in packing order), all of
// `original_dtype`, sharded over `world` ranks, each shard held by `replicas` HSDP replicas
// (which split it again under options.outer_strategy kOptim).
GroupPlan plan_group(const std::vector<std::vector<int64_t>>& shapes, at::ScalarType original_dtype,
                     bool requires_grad, const FullyShardOptions& options, int world, int replicas = 1);

}  // namespace mfsdp::detail
