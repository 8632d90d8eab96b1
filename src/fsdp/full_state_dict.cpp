// Full state dicts gathered one parameter group at a time (include/mfsdp/fsdp/fully_shard.h):
// streamed to a callback, or copied to the host as they come, so that the device never holds
// more than one group's full values, where full_state_dict(bool) keeps every one on the device.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <exception>

#include "fsdp/param_group.h"
#include "fsdp/shard_views.h"
#include "fsdp/unit_state.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp {

void FsdpHandle::for_each_full_tensor(
    const std::function<void(const std::string& name, const at::Tensor& full)>& visit, bool all_ranks) const {
  at::NoGradGuard no_grad;
  // Rank 0 of the job, not of each shard group (HSDP has one per replica), as full_state_dict.
  const FullyShardOptions& o = state().options();
  const bool receives = all_ranks || (o.mesh ? o.mesh->world()->rank() : o.comm->rank()) == 0;
  std::vector<const detail::ParamGroup*> groups;
  for (detail::UnitState* u : state().context().units)
    for (auto& g : u->groups()) groups.push_back(g.get());
  const at::Tensor scratch = detail::full_gather_scratch(groups);
  // A throwing visit must not leave this rank out of the other groups' collectives: the first
  // exception stops the visits and is rethrown once every group is gathered.
  std::exception_ptr failed;
  auto call = [&](const std::string& name, const at::Tensor& full) {
    if (failed) return;
    try {
      visit(name, full);
    } catch (...) {
      failed = std::current_exception();
    }
  };
  for (const detail::ParamGroup* g : groups) {
    std::function<void(size_t, const at::Tensor&)> each;
    if (receives) each = [&](size_t i, const at::Tensor& full) { call(g->params()[i].name, full); };
    detail::for_each_full_parameter(*g, scratch, each);  // collective: every rank takes part
  }
  if (receives)
    for (const auto& [name, b] : buffers()) call(name, b);
  if (failed) std::rethrow_exception(failed);
}

std::map<std::string, at::Tensor> FsdpHandle::full_state_dict(const FullStateDictOptions& options) const {
  std::map<std::string, at::Tensor> out;
  for_each_full_tensor(
      [&](const std::string& name, const at::Tensor& full) {
        // A copy of its own either way: `full` views a buffer the next group overwrites.
        out[name] = options.cpu_offload ? full.to(at::kCPU, full.scalar_type(), /*non_blocking=*/false, /*copy=*/true)
                                        : full.clone();
      },
      options.all_ranks);
  return out;
}

}  // namespace mfsdp
