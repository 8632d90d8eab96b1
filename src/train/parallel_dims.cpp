#include "mfsdp/train/parallel_dims.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "mfsdp/models/model_spec.h"

namespace mfsdp {
namespace {

const char* const kTp = "--tensor-model-parallel-size";
const char* const kCp = "--context-parallel-size";
const char* const kEp = "--expert-model-parallel-size";
const char* const kEtp = "--expert-tensor-parallel-size";
const char* const kPp = "--pipeline-model-parallel-size";
const char* const kInstances = "--num-distributed-optimizer-instances";

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

std::string ParallelDims::describe() const {
  std::string s = str(world()) + " ranks = data-parallel " + str(dp());
  s += " x context-parallel " + str(cp) + " x tensor-parallel " + str(tp);
  if (pp > 1) s += " x pipeline-parallel " + str(pp);
  if (ep > 1 || etp != tp)
    s += "; experts: expert-data-parallel " + str(edp()) + " x expert-parallel " + str(ep) +
         " x expert-tensor-parallel " + str(etp);
  return s;
}

ParallelDims parallel_dims(const ParallelSection& p, const FsdpSection& fsdp, int64_t world) {
  p.validate();
  if (world < 1 || world > kMaxSimulatedWorldSize)
    throw std::invalid_argument("the job has " + str(world) + " ranks; mfsdp lays out 1 to " +
                                str(kMaxSimulatedWorldSize));
  const int64_t etp_given = p.expert_tensor_parallel_size == 0 ? p.tensor_model_parallel_size
                                                               : p.expert_tensor_parallel_size;
  // Every size at most the world before any product is formed: the products below then stay
  // under world^2 <= 2^40.
  for (const auto& [flag, v] : {std::pair<const char*, int64_t>{kTp, p.tensor_model_parallel_size},
                                {kCp, p.context_parallel_size},
                                {kEp, p.expert_model_parallel_size},
                                {kEtp, etp_given},
                                {kPp, p.pipeline_model_parallel_size},
                                {kInstances, p.num_distributed_optimizer_instances}})
    if (v > world) flag_error(flag, str(v) + " is more than the world size " + str(world));
  ParallelDims d;
  d.tp = static_cast<int>(p.tensor_model_parallel_size);
  d.cp = static_cast<int>(p.context_parallel_size);
  d.pp = static_cast<int>(p.pipeline_model_parallel_size);
  d.ep = static_cast<int>(p.expert_model_parallel_size);
  d.etp = static_cast<int>(etp_given);
  d.sequence_parallel = p.sequence_parallel && d.tp > 1;
  if (p.decoder_first_pipeline_num_layers >= 0) d.pipeline.first_stage_layers = p.decoder_first_pipeline_num_layers;
  if (p.decoder_last_pipeline_num_layers >= 0) d.pipeline.last_stage_layers = p.decoder_last_pipeline_num_layers;
  d.pipeline.account_for_embedding = p.account_for_embedding_in_pipeline_split;
  d.pipeline.account_for_loss = p.account_for_loss_in_pipeline_split;
  if (p.num_virtual_stages_per_pipeline_rank > 0)
    d.pipeline.virtual_stages = static_cast<int>(std::min<int64_t>(p.num_virtual_stages_per_pipeline_rank, 1 << 20));
  d.layers_per_virtual_stage = p.num_layers_per_virtual_pipeline_stage;
  if (d.pp == 1 && (d.pipeline.first_stage_layers || d.pipeline.last_stage_layers || d.pipeline.account_for_embedding ||
                    d.pipeline.account_for_loss || d.pipeline.virtual_stages > 1 || d.layers_per_virtual_stage > 0))
    flag_error(kPp, "1: the pipeline split flags (--decoder-first/last-pipeline-num-layers, "
                    "--account-for-embedding/loss-in-pipeline-split, the virtual stages) need pipeline parallelism");
  // Megatron's arguments.py: the layers of a virtual stage fix the split, so the ends cannot.
  if (d.layers_per_virtual_stage > 0 && (d.pipeline.first_stage_layers || d.pipeline.last_stage_layers))
    flag_error("--num-layers-per-virtual-pipeline-stage",
               "cannot be combined with --decoder-first/last-pipeline-num-layers (give "
               "--num-virtual-stages-per-pipeline-rank instead)");
  const int64_t model_parallel = int64_t{d.tp} * d.cp * d.pp;
  if (model_parallel > world || world % model_parallel != 0)
    flag_error(d.tp > 1 ? kTp : kCp, str(d.tp) + " x " + kCp + " " + str(d.cp) +
                                         (d.pp > 1 ? std::string(" x ") + kPp + " " + str(d.pp) : std::string()) +
                                         " does not divide the world size " + str(world));
  const int64_t dp = world / model_parallel, instances = p.num_distributed_optimizer_instances;
  if (dp % instances != 0)
    flag_error(kInstances, str(instances) + " does not divide the data-parallel size " + str(dp));
  d.dp_replicate = static_cast<int>(instances);
  d.dp_shard = static_cast<int>(dp / instances);
  // Megatron's expert layout: ETP x EP x PP ranks hold one copy of the experts.
  const int64_t expert_parallel = int64_t{d.etp} * d.ep * d.pp;
  if (expert_parallel > world || world % expert_parallel != 0)
    flag_error(kEp, str(d.ep) + " x " + kEtp + " " + str(d.etp) + " does not divide the world size " + str(world));
  if ((world / expert_parallel) % instances != 0)
    flag_error(kInstances, str(instances) + " does not divide the expert-data-parallel size " +
                               str(world / expert_parallel) + " (world / expert-parallel / expert-tensor-parallel)");
  if (d.etp != 1 && d.etp != d.tp)
    flag_error(kEtp, str(d.etp) + ": mfsdp splits experts over 1 rank or over the tensor-parallel ranks (" +
                         str(d.tp) + ")");
  // Megatron-FSDP's HFSDP shards the main weights across the instances: it builds on ZeRO-3 inside.
  if (p.outer_dp_sharding_strategy == "optim" && fsdp.data_parallel_sharding_strategy != "optim_grads_params")
    flag_error("--outer-dp-sharding-strategy", "optim (HFSDP) needs --data-parallel-sharding-strategy "
                                               "optim_grads_params, got " + fsdp.data_parallel_sharding_strategy);
  if (p.outer_dp_sharding_strategy == "optim" && instances < 2)
    flag_error("--outer-dp-sharding-strategy", std::string("optim shards across the instances of ") + kInstances +
                                                   ", which is " + str(instances) + " (needs 2 or more)");
  return d;
}

PipelineSplitOptions ParallelDims::pipeline_split_options(int64_t num_layers) const {
  PipelineSplitOptions o = pipeline;
  o.num_layers = num_layers;
  o.stages = pp;
  if (layers_per_virtual_stage > 0) {
    // Megatron's arguments.py: (layers / stages) / layers per virtual stage chunks per stage.
    const int64_t per_stage = num_layers / pp;
    if (num_layers % pp != 0 || per_stage % layers_per_virtual_stage != 0)
      flag_error("--num-layers-per-virtual-pipeline-stage",
                 str(layers_per_virtual_stage) + " does not divide the " + str(num_layers) + " layers' " +
                     str(per_stage) + " per stage of " + kPp + " " + str(pp));
    o.virtual_stages = static_cast<int>(per_stage / layers_per_virtual_stage);
  }
  return o;
}

void check_parallel_model(const ParallelDims& d, const ModelConfig& config) {
  const ParallelSplits splits = config.spec->parallel_splits(config);
  const std::string model = "the model (" + config.spec->describe(config) + ")";
  // Megatron's layer split (each refusal names its flags).
  if (d.pp > 1) pipeline_split(d.pipeline_split_options(config.num_layers()));
  if (d.tp > 1)
    for (const auto& [field, value] : splits.tensor_parallel)
      if (value % d.tp != 0)
        flag_error(kTp, str(d.tp) + " does not divide " + model + "'s " + field + " " + str(value));
  if (d.ep > 1 && splits.experts == 0)
    flag_error(kEp, model + " has no experts to split over " + str(d.ep) + " ranks");
  if (splits.experts % d.ep != 0)
    flag_error(kEp, str(d.ep) + " does not divide " + model + "'s " + str(splits.experts) + " experts");
  // Megatron's MoE layer refuses to train under tensor parallelism without sequence parallelism:
  // each tensor-parallel rank routes its own slice of the sequence.
  if (splits.experts > 0 && d.tp > 1 && !d.sequence_parallel)
    flag_error(kTp, str(d.tp) + " with " + model + "'s MoE layers needs --sequence-parallel (each rank routes its "
                                                   "slice of the sequence, as in Megatron-LM)");
  if (splits.experts > 0 && d.etp > 1)
    for (const auto& [field, value] : splits.expert_tensor_parallel)
      if (value % d.etp != 0)
        flag_error(kEtp, str(d.etp) + " does not divide " + model + "'s " + field + " " + str(value));
}

ParallelMesh::ParallelMesh(const ParallelDims& dims, std::shared_ptr<Communicator> world)
    : dims_(dims), world_(std::move(world)), cache_(std::make_shared<GroupCache>()) {
  if (dims_.world() != world_->size())
    throw std::invalid_argument("ParallelMesh: the layout (" + dims_.describe() + ") is not the world's " +
                                str(world_->size()) + " ranks");
  dense_ = std::make_shared<DeviceMesh>(world_, std::vector<int>{dims_.pp, dims_.dp_replicate, dims_.dp_shard,
                                                                 dims_.cp, dims_.tp},
                                        std::vector<std::string>{"pp", "dp_replicate", "dp_shard", "cp", "tp"}, cache_);
  dense_->flatten({"dp_replicate", "dp_shard"}, "dp");
  dense_->flatten({"dp_shard", "cp"}, "dp_shard_cp");
  dense_->flatten({"dp_replicate", "dp_shard", "cp"}, "dp_cp");
  dense_->flatten({"cp", "tp"}, "tp_cp");
  expert_ = std::make_shared<DeviceMesh>(world_, std::vector<int>{dims_.pp, dims_.dp_replicate, dims_.edp_shard(),
                                                                  dims_.ep, dims_.etp},
                                         std::vector<std::string>{"pp", "dp_replicate", "edp_shard", "ep", "etp"},
                                         cache_);
  expert_->flatten({"dp_replicate", "edp_shard"}, "edp");
  if (dims_.dp_replicate > 1) {
    dense_fsdp_ = dense_->submesh({"dp_replicate", "dp_shard_cp"});
    expert_fsdp_ = expert_->submesh({"dp_replicate", "edp_shard"});
  }
}

const DeviceMesh& ParallelMesh::mesh_of(const std::string& name) const {
  if (dense_->has(name)) return *dense_;
  if (expert_->has(name)) return *expert_;
  throw std::invalid_argument("ParallelMesh: no group '" + name +
                              "' (tp, cp, pp, dp_replicate, dp_shard, dp, dp_shard_cp, dp_cp, tp_cp, ep, etp, edp_shard, edp)");
}

std::shared_ptr<Communicator> ParallelMesh::get(const std::string& name) const { return mesh_of(name).get(name); }

std::shared_ptr<Communicator> ParallelMesh::split(const std::string& name) const {
  return mesh_of(name).size(name) > 1 ? get(name) : nullptr;
}

std::vector<int> ParallelMesh::group_ranks(const std::string& name) const { return mesh_of(name).group_ranks(name); }

int ParallelMesh::coordinate(const std::string& name) const { return mesh_of(name).coordinate(name); }

FullyShardOptions ParallelMesh::dense_shard_options(const FullyShardOptions& base) const {
  FullyShardOptions o = base;
  o.mesh = dense_fsdp_;
  o.comm = dense_fsdp_ ? nullptr : get("dp_shard_cp");
  return o;
}

FullyShardOptions ParallelMesh::expert_shard_options(const FullyShardOptions& base) const {
  FullyShardOptions o = base;
  o.mesh = expert_fsdp_;
  o.comm = expert_fsdp_ ? nullptr : get("edp_shard");
  return o;
}

}  // namespace mfsdp
