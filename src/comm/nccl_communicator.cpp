#include "comm/nccl_communicator.h"

#include <ATen/ATen.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/collective_args.h"
#include "comm/nccl_call_guards.h"

namespace mfsdp {
namespace {

using Clock = std::chrono::steady_clock;

std::string where(const char* op, int rank) {
  return std::string(op) + " on rank " + std::to_string(rank);
}

void cuda_check(cudaError_t e, const std::string& context) {
  if (e != cudaSuccess) throw CommError(context + ": CUDA error: " + cudaGetErrorString(e));
}

void nccl_check(ncclResult_t r, const std::string& context) {
  if (r != ncclSuccess) throw CommError(context + ": NCCL error: " + ncclGetErrorString(r));
}

// Communicators are nonblocking (ncclConfig_t::blocking = 0), as c10d makes them: no NCCL call
// holds the host while peers connect, so a peer that died is an error at `deadline`, not a
// hang (ncclCommInitRank and a first collective's lazy connection setup block without one).
// A call that returns ncclInProgress is polled here until it completes or fails.
void nccl_wait(ncclResult_t r, ncclComm_t comm, Clock::time_point deadline, const std::string& context) {
  int polls = 0;
  while (r == ncclInProgress) {
    if (Clock::now() > deadline)
      throw CommError(context + ": NCCL still in progress at the timeout (a peer that died or never "
                      "joined, or mismatched calls)");
    if (++polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(100));
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
    r = state;
  }
  nccl_check(r, context);
}

// Every communicator is nonblocking (above). splitShare: whether the groups later split from it
// share its channels and buffers, a property of the parent for all its children; off (c10d's
// default) unless MFSDP_NCCL_SPLIT_SHARE=1, since communicators that share are serialised
// through one NCCL stream, and FSDP reduces on a second communicator precisely to run beside
// its all-gathers (docs/comm.md).
ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const char* share = std::getenv("MFSDP_NCCL_SPLIT_SHARE");
  config.splitShare = share != nullptr && std::string(share) == "1" ? 1 : 0;
  return config;
}

// Debug switch (docs/comm.md, "Checking stream order"): MFSDP_DEBUG_STREAM_SLEEP=comm:<cycles>
// enqueues a GPU sleep on the communication stream before every collective, =compute:<cycles>
// on the caller's stream just before the collective is ordered after it. Either makes a missing
// compute/communication dependency a deterministic wrong result even at world size 1, where
// collectives are otherwise too quick to race (c10d's tests do the same with torch.cuda._sleep).
struct StreamSleep {
  enum Where { kNone, kComm, kCompute } where = kNone;
  int64_t cycles = 0;
};

StreamSleep stream_sleep_from_env() {
  StreamSleep s;
  const char* v = std::getenv("MFSDP_DEBUG_STREAM_SLEEP");
  if (v == nullptr || *v == '\0') return s;
  const std::string value(v);
  const auto colon = value.find(':');
  const std::string where = value.substr(0, colon);
  char* end = nullptr;
  const long long cycles = colon == std::string::npos ? 0 : std::strtoll(value.c_str() + colon + 1, &end, 10);
  if ((where != "comm" && where != "compute") || colon == std::string::npos || end == nullptr || *end != '\0' ||
      cycles <= 0)
    throw std::invalid_argument("MFSDP_DEBUG_STREAM_SLEEP='" + value +
                                "': expected comm:<cycles> or compute:<cycles> with cycles > 0");
  s.where = where == "comm" ? StreamSleep::kComm : StreamSleep::kCompute;
  s.cycles = cycles;
  return s;
}

// c10d's TORCH_NCCL_ASYNC_ERROR_HANDLING: when the watchdog finds a collective failed or overdue,
// the host may already have gone past a wait() on it (only the stream waits), and would go on
// computing with whatever the aborted collective left in its buffers. So by default the watchdog
// ends the process once it has aborted the communicator; MFSDP_NCCL_ASYNC_ERROR_HANDLING=0 keeps
// it alive (every later call on the communicator then throws the first error).
bool end_process_on_async_error() {
  const char* v = std::getenv("MFSDP_NCCL_ASYNC_ERROR_HANDLING");
  return v == nullptr || std::string(v) != "0";
}

ncclDataType_t nccl_dtype(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    default:
      throw std::invalid_argument(std::string(op) + ": dtype " + c10::toString(t) +
                                  " is not supported by NCCL reductions");
  }
}

