// The transient peak of a training step, replayed from the runtime's schedule (unit_state.h,
// root_context.cpp) over byte counts instead of buffers, for plan_memory (memory_plan.h).
//
// What the runtime does, from the second step on (the order is known; the first step prefetches
// nothing and keeps fewer units gathered, so its peak is not higher):
//   after the optimizer step  everything resharded; the root's all-gather started
//                             (all_gather_in_start_param_sync)
//   forward                   each unit gathered, the next one prefetched; a child resharded after
//                             its forward unless it is the first child of the backward
//   backward                  the root, then the children in reverse: a unit gathered (unless it
//                             skips that in backward), the next one prefetched, its gradient buffer
//                             made; when its gradients are complete, the reductions in flight are
//                             finished first (freeing their buffers), then its own start (ZeRO-1:
//                             accumulated locally and freed at once), and it is resharded
//   micro-batches before the last (no gradient sync): gradients stay unsharded (or move into an
//                             fp32 accumulator under bf16 compute); the root and the first child
//                             stay gathered for the next forward
// Each change goes through one counter whose peak is taken on every increase, as
// TransientCounter does, so the planned and the measured peaks are the same number.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mfsdp::detail {

// One unit's transient buffers, in bytes (sums over its parameter groups).
struct UnitTransients {
  std::string path;
  int64_t weights = 0;      // all-gathered weights (0 unless the model weights are sharded)
  int64_t gradients = 0;    // the unsharded gradient buffer (0 when frozen)
  int64_t accumulator = 0;  // accumulator of unsynced micro-batches (0 unless compute != grad dtype)
  bool unshard_in_backward = true;
};

struct ScheduleOptions {
  bool prefetch = true;
  bool reshard_after_forward = true;
  bool all_gather_in_start_param_sync = true;
  bool deferred_reduction = false;  // ZeRO-1: replicated main grads under sharded main weights
  int64_t micro_batches = 1;
  int root_gradients_after = -1;    // StepShape::root_gradients_after
};

struct TransientPeak {
  int64_t bytes = 0;
  std::string where;  // the event that reached it
};

// `units`: the root first, then the children in forward order.
TransientPeak plan_transient_peak(const std::vector<UnitTransients>& units, const ScheduleOptions& options);

}  // namespace mfsdp::detail
