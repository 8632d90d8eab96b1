#include "mfsdp/train/model_memory_plan.h"

#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/train/pipeline_schedule.h"

namespace mfsdp {

StepShape training_step_shape(const CausalLM& model, const OptimizerSection& optimizer, int64_t micro_batches) {
  StepShape step = model.unit_schedule();
  step.micro_batches = micro_batches;
  // Muon keeps three shard-sized states (its momentum, AdamW's two moments for the rest).
  step.optimizer_states = optimizer.optimizer == "adam"   ? 2
                          : optimizer.optimizer == "muon" ? 3
                                                          : (optimizer.sgd_momentum != 0 ? 1 : 0);
  if (optimizer.optimizer == "adam" && (optimizer.exp_avg_dtype == "bf16" || optimizer.exp_avg_sq_dtype == "bf16"))
    step.optimizer_state_bytes = (optimizer.exp_avg_dtype == "bf16" ? 2 : 4) + (optimizer.exp_avg_sq_dtype == "bf16" ? 2 : 4);
  return step;
}

MemoryPlan plan_training_memory(const ModelConfig& config, const OptimizerSection& optimizer, const ParallelDims& dims,
                                const FullyShardOptions& shard, int64_t micro_batches, int stage) {
  ModelBuildOptions options;
  if (dims.pp > 1) options.pipeline = stage_chunks(dims.pipeline_split_options(config.num_layers()), stage);
  options.deferred_init = true;  // full sizes, no memory: only shapes and dtypes are read
  options.init_seed = 0;
  // Under expert parallelism the model holds one expert-parallel rank's experts (every rank holds
  // as many); the group only says which, and nothing is exchanged. Likewise one tensor-parallel
  // rank's slices.
  if (dims.ep > 1) options.expert_parallel = make_simulated_communicator(0, dims.ep);
  if (dims.tp > 1) options.tensor_parallel = make_simulated_communicator(0, dims.tp);
  options.sequence_parallel = dims.sequence_parallel;
  if (dims.etp > 1) options.expert_tensor_parallel = options.tensor_parallel;
  std::shared_ptr<CausalLM> model = config.spec->build(config, options);
  StepShape step = training_step_shape(*model, optimizer, micro_batches);
  if (dims.experts_apart()) step.expert_data_parallel = dims.edp_shard();
  // FSDP's shard groups (ParallelMesh::dense_shard_options: dp_shard x cp ranks), with HSDP's
  // replicas of each (which split the main weights, gradients and optimizer state under
  // --outer-dp-sharding-strategy optim).
  return plan_memory(*model, step, shard, dims.dp_cp() / dims.dp_replicate, dims.dp_replicate);
}

void print_memory_plan(const ModelConfig& config, const OptimizerSection& optimizer, const ParallelDims& dims,
                       const FullyShardOptions& shard, int64_t micro_batches, const std::shared_ptr<Communicator>& comm,
                       std::ostream& log) {
  // The job's ranks are pp outermost: rank r is on stage r / (ranks per stage).
  const int own_stage = comm->rank() / (comm->size() / dims.pp);
  const MemoryPlan plan = plan_training_memory(config, optimizer, dims, shard, micro_batches, own_stage);
  if (comm->rank() != 0 && !is_simulated(*comm)) return;
  log << (is_simulated(*comm) ? " SIMULATED" : "") << " memory plan of rank " << comm->rank() << " of "
      << comm->size() << " (--memory-plan: nothing was allocated or trained)\n";
  // Under TP or CP the table's "per rank of" is the FSDP group's size (DP x CP), not the job's.
  if (dims.world() > dims.dp())
    log << " mesh: " << dims.describe() << "; FSDP shards each tensor-parallel rank's "
        << (dims.tp > 1 ? "slice" : "parameters") << " over its data- x context-parallel group of " << dims.dp_cp()
        << " ranks\n";
  if (dims.pp == 1) log << format_memory_plan(plan);
  const PipelineSplitOptions split = dims.pipeline_split_options(config.num_layers());
  for (int stage = 0; stage < dims.pp && dims.pp > 1; ++stage) {
    log << " pipeline stage " << stage << " of " << dims.pp << ":";
    const std::vector<PipelineChunk> chunks = stage_chunks(split, stage);
    for (const PipelineChunk& chunk : chunks)
      log << (chunk.virtual_stage > 0 ? ";" : "") << " decoder layers " << chunk.first_layer << " to "
          << chunk.first_layer + chunk.num_layers - 1 << (chunk.embedding ? ", the embedding" : "")
          << (chunk.output ? ", the output layer" : "");
    log << "\n";
    // The activations are not in the table (it plans FSDP's bytes): how many forwards' the
    // schedule keeps at once, each a micro-batch through one of this stage's chunks.
    const int64_t in_flight = in_flight_peak(
        split.virtual_stages > 1 ? interleaved_one_f_one_b(dims.pp, stage, split.virtual_stages, micro_batches)
                                 : one_f_one_b(dims.pp, stage, micro_batches));
    const int64_t v = split.virtual_stages;
    log << "   activations kept at once, at most: " << in_flight << " of the step's " << micro_batches * v
        << (v > 1 ? " (micro-batch, chunk) forwards (interleaved 1F1B)" : " micro-batches (1F1B)") << "\n";
    log << format_memory_plan(stage == own_stage ? plan
                                                 : plan_training_memory(config, optimizer, dims, shard, micro_batches, stage));
  }
  log << " planned memory per rank (MiB): model weights " << plan.model_weights / 1048576.0 << ", main weights "
      << plan.main_weights / 1048576.0 << ", main grads " << plan.main_grads / 1048576.0 << ", optimizer state "
      << plan.optimizer_state / 1048576.0 << ", transient peak " << plan.transient_peak / 1048576.0 << "\n";
}

}  // namespace mfsdp
