// A communicator for one process that plays rank `rank` of a `world_size`-rank job (issue:
// simulated scale). Every collective keeps its argument checks and moves the bytes a real rank
// would move locally: all-gather copies this rank's input into every slot of the output,
// reduce-scatter copies this rank's slice of the input (times the prescale), all-reduce sums N
// identical contributions (x N for kSum); point-to-point sends move nothing and receives are
// filled with zeros. So fully_shard, the optimizer and the trainer allocate and compute exactly
// what rank `rank` of the real job would (per-rank memory and compute of 64-rank jobs on one
// device), while the values are NOT those of the real job: losses and gradients of other ranks'
// data are never seen. Anything reporting from a simulated run must
// say that it is simulated (is_simulated()).
#pragma once

#include <memory>
#include <string>

#include "mfsdp/comm/comm.h"

namespace mfsdp {

// `device` is where the simulated job's tensors live (CPU, or a CUDA device: the communicator
// then reports backend "nccl", as the real job's would).
std::shared_ptr<Communicator> make_simulated_communicator(int rank, int world_size,
                                                          at::Device device = at::kCPU);

bool is_simulated(const Communicator& comm);

}  // namespace mfsdp
