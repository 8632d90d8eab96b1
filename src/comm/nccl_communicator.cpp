#include "comm/nccl_communicator.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/collective_args.h"

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

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
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

class NcclCommunicator : public Communicator {
 public:
  // `connect_timeout` bounds the wait for rank 0's unique id (the world's: start-up, see
  // CommOptions::rendezvous_timeout; a sub-group's: `timeout`).
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, std::vector<int> global_ranks,
                   int device, std::chrono::milliseconds timeout,
                   std::chrono::milliseconds connect_timeout)
      : store_(std::move(store)), rank_(rank), global_ranks_(std::move(global_ranks)),
        device_(device), timeout_(timeout) {
    c10::cuda::CUDAGuard guard(device_);
    ncclUniqueId id;
    if (rank_ == 0) {
      nccl_check(ncclGetUniqueId(&id), "nccl rendezvous");
      std::vector<uint8_t> bytes(sizeof(id));
      std::memcpy(bytes.data(), &id, sizeof(id));
      store_->set("nccl_unique_id", bytes);
    } else {
      store_->wait({"nccl_unique_id"}, connect_timeout);
      std::vector<uint8_t> bytes = store_->get("nccl_unique_id");
      if (bytes.size() != sizeof(id))
        throw CommError("nccl rendezvous: unique id of " + std::to_string(bytes.size()) +
                        " bytes in the store, expected " + std::to_string(sizeof(id)));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    nccl_check(ncclCommInitRank(&comm_, size(), id, rank_),
               "nccl rendezvous on rank " + std::to_string(rank_));
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
    if (!aborted_) ncclCommDestroy(comm_);  // an aborted communicator is already gone
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(global_ranks_.size()); }
  std::string backend() const override { return "nccl"; }
  at::Device device() const override { return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_)); }
  std::chrono::milliseconds default_timeout() const override { return timeout_; }

  WorkHandle all_gather_async(const at::Tensor& output, const at::Tensor& input,
                              const AllGatherOptions& options) override {
    RankSlices s = all_gather_layout(output, input, options, rank_, size(), c10::kCUDA);
    const bool equal = std::all_of(s.counts.begin(), s.counts.end(),
                                   [&](int64_t c) { return c == s.counts[0]; });
    return launch("all_gather", options.timeout, {output, input}, [&](cudaStream_t stream) {
      if (equal) {
        nccl_check(ncclAllGather(input.data_ptr(), output.data_ptr(), input.nbytes(), ncclUint8,
                                 comm_, stream),
                   where("all_gather", rank_));
        return;
      }
      at::Tensor flat = output.view(-1);
      at::Tensor own = flat.narrow(0, s.offsets[rank_], s.counts[rank_]);
      if (own.data_ptr() != input.data_ptr()) own.copy_(input.view(-1));
      gather_slices(stream, flat, s, "all_gather");
    });
  }

  WorkHandle reduce_scatter_async(const at::Tensor& output, const at::Tensor& input,
                                  const ReduceScatterOptions& options) override {
    RankSlices s = reduce_scatter_layout(output, input, options, rank_, size(), c10::kCUDA);
    const bool equal = std::all_of(s.counts.begin(), s.counts.end(),
                                   [&](int64_t c) { return c == s.counts[0]; });
    return launch("reduce_scatter", options.timeout, {output, input}, [&](cudaStream_t stream) {
      at::ScalarType acc = accumulation_dtype(input.scalar_type());
      if (acc != input.scalar_type()) {
        // Low precision: the input's own dtype on the wire, summed in fp32, rounded once.
        at::Tensor reduced = at::empty({s.counts[rank_]}, output.options().dtype(acc));
        direct_reduce_scatter(stream, reduced, input.view(-1), s, options.op, options.prescale);
        output.view(-1).copy_(reduced);
        return;
      }
      at::Tensor send = input.view(-1);
      if (options.prescale != 1.0) send = send * options.prescale;  // a temporary on `stream`
      ncclDataType_t dtype = nccl_dtype(acc, "reduce_scatter");
      ncclRedOp_t op = nccl_op(options.op);
      if (equal) {
        nccl_check(ncclReduceScatter(send.data_ptr(), output.data_ptr(), s.counts[0], dtype, op,
                                     comm_, stream),
                   where("reduce_scatter", rank_));
      } else {
        const int64_t item = c10::elementSize(acc);
        char* base = static_cast<char*>(send.data_ptr());
        nccl_check(ncclGroupStart(), where("reduce_scatter", rank_));
        for (int r = 0; r < size(); ++r) {
          if (s.counts[r] == 0) continue;
          void* dst = r == rank_ ? output.data_ptr() : nullptr;  // used at the root only
          nccl_check(ncclReduce(base + s.offsets[r] * item, dst, s.counts[r], dtype, op, r, comm_,
                                stream),
                     where("reduce_scatter", rank_));
        }
        nccl_check(ncclGroupEnd(), where("reduce_scatter", rank_));
      }
    });
  }

  WorkHandle all_reduce_async(const at::Tensor& tensor, const AllReduceOptions& options) override {
    check_tensor("all_reduce", "input", tensor, c10::kCUDA);
    check_reduction("all_reduce", options.op, tensor.scalar_type(), 1.0);
    return launch("all_reduce", options.timeout, {tensor}, [&](cudaStream_t stream) {
      at::ScalarType acc = accumulation_dtype(tensor.scalar_type());
      if (acc != tensor.scalar_type()) {
        // Low precision: reduce-scatter in the tensor's own dtype (summed in fp32, rounded once),
        // then all-gather the rounded slices: the same dtype on the wire both ways.
        at::Tensor flat = tensor.view(-1);
        RankSlices s = even_slices(flat.numel(), size());
        at::Tensor reduced = at::empty({s.counts[rank_]}, flat.options().dtype(acc));
        direct_reduce_scatter(stream, reduced, flat, s, options.op, 1.0);
        flat.narrow(0, s.offsets[rank_], s.counts[rank_]).copy_(reduced);
        gather_slices(stream, flat, s, "all_reduce");
        return;
      }
      nccl_check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                               nccl_dtype(acc, "all_reduce"), nccl_op(options.op), comm_, stream),
                 where("all_reduce", rank_));
    });
  }

  WorkHandle broadcast_async(const at::Tensor& tensor, const BroadcastOptions& options) override {
    check_tensor("broadcast", "input", tensor, c10::kCUDA);
    if (options.root < 0 || options.root >= size())
      throw std::invalid_argument("broadcast: root " + std::to_string(options.root) +
                                  " is outside [0, " + std::to_string(size()) + ")");
    return launch("broadcast", options.timeout, {tensor}, [&](cudaStream_t stream) {
      if (tensor.nbytes() == 0) return;
      nccl_check(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.nbytes(), ncclUint8,
                               options.root, comm_, stream),
                 where("broadcast", rank_));
    });
  }

  WorkHandle all_to_all_single_async(const at::Tensor& output, const at::Tensor& input,
                                     const AllToAllOptions& options) override {
    const char* op = "all_to_all_single";
    AllToAllLayout l = all_to_all_layout(output, input, options, rank_, size(), c10::kCUDA);
    return launch(op, options.timeout, {output, input}, [&](cudaStream_t stream) {
      const int64_t item = input.element_size();
      const char* in = static_cast<const char*>(input.data_ptr());
      char* out = static_cast<char*>(output.data_ptr());
      output.view(-1).narrow(0, l.recv.offsets[rank_], l.recv.counts[rank_])
          .copy_(input.view(-1).narrow(0, l.send.offsets[rank_], l.send.counts[rank_]));
      // Bytes, so that every dtype (bool too) goes as it is. Zero counts are skipped on both
      // sides alike, as long as the ranks' splits agree (the caller's contract).
      nccl_check(ncclGroupStart(), where(op, rank_));
      for (int r = 0; r < size(); ++r) {
        if (r == rank_) continue;
        if (l.send.counts[r] > 0)
          nccl_check(ncclSend(in + l.send.offsets[r] * item, l.send.counts[r] * item, ncclUint8, r,
                              comm_, stream),
                     where(op, rank_));
        if (l.recv.counts[r] > 0)
          nccl_check(ncclRecv(out + l.recv.offsets[r] * item, l.recv.counts[r] * item, ncclUint8, r,
                              comm_, stream),
                     where(op, rank_));
      }
      nccl_check(ncclGroupEnd(), where(op, rank_));
    });
  }

  WorkHandle barrier_async(const BarrierOptions& options) override {
    at::Tensor token = at::ones({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_));
    auto work = std::static_pointer_cast<NcclWork>(
        all_reduce_async(token, AllReduceOptions{ReduceOp::kSum, options.timeout}));
    work->synchronize();  // a barrier holds the host, not only the stream
    return work;
  }

  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks,
                                          const std::string& name) override {
    GroupPlan plan = plan_group(ranks, name, rank_, size(), global_ranks_, groups_created_);
    return std::make_shared<NcclCommunicator>(
        c10::make_intrusive<c10d::PrefixStore>(plan.store_prefix, store_), plan.my_index,
        std::move(plan.global_ranks), device_, timeout_, timeout_);
  }

 private:
  // Every rank's slice of `buffer` (laid out by `s`) from its owner, whose own slice is in place:
  // one broadcast per rank into its slot, fused into one NCCL group (any counts, zeros too).
  void gather_slices(cudaStream_t stream, const at::Tensor& buffer, const RankSlices& s, const char* op) {
    const int64_t item = buffer.element_size();
    char* base = static_cast<char*>(buffer.data_ptr());
    nccl_check(ncclGroupStart(), where(op, rank_));
    for (int r = 0; r < size(); ++r) {
      if (s.counts[r] == 0) continue;
      char* slot = base + s.offsets[r] * item;
      nccl_check(ncclBroadcast(slot, slot, s.counts[r] * item, ncclUint8, r, comm_, stream), where(op, rank_));
    }
    nccl_check(ncclGroupEnd(), where(op, rank_));
  }

  // Reduce-scatter keeping a low-precision input's own dtype on the wire: every rank sends slice
  // r of `input` to rank r (point to point, one NCCL group), which sums the contributions in rank
  // order into `result` (the accumulation dtype) and is rounded once by the caller. Each rank
  // sends (n-1)/n of the input, as a ring does, at half the bytes of fp32.
  void direct_reduce_scatter(cudaStream_t stream, const at::Tensor& result, const at::Tensor& input,
                             const RankSlices& s, ReduceOp op, double prescale) {
    const int n = size();
    const int64_t count = s.counts[rank_], item = input.element_size();
    const ncclDataType_t wire = nccl_dtype(input.scalar_type(), "reduce_scatter");
    at::Tensor rows = at::empty({n, count}, input.options());  // on the communication stream
    rows[rank_].copy_(input.narrow(0, s.offsets[rank_], count));
    char* in = static_cast<char*>(input.data_ptr());
    nccl_check(ncclGroupStart(), where("reduce_scatter", rank_));
    for (int r = 0; r < n; ++r) {
      if (r == rank_) continue;
      if (s.counts[r] > 0)
        nccl_check(ncclSend(in + s.offsets[r] * item, s.counts[r], wire, r, comm_, stream),
                   where("reduce_scatter", rank_));
      if (count > 0)
        nccl_check(ncclRecv(rows[r].data_ptr(), count, wire, r, comm_, stream),
                   where("reduce_scatter", rank_));
    }
    nccl_check(ncclGroupEnd(), where("reduce_scatter", rank_));
    if (count == 0) return;
    reduce_in_rank_order(result, n, [&](int q) { return rows[q]; }, op, prescale);
    if (op == ReduceOp::kAvg) result.div_(n);
  }

  // Orders the collective after the caller's current stream, runs `body` on the communication
  // stream and registers the work with the watchdog.
  WorkHandle launch(const char* op, std::chrono::milliseconds timeout,
                    std::vector<at::Tensor> tensors,
                    const std::function<void(cudaStream_t)>& body) {
    if (aborted_)
      throw CommError(std::string(op) + " on rank " + std::to_string(rank_) +
                      ": communicator is broken by an earlier failure: " + first_error_);
    c10::cuda::CUDAGuard guard(device_);
    cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_).stream();
    cudaEvent_t ready;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), op);
    cuda_check(cudaEventRecord(ready, caller), op);
    cuda_check(cudaStreamWaitEvent(stream_->stream(), ready, 0), op);
    cudaEventDestroy(ready);  // safe: destruction is deferred until the event completed

    auto work = std::make_shared<NcclWork>(op, next_seq_++, device_,
                                           timeout.count() > 0 ? timeout : timeout_,
                                           std::move(tensors));
    {
      c10::cuda::CUDAStreamGuard on_comm_stream(*stream_);
      body(stream_->stream());
    }
    cuda_check(cudaEventRecord(work->end_event(), stream_->stream()), op);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      release_completed();
      pending_.push_back(work);
    }
    return work;
  }

  // Drops the finished collectives, and with them the tensors they kept alive (a unit's
  // unsharded gradients and gathered weights). Called at every launch, not only by the
  // watchdog's 100 ms poll: held until that poll, the buffers of most of a step's units were
  // alive at once, and the peak memory of a 120 ms step on one H200 grew by up to 10 GiB over
  // its iterations (docs/PERFORMANCE.md, "GPU: where the step goes"). Needs mutex_.
  void release_completed() {
    pending_.remove_if([](const std::shared_ptr<NcclWork>& work) { return work->completed_ok(); });
  }

  // Watchdog: fails and aborts on timeout or asynchronous NCCL errors.
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      watchdog_cv_.wait_for(lock, std::chrono::milliseconds(100));
      auto now = Clock::now();
      ncclResult_t async_error = ncclSuccess;
      if (!aborted_) ncclCommGetAsyncError(comm_, &async_error);
      for (auto it = pending_.begin(); it != pending_.end();) {
        auto& work = *it;
        if (work->is_completed()) {
          it = pending_.erase(it);
          continue;
        }
        if (async_error != ncclSuccess || work->overdue(now) || aborted_) {
          std::string why = async_error != ncclSuccess
                                ? std::string("NCCL error ") + ncclGetErrorString(async_error)
                                : aborted_ ? "communicator aborted: " + first_error_
                                           : "timed out on rank " + std::to_string(rank_) +
                                                 " waiting for its peers";
          work->fail(why);
          if (!aborted_) {
            first_error_ = why;
            aborted_ = true;
            ncclCommAbort(comm_);  // unblocks kernels stuck on dead peers
          }
          it = pending_.erase(it);
          continue;
        }
        ++it;
      }
    }
  }

  // Constant after construction.
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  std::vector<int> global_ranks_;
  int device_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<c10::cuda::CUDAStream> stream_;  // the communication stream

  // Caller's thread only.
  uint64_t next_seq_ = 1;
  std::map<std::string, int> groups_created_;

  std::mutex mutex_;
  std::condition_variable watchdog_cv_;
  std::list<std::shared_ptr<NcclWork>> pending_;  // guarded by mutex_
  bool stopping_ = false;                         // guarded by mutex_
  std::atomic<bool> aborted_{false};
  std::string first_error_;                       // written once before aborted_ is set
  ncclComm_t comm_ = nullptr;
  std::thread watchdog_;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const RendezvousInfo& info, int device_index,
                                                     std::chrono::milliseconds timeout,
                                                     std::chrono::milliseconds connect_timeout) {
  std::vector<int> globals(info.world_size);
  for (int i = 0; i < info.world_size; ++i) globals[i] = i;
  return std::make_shared<NcclCommunicator>(
      c10::make_intrusive<c10d::PrefixStore>("mfsdp/nccl/world", store), info.rank,
      std::move(globals), device_index, timeout, connect_timeout);
}

}  // namespace mfsdp
