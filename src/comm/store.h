// The key-value store ranks meet through before they open direct connections: rank 0 serves it
// (src/comm/store_server.h), every rank is a client that proves the job token first
// (docs/comm.md, "Security and failures").
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

#include "mfsdp/comm/rendezvous.h"

namespace mfsdp {

// A job of one rank gets a store in memory (no port). Otherwise rank 0 starts the server on
// info.master_addr:info.master_port, then every rank connects to
// it, retrying quietly while nothing listens there yet, for at most `timeout` (also the
// store's default timeout of get and wait). Throws CommError, one line naming the address and
// port: rank 0 when the port is in use or the address is not of its host; any rank when the
// address does not resolve, the store cannot be reached within `timeout`, or it refuses the
// rank (another job's store: the job token differs). Under torchrun's agent store
// (info.agent_store) every rank is a client of the agent's c10d TCPStore instead, with keys
// under "mfsdp/start_<restart count>/"; CommError naming it when it cannot be reached.
c10::intrusive_ptr<c10d::Store> connect_store(const RendezvousInfo& info,
                                              std::chrono::milliseconds timeout);

// One more connection of this process to the job's store, which rank 0 already serves.
c10::intrusive_ptr<c10d::Store> connect_store_client(const RendezvousInfo& info,
                                                     std::chrono::milliseconds timeout);

}  // namespace mfsdp
