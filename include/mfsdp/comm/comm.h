// Communicator: the only way mfsdp ranks talk to each other (docs/comm.md).
//
// Every rank of a communicator must issue the same collectives in the same order with matching
// arguments (sizes, counts, dtypes, roots). Each collective has an asynchronous form returning a
// Work handle and a synchronous form (the async form followed by wait()). Asynchronous work runs
// in issue order on the communicator's own thread (CPU) or stream (CUDA), so it overlaps compute.
//
// Every collective has a timeout. A peer that died or stopped responding makes the collective
// fail with CommError naming the operation, this rank and the peer it was waiting on; after a
// failure the communicator is broken and every later call fails at once with the first error.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace mfsdp {

// Thrown by collectives that could not complete (peer gone, timeout, transport error).
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class ReduceOp { kSum, kAvg, kMax };
const char* to_string(ReduceOp op);

// How a bf16/fp16 sum or average is accumulated (docs/comm.md, "Reductions").
//  kNative: the backend's own reduction kernels in the tensor's dtype (NCCL's ring, tree or NVLS
//    algorithms, each hop rounding to the dtype), as Megatron-LM and c10d reduce bf16: the fast
//    default. The bits may depend on the world size and NCCL's choice of algorithm.
//  kRankOrderFp32: every rank's contribution summed in fp32 in rank order and rounded once, the
//    dtype itself on the wire (point to point): reproducible, bit-equal to a single process
//    summing the same parts, at the cost of NCCL's algorithms (an opt-in for reproducibility).
// The CPU backend always sums in fp32 in rank order. Other dtypes are unaffected.
enum class LowPrecisionSum { kNative, kRankOrderFp32 };

// Handle to an issued collective (c10d's Work, reduced to what we need).
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective finished; rethrows its error (CommError) if it failed.
  // CUDA: makes the caller's current stream wait for the collective instead of blocking the host.
  virtual void wait() = 0;
  // True once the collective finished (successfully or not); never blocks.
  virtual bool is_completed() = 0;
};
using WorkHandle = std::shared_ptr<Work>;

// Per-call options. A zero timeout means "the communicator's default".
struct AllGatherOptions {
  // Elements contributed by each rank (size() == world size). Empty: every rank contributes
  // input.numel() elements. Counts may differ and may be zero.
  std::vector<int64_t> counts;
  std::chrono::milliseconds timeout{0};
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  // Multiplies the input by this factor before reducing (e.g. 1/dp gradient scaling), without
  // modifying the caller's input.
  double prescale = 1.0;
  // Elements of the reduced result each rank receives (size() == world size). Empty: equal
  // shards of input.numel() / world size. Counts may differ and may be zero.
  std::vector<int64_t> counts;
  LowPrecisionSum low_precision_sum = LowPrecisionSum::kNative;
  std::chrono::milliseconds timeout{0};
};

struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  std::chrono::milliseconds timeout{0};
  LowPrecisionSum low_precision_sum = LowPrecisionSum::kNative;
};

struct BroadcastOptions {
  int root = 0;
  std::chrono::milliseconds timeout{0};
};

struct BarrierOptions {
  std::chrono::milliseconds timeout{0};
};

// Rows (entries along dim 0) this rank sends to / receives from each rank (size() == world size
// each). Empty: equal splits, size(0) / world size rows per rank (size(0) must divide). Splits may
// differ and may be zero.
struct AllToAllOptions {
  std::vector<int64_t> input_split_sizes;
  std::vector<int64_t> output_split_sizes;
  std::chrono::milliseconds timeout{0};
};

// One send or receive of a batch (torch.distributed.P2POp). Point-to-point traffic is not
// collective: only the two ranks of a message take part, and any rank may issue any number of
// batches (pipeline parallelism: activations and their gradients between adjacent stages).
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind;
  at::Tensor tensor;  // contiguous, on device(); a receive's tensor is written
  int peer;           // a rank of this communicator other than rank()
};

