#include "fsdp/group_plan.h"

#include <c10/core/ScalarType.h>

namespace mfsdp::detail {

GroupPlan plan_group(const std::vector<std::vector<int64_t>>& shapes, at::ScalarType original,
                     bool requires_grad, const FullyShardOptions& options, int world, int replicas) {
  const MixedPrecisionPolicy& mp = options.mixed_precision;
  GroupPlan p;
  const int outer = options.outer_strategy == ShardingStrategy::kOptim ? replicas : 1;
  p.layout = FlatLayout::build(shapes, world, options.align_rows, 0.25, outer);
  p.placement = placements_of(options.strategy, outer > 1 ? options.outer_strategy : ShardingStrategy::kNoShard);
  // Integer parameters keep their dtype in every role.
  p.compute_dtype = mp.param_dtype && at::isFloatingType(original) ? *mp.param_dtype : original;
  p.main_dtype = at::isFloatingType(original) ? mp.main_params_dtype : original;
  p.grad_dtype = mp.main_grads_dtype;
  p.requires_grad = requires_grad;
  p.keeps_synced_region = replicas > 1 && p.placement.main_grads == Placement::kReplicated &&
                          p.placement.main_weights == Placement::kSharded;
  return p;
}

int64_t GroupPlan::model_weight_bytes() const {
  return elements(placement.model_weights) * static_cast<int64_t>(c10::elementSize(compute_dtype));
}

int64_t GroupPlan::main_weight_bytes() const {
  if (!main_weights_own_memory()) return 0;
  return elements(placement.main_weights) * static_cast<int64_t>(c10::elementSize(main_dtype));
}

int64_t GroupPlan::main_grad_bytes() const {
  if (!requires_grad) return 0;
  const int64_t synced = keeps_synced_region ? layout.shard : 0;
  return (elements(placement.main_grads) + synced) * static_cast<int64_t>(c10::elementSize(grad_dtype));
}

int64_t GroupPlan::main_weight_elements() const { return requires_grad ? elements(placement.main_weights) : 0; }

int64_t GroupPlan::unsharded_bytes() const {
  return layout.total() * static_cast<int64_t>(c10::elementSize(compute_dtype));
}

int64_t GroupPlan::accumulator_bytes() const {
  if (!requires_grad || compute_dtype == grad_dtype) return 0;
  return layout.total() * static_cast<int64_t>(c10::elementSize(grad_dtype));
}

}  // namespace mfsdp::detail
