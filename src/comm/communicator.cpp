#include <torch/cuda.h>

#include <algorithm>
#include <stdexcept>

#include "comm/cpu_communicator.h"
#include "comm/store.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"

#ifdef MFSDP_WITH_CUDA
#include "comm/nccl_communicator.h"
#endif

namespace mfsdp {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

void Communicator::all_gather(const at::Tensor& output, const at::Tensor& input,
                              const AllGatherOptions& options) {
  all_gather_async(output, input, options)->wait();
}
void Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                  const ReduceScatterOptions& options) {
  reduce_scatter_async(output, input, options)->wait();
}
void Communicator::all_reduce(const at::Tensor& tensor, const AllReduceOptions& options) {
  all_reduce_async(tensor, options)->wait();
}
void Communicator::broadcast(const at::Tensor& tensor, const BroadcastOptions& options) {
  broadcast_async(tensor, options)->wait();
}
WorkHandle Communicator::all_to_all_single_async(const at::Tensor&, const at::Tensor&,
                                                 const AllToAllOptions&) {
  throw std::logic_error("all_to_all_single: the '" + backend() + "' communicator of rank " +
                         std::to_string(rank()) + " does not implement it");
}
void Communicator::all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                     const AllToAllOptions& options) {
  all_to_all_single_async(output, input, options)->wait();
}
void Communicator::barrier(const BarrierOptions& options) { barrier_async(options)->wait(); }

at::Device resolve_device(const std::string& choice, int local_rank, int local_world_size) {
  if (choice != "auto" && choice != "cpu" && choice != "cuda")
    throw std::invalid_argument("--device: unknown value '" + choice + "' (expected auto, cpu or cuda)");
  if (choice == "cpu") return at::kCPU;
#ifdef MFSDP_WITH_CUDA
  const int gpus = static_cast<int>(torch::cuda::device_count());
#else
  const int gpus = 0;  // a CPU-only build cannot use a GPU even where one is present
#endif
  if (choice == "auto" && gpus < std::max(local_world_size, 1)) return at::kCPU;
  if (gpus == 0)
    throw std::invalid_argument(
        "--device cuda: no CUDA GPU is usable here (torch::cuda::device_count() == 0, or a build "
        "without CUDA); use --device cpu");
  if (local_rank < 0 || local_rank >= gpus)
    throw std::invalid_argument("--device " + choice + ": LOCAL_RANK " + std::to_string(local_rank) +
                                " has no GPU of its own (this machine has " + std::to_string(gpus) +
                                "); start at most one rank per GPU");
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

std::string backend_for(const at::Device& device) { return device.is_cuda() ? "nccl" : "gloo"; }

std::shared_ptr<Communicator> init_communicator(const CommOptions& options) {
  return init_communicator(rendezvous_from_env(), options);
}

namespace {

// Rank 0 serves the store (store.h), and start-up is each rank's last use of it. A rank 0 that
// leaves start-up first and ends at once (a run that only prints its memory plan) would take the
// store away from peers still reading their last start-up keys ("Connection reset by peer" on
// rank 1 in CI). So every rank says when its start-up reads are done, and rank 0 returns only
// once all have: the server answers a set before it wakes the get waiting for it, so no peer is
// left without its answer.
void hold_store_until_start_up_ends(c10d::Store& store, const RendezvousInfo& info) {
  store.set("mfsdp/start_up_done/" + std::to_string(info.rank), std::vector<uint8_t>{'1'});
  if (info.rank != 0) return;
  for (int r = 0; r < info.world_size; ++r) store.get("mfsdp/start_up_done/" + std::to_string(r));
}

}  // namespace

std::shared_ptr<Communicator> init_communicator(const RendezvousInfo& info,
                                                const CommOptions& options) {
  const auto startup = options.rendezvous_timeout;
  if (options.backend != "gloo" && options.backend != "nccl")
    throw std::invalid_argument("unknown communicator backend '" + options.backend +
                                "' (expected 'gloo' or 'nccl')");
#ifndef MFSDP_WITH_CUDA
  if (options.backend == "nccl")
    throw std::invalid_argument(
        "communicator backend 'nccl' needs a build against a LibTorch with CUDA (MFSDP_CUDA "
        "AUTO or ON, docs/building.md); this build has only 'gloo'");
#endif
  c10::intrusive_ptr<c10d::Store> store = connect_store(info, startup);
  std::shared_ptr<Communicator> comm;
  if (options.backend == "gloo") comm = make_cpu_communicator(store, info, options);
#ifdef MFSDP_WITH_CUDA
  if (options.backend == "nccl") {
    int device = options.device_index >= 0 ? options.device_index : info.local_rank;
    comm = make_nccl_communicator(store, info, device, options.timeout, startup);
  }
#endif
  hold_store_until_start_up_ends(*store, info);
  return comm;
}

}  // namespace mfsdp
