// The key-value store ranks meet through before they open direct connections: a c10d TCPStore
// whose server runs in rank 0.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

#include "mfsdp/rendezvous.h"

namespace mfsdp {

// Rank 0 starts the server on info.master_port; every rank connects to info.master_addr.
// Throws CommError naming the address when rank 0 cannot be reached within `timeout`.
c10::intrusive_ptr<c10d::Store> connect_store(const RendezvousInfo& info,
                                              std::chrono::milliseconds timeout);

}  // namespace mfsdp
