// GPU communicator on NCCL, for CUDA tensors. Built whenever LibTorch has CUDA (MFSDP_WITH_CUDA:
// the default build against the pinned CUDA wheel, so CI compiles and links it), against the NCCL
// that LibTorch itself loads (CMakeLists.txt). tests/gpu/ runs it on a machine with a GPU.
//
// Streams: every collective runs on the communicator's own high-priority CUDA stream, after the
// caller's current stream has reached the point of the call (an event), so it overlaps compute
// that the caller issues next. Work::wait() makes the caller's current stream wait for the
// collective's end event; it does not block the host (barrier() does). Tensors must stay alive
// until wait() (Work keeps references; we never call recordStream, so the caching allocator
// must not see them freed early). Temporaries live on the communication stream.
//
// Reductions: bf16/fp16 use NCCL's own kernels in that dtype unless the caller asks for the
// rank-order fp32 sum (LowPrecisionSum, comm.h); a prescale is an NCCL PreMulSum.
//
// Groups: new_group splits this communicator (ncclCommSplit); no unique id goes through the
// store. Communicators keep resources of their own (splitShare 0) unless MFSDP_NCCL_SPLIT_SHARE=1.
//
// Failures never hang: communicators are nonblocking and every NCCL call in progress is polled
// until the collective's timeout (init and split included). A watchdog thread polls unfinished
// work; past its timeout, or when NCCL reports an asynchronous error, it aborts the communicator
// (never while another thread is inside an NCCL call on it: nccl_call_guards.h) and, like c10d's
// async error handling, ends the process, so that no host code computes on with the buffers of
// a failed collective (MFSDP_NCCL_ASYNC_ERROR_HANDLING=0: every later call throws instead).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>

#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"

namespace mfsdp {

std::shared_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const RendezvousInfo& info, int device_index,
                                                     std::chrono::milliseconds timeout,
                                                     std::chrono::milliseconds connect_timeout);

}  // namespace mfsdp
