#include "comm/store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "mfsdp/comm.h"

namespace mfsdp {

c10::intrusive_ptr<c10d::Store> connect_store(const RendezvousInfo& info,
                                              std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(info.master_port);
  options.isServer = info.rank == 0;
  options.numWorkers = info.world_size;
  options.waitWorkers = false;  // ranks wait for each other in the Gloo/NCCL rendezvous instead
  options.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(info.master_addr, options);
  } catch (const std::exception& e) {
    throw CommError("rendezvous: rank " + std::to_string(info.rank) + " could not " +
                    (options.isServer ? "start" : "reach") + " the store at " + info.master_addr +
                    ":" + std::to_string(info.master_port) + ": " + e.what());
  }
}

}  // namespace mfsdp
