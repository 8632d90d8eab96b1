#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <utility>
#include <vector>

#include "comm/cpu_communicator.h"
#include "comm/device_selection.h"
#include "comm/store.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"

#ifdef MFSDP_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

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
WorkHandle Communicator::send_recv_async(const std::vector<P2POp>&, const P2POptions&) {
  throw std::logic_error("send_recv: the '" + backend() + "' communicator of rank " + std::to_string(rank()) +
                         " does not implement it");
}
void Communicator::send(const at::Tensor& tensor, int peer, const P2POptions& options) {
  send_recv_async({P2POp{P2POp::Kind::kSend, tensor, peer}}, options)->wait();
}
void Communicator::recv(const at::Tensor& tensor, int peer, const P2POptions& options) {
  send_recv_async({P2POp{P2POp::Kind::kRecv, tensor, peer}}, options)->wait();
}

at::Device select_device(const std::string& choice, int local_rank, int local_world_size, int gpus,
                         const std::optional<std::string>& cuda_visible_devices) {
  if (choice != "auto" && choice != "cpu" && choice != "cuda")
    throw std::invalid_argument("--device: unknown value '" + choice + "' (expected auto, cpu or cuda)");
  if (choice == "cpu") return at::kCPU;
  const std::string visible =
      cuda_visible_devices ? " (CUDA_VISIBLE_DEVICES='" + *cuda_visible_devices + "')" : std::string();
  if (gpus == 0) {
    if (choice == "auto") return at::kCPU;
    throw std::invalid_argument(
        "--device cuda: no CUDA GPU is usable here (torch::cuda::device_count() == 0" + visible +
        ", or a build without CUDA); use --device cpu");
  }
  const int local_ranks = std::max(local_world_size, 1);
  // One GPU per task: Slurm's --gpus-per-task=1 (or a per-rank CUDA_VISIBLE_DEVICES) shows each
  // rank only its own GPU, as device 0. Ranks that in fact share it are refused when the NCCL
  // communicator is created (check_one_rank_per_gpu), naming them.
  if (gpus == 1 && local_ranks > 1) return at::Device(at::kCUDA, 0);
  // Some GPUs, fewer than the ranks: falling back to the CPU would train there without a word.
  if (gpus < local_ranks)
    throw std::invalid_argument(
        "--device " + choice + ": this rank sees " + std::to_string(gpus) + " GPUs" + visible + " but " +
        std::to_string(local_ranks) +
        " ranks run on its node: each rank needs a GPU of its own, either every GPU of the node "
        "visible to every rank (LOCAL_RANK picks one, torchrun's convention) or exactly one per "
        "rank (Slurm --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank); start at most " +
        std::to_string(gpus) + " ranks per node, or use --device cpu");
  if (local_rank < 0 || local_rank >= gpus)
    throw std::invalid_argument("--device " + choice + ": LOCAL_RANK " + std::to_string(local_rank) +
                                " has no GPU of its own (this rank sees " + std::to_string(gpus) + visible +
                                "); start at most one rank per GPU");
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

at::Device resolve_device(const std::string& choice, int local_rank, int local_world_size) {
#ifdef MFSDP_WITH_CUDA
  const int gpus = static_cast<int>(torch::cuda::device_count());
#else
  const int gpus = 0;  // a CPU-only build cannot use a GPU even where one is present
#endif
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  return select_device(choice, local_rank, local_world_size, gpus,
                       visible != nullptr ? std::optional<std::string>(visible) : std::nullopt);
}

void check_one_rank_per_gpu(c10d::Store& store, int rank, int world_size, const std::string& gpu_id,
                            const std::string& gpu, std::chrono::milliseconds timeout) {
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  const std::string me = std::to_string(rank);
  // The first rank to claim the GPU owns it; compareSet answers with the owner.
  const std::vector<uint8_t> claim = store.compareSet("mfsdp/gpu/owner/" + gpu_id, {}, bytes(me));
  const int owner = std::stoi(std::string(claim.begin(), claim.end()));
  if (owner != rank)
    store.set("mfsdp/gpu/shared",
              bytes("ranks " + std::to_string(std::min(owner, rank)) + " and " +
                    std::to_string(std::max(owner, rank)) + " both use GPU " + gpu +
                    ": NCCL needs a GPU of its own for every rank; give each rank its own GPU "
                    "(every GPU visible to every rank and LOCAL_RANK picking one, or Slurm "
                    "--gpus-per-task=1 / CUDA_VISIBLE_DEVICES per rank), start at most one rank "
                    "per GPU, or use --device cpu"));
  // Every rank decides only once all have claimed, so all fail together (a rank left alone in
  // NCCL's init would wait there for the others for ever). A sharer's set precedes its add.
  if (store.add("mfsdp/gpu/claimed", 1) == world_size) store.set("mfsdp/gpu/all_claimed", bytes("1"));
  store.wait({"mfsdp/gpu/all_claimed"}, timeout);
  if (!store.check({"mfsdp/gpu/shared"})) return;
  const std::vector<uint8_t> what = store.get("mfsdp/gpu/shared");
  // Rank 0 serves the store: it leaves only once every rank has read the message (as in
  // hold_store_until_start_up_ends), or a peer would see the connection drop instead.
  if (store.add("mfsdp/gpu/told", 1) == world_size) store.set("mfsdp/gpu/all_told", bytes("1"));
  if (rank == 0) store.wait({"mfsdp/gpu/all_told"}, timeout);
  throw std::invalid_argument("communicator 'nccl': " + std::string(what.begin(), what.end()));
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

#ifdef MFSDP_WITH_CUDA
// GPU `device`'s UUID in nvidia-smi's form (GPU-8c2f...; unique across machines), and how
// messages name it.
std::pair<std::string, std::string> gpu_identity(int device) {
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::string uuid = "GPU-";
  for (int i = 0; i < 16; ++i) {
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    uuid += hex;
    if (i == 3 || i == 5 || i == 7 || i == 9) uuid += '-';
  }
  char bus[32];
  std::snprintf(bus, sizeof bus, "%04x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID, prop.pciDeviceID);
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return {uuid, uuid + " (PCI bus " + bus + " on host " + host + ")"};
}
#endif

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
    const int device = options.device_index >= 0
                           ? options.device_index
                           : resolve_device("cuda", info.local_rank, info.local_world_size).index();
    const int gpus = static_cast<int>(torch::cuda::device_count());
    if (device >= gpus)
      throw std::invalid_argument("communicator 'nccl': device index " + std::to_string(device) +
                                  ", but this process sees " + std::to_string(gpus) + " GPUs");
    // The rank's GPU stays current on this thread, as torch.cuda.set_device(local_rank) makes
    // it: the caching allocator, plain at::kCUDA tensors and kernels launched without a guard
    // all use the current device, which would otherwise be cuda:0 on every rank.
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
    const auto [gpu_id, gpu] = gpu_identity(device);
    check_one_rank_per_gpu(*store, info.rank, info.world_size, gpu_id, gpu, startup);
    comm = make_nccl_communicator(store, info, device, options.timeout, startup);
  }
#endif
  hold_store_until_start_up_ends(*store, info);
  return comm;
}

}  // namespace mfsdp
