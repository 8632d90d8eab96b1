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
// Timeouts: a watchdog thread polls unfinished work; past its timeout, or when NCCL reports an
// asynchronous error, the NCCL communicator is aborted and every pending and later call fails
// with CommError naming the operation and rank.
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
