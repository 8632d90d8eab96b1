// Where the job's store lives: MASTER_ADDR and MASTER_PORT resolved to socket addresses, which
// rank 0 binds (src/comm/store_server.h) and the other ranks connect to (src/comm/store.cpp).
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <string>
#include <vector>

namespace mfsdp {

struct SocketAddress {
  sockaddr_storage addr{};
  socklen_t len = 0;

  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&addr); }
  // "127.0.0.1:29500", "[::1]:29500"
  std::string text() const;
};

// The addresses of `host` (a name or a numeric address) with `port`, in the resolver's order.
// A name that does not resolve is asked again, quietly, every 500 ms for `window` (the DNS entry
// of a node that is still starting can appear late; a zero window asks once), then throws
// CommError: one line naming the host and the resolver's last answer.
std::vector<SocketAddress> resolve_master(const std::string& host, int port,
                                          std::chrono::milliseconds window);

}  // namespace mfsdp
