#include "mfsdp/train/parallel_groups.h"

#include <string>
#include <vector>

namespace mfsdp {

ParallelGroups parallel_groups(const FsdpSection& fsdp, const std::shared_ptr<Communicator>& world) {
  ParallelGroups g;
  g.tp = static_cast<int>(fsdp.tensor_model_parallel_size);
  g.cp = static_cast<int>(fsdp.context_parallel_size);
  g.dp = world->size() / (g.tp * g.cp);
  g.fsdp = world;
  g.dp_rank = world->rank();
  if (g.tp == 1 && g.cp == 1) return g;
  g.mesh = std::make_shared<DeviceMesh>(world, std::vector<int>{g.dp, g.cp, g.tp},
                                        std::vector<std::string>{"dp", "cp", "tp"});
  g.dp_rank = g.mesh->coordinate("dp");
  if (g.tp > 1) {
    g.tensor_parallel = g.mesh->get("tp");
    g.fsdp_mesh = std::make_shared<DeviceMesh>(world, std::vector<int>{g.dp * g.cp, g.tp},
                                               std::vector<std::string>{"dp_cp", "tp"});
    g.fsdp = g.fsdp_mesh->get("dp_cp");
  }
  if (g.cp > 1) g.context_parallel = g.mesh->get("cp");
  return g;
}

}  // namespace mfsdp
