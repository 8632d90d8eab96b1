// shard_model and unit_schedule: the FSDP units of a family's plan (include/mfsdp/models/causal_lm.h).
#include "mfsdp/models/causal_lm.h"

#include <algorithm>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace mfsdp {

StepShape CausalLM::unit_schedule() const {
  StepShape step;
  for (const FsdpUnit& u : parallel_plan_.fsdp_units) step.forward_order.push_back({u.module, u.unshard_in_backward, u.experts});
  step.root_gradients_after = parallel_plan_.root_gradients_after;
  return step;
}

FsdpHandle shard_model(CausalLM& model, const FullyShardOptions& options, const FullyShardOptions* experts_options) {
  const std::vector<FsdpUnit>& units = model.parallel_plan().fsdp_units;
  if (units.empty() || !units.front().module.empty())
    throw std::logic_error("shard_model: the plan's FSDP units must start with the root (\"\")");
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) modules[item.key()] = item.value();
  const auto shard = [&](const FsdpUnit& u) {
    // Under expert parallelism a layer's experts are a unit of their own, over the ranks that
    // hold the same experts; their gradients are still divided by the root's data-parallel size.
    if (u.experts && experts_options == nullptr) return;
    const auto it = modules.find(u.module);
    if (it == modules.end())
      throw std::logic_error("shard_model: the plan's FSDP unit '" + u.module + "' is not a module of the model");
    FsdpHandle handle = fully_shard(*it->second, u.experts ? *experts_options : options);
    if (!u.unshard_in_backward) handle.set_unshard_in_backward(false);
  };
  // fully_shard copies each parameter into its flat buffer, so a deferred layer is materialised
  // right before it becomes a unit; one layer at a time keeps the unsharded model off the rank.
  // A unit inside another is sharded first (fully_shard's ownership rule).
  // The layers are those the plan has units of (a pipeline chunk's own).
  const bool deferred = model.has_deferred();
  std::vector<int64_t> layers;
  for (const FsdpUnit& u : units)
    if (u.layer >= 0 && std::find(layers.begin(), layers.end(), u.layer) == layers.end()) layers.push_back(u.layer);
  for (int64_t i : layers) {
    if (deferred) model.materialize_and_init_layer(i);
    std::vector<const FsdpUnit*> layer;
    for (const FsdpUnit& u : units)
      if (u.layer == i) layer.push_back(&u);
    std::stable_sort(layer.begin(), layer.end(),
                     [](const FsdpUnit* a, const FsdpUnit* b) { return a->module.size() > b->module.size(); });
    for (const FsdpUnit* u : layer) shard(*u);
  }
  if (deferred) model.init_root();
  for (const FsdpUnit& u : units)
    if (u.layer < 0 && !u.module.empty()) shard(u);
  return fully_shard(model, options);
}

}  // namespace mfsdp
