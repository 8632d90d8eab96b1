// The server of the job's rendezvous store, run by rank 0 on MASTER_ADDR:MASTER_PORT.
//
// What it accepts (docs/comm.md, "Security and failures"): a connection is served only after
// its greeting proves the job token and names a rank and the world size of this job; until
// then at most kMaxGreetingBytes are read from it, and it is closed after kGreetingTimeout.
// Requests of a proven client are capped (keys, values: src/comm/store_protocol.h), a request
// must arrive whole within kRequestTimeout, the unfinished requests of all connections together
// are held to kMaxBufferedBytes (past it, senders wait; one holding part of a request silently
// is closed), and answers go out without blocking: one thread polls every connection, so no
// client, silent, slow or hostile, holds up another, start-up or exit. Clients that are refused or dropped are reported on stderr, one line each, at most one
// a minute after the first few.
#pragma once

#include <string>
#include <thread>
#include <vector>

#include "comm/master_address.h"
#include "launch/socket_fd.h"

namespace mfsdp {

class StoreServer {
 public:
  // Listens on the first of `addresses` (MASTER_ADDR resolved) that is an address of this
  // host. Throws CommError naming the port when it is in use (another job serves there) or
  // naming the address when none is of this host.
  StoreServer(const std::vector<SocketAddress>& addresses, std::string job_token, int world_size);
  // Stops at once, whatever the clients are doing.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // Where it listens (rank 0's own client connects here).
  const SocketAddress& address() const { return address_; }

 private:
  void run();

  SocketAddress address_;
  std::string job_token_;
  int world_size_;
  Fd listener_;
  Fd wake_;  // eventfd: the destructor's stop signal
  std::thread thread_;  // last: started once everything it uses exists
};

}  // namespace mfsdp
