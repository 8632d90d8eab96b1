// CPU communicator on libgloo's TCP transport.
//
// c10d's ProcessGroupGloo (1.13) has no reduce-scatter, no flat all-gather and no bf16
// (research/libtorch_probe.md Q7), so the collectives here are our own ring algorithms over
// gloo's point-to-point unbound buffers: bandwidth-optimal ((N-1)/N of the data per link), any
// per-rank counts including zero, any dtype, fp32 accumulation for bf16/fp16, and errors that
// name the peer a rank was waiting on. They run on the communicator's CommThread.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "mfsdp/comm.h"
#include "mfsdp/rendezvous.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace mfsdp {

// Connects every rank of `info` through `store` (see store.h) and returns the world
// communicator. Its keys live under "mfsdp/gloo/", so the store can be shared.
std::shared_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const RendezvousInfo& info,
                                                     std::chrono::milliseconds timeout);

}  // namespace mfsdp
