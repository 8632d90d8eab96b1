// How the launchers' rendezvous works: node 0's server is one thread polling non-blocking
// sockets (the listener, the waiting connections and an eventfd that stops it); each client
// request is a non-blocking connect, send and read of one line against a single deadline. Plain
// POSIX: no torch headers here.
#include "mfsdp/launch/launcher_rendezvous.h"

#include "launch/socket_fd.h"
#include "mfsdp/launch/rank_processes.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace mfsdp::launch {
namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kMagic = "mfsdp-rdzv1";
constexpr size_t kMaxRequestBytes = 8192;
constexpr size_t kMaxWaitingConnections = 64;

struct Address {
  sockaddr_storage storage{};
  socklen_t length = 0;
};

std::string address_text(const Address& address) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (address.storage.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&address.storage);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&address.storage);
  inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
  return "[" + std::string(host) + "]:" + std::to_string(ntohs(in6->sin6_port));
}

// The TCP addresses of host:port; throws std::runtime_error naming the host when it does not
// resolve.
std::vector<Address> resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) throw std::runtime_error("the address '" + host + "' does not resolve: " + gai_strerror(rc));
  std::vector<Address> addresses;
  for (addrinfo* entry = found; entry != nullptr; entry = entry->ai_next) {
    Address& address = addresses.emplace_back();
    std::memcpy(&address.storage, entry->ai_addr, entry->ai_addrlen);
    address.length = entry->ai_addrlen;
  }
  freeaddrinfo(found);
  return addresses;
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::max<long long>(left, 0));
}

// Waits for `events` on fd until the deadline; false on timeout.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd entry{fd, events, 0};
    const int ready = poll(&entry, 1, remaining_ms(deadline));
    if (ready > 0) return true;
    if (ready == 0) return false;
    if (errno != EINTR) throw std::runtime_error("poll: " + errno_text(errno));
  }
}

// One request on a connection of its own: connect, send `line`, read the reply line, all before
// `deadline`. Throws std::runtime_error with the reason (refused, timed out, closed).
std::string exchange(const Address& address, const std::string& line, Clock::time_point deadline) {
  Fd socket_fd(::socket(address.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!socket_fd.valid()) throw std::runtime_error("socket: " + errno_text(errno));
  if (::connect(socket_fd.get(), reinterpret_cast<const sockaddr*>(&address.storage), address.length) != 0) {
    if (errno != EINPROGRESS) throw std::runtime_error(errno_text(errno));
    if (!wait_for(socket_fd.get(), POLLOUT, deadline)) throw std::runtime_error("connection timed out");
    int error = 0;
    socklen_t size = sizeof error;
    getsockopt(socket_fd.get(), SOL_SOCKET, SO_ERROR, &error, &size);
    if (error != 0) throw std::runtime_error(errno_text(error));
  }
  for (size_t sent = 0; sent < line.size();) {
    const ssize_t n = ::send(socket_fd.get(), line.data() + sent, line.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!wait_for(socket_fd.get(), POLLOUT, deadline)) throw std::runtime_error("sending timed out");
    } else {
      throw std::runtime_error("send: " + errno_text(errno));
    }
  }
  std::string reply;
  for (;;) {
    if (size_t newline = reply.find('\n'); newline != std::string::npos) return reply.substr(0, newline);
    if (reply.size() > kMaxRequestBytes) throw std::runtime_error("the reply is too long");
    char buffer[1024];
    const ssize_t n = ::recv(socket_fd.get(), buffer, sizeof buffer, 0);
    if (n > 0) {
      reply.append(buffer, static_cast<size_t>(n));
    } else if (n == 0) {
      throw std::runtime_error("the connection was closed without a reply");
    } else if (errno == EAGAIN || errno == EINTR) {
      if (!wait_for(socket_fd.get(), POLLIN, deadline)) throw std::runtime_error("no reply in time");
    } else {
      throw std::runtime_error("recv: " + errno_text(errno));
    }
  }
}

RendezvousReply parse_reply(const std::string& line) {
  RendezvousReply reply;
  std::istringstream fields(line);
  std::string kind;
  fields >> kind;
  auto rest = [&] {
    std::string text;
    std::getline(fields >> std::ws, text);
    return text;
  };
  if (kind == "go" && fields >> reply.round >> reply.master_port) {
    reply.kind = RendezvousReply::kGo;
  } else if (kind == "wait" && fields >> reply.round) {
    reply.kind = RendezvousReply::kWait;
    reply.text = rest();
  } else if (kind == "round" && fields >> reply.round >> reply.done >> reply.failed_by) {
    reply.kind = RendezvousReply::kRound;
  } else if (kind == "abort") {
    reply.kind = RendezvousReply::kAbort;
    reply.text = rest();
  } else {
    reply.kind = RendezvousReply::kError;
    reply.text = kind == "error" ? rest() : "a reply mfsdp-run does not know: '" + line.substr(0, 200) + "'";
  }
  return reply;
}

