// Which parameters a unit owns and how it groups them (docs/fully_shard.md): a parameter belongs
// to the innermost unit whose module path is a prefix of its name; a unit's own parameters form
// one group per (dtype, requires_grad), groups in order of first appearance, parameters in
// registration order. fully_shard and plan_memory (include/mfsdp/fsdp/memory_plan.h) both go through
// here, so a plan has the groups the runtime builds.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace mfsdp::detail {

using NamedParameter = std::pair<std::string, at::Tensor>;

struct OwnedParameters {
  std::vector<NamedParameter> own;                      // this unit's, a tied tensor once
  std::map<const c10::TensorImpl*, std::string> names;  // every parameter under the module: its first name
};

// `inner_units`: the module paths (relative to `module`) of the units below it. Throws
// std::invalid_argument when one tensor belongs to two units.
OwnedParameters owned_parameters(const torch::nn::Module& module, const std::vector<std::string>& inner_units);

// `own` split into the unit's parameter groups.
std::vector<std::vector<NamedParameter>> parameter_groups(const std::vector<NamedParameter>& own);

// `name` lies under the module path `prefix` ("a.b" is under "a", not under "ab").
bool has_prefix(const std::string& name, const std::string& prefix);

}  // namespace mfsdp::detail
