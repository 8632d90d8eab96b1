#include "train/llama_memory_plan.h"

#include "mfsdp/comm/simulated_comm.h"
#include "train/training_run.h"

namespace mfsdp {

StepShape llama_step_shape(const LlamaForCausalLMImpl& model, const PretrainArgs& args) {
  StepShape step;
  const bool untied = static_cast<bool>(model.lm_head);
  step.forward_order.push_back({""});
  if (untied) step.forward_order.push_back({"model.embed_tokens", /*unshard_in_backward=*/false});
  for (int64_t i = 0; i < model.model->num_layers(); ++i)
    step.forward_order.push_back({"model.layers." + std::to_string(i)});
  if (untied) step.forward_order.push_back({"lm_head"});
  step.root_gradients_after = untied ? 1 : static_cast<int>(step.forward_order.size()) - 1;
  step.micro_batches = args.num_micro_batches;
  step.optimizer_states = args.optimizer == "adam" ? 2 : (args.sgd_momentum != 0 ? 1 : 0);
  return step;
}

MemoryPlan plan_llama_memory(const PretrainArgs& args, int world) {
  LlamaOptions options;
  options.deferred_init = true;  // full sizes, no memory: only shapes and dtypes are read
  options.init_seed = 0;
  LlamaForCausalLM model(llama_config_from_args(args), options);
  const FullyShardOptions shard = shard_options_from_args(args, nullptr, args.calculate_per_token_loss);
  return plan_memory(*model, llama_step_shape(*model, args), shard, world);
}

void print_memory_plan(const PretrainArgs& args, const std::shared_ptr<Communicator>& comm, std::ostream& log) {
  const MemoryPlan plan = plan_llama_memory(args, comm->size());
  if (comm->rank() != 0 && !is_simulated(*comm)) return;
  log << (is_simulated(*comm) ? " SIMULATED" : "") << " memory plan of rank " << comm->rank() << " of "
      << comm->size() << " (--memory-plan: nothing was allocated or trained)\n"
      << format_memory_plan(plan);
  log << " planned memory per rank (MiB): model weights " << plan.model_weights / 1048576.0 << ", main weights "
      << plan.main_weights / 1048576.0 << ", main grads " << plan.main_grads / 1048576.0 << ", optimizer state "
      << plan.optimizer_state / 1048576.0 << ", transient peak " << plan.transient_peak / 1048576.0 << "\n";
}

}  // namespace mfsdp