// One issued collective: its end event on the communication stream and the tensors it uses.
class NcclWork : public Work {
 public:
  NcclWork(const char* op, uint64_t seq, int device, std::chrono::milliseconds timeout,
           std::vector<at::Tensor> keep_alive)
      : op_(op), seq_(seq), device_(device), timeout_(timeout), start_(Clock::now()),
        keep_alive_(std::move(keep_alive)) {
    cuda_check(cudaEventCreateWithFlags(&end_, cudaEventDisableTiming), op_);
  }
  ~NcclWork() override { cudaEventDestroy(end_); }

  cudaEvent_t end_event() const { return end_; }

  void wait() override {
    throw_if_failed();
    c10::cuda::CUDAGuard guard(device_);
    cuda_check(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_).stream(), end_, 0),
               op_);
  }

  bool is_completed() override {
    if (failed_.load()) return true;
    return cudaEventQuery(end_) == cudaSuccess;
  }

  // Finished on the GPU and not failed (a failed work stays for the watchdog to report).
  bool completed_ok() { return !failed_.load() && cudaEventQuery(end_) == cudaSuccess; }

  // Blocks the host until the collective finished, failed, or the watchdog aborted it.
  void synchronize() {
    while (!is_completed()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    throw_if_failed();
  }

  bool overdue(Clock::time_point now) const { return now - start_ > timeout_; }

  // "all_gather #12: why" once failed.
  std::string describe() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

  void fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::string(op_) + " #" + std::to_string(seq_) + ": " + why;
    }
    failed_ = true;
  }

 private:
  void throw_if_failed() {
    if (!failed_.load()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    throw CommError(error_);
  }

  const char* op_;
  uint64_t seq_;
  int device_;
  std::chrono::milliseconds timeout_;
  Clock::time_point start_;
  std::vector<at::Tensor> keep_alive_;
  cudaEvent_t end_ = nullptr;
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::string error_;  // guarded by mutex_
};

using detail::ScopedGroup;

