// ParallelDims and ParallelMesh (include/mfsdp/train/parallel_dims.h): every group of 14 layouts
// equals Megatron-Core's (tests/reference/megatron_rank_groups.json, written by its
// RankGenerator), each group is made once, and sizes are bounded before any product is formed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/train/parallel_dims.h"

namespace {

using json = nlohmann::json;

// ParallelMesh's names for Megatron's groups (the reference's keys).
const std::vector<std::string> kGroups = {"tp", "cp", "dp", "dp_cp", "tp_cp", "pp", "ep", "etp", "edp",
                                          "dp_shard_cp", "dp_replicate", "edp_shard"};

std::shared_ptr<mfsdp::Communicator> simulated(int rank, int world) {
  return mfsdp::make_simulated_communicator(rank, world, at::Device(at::kCPU));
}

TEST(ParallelDims, EveryGroupEqualsMegatronsRankGenerator) {
  std::ifstream in(std::string(MFSDP_SOURCE_DIR) + "/tests/reference/megatron_rank_groups.json");
  ASSERT_TRUE(in) << "tests/reference/megatron_rank_groups.json";
  const json layouts = json::parse(in);
  ASSERT_EQ(layouts.size(), 14u);
  for (const json& l : layouts) {
    mfsdp::ParallelDims d;
    d.tp = l["tp"];
    d.cp = l["cp"];
    d.ep = l["ep"];
    d.etp = l["etp"];
    d.pp = l["pp"];
    d.dp_replicate = l["instances"];
    const int world = l["world"];
    d.dp_shard = world / (d.tp * d.cp * d.pp * d.dp_replicate);
    ASSERT_EQ(d.world(), world) << l.dump();
    for (int rank = 0; rank < world; ++rank) {
      const mfsdp::ParallelMesh mesh(d, simulated(rank, world));
      for (const std::string& name : kGroups) {
        std::vector<int> want;
        for (const json& g : l["groups"][name])
          if (std::find(g.begin(), g.end(), rank) != g.end()) want = g.get<std::vector<int>>();
        SCOPED_TRACE(d.describe() + ", rank " + std::to_string(rank) + ", group " + name);
        EXPECT_EQ(mesh.group_ranks(name), want);
        EXPECT_EQ(mesh.coordinate(name), std::find(want.begin(), want.end(), rank) - want.begin());
        EXPECT_EQ(mesh.get(name)->size(), static_cast<int>(want.size()));
        EXPECT_EQ(mesh.get(name)->rank(), mesh.coordinate(name));
      }
    }
  }
}

// Equal groups are one communicator, whichever mesh or name asks: HSDP 2 x dp_shard 2 x TP 2 with
// EP 2 (ETP 1) on 8 ranks has 5 distinct groups besides the world: the ranks alone (pp, cp, etp),
// the replicas, dp_shard (= dp_shard_cp = edp_shard), tp (= ep) and dp (= dp_cp = edp).
TEST(ParallelDims, EachGroupIsMadeOnce) {
  mfsdp::ParallelDims d;
  d.tp = 2;
  d.dp_shard = 2;
  d.dp_replicate = 2;
  d.ep = 2;
  d.etp = 1;
  const std::shared_ptr<mfsdp::Communicator> world = simulated(0, 8);
  const mfsdp::ParallelMesh mesh(d, world);
  EXPECT_EQ(mesh.groups_made(), 5);
  EXPECT_EQ(mesh.get("ep"), mesh.get("tp"));
  EXPECT_EQ(mesh.get("edp"), mesh.get("dp_cp"));
  EXPECT_EQ(mesh.get("edp_shard"), mesh.get("dp_shard_cp"));
  EXPECT_EQ(mesh.get("pp"), mesh.get("cp"));
  EXPECT_EQ(mesh.split("cp"), nullptr);
  EXPECT_NE(mesh.split("tp"), nullptr);
  // Without any split every group is the world or the rank alone.
  mfsdp::ParallelDims plain;
  plain.dp_shard = 8;
  const mfsdp::ParallelMesh flat(plain, world);
  EXPECT_EQ(flat.groups_made(), 1);
  EXPECT_EQ(flat.get("dp_shard_cp"), world);
  EXPECT_EQ(flat.get("edp"), world);
}

std::string error_of(const mfsdp::ParallelSection& p, int64_t world, const mfsdp::FsdpSection& fsdp = {}) {
  try {
    mfsdp::parallel_dims(p, fsdp, world);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// The sizes of the report that wrapped tp x cp to 0 and died of SIGFPE, and every size up to
// int64's largest in every field: refused naming the flag.
TEST(ParallelDims, SizesAreBoundedBeforeTheirProduct) {
  mfsdp::ParallelSection p;
  p.tensor_model_parallel_size = 4294967296;
  p.context_parallel_size = 4294967296;
  EXPECT_EQ(error_of(p, 8), "--tensor-model-parallel-size: 4294967296 is more than the world size 8");
  for (const int64_t big : {int64_t{9}, int64_t{1} << 31, int64_t{1} << 32, int64_t{1} << 62,
                            std::numeric_limits<int64_t>::max()})
    for (int64_t mfsdp::ParallelSection::*field :
         {&mfsdp::ParallelSection::tensor_model_parallel_size, &mfsdp::ParallelSection::context_parallel_size,
          &mfsdp::ParallelSection::expert_model_parallel_size, &mfsdp::ParallelSection::expert_tensor_parallel_size,
          &mfsdp::ParallelSection::pipeline_model_parallel_size,
          &mfsdp::ParallelSection::num_distributed_optimizer_instances}) {
      mfsdp::ParallelSection q;
      q.*field = big;
      EXPECT_NE(error_of(q, 8).find("is more than the world size 8"), std::string::npos) << big;
    }
}

TEST(ParallelDims, MegatronsLayoutAndItsRefusals) {
  mfsdp::ParallelSection p;
  p.tensor_model_parallel_size = 2;
  p.context_parallel_size = 2;
  p.num_distributed_optimizer_instances = 2;
  const mfsdp::ParallelDims d = mfsdp::parallel_dims(p, {}, 16);
  EXPECT_EQ(d.dp_replicate, 2);
  EXPECT_EQ(d.dp_shard, 2);
  EXPECT_EQ(d.etp, 2);  // Megatron's default: the tensor-parallel size
  EXPECT_EQ(d.edp(), 8);
  EXPECT_EQ(d.edp_shard(), 4);
  EXPECT_EQ(d.describe(), "16 ranks = data-parallel 4 x context-parallel 2 x tensor-parallel 2");

  mfsdp::ParallelSection e;
  e.expert_model_parallel_size = 2;
  e.num_distributed_optimizer_instances = 2;
  const mfsdp::ParallelDims hsdp_ep = mfsdp::parallel_dims(e, {}, 4);  // HSDP x EP: the experts' own replicas
  EXPECT_EQ(hsdp_ep.edp_shard(), 1);
  e.num_distributed_optimizer_instances = 4;
  EXPECT_EQ(error_of(e, 4), "--num-distributed-optimizer-instances: 4 does not divide the expert-data-parallel size 2 "
                            "(world / expert-parallel / expert-tensor-parallel)");

  // TP x EP with the experts whole (ETP 1): the expert-parallel ranks are the tensor-parallel
  // pairs, each expert sharded over the 2 ranks of its expert-data-parallel group.
  mfsdp::ParallelSection tp_ep;
  tp_ep.tensor_model_parallel_size = 2;
  tp_ep.expert_model_parallel_size = 2;
  tp_ep.expert_tensor_parallel_size = 1;
  tp_ep.sequence_parallel = true;
  const mfsdp::ParallelDims tp2_ep2 = mfsdp::parallel_dims(tp_ep, {}, 4);
  EXPECT_EQ(tp2_ep2.edp(), 2);
  EXPECT_TRUE(tp2_ep2.sequence_parallel);
  tp_ep.tensor_model_parallel_size = 1;
  EXPECT_FALSE(mfsdp::parallel_dims(tp_ep, {}, 4).sequence_parallel);  // Megatron drops it without TP
  mfsdp::ParallelSection etp;
  etp.expert_tensor_parallel_size = 2;
  EXPECT_EQ(error_of(etp, 4),
            "--expert-tensor-parallel-size: 2: mfsdp splits experts over 1 rank or over the tensor-parallel ranks (1)");
  mfsdp::ParallelSection pp;
  pp.pipeline_model_parallel_size = 2;
  pp.decoder_first_pipeline_num_layers = 1;
  const mfsdp::ParallelDims pp2 = mfsdp::parallel_dims(pp, {}, 4);
  EXPECT_EQ(pp2.pp, 2);
  EXPECT_EQ(pp2.dp(), 2);
  EXPECT_EQ(pp2.pipeline_split_options(4).first_stage_layers, std::optional<int64_t>(1));
  pp.pipeline_model_parallel_size = 1;
  EXPECT_NE(error_of(pp, 4).find("the pipeline split flags"), std::string::npos);
  mfsdp::ParallelSection hfsdp;
  hfsdp.num_distributed_optimizer_instances = 2;
  hfsdp.outer_dp_sharding_strategy = "optim";
  mfsdp::FsdpSection zero1;
  zero1.data_parallel_sharding_strategy = "optim";
  EXPECT_NE(error_of(hfsdp, 4, zero1).find("needs --data-parallel-sharding-strategy optim_grads_params"),
            std::string::npos);
}

}  // namespace