struct P2POptions {
  std::chrono::milliseconds timeout{0};
};

// Numerics (all backends): bf16/fp16 reductions accumulate in fp32 and round once at the end,
// so the result is the fp32 sum of the inputs rounded to the tensor's dtype (independent of the
// world size and reduction order up to fp32 rounding). Integer tensors are reduced exactly;
// kAvg needs a floating-point dtype.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "gloo" or "nccl"
  virtual std::string backend() const = 0;
  // The device every tensor passed to this communicator lives on: CPU for the CPU backend,
  // cuda:<index> for NCCL. The runtime places its buffers here (never by backend name).
  virtual at::Device device() const = 0;
  virtual std::chrono::milliseconds default_timeout() const = 0;

  // Concatenates every rank's `input` (1-D view of its elements) into `output` in rank order.
  // output: contiguous, same dtype/device, numel == sum(counts). `input` may alias the rank's own
  // slot of `output` (in-place all-gather).
  virtual WorkHandle all_gather_async(const at::Tensor& output, const at::Tensor& input,
                                      const AllGatherOptions& options = {}) = 0;

  // Reduces `input` (numel == sum(counts)) over ranks and leaves rank r's slice
  // [sum(counts[:r]), sum(counts[:r+1])) in `output` (numel == counts[r]). `input` is not modified.
  virtual WorkHandle reduce_scatter_async(const at::Tensor& output, const at::Tensor& input,
                                          const ReduceScatterOptions& options = {}) = 0;

  // Reduces `tensor` over ranks in place.
  virtual WorkHandle all_reduce_async(const at::Tensor& tensor,
                                      const AllReduceOptions& options = {}) = 0;

  // Copies `tensor` of rank `root` into `tensor` of every rank.
  virtual WorkHandle broadcast_async(const at::Tensor& tensor,
                                     const BroadcastOptions& options = {}) = 0;

  // torch.distributed.all_to_all_single: input rows [in_off[r], in_off[r] + input_split[r]) go to
  // rank r; output rows [out_off[q], out_off[q] + output_split[q]) come from rank q (offsets are
  // prefix sums of the splits). input and output: contiguous, same dtype (any), same trailing
  // shape (sizes after dim 0), not overlapping; zero rows allowed. Contract, not checkable
  // without traffic: input_split[r] here == output_split[rank()] on rank r. The CPU backend
  // fails a violation with CommError naming both ranks; NCCL's behaviour is undefined (c10d's
  // too). Not pure, so that communicators written before it (test doubles) still compile: the
  // default throws std::logic_error; every mfsdp backend overrides it.
  virtual WorkHandle all_to_all_single_async(const at::Tensor& output, const at::Tensor& input,
                                             const AllToAllOptions& options = {});

  // Issues every op of `ops` together (torch.distributed.batch_isend_irecv): the sends do not
  // wait for the receives, so a ring (send to rank+1, receive from rank-1 in one batch) cannot
  // deadlock. The k-th message this rank sends to peer q (over all batches, in issue order) is
  // the k-th receive q posts from this rank; byte sizes must match (the CPU backend fails a
  // mismatch with CommError naming both sizes and ranks; NCCL's behaviour is undefined). Runs
  // in issue order with the communicator's other work. Zero-byte tensors are allowed. Bad ops
  // (a peer out of range or rank() itself, a tensor not contiguous or on another device) throw
  // std::invalid_argument naming the op's index. Not pure (as all_to_all_single_async): the
  // default throws std::logic_error; every mfsdp backend overrides it.
  virtual WorkHandle send_recv_async(const std::vector<P2POp>& ops, const P2POptions& options = {});

  // Completes once every rank reached it (and all previously issued work has finished here).
  virtual WorkHandle barrier_async(const BarrierOptions& options = {}) = 0;

  // A communicator over `ranks` (ranks of this communicator, ascending, including rank()), for
  // meshes and subgroups. Collective over this whole communicator (NCCL splits it: one
  // ncclCommSplit): every rank calls it in the same order with the same `name`, each naming the
  // group it belongs to, so that the groups of one call partition the ranks (a group of one rank
  // included). Ranks are renumbered 0..ranks.size()-1.
  virtual std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks,
                                                  const std::string& name) = 0;

  // Synchronous forms: the async form followed by wait(), unless a backend has a faster path.
  virtual void all_gather(const at::Tensor& output, const at::Tensor& input,
                          const AllGatherOptions& options = {});
  virtual void reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                              const ReduceScatterOptions& options = {});
  virtual void all_reduce(const at::Tensor& tensor, const AllReduceOptions& options = {});
  virtual void broadcast(const at::Tensor& tensor, const BroadcastOptions& options = {});
  virtual void all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                 const AllToAllOptions& options = {});
  virtual void barrier(const BarrierOptions& options = {});
  // Synchronous single point-to-point transfers: send_recv_async({one op}, options)->wait().
  void send(const at::Tensor& tensor, int peer, const P2POptions& options = {});
  void recv(const at::Tensor& tensor, int peer, const P2POptions& options = {});
};

