// What the optimizer and checkpoints see of a ParamGroup's buffers, as FSDP2's FSDPParam views
// them: this rank's shard of each parameter (LocalShard: checkpoint boxes), the optimizer's flat
// shard with its weight-decay segments, and full values gathered from, or loaded into, the shards.
// The group keeps its buffers and their lifecycle (param_group.h); these only read them, or write
// through ParamGroup::load_values.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "fsdp/param_group.h"
#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp::detail {

// The optimizer's view: main weights and main grads of this rank's region, and each parameter's
// segment in it (weight decay on 2-D and larger parameters only, Megatron's rule). Empty when
// the group is frozen.
OptimizerShard optimizer_shard(const ParamGroup& group);
// Each parameter's part of this rank's main weights (model weights when frozen), with where it
// sits in the full parameter and which replica holds it.
std::vector<LocalShard> local_shards(const ParamGroup& group);
// Full value of every parameter, gathered from the main weights (or model weights if frozen),
// in the parameters' original dtype. Collective over the shard group when sharded.
std::vector<at::Tensor> gather_full_parameters(const ParamGroup& group);
// Bytes for_each_full_parameter gathers the group into (0 when its source is not sharded).
int64_t full_gather_bytes(const ParamGroup& group);
// One byte buffer, on the groups' device, that any of their gathers fits in (undefined when no
// group is sharded): reused group after group, so a collective that still holds the previous
// group's output until its next launch (the NCCL communicator's pending work) costs nothing more.
at::Tensor full_gather_scratch(const std::vector<const ParamGroup*>& groups);
// Gathers the group's source into `scratch` (a byte tensor of at least full_gather_bytes on the
// source's device; unused when 0) and calls visit(i, full value of parameter i) in group order,
// in the original dtype: a view of `scratch` or of the unsharded source when the dtypes match,
// so valid only until `scratch` is reused. A null `visit` only takes part in the collective.
void for_each_full_parameter(const ParamGroup& group, const at::Tensor& scratch,
                             const std::function<void(size_t, const at::Tensor&)>& visit);
// Copies full values (in group order) into this rank's shards and the model weights.
void load_full_parameters(ParamGroup& group, const std::vector<at::Tensor>& values);

}  // namespace mfsdp::detail
