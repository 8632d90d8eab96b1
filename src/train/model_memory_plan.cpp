#include "mfsdp/train/model_memory_plan.h"

#include "mfsdp/comm/simulated_comm.h"

namespace mfsdp {

StepShape training_step_shape(const CausalLM& model, const OptimizerSection& optimizer, int64_t micro_batches) {
  StepShape step = model.unit_schedule();
  step.micro_batches = micro_batches;
  step.optimizer_states = optimizer.optimizer == "adam" ? 2 : (optimizer.sgd_momentum != 0 ? 1 : 0);
  return step;
}

MemoryPlan plan_training_memory(const ModelConfig& config, const MoeSection& moe, const OptimizerSection& optimizer,
                                const FsdpSection& fsdp, const FullyShardOptions& shard, int64_t micro_batches,
                                int world) {
  ModelBuildOptions options;
  options.deferred_init = true;  // full sizes, no memory: only shapes and dtypes are read
  options.init_seed = 0;
  const int ep = static_cast<int>(moe.expert_model_parallel_size);
  // Under expert parallelism the model holds one expert-parallel rank's experts (every rank holds
  // as many); the group only says which, and nothing is exchanged.
  if (ep > 1) options.expert_parallel = make_simulated_communicator(0, ep);
  // Tensor parallelism: one TP rank's slices (every TP rank holds as many), sharded by FSDP over
  // the world / TP ranks of its data- and context-parallel group.
  const int tp = static_cast<int>(fsdp.tensor_model_parallel_size);
  if (tp > 1) options.tensor_parallel = make_simulated_communicator(0, tp);
  world /= tp;
  std::shared_ptr<CausalLM> model = config.spec->build(config, options);
  StepShape step = training_step_shape(*model, optimizer, micro_batches);
  if (ep > 1) step.expert_data_parallel = world / ep;
  // HSDP: shard groups of world / N ranks, N replicas of each (which split the main weights,
  // gradients and optimizer state under --outer-dp-sharding-strategy optim).
  const int instances = static_cast<int>(fsdp.num_distributed_optimizer_instances);
  return plan_memory(*model, step, shard, world / instances, instances);
}

void print_memory_plan(const ModelConfig& config, const MoeSection& moe, const OptimizerSection& optimizer,
                       const FsdpSection& fsdp, const FullyShardOptions& shard, int64_t micro_batches,
                       const std::shared_ptr<Communicator>& comm, std::ostream& log) {
  const MemoryPlan plan = plan_training_memory(config, moe, optimizer, fsdp, shard, micro_batches, comm->size());
  if (comm->rank() != 0 && !is_simulated(*comm)) return;
  log << (is_simulated(*comm) ? " SIMULATED" : "") << " memory plan of rank " << comm->rank() << " of "
      << comm->size() << " (--memory-plan: nothing was allocated or trained)\n";
  // Under TP or CP the table's "per rank of" is the FSDP group's size (DP x CP), not the job's.
  const int64_t tp = fsdp.tensor_model_parallel_size, cp = fsdp.context_parallel_size;
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