struct CommOptions {
  // "gloo" (CPU tensors) or "nccl" (CUDA tensors; needs a build against a LibTorch with CUDA).
  std::string backend = "gloo";
  // Default timeout of every collective (and of creating a sub-group): how long a silent peer
  // may keep a rank waiting. A peer that exits is named at once, whatever this is.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // How long start-up may take: every rank waits this long for the others to reach the store
  // and connect the world communicator. Kept apart from `timeout` so that a short collective
  // timeout does not fail a job whose ranks start slowly (a loaded machine, a cold file cache).
  std::chrono::milliseconds rendezvous_timeout = std::chrono::minutes(5);
  // CUDA device index for the NCCL backend; -1: chosen as --device cuda chooses (resolve_device).
  // init_communicator makes it the process's current device (torch.cuda.set_device), so that
  // allocations without an explicit device land on it.
  int device_index = -1;
  // CPU backend: move the collectives' bulk data through one /dev/shm segment when every rank is
  // on this host (docs/comm.md), else over TCP. Unset: on, unless the environment has
  // MFSDP_SHM=0 (the variable is the fallback, for launch scripts and the tests' TCP runs).
  std::optional<bool> shared_memory;
  // CPU backend: the network interface ranks listen on ("eth0"). Empty: MFSDP_SOCKET_IFNAME, else
  // GLOO_SOCKET_IFNAME (torch's), else loopback when every rank is on this node, else this host's
  // name.
  std::string socket_ifname;
};

// The tools' --device (docs/comm.md, "Devices"): "cpu"; "cuda": cuda:local_rank when the node
// shows a GPU per local rank, cuda:0 when each rank sees one GPU of its own (Slurm's
// --gpus-per-task=1 / a per-task CUDA_VISIBLE_DEVICES), an error naming the counts when some
// GPUs are visible but fewer than the local ranks, or none; "auto": the same, but the CPU when
// no GPU is visible or the build has no CUDA. Every rank decides the same.
at::Device resolve_device(const std::string& choice, int local_rank, int local_world_size = 1);
// The communicator backend for tensors on `device`: "nccl" for CUDA, "gloo" for the CPU.
std::string backend_for(const at::Device& device);

struct RendezvousInfo;  // mfsdp/comm/rendezvous.h

// Creates the world communicator from the launcher's environment (torchrun, Slurm or Open MPI
// variables; see rendezvous.h).
std::shared_ptr<Communicator> init_communicator(const CommOptions& options = {});
// Same, from an explicit rendezvous description.
std::shared_ptr<Communicator> init_communicator(const RendezvousInfo& info,
                                                const CommOptions& options = {});

}  // namespace mfsdp