class NcclCommunicator : public Communicator {
 public:
  // Takes over `comm`, ready (initialised or split), of rank `rank` among `global_ranks`.
  NcclCommunicator(ncclComm_t comm, int rank, std::vector<int> global_ranks, int device,
                   std::chrono::milliseconds timeout, StreamSleep sleep)
      : rank_(rank), global_ranks_(std::move(global_ranks)), device_(device), timeout_(timeout),
        sleep_(sleep), comm_(comm) {
    c10::cuda::CUDAGuard guard(device_);
    stream_ = std::make_unique<c10::cuda::CUDAStream>(
        c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_));
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    watchdog_cv_.notify_all();
    watchdog_.join();
    // Flushes what was issued (bounded), then frees; an aborted communicator is already gone.
    gate_.abort("communicator destroyed", [&] {
      c10::cuda::CUDAGuard guard(device_);
      try {
        nccl_wait(ncclCommFinalize(comm_), comm_, Clock::now() + timeout_, "ncclCommFinalize");
        ncclCommDestroy(comm_);
      } catch (const CommError&) {
        ncclCommAbort(comm_);
      }
    });
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(global_ranks_.size()); }
  std::string backend() const override { return "nccl"; }
  at::Device device() const override { return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_)); }
  std::chrono::milliseconds default_timeout() const override { return timeout_; }

  WorkHandle all_gather_async(const at::Tensor& output, const at::Tensor& input,
                              const AllGatherOptions& options) override {
    RankSlices s = all_gather_layout(output, input, options, rank_, size(), device());
    const bool equal = std::all_of(s.counts.begin(), s.counts.end(),
                                   [&](int64_t c) { return c == s.counts[0]; });
    return launch("all_gather", options.timeout, {output, input}, [&](const Issue& in) {
      if (equal) {
        in.nccl([&] {
          in.call(ncclAllGather(input.data_ptr(), output.data_ptr(), input.nbytes(), ncclUint8, comm_, in.stream));
        });
        return;
      }
      at::Tensor flat = output.view(-1);
      at::Tensor own = flat.narrow(0, s.offsets[rank_], s.counts[rank_]);
      if (own.data_ptr() != input.data_ptr()) own.copy_(input.view(-1));
      gather_slices(in, flat, s);
    });
  }

  WorkHandle reduce_scatter_async(const at::Tensor& output, const at::Tensor& input,
                                  const ReduceScatterOptions& options) override {
    RankSlices s = reduce_scatter_layout(output, input, options, rank_, size(), device());
    const bool equal = std::all_of(s.counts.begin(), s.counts.end(),
                                   [&](int64_t c) { return c == s.counts[0]; });
    return launch("reduce_scatter", options.timeout, {output, input}, [&](const Issue& in) {
      at::ScalarType acc = accumulation_dtype(input.scalar_type());
      if (acc != input.scalar_type() && options.low_precision_sum == LowPrecisionSum::kRankOrderFp32) {
        // The input's own dtype on the wire, summed in fp32 in rank order, rounded once.
        at::Tensor reduced = at::empty({s.counts[rank_]}, output.options().dtype(acc));
        direct_reduce_scatter(in, reduced, input.view(-1), s, options.op, options.prescale);
        output.view(-1).copy_(reduced);
        return;
      }
      // NCCL's own kernels in the input's dtype; a prescale is a PreMulSum (no scaled copy).
      ncclDataType_t dtype = nccl_dtype(input.scalar_type(), "reduce_scatter");
      at::Tensor send = input.view(-1);
      double prescale = options.prescale;
      if (options.op == ReduceOp::kMax && prescale != 1.0) {
        send = send * prescale;  // no PreMulMax in NCCL: a scaled temporary on the comm stream
        prescale = 1.0;
      }
      char* base = static_cast<char*>(send.data_ptr());
      const int64_t item = input.element_size();
      in.nccl([&] {
        ReductionOp op(comm_, options.op, prescale, input.scalar_type(), dtype, size());
        if (equal) {
          in.call(ncclReduceScatter(base, output.data_ptr(), s.counts[0], dtype, op.op, comm_, in.stream));
          return;
        }
        ScopedGroup group([&] { in.call(ncclGroupStart()); }, [&] { in.call(ncclGroupEnd()); });
        for (int r = 0; r < size(); ++r) {
          if (s.counts[r] == 0) continue;
          void* dst = r == rank_ ? output.data_ptr() : nullptr;  // used at the root only
          in.call(ncclReduce(base + s.offsets[r] * item, dst, s.counts[r], dtype, op.op, r, comm_, in.stream));
        }
        group.end();
      });
    });
  }

  WorkHandle all_reduce_async(const at::Tensor& tensor, const AllReduceOptions& options) override {
    check_tensor("all_reduce", "input", tensor, device());
    check_reduction("all_reduce", options.op, tensor.scalar_type(), 1.0);
    return launch("all_reduce", options.timeout, {tensor}, [&](const Issue& in) {
      at::ScalarType acc = accumulation_dtype(tensor.scalar_type());
      if (acc != tensor.scalar_type() && options.low_precision_sum == LowPrecisionSum::kRankOrderFp32) {
        // Reduce-scatter in the tensor's own dtype (summed in fp32, rounded once), then
        // all-gather the rounded slices: the same dtype on the wire both ways.
        at::Tensor flat = tensor.view(-1);
        RankSlices s = even_slices(flat.numel(), size());
        at::Tensor reduced = at::empty({s.counts[rank_]}, flat.options().dtype(acc));
        direct_reduce_scatter(in, reduced, flat, s, options.op, 1.0);
        flat.narrow(0, s.offsets[rank_], s.counts[rank_]).copy_(reduced);
        gather_slices(in, flat, s);
        return;
      }
      ncclDataType_t dtype = nccl_dtype(tensor.scalar_type(), "all_reduce");
      in.nccl([&] {
        ReductionOp op(comm_, options.op, 1.0, tensor.scalar_type(), dtype, size());
        in.call(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), dtype, op.op, comm_, in.stream));
      });
    });
  }

  WorkHandle broadcast_async(const at::Tensor& tensor, const BroadcastOptions& options) override {
    check_tensor("broadcast", "input", tensor, device());
    if (options.root < 0 || options.root >= size())
      throw std::invalid_argument("broadcast: root " + std::to_string(options.root) +
                                  " is outside [0, " + std::to_string(size()) + ")");
    return launch("broadcast", options.timeout, {tensor}, [&](const Issue& in) {
      if (tensor.nbytes() == 0) return;
      in.nccl([&] {
        in.call(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.nbytes(), ncclUint8, options.root,
                              comm_, in.stream));
      });
    });
  }

  WorkHandle all_to_all_single_async(const at::Tensor& output, const at::Tensor& input,
                                     const AllToAllOptions& options) override {
    AllToAllLayout l = all_to_all_layout(output, input, options, rank_, size(), device());
    return launch("all_to_all_single", options.timeout, {output, input}, [&](const Issue& in) {
      const int64_t item = input.element_size();
      const char* src = static_cast<const char*>(input.data_ptr());
      char* dst = static_cast<char*>(output.data_ptr());
      output.view(-1).narrow(0, l.recv.offsets[rank_], l.recv.counts[rank_])
          .copy_(input.view(-1).narrow(0, l.send.offsets[rank_], l.send.counts[rank_]));
      // Bytes, so that every dtype (bool too) goes as it is. Zero counts are skipped on both
      // sides alike, as long as the ranks' splits agree (the caller's contract).
      in.nccl([&] {
        ScopedGroup group([&] { in.call(ncclGroupStart()); }, [&] { in.call(ncclGroupEnd()); });
        for (int r = 0; r < size(); ++r) {
          if (r == rank_) continue;
          if (l.send.counts[r] > 0)
            in.call(ncclSend(src + l.send.offsets[r] * item, l.send.counts[r] * item, ncclUint8, r, comm_,
                             in.stream));
          if (l.recv.counts[r] > 0)
            in.call(ncclRecv(dst + l.recv.offsets[r] * item, l.recv.counts[r] * item, ncclUint8, r, comm_,
                             in.stream));
        }
        group.end();
      });
    });
  }

  // One NCCL group of ncclSend / ncclRecv of bytes (any dtype), in issue order; NCCL matches
  // the sends and receives of a pair of ranks in order. Zero-byte ops are skipped, on both sides
  // alike (their sizes match, the caller's contract).
  WorkHandle send_recv_async(const std::vector<P2POp>& ops, const P2POptions& options) override {
    check_p2p_ops(ops, rank_, size(), device());
    std::vector<at::Tensor> tensors;
    for (const P2POp& op : ops) tensors.push_back(op.tensor);
    return launch("send_recv", options.timeout, std::move(tensors), [&](const Issue& in) {
      in.nccl([&] {
        ScopedGroup group([&] { in.call(ncclGroupStart()); }, [&] { in.call(ncclGroupEnd()); });
        for (const P2POp& op : ops) {
          const size_t nbytes = op.tensor.nbytes();
          if (nbytes == 0) continue;
          if (op.kind == P2POp::Kind::kSend)
            in.call(ncclSend(op.tensor.data_ptr(), nbytes, ncclUint8, op.peer, comm_, in.stream));
          else
            in.call(ncclRecv(op.tensor.data_ptr(), nbytes, ncclUint8, op.peer, comm_, in.stream));
        }
        group.end();
      });
    });
  }

  WorkHandle barrier_async(const BarrierOptions& options) override {
    at::Tensor token = at::ones({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_));
    auto work = std::static_pointer_cast<NcclWork>(
        all_reduce_async(token, AllReduceOptions{ReduceOp::kSum, options.timeout}));
    work->synchronize();  // a barrier holds the host, not only the stream
    return work;
  }

  // ncclCommSplit of this communicator: every rank calls it (the contract in comm.h), and the
  // groups of one call are disjoint, so a group's lowest rank is its colour. No unique id goes
  // through the store, and NCCL reuses what it learnt of the topology. Bounded like every call;
  // at the deadline the parent is aborted, which also ends NCCL's background split job (it
  // would otherwise write the child's handle into this frame after it returned).
  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks, const std::string& name) override {
    GroupPlan plan = plan_group(ranks, name, rank_, size(), global_ranks_, groups_created_);
    const std::string context = "new_group '" + name + "' on rank " + std::to_string(global_rank());
    c10::cuda::CUDAGuard guard(device_);
    ncclConfig_t config = nonblocking_config();
    ncclComm_t child = nullptr;
    try {
      gate_.issue<CommError>([&] {
        const Clock::time_point deadline = Clock::now() + timeout_;
        // Nonblocking split, as c10d's NCCLComm::split waits for it: first the parent out of
        // ncclInProgress; then the child's handle, which NCCL's background job writes into
        // `child` later still (NCCL 2.23+; NVIDIA/nccl issue 1472; on one H200 with NCCL
        // 2.28.9 it was still null after the parent's wait); then the child ready.
        nccl_wait(ncclCommSplit(comm_, ranks.front(), plan.my_index, &child, &config), comm_, deadline, context);
        int polls = 0;
        while (__atomic_load_n(&child, __ATOMIC_ACQUIRE) == nullptr) {
          if (Clock::now() > deadline)
            throw CommError(context + ": ncclCommSplit gave no communicator by the timeout");
          if (++polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        nccl_wait(ncclInProgress, child, deadline, context);
      });
    } catch (const CommError& e) {
      if (!gate_.aborted()) abort_communicator(e.what());
      if (child != nullptr) ncclCommAbort(child);
      throw;
    }
    if (child == nullptr) throw CommError(context + ": ncclCommSplit returned no communicator");
    return std::make_shared<NcclCommunicator>(child, plan.my_index, std::move(plan.global_ranks), device_,
                                              timeout_, sleep_);
  }

 private:
  // What a collective's body issues with: the communication stream; `nccl`, which runs NCCL
  // calls through the issue gate (so never beside an abort: allocations and kernels stay outside
  // it, where a stuck device cannot hold the gate); and `call`, which checks an NCCL result
  // (polling one in progress until the collective's deadline).
  struct Issue {
    cudaStream_t stream;
    ncclComm_t comm;
    Clock::time_point deadline;
    std::string context;
    detail::IssueGate* gate;
    void call(ncclResult_t r) const { nccl_wait(r, comm, deadline, context); }
    template <class Calls>
    void nccl(Calls&& calls) const {
      gate->issue<CommError>(calls);
    }
  };

  // The NCCL reduction for `op` in `dtype`: a prescale other than 1 (and an average with one)
  // becomes a PreMulSum with the factor in the tensor's dtype, destroyed once the calls using it
  // were issued (NCCL allows that), so the input is never copied to be scaled. Not destroyed when
  // an issue failed: the communicator may still be in progress, and the abort that follows
  // frees it.
  struct ReductionOp {
    ReductionOp(ncclComm_t comm, ReduceOp reduce, double prescale, at::ScalarType type,
                ncclDataType_t dtype, int world)
        : comm_(comm), exceptions_(std::uncaught_exceptions()) {
      if (prescale == 1.0) {
        op = reduce == ReduceOp::kSum ? ncclSum : reduce == ReduceOp::kAvg ? ncclAvg : ncclMax;  // ncclAvg: NCCL >= 2.10
        return;
      }
      const double factor = reduce == ReduceOp::kAvg ? prescale / world : prescale;  // kMax: scaled by the caller
      at::Tensor scalar = at::full({}, factor, at::TensorOptions().dtype(type));  // host, in the dtype
      nccl_check(ncclRedOpCreatePreMulSum(&op, scalar.data_ptr(), dtype, ncclScalarHostImmediate, comm),
                 "ncclRedOpCreatePreMulSum");
      custom_ = true;
    }
    ~ReductionOp() {
      if (custom_ && std::uncaught_exceptions() == exceptions_) ncclRedOpDestroy(op, comm_);
    }
    ReductionOp(const ReductionOp&) = delete;
    ReductionOp& operator=(const ReductionOp&) = delete;
    ncclRedOp_t op = ncclSum;

   private:
    ncclComm_t comm_;
    int exceptions_;
    bool custom_ = false;
  };

  int global_rank() const { return global_ranks_[static_cast<size_t>(rank_)]; }

  // Every rank's slice of `buffer` (laid out by `s`) from its owner, whose own slice is in place:
  // one broadcast per rank into its slot, fused into one NCCL group (any counts, zeros too).
  void gather_slices(const Issue& in, const at::Tensor& buffer, const RankSlices& s) {
    const int64_t item = buffer.element_size();
    char* base = static_cast<char*>(buffer.data_ptr());
    in.nccl([&] {
      ScopedGroup group([&] { in.call(ncclGroupStart()); }, [&] { in.call(ncclGroupEnd()); });
      for (int r = 0; r < size(); ++r) {
        if (s.counts[r] == 0) continue;
        char* slot = base + s.offsets[r] * item;
        in.call(ncclBroadcast(slot, slot, s.counts[r] * item, ncclUint8, r, comm_, in.stream));
      }
      group.end();
    });
  }

  // LowPrecisionSum::kRankOrderFp32's reduce-scatter: every rank sends slice r of `input` (its
  // own low-precision dtype) to rank r (point to point, one NCCL group), which sums the
  // contributions in rank order into `result` (the accumulation dtype), rounded once by the
  // caller. Each rank sends (n-1)/n of the input, as a ring does, at half the bytes of fp32.
  void direct_reduce_scatter(const Issue& in, const at::Tensor& result, const at::Tensor& input,
                             const RankSlices& s, ReduceOp op, double prescale) {
    const int n = size();
    const int64_t count = s.counts[rank_], item = input.element_size();
    const ncclDataType_t wire = nccl_dtype(input.scalar_type(), "reduce_scatter");
    at::Tensor rows = at::empty({n, count}, input.options());  // on the communication stream
    rows[rank_].copy_(input.narrow(0, s.offsets[rank_], count));
    char* src = static_cast<char*>(input.data_ptr());
    in.nccl([&] {
      ScopedGroup group([&] { in.call(ncclGroupStart()); }, [&] { in.call(ncclGroupEnd()); });
      for (int r = 0; r < n; ++r) {
        if (r == rank_) continue;
        if (s.counts[r] > 0) in.call(ncclSend(src + s.offsets[r] * item, s.counts[r], wire, r, comm_, in.stream));
        if (count > 0) in.call(ncclRecv(rows[r].data_ptr(), count, wire, r, comm_, in.stream));
      }
      group.end();
    });
    if (count == 0) return;
    reduce_in_rank_order(result, n, [&](int q) { return rows[q]; }, op, prescale);
    if (op == ReduceOp::kAvg) result.div_(n);
  }

  // Orders the collective after the caller's current stream, runs `body` on the communication
  // stream (its NCCL calls through the issue gate) and registers the work with the watchdog. A
  // call still in progress at the deadline aborts the communicator.
  WorkHandle launch(const char* op, std::chrono::milliseconds timeout, std::vector<at::Tensor> tensors,
                    const std::function<void(const Issue&)>& body) {
    if (gate_.aborted())
      throw CommError(where(op, global_rank()) + ": communicator is broken by an earlier failure: " +
                      gate_.reason());
    const std::chrono::milliseconds limit = timeout.count() > 0 ? timeout : timeout_;
    c10::cuda::CUDAGuard guard(device_);
    auto work = std::make_shared<NcclWork>(op, next_seq_++, device_, limit, std::move(tensors));
    const Issue in{stream_->stream(), comm_, Clock::now() + limit, where(op, global_rank()), &gate_};
    cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_).stream();
    if (sleep_.where == StreamSleep::kCompute) at::cuda::sleep(sleep_.cycles);  // on the caller's stream
    cudaEvent_t ready;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), op);
    cuda_check(cudaEventRecord(ready, caller), op);
    cuda_check(cudaStreamWaitEvent(stream_->stream(), ready, 0), op);
    cudaEventDestroy(ready);  // safe: destruction is deferred until the event completed
    try {
      c10::cuda::CUDAStreamGuard on_comm_stream(*stream_);
      if (sleep_.where == StreamSleep::kComm) at::cuda::sleep(sleep_.cycles);
      body(in);
    } catch (const CommError& e) {
      if (!gate_.aborted()) abort_communicator(e.what());  // a call in progress at the deadline
      throw;
    }
    cuda_check(cudaEventRecord(work->end_event(), stream_->stream()), op);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      release_completed();
      pending_.push_back(work);
    }
    return work;
  }

  // Aborts the NCCL communicator once (never beside a call being issued: the gate), which
  // unblocks kernels stuck on dead peers. Returns whether this call aborted it.
  bool abort_communicator(const std::string& why) {
    return gate_.abort(why, [&] {
      c10::cuda::CUDAGuard guard(device_);
      ncclCommAbort(comm_);
    });
  }

  // Drops the finished collectives, and with them the tensors they kept alive (a unit's
  // unsharded gradients and gathered weights). Called at every launch, not only by the
  // watchdog's 100 ms poll: held until that poll, the buffers of most of a step's units were
  // alive at once, and the peak memory of a 120 ms step on one H200 grew by up to 10 GiB over
  // its iterations (docs/PERFORMANCE.md, "GPU: where the step goes"). Needs mutex_.
  void release_completed() {
    pending_.remove_if([](const std::shared_ptr<NcclWork>& work) { return work->completed_ok(); });
  }

  // Watchdog: fails and aborts on timeout or asynchronous NCCL errors, then (by default) ends
  // the process, as c10d's watchdog does (end_process_on_async_error).
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      watchdog_cv_.wait_for(lock, std::chrono::milliseconds(100));
      auto now = Clock::now();
      ncclResult_t async_error = ncclSuccess;
      gate_.try_query([&] { ncclCommGetAsyncError(comm_, &async_error); });
      if (async_error == ncclInProgress) async_error = ncclSuccess;  // a call being enqueued
      std::string failure;
      for (auto it = pending_.begin(); it != pending_.end();) {
        auto& work = *it;
        if (work->is_completed()) {
          it = pending_.erase(it);
          continue;
        }
        const bool aborted = gate_.aborted();
        if (async_error != ncclSuccess || work->overdue(now) || aborted) {
          std::string why = async_error != ncclSuccess
                                ? std::string("NCCL error ") + ncclGetErrorString(async_error)
                                : aborted ? "communicator aborted: " + gate_.reason()
                                          : "timed out on rank " + std::to_string(global_rank()) +
                                                " waiting for its peers";
          work->fail(why);
          abort_communicator(why);
          // Whoever aborted (this thread or the caller's at a deadline), a work the host may
          // already have waited for is failed: end the process (below).
          if (failure.empty()) failure = work->describe();
          it = pending_.erase(it);
          continue;
        }
        ++it;
      }
      if (!failure.empty() && end_process_) {
        std::fprintf(stderr,
                     "mfsdp: NCCL watchdog on rank %d: %s; the communicator was aborted and the "
                     "process ends now, so that no host code runs on with the buffers of a failed "
                     "collective (MFSDP_NCCL_ASYNC_ERROR_HANDLING=0 keeps it alive)\n",
                     global_rank(), failure.c_str());
        std::fflush(stderr);
        std::_Exit(EXIT_FAILURE);
      }
    }
  }

  // Constant after construction.
  int rank_;
  std::vector<int> global_ranks_;
  int device_;
  std::chrono::milliseconds timeout_;
  const StreamSleep sleep_;
  const bool end_process_ = end_process_on_async_error();
  ncclComm_t comm_;
  std::unique_ptr<c10::cuda::CUDAStream> stream_;  // the communication stream

  // Caller's thread only.
  uint64_t next_seq_ = 1;
  std::map<std::string, int> groups_created_;

  detail::IssueGate gate_;  // issuing vs aborting comm_
  std::mutex mutex_;
  std::condition_variable watchdog_cv_;
  std::list<std::shared_ptr<NcclWork>> pending_;  // guarded by mutex_
  bool stopping_ = false;                         // guarded by mutex_
  std::thread watchdog_;
};

