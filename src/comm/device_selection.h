// How a rank picks its GPU (docs/comm.md, "Devices"): the decision apart from the machine, so
// that every rule is testable without a GPU (tests/unit/device_selection_test.cpp).
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <optional>
#include <string>

namespace c10d {
class Store;
}

namespace mfsdp {

// resolve_device's rules for local rank `local_rank` of `local_world_size` in a process that
// sees `gpus` CUDA devices; `cuda_visible_devices` is that variable (nullopt: unset), quoted in
// the errors.
at::Device select_device(const std::string& choice, int local_rank, int local_world_size, int gpus,
                         const std::optional<std::string>& cuda_visible_devices);

// NCCL refuses two ranks of one communicator on the same GPU ("duplicate GPU"), deep inside its
// init. Every rank of `world_size` claims `gpu_id` (a GPU's UUID: globally unique, so equal ids
// mean the same physical GPU) in `store`; once all have, every rank throws the same
// std::invalid_argument naming two ranks that share a GPU, if any do, so that none goes on into
// an init the others left. `gpu` describes this rank's GPU in that message.
void check_one_rank_per_gpu(c10d::Store& store, int rank, int world_size, const std::string& gpu_id,
                            const std::string& gpu, std::chrono::milliseconds timeout);

}  // namespace mfsdp