// "1", "1 and 3", "1, 2 and 3"
std::string node_list(const std::vector<int>& nodes) {
  std::string text;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (i > 0) text += i + 1 == nodes.size() ? " and " : ", ";
    text += std::to_string(nodes[i]);
  }
  return text;
}

std::string seconds_text(std::chrono::milliseconds duration) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", static_cast<double>(duration.count()) / 1000.0);
  return text;
}

}  // namespace

// ---- the server ---------------------------------------------------------------------------------

class RendezvousServer::Impl {
 public:
  Impl(const std::string& host, int port, Config config) : config_(std::move(config)), port_(port) {
    std::string why;
    for (const Address& address : resolve(host, port)) {
      Fd listener(::socket(address.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!listener.valid()) continue;
      const int one = 1;
      setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(listener.get(), reinterpret_cast<const sockaddr*>(&address.storage), address.length) != 0 ||
          ::listen(listener.get(), 128) != 0) {
        const int err = errno;
        why = address_text(address) + ": " +
              (err == EADDRINUSE ? "port " + std::to_string(port) +
                                       " is in use (give each job its own --master-port, or --rdzv-port)"
               : err == EADDRNOTAVAIL ? "not an address of this host (node 0 must run where --master-addr points)"
                                      : errno_text(err));
        continue;
      }
      listener_ = std::move(listener);
      address_ = address_text(address);
      break;
    }
    if (!listener_.valid())
      throw std::runtime_error("node 0 cannot serve the launchers' rendezvous on " + host + ":" + std::to_string(port) +
                               ": " + (why.empty() ? "no usable address" : why));
    wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_.valid()) throw std::runtime_error("eventfd: " + errno_text(errno));
    joined_.assign(config_.nnodes, "");
    done_.assign(config_.nnodes, false);
    master_port_ = config_.first_master_port;
    deadline_ = Clock::now() + config_.join_timeout;
    thread_ = std::thread([this] { serve(); });
  }

  ~Impl() {
    const uint64_t one = 1;
    ssize_t ignored = ::write(wake_.get(), &one, sizeof one);
    (void)ignored;
    thread_.join();
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  const std::string& address() const { return address_; }

 private:
  struct Connection {
    Fd fd;
    std::string peer;
    std::string buffer;
    Clock::time_point deadline;
  };

  void serve() {
    std::vector<Connection> connections;
    for (;;) {
      std::vector<pollfd> fds = {{wake_.get(), POLLIN, 0}, {listener_.get(), POLLIN, 0}};
      for (const Connection& c : connections) fds.push_back({c.fd.get(), POLLIN, 0});
      int timeout = 1000;
      for (const Connection& c : connections) timeout = std::min(timeout, remaining_ms(c.deadline) + 1);
      if (poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) return;
      if (fds[0].revents != 0) return;
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents != 0) read_request(connections[i - 2]);
      }
      if (fds[1].revents != 0) accept_all(connections);
      const auto now = Clock::now();
      connections.erase(std::remove_if(connections.begin(), connections.end(),
                                       [&](const Connection& c) { return !c.fd.valid() || now >= c.deadline; }),
                        connections.end());
    }
  }

  void accept_all(std::vector<Connection>& connections) {
    for (;;) {
      Address peer;
      peer.length = sizeof peer.storage;
      Fd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&peer.storage), &peer.length,
                      SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!fd.valid()) return;  // EAGAIN: none left (or an error the next poll reports again)
      if (connections.size() >= kMaxWaitingConnections) continue;  // closed: the client retries
      connections.push_back({std::move(fd), address_text(peer), "", Clock::now() + kRendezvousRequestTimeout});
    }
  }

  void read_request(Connection& c) {
    char buffer[2048];
    const ssize_t n = ::recv(c.fd.get(), buffer, sizeof buffer, 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0) {
      c.fd.reset();
      return;
    }
    c.buffer.append(buffer, static_cast<size_t>(n));
    const size_t newline = c.buffer.find('\n');
    if (newline == std::string::npos) {
      if (c.buffer.size() > kMaxRequestBytes) c.fd.reset();
      return;
    }
    const std::string reply = answer(c.buffer.substr(0, newline), c.peer) + "\n";
    // A short reply fits the socket's send buffer; a client that cannot take it asks again.
    ssize_t ignored = ::send(c.fd.get(), reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)ignored;
    c.fd.reset();
  }

  // "mfsdp-rdzv1 NNODES MAX_RESTARTS NODE LAUNCHER_ID VERB ROUND ARG TOKEN..." -> the reply line.
  std::string answer(const std::string& line, const std::string& peer) {
    std::istringstream fields(line);
    std::string magic, launcher_id, verb;
    int nnodes = -1, max_restarts = -1, node = -1, round = -1, arg = 0;
    fields >> magic >> nnodes >> max_restarts >> node >> launcher_id >> verb >> round >> arg;
    std::string token;
    if (fields.get() == ' ') std::getline(fields, token);  // the rest of the line, spaces and all
    if (magic != kMagic || node < 0 || node >= config_.nnodes || round < 0)
      return refuse(peer, "not a request of mfsdp-run's rendezvous (or from another version)");
    if (token != config_.token)
      return refuse(peer, "node " + std::to_string(node) + " has another job token than node 0 (MFSDP_JOB_TOKEN)");
    if (nnodes != config_.nnodes)
      return refuse(peer, "node " + std::to_string(node) + " was started with --nnodes " + std::to_string(nnodes) +
                              ", node 0 with --nnodes " + std::to_string(config_.nnodes));
    if (max_restarts != config_.max_restarts)
      return refuse(peer, "node " + std::to_string(node) + " was started with --max-restarts " +
                              std::to_string(max_restarts) + ", node 0 with --max-restarts " +
                              std::to_string(config_.max_restarts));
    if (verb == "join") return join(node, launcher_id, round);
    if (verb == "fail") {
      if (round == round_ && started_ && aborted_.empty()) fail(node);
    } else if (verb == "done") {
      if (round == round_) done_[node] = true;
      // Its ranks finished a round that another node's failure ended: the next round would have
      // to run without it.
      if (round < round_ && aborted_.empty())
        aborted_ = "node " + std::to_string(node) + "'s ranks all exited 0 in round " + std::to_string(round) +
                   ", which node " + std::to_string(failed_by_) + " failed: round " + std::to_string(round_) +
                   " cannot start without them";
    } else if (verb == "interrupt") {
      if (aborted_.empty())
        aborted_ = "node " + std::to_string(node) + "'s mfsdp-run was interrupted by signal " + std::to_string(arg) +
                   " (an interrupt is never restarted)";
    } else if (verb != "poll") {
      return "error unknown request '" + verb.substr(0, 64) + "'";
    }
    return state();
  }

  std::string join(int node, const std::string& launcher_id, int round) {
    if (!aborted_.empty()) return "abort " + aborted_;
    if (round < round_) return state();  // the job moved on: the client joins round_ instead
    if (round > round_)
      return "error node " + std::to_string(node) + " asks to join round " + std::to_string(round) +
             ", but the job is in round " + std::to_string(round_);
    if (!joined_[node].empty() && joined_[node] != launcher_id)
      return "error node " + std::to_string(node) + " already joined round " + std::to_string(round_) +
             " from another mfsdp-run (two launchers given --node-rank " + std::to_string(node) + "?)";
    if (started_) return go();
    std::vector<int> missing;
    for (int other = 0; other < config_.nnodes; ++other) {
      if (other != node && joined_[other].empty()) missing.push_back(other);
    }
    if (!missing.empty() && Clock::now() >= deadline_) {
      aborted_ = (missing.size() == 1 ? "node " : "nodes ") + node_list(missing) + " did not join round " +
                 std::to_string(round_) + " within " + seconds_text(config_.join_timeout) +
                 " (--rdzv-conf join_timeout); was its mfsdp-run stopped, or is " +
                 (missing.size() == 1 ? "its host" : "a host") + " down?";
      return "abort " + aborted_;
    }
    joined_[node] = launcher_id;
    if (!missing.empty()) {
      std::string list;
      for (int other : missing) list += (list.empty() ? "" : ",") + std::to_string(other);
      return "wait " + std::to_string(round_) + " " + list;
    }
    started_ = true;
    return go();
  }

  // A node's ranks failed in the running round: the next round begins (when restarts remain, the
  // clients join it; otherwise nobody does and every launcher ends on its own).
  void fail(int node) {
    std::vector<int> finished;
    for (int other = 0; other < config_.nnodes; ++other) {
      if (done_[other]) finished.push_back(other);
    }
    if (!finished.empty()) {
      aborted_ = "round " + std::to_string(round_) + " failed on node " + std::to_string(node) + " after node " +
                 node_list(finished) + "'s ranks all exited 0: round " + std::to_string(round_ + 1) +
                 " cannot start without them";
      return;
    }
    ++round_;
    failed_by_ = node;
    started_ = false;
    joined_.assign(config_.nnodes, "");
    done_.assign(config_.nnodes, false);
    deadline_ = Clock::now() + config_.join_timeout;
    if (round_ > config_.max_restarts) return;
    // A port of its own for each round's store (as torchrun's agent picks one): never this
    // server's, nor the round before's, which an old rank might still hold a moment.
    try {
      int port = master_port_;
      for (int attempt = 0; attempt < 16 && (port == master_port_ || port == port_); ++attempt) port = pick_free_port();
      master_port_ = port;
    } catch (const std::exception& error) {
      aborted_ = std::string("no port for round ") + std::to_string(round_) + ": " + error.what();
    }
  }

  std::string go() const { return "go " + std::to_string(round_) + " " + std::to_string(master_port_); }

  std::string state() const {
    if (!aborted_.empty()) return "abort " + aborted_;
    const int done = static_cast<int>(std::count(done_.begin(), done_.end(), true));
    return "round " + std::to_string(round_) + " " + std::to_string(done) + " " + std::to_string(failed_by_);
  }

  // Refused requests are told why and noted on stderr (the first few, then one a minute at most).
  std::string refuse(const std::string& peer, const std::string& why) {
    const auto now = Clock::now();
    if (refusals_ < 5 || now >= next_refusal_note_) {
      std::fprintf(stderr, "mfsdp-run: the launchers' rendezvous on %s refused a request from %s: %s\n",
                   address_.c_str(), peer.c_str(), why.c_str());
      if (refusals_ >= 5) next_refusal_note_ = now + std::chrono::minutes(1);
    }
    ++refusals_;
    return "error refused by node 0's launcher: " + why;
  }

  const Config config_;
  const int port_;
  std::string address_;
  Fd listener_;
  Fd wake_;
  // The job's state; only the serving thread touches it.
  int round_ = 0;
  int master_port_ = 0;
  int failed_by_ = -1;
  bool started_ = false;                // every node joined round_
  std::vector<std::string> joined_;     // per node: the launcher id that joined round_, "" if none
  std::vector<bool> done_;              // per node: every rank exited 0 in round_
  Clock::time_point deadline_;          // for every node to join round_
  std::string aborted_;                 // not empty: the job ends, for this reason
  int refusals_ = 0;
  Clock::time_point next_refusal_note_{};
  std::thread thread_;  // last: started once everything it uses exists
};

