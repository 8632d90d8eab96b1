// shard_model: every family's units in the order its CausalLM gives (include/mfsdp/models/causal_lm.h).
#include "mfsdp/models/causal_lm.h"

namespace mfsdp {

FsdpHandle shard_model(CausalLM& model, const FullyShardOptions& options, const FullyShardOptions* experts_options) {
  // fully_shard copies each parameter into its flat buffer, so a deferred layer is materialised
  // right before it becomes a unit; one layer at a time keeps the unsharded model off the rank.
  const bool deferred = model.has_deferred();
  for (int64_t i = 0; i < model.num_layers(); ++i) {
    if (deferred) model.materialize_and_init_layer(i);
    // Under expert parallelism a layer's experts are a unit of their own, over the ranks that
    // hold the same experts; their gradients are still divided by the root's data-parallel size.
    if (torch::nn::Module* experts = model.expert_unit(i); experts != nullptr && experts_options != nullptr)
      fully_shard(*experts, *experts_options);
    fully_shard(model.layer_unit(i), options);
  }
  if (deferred) model.init_root();
  return model.shard_root(options);
}

}  // namespace mfsdp
