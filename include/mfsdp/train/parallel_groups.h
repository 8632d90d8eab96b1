// The trainer's device mesh (--tensor-model-parallel-size, --context-parallel-size): the world's
// ranks in Megatron's order, tensor-parallel ranks adjacent, then context-parallel, then
// data-parallel (rank = (dp x CP + cp) x TP + tp), and the groups carved from it. FSDP shards
// over DP x CP, as Megatron-FSDP does: every rank of one context-parallel group holds the whole
// parameters and each tensor-parallel rank its slices, sharded over the ranks with its own TP
// coordinate.
#pragma once

#include <memory>

#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/train/config/sections.h"

namespace mfsdp {

struct ParallelGroups {
  int tp = 1, cp = 1, dp = 1;  // sizes; tp x cp x dp = world
  int dp_rank = 0;             // which data-parallel replica this rank is: its share of the data
  std::shared_ptr<Communicator> tensor_parallel;   // null when tp = 1
  std::shared_ptr<Communicator> context_parallel;  // null when cp = 1
  std::shared_ptr<Communicator> fsdp;              // DP x CP (the world when tp = 1)
  std::shared_ptr<DeviceMesh> mesh;                // {dp, cp, tp}; null when tp = cp = 1
  std::shared_ptr<DeviceMesh> fsdp_mesh;           // {dp x cp, tp}; null when tp = 1
  int dp_cp() const { return dp * cp; }
};

// The mesh of fsdp's --tensor-model-parallel-size and --context-parallel-size over `world`.
// Collective over `world` when TP or CP > 1 (the groups are made); the sizes are checked by
// validate_training_args.
ParallelGroups parallel_groups(const FsdpSection& fsdp, const std::shared_ptr<Communicator>& world);

}  // namespace mfsdp
