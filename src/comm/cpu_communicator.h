// The CPU communicator (backend "gloo", the name torch users know for CPU collectives).
//
// Collectives are our own ring algorithms (all-to-all: every rank sends to every other directly):
// bandwidth-optimal ((N-1)/N of the data per link), any per-rank counts including zero, any
// dtype, fp32 accumulation for bf16/fp16, and errors that name the peer a rank was waiting on.
// They run on the communicator's CommThread. Bulk data moves through shared memory when every
// rank is on this host (src/comm/shm_exchange.h), else (and for broadcast and barrier) over our
// own TCP mesh (src/comm/tcp_mesh.h): tagged point-to-point messages on one connection per pair
// of ranks.
//
// Why not Gloo, whose name the backend keeps: the PyTorch wheel's libtorch_cpu.so exports its own,
// newer Gloo but ships no Gloo headers, and a second Gloo (say Debian's libgloo) beside it would
// put two definitions of every Gloo symbol into one process. We only ever used Gloo's TCP
// transport (c10d's ProcessGroupGloo had no reduce-scatter, no flat all-gather and no bf16), and
// that transport is small enough to own.
//
// Addresses: CommOptions::socket_ifname (else MFSDP_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME) names
// the interface whose address ranks listen on; otherwise the loopback address when all ranks are
// on one node, else this host's name.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace mfsdp {

// Connects every rank of `info` through `store` (see store.h) within
// options.rendezvous_timeout and returns the world communicator, whose collectives time out
// after options.timeout; options.shared_memory and options.socket_ifname as comm.h says (the
// environment variables only where they are unset). Its keys live under "mfsdp/gloo/", so the
// store can be shared.
std::shared_ptr<Communicator> make_cpu_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RendezvousInfo& info, const CommOptions& options);

// Payload bytes `comm` (a CPU communicator) has put on its links so far: TCP messages plus what
// it wrote into shared-memory slots for its peers; -1 for any other communicator. For tests and
// benchmarks of wire volume (e.g. --grad-reduce-in-bf16 halves a reduce-scatter's bytes).
int64_t cpu_bytes_sent(const Communicator& comm);

}  // namespace mfsdp
