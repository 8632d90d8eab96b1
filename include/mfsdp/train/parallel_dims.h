// ParallelDims: the one owner of the job's parallel layout (TorchTitan's ParallelDims, Megatron-LM's
// parallel_state): the size of every dimension, their one validation, and the one place the
// job's meshes and their communicators are made. Everything else asks ParallelMesh for a group
// by name.
//
// Rank order: Megatron's default "tp-cp-ep-dp-pp", tensor-parallel ranks adjacent, pipeline
// stages outermost, and the experts' layout over the same ranks:
//   dense:  rank = tp  + TP  x (cp + CP x (dp_shard  + DPS  x (dp_replicate + R x pp)))
//   expert: rank = etp + ETP x (ep + EP x (edp_shard + EDPS x (dp_replicate + R x pp)))
// dp = dp_replicate x dp_shard: HSDP's R instances (--num-distributed-optimizer-instances) are
// runs of consecutive data-parallel ranks, as Megatron's partial distributed optimizer has them;
// edp = world / (pp x ep x etp) is Megatron's expert data-parallel size and edp_shard = edp / R
// (its intra-instance expert group). tests/dist/parallel_dims_test.cpp checks every group
// against Megatron-Core's RankGenerator.
//
// The groups ParallelMesh gives (each made once per job; a group of one rank when its size is 1):
//   "tp", "cp", "pp", "dp_replicate", "dp_shard", "dp" (replicate x shard: the data replicas),
//   "dp_shard_cp" (FSDP's shard group), "dp_cp" (Megatron's data-parallel group with CP), "tp_cp"
//   (the tokens of one sequence under sequence and context parallelism: MoE's balancing losses),
//   "ep", "etp", "edp_shard", "edp" (replicate x edp_shard: the ranks holding the same experts).
#pragma once

#include <memory>
#include <string>

#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/pipeline_split.h"
#include "mfsdp/train/config/sections.h"

namespace mfsdp {

struct ModelConfig;

struct ParallelDims {
  int pp = 1, dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1, ep = 1, etp = 1;
  // --sequence-parallel, kept only with tensor parallelism (as Megatron does).
  bool sequence_parallel = false;
  // How the decoder layers are split over the pipeline stages (the split flags; num_layers and
  // stages are filled by pipeline_split_options, and virtual_stages from
  // --num-layers-per-virtual-pipeline-stage when that is given).
  PipelineSplitOptions pipeline;
  int64_t layers_per_virtual_stage = 0;
  // The split of a model of `num_layers` decoder layers over this layout's stages. Throws
  // std::invalid_argument naming the flag when --num-layers-per-virtual-pipeline-stage does not fit.
  PipelineSplitOptions pipeline_split_options(int64_t num_layers) const;

  int world() const { return pp * dp_replicate * dp_shard * cp * tp; }
  int dp() const { return dp_replicate * dp_shard; }  // data replicas: each reads its own share
  int dp_cp() const { return dp() * cp; }             // the ranks FSDP spreads a TP slice over
  int edp() const { return world() / (pp * ep * etp); }
  int edp_shard() const { return edp() / dp_replicate; }
  // The experts' data-parallel group is not the layers' (expert parallelism, or experts whole
  // under tensor parallelism): the experts are FSDP units of their own (ParallelPlan::fsdp_units).
  bool experts_apart() const { return ep > 1 || etp != tp; }
  // "8 ranks = data-parallel 2 x context-parallel 2 x tensor-parallel 2", with the expert layout
  // when it is not the dense one's (HSDP's instances have a line of their own).
  std::string describe() const;
};

// The layout the flags describe over `world` ranks: Megatron's checks (arguments.py and
// parallel_state.py), each size bounded by the world before any product is formed. What mfsdp
// does not combine is refused here, naming the flags and why. Throws std::invalid_argument
// "<flag>: <what>".
ParallelDims parallel_dims(const ParallelSection& parallel, const FsdpSection& fsdp, int64_t world);

// What the model must allow of the layout (its family's parallel_splits(): the sizes tensor
// parallelism splits, the experts expert parallelism splits). Throws std::invalid_argument
// naming the flag and the model's field.
void check_parallel_model(const ParallelDims& dims, const ModelConfig& config);

// The job's meshes over `world` (collective over it): the dense mesh
// [pp, dp_replicate, dp_shard, cp, tp] and the expert mesh [pp, dp_replicate, edp_shard, ep, etp],
// sharing one GroupCache, so every group is made once.
class ParallelMesh {
 public:
  ParallelMesh(const ParallelDims& dims, std::shared_ptr<Communicator> world);

  const ParallelDims& dims() const { return dims_; }
  const std::shared_ptr<Communicator>& world() const { return world_; }
  // The group `name` (see the list above); throws naming the groups for an unknown name.
  std::shared_ptr<Communicator> get(const std::string& name) const;
  // As get, but null when the group has one rank (the models take null for "not split").
  std::shared_ptr<Communicator> split(const std::string& name) const;
  // World ranks of this rank's group `name`, in group-rank order.
  std::vector<int> group_ranks(const std::string& name) const;
  // This rank's index in group `name` (its data shard along "dp", its stage along "pp").
  int coordinate(const std::string& name) const;
  // Communicators made (each group once, whatever asks for it).
  int groups_made() const { return cache_->made(); }

  // FSDP's options for the dense units: over "dp_shard_cp", or with HSDP the 2-D mesh
  // [dp_replicate, dp_shard_cp]. `base` gives the strategy and the rest.
  FullyShardOptions dense_shard_options(const FullyShardOptions& base) const;
  // The experts' own: over "edp_shard", or [dp_replicate, edp_shard] (Megatron-FSDP's
  // hybrid_fsdp_expt_group), with the dense units' strategies.
  FullyShardOptions expert_shard_options(const FullyShardOptions& base) const;

 private:
  const DeviceMesh& mesh_of(const std::string& name) const;

  ParallelDims dims_;
  std::shared_ptr<Communicator> world_;
  std::shared_ptr<GroupCache> cache_;
  std::shared_ptr<DeviceMesh> dense_, expert_;
  std::shared_ptr<DeviceMesh> dense_fsdp_, expert_fsdp_;  // the HSDP meshes; null without
};

}  // namespace mfsdp