RendezvousServer::RendezvousServer(const std::string& host, int port, Config config)
    : impl_(std::make_unique<Impl>(host, port, std::move(config))) {}

RendezvousServer::~RendezvousServer() = default;

const std::string& RendezvousServer::address() const { return impl_->address(); }

// ---- the client ---------------------------------------------------------------------------------

struct RendezvousClient::Addresses {
  std::vector<Address> list;  // empty: resolved on the next request
};

RendezvousClient::RendezvousClient(std::string host, int port, RendezvousIdentity identity)
    : host_(std::move(host)),
      port_(port),
      identity_(std::move(identity)),
      addresses_(std::make_unique<Addresses>()) {}

RendezvousClient::~RendezvousClient() = default;

std::string RendezvousClient::server_text() const { return host_ + ":" + std::to_string(port_); }

RendezvousReply RendezvousClient::request(const std::string& verb, int round, int arg,
                                          std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const std::string line = std::string(kMagic) + " " + std::to_string(identity_.nnodes) + " " +
                           std::to_string(identity_.max_restarts) + " " + std::to_string(identity_.node_rank) + " " +
                           identity_.launcher_id + " " + verb + " " + std::to_string(round) + " " +
                           std::to_string(arg) + " " + identity_.token + "\n";
  std::string why;
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Address>& addresses = addresses_->list;
    if (addresses.empty()) addresses = resolve(host_, port_);
    for (const Address& address : addresses) {
      try {
        return parse_reply(exchange(address, line, deadline));
      } catch (const std::runtime_error& error) {
        why = address_text(address) + ": " + error.what();
      }
    }
    addresses.clear();  // resolved again next time: the name may point elsewhere by then
  } catch (const std::runtime_error& error) {
    why = error.what();
  }
  throw std::runtime_error("cannot reach node 0's launcher at " + server_text() + " (" + why + ")");
}

}  // namespace mfsdp::launch
