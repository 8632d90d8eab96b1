#include "comm/master_address.h"

#include <netdb.h>
#include <netinet/in.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include "mfsdp/comm/comm.h"

namespace mfsdp {

std::string SocketAddress::text() const {
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (::getnameinfo(get(), len, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  return addr.ss_family == AF_INET6 ? "[" + std::string(host) + "]:" + port
                                    : std::string(host) + ":" + port;
}

std::vector<SocketAddress> resolve_master(const std::string& host, int port,
                                          std::chrono::milliseconds window) {
  using Clock = std::chrono::steady_clock;
  const auto give_up = Clock::now() + window;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  const std::string service = std::to_string(port);
  for (;;) {
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
    const int err = errno;
    if (rc == 0) {
      std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> list(found, freeaddrinfo);
      std::vector<SocketAddress> out;
      for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
        SocketAddress a;
        std::memcpy(&a.addr, ai->ai_addr, ai->ai_addrlen);
        a.len = ai->ai_addrlen;
        out.push_back(a);
      }
      if (!out.empty()) return out;
    }
    if (Clock::now() >= give_up) {
      const std::string why = rc == 0 ? "no address" : rc == EAI_SYSTEM ? std::strerror(err)
                                                                        : gai_strerror(rc);
      throw CommError("rendezvous: the master address '" + host + "' (MASTER_ADDR) does not " +
                      "resolve: " + why + (window.count() > 0 ? " (asked for " +
                      std::to_string(window.count()) + " ms)" : std::string()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
}

}  // namespace mfsdp
