#include "train/model_memory_plan.h"

#include "mfsdp/comm/simulated_comm.h"
#include "train/training_run.h"

namespace mfsdp {

StepShape training_step_shape(const CausalLM& model, const PretrainArgs& args) {
  StepShape step = model.unit_schedule();
  step.micro_batches = args.num_micro_batches;
  step.optimizer_states = args.optimizer == "adam" ? 2 : (args.sgd_momentum != 0 ? 1 : 0);
  return step;
}

MemoryPlan plan_training_memory(const PretrainArgs& args, int world) {
  ModelBuildOptions options;
  options.deferred_init = true;  // full sizes, no memory: only shapes and dtypes are read
  options.init_seed = 0;
  const int ep = static_cast<int>(args.expert_model_parallel_size);
  // Under expert parallelism the model holds one expert-parallel rank's experts (every rank holds
  // as many); the group only says which, and nothing is exchanged.
  if (ep > 1) options.expert_parallel = make_simulated_communicator(0, ep);
  // Tensor parallelism: one TP rank's slices (every TP rank holds as many), sharded by FSDP over
  // the world / TP ranks of its data- and context-parallel group.
  const int tp = static_cast<int>(args.tensor_model_parallel_size);
  if (tp > 1) options.tensor_parallel = make_simulated_communicator(0, tp);
  world /= tp;
  const ModelConfig config = model_config_from_args(args);
  std::shared_ptr<CausalLM> model = config.spec->build(config, options);
  const FullyShardOptions shard = shard_options_from_args(args, nullptr, args.calculate_per_token_loss);
  StepShape step = training_step_shape(*model, args);
  if (ep > 1) step.expert_data_parallel = world / ep;
  // HSDP: shard groups of world / N ranks, N replicas of each (which split the main weights,
  // gradients and optimizer state under --outer-dp-sharding-strategy optim).
  const int instances = static_cast<int>(args.num_distributed_optimizer_instances);
  return plan_memory(*model, step, shard, world / instances, instances);
}

void print_memory_plan(const PretrainArgs& args, const std::shared_ptr<Communicator>& comm, std::ostream& log) {
  const MemoryPlan plan = plan_training_memory(args, comm->size());
  if (comm->rank() != 0 && !is_simulated(*comm)) return;
  log << (is_simulated(*comm) ? " SIMULATED" : "") << " memory plan of rank " << comm->rank() << " of "
      << comm->size() << " (--memory-plan: nothing was allocated or trained)\n";
  // Under TP or CP the table's "per rank of" is the FSDP group's size (DP x CP), not the job's.
  const int64_t tp = args.tensor_model_parallel_size, cp = args.context_parallel_size;
  if (tp * cp > 1)
    log << " mesh: " << comm->size() << " ranks = data-parallel " << comm->size() / (tp * cp)
        << " x context-parallel " << cp << " x tensor-parallel " << tp << "; FSDP shards each tensor-parallel rank's "
        << (tp > 1 ? "slice" : "parameters") << " over its data- x context-parallel group of " << comm->size() / tp
        << " ranks\n";
  log << format_memory_plan(plan);
  log << " planned memory per rank (MiB): model weights " << plan.model_weights / 1048576.0 << ", main weights "
      << plan.main_weights / 1048576.0 << ", main grads " << plan.main_grads / 1048576.0 << ", optimizer state "
      << plan.optimizer_state / 1048576.0 << ", transient peak " << plan.transient_peak / 1048576.0 << "\n";
}

}  // namespace mfsdp