// The world communicator: rank 0's unique id through the store, then a nonblocking
// ncclCommInitRankConfig bounded by `connect_timeout` (a peer that dies after the id exchange
// leaves the others in a blocking init forever).
ncclComm_t init_world_comm(c10d::Store& store, int rank, int world, int device,
                           std::chrono::milliseconds connect_timeout) {
  c10::cuda::CUDAGuard guard(device);
  const std::string context = "nccl rendezvous on rank " + std::to_string(rank);
  ncclUniqueId id;
  if (rank == 0) {
    nccl_check(ncclGetUniqueId(&id), context);
    std::vector<uint8_t> bytes(sizeof(id));
    std::memcpy(bytes.data(), &id, sizeof(id));
    store.set("nccl_unique_id", bytes);
  } else {
    store.wait({"nccl_unique_id"}, connect_timeout);
    std::vector<uint8_t> bytes = store.get("nccl_unique_id");
    if (bytes.size() != sizeof(id))
      throw CommError("nccl rendezvous: unique id of " + std::to_string(bytes.size()) +
                      " bytes in the store, expected " + std::to_string(sizeof(id)));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  ncclConfig_t config = nonblocking_config();
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  try {
    nccl_wait(r, comm, Clock::now() + connect_timeout, context);
  } catch (...) {
    if (comm != nullptr) ncclCommAbort(comm);
    throw;
  }
  return comm;
}

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const RendezvousInfo& info, int device_index,
                                                     std::chrono::milliseconds timeout,
                                                     std::chrono::milliseconds connect_timeout) {
  std::vector<int> globals(info.world_size);
  for (int i = 0; i < info.world_size; ++i) globals[i] = i;
  const StreamSleep sleep = stream_sleep_from_env();  // refused before any NCCL state exists
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("mfsdp/nccl/world", store);
  ncclComm_t comm = init_world_comm(*prefixed, info.rank, info.world_size, device_index, connect_timeout);
  return std::make_shared<NcclCommunicator>(comm, info.rank, std::move(globals), device_index, timeout, sleep);
}

}  // namespace mfsdp
