// The store's client: a c10d::Store over one connection, one request at a time (a mutex
// serialises the threads of a process), with every wait bounded by a deadline.
#include "comm/store.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "comm/master_address.h"
#include "comm/store_protocol.h"
#include "comm/store_server.h"
#include "launch/socket_fd.h"
#include "mfsdp/comm/comm.h"

namespace mfsdp {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using namespace store_wire;

// How long a get or wait may outlast its own timeout before the server's answer is overdue.
constexpr milliseconds kAnswerGrace{10000};
// How long a master name that does not resolve is asked again on a job of several nodes.
constexpr milliseconds kResolveWindow{30000};

milliseconds left_until(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return milliseconds(-1);  // poll(): no limit
  return std::max(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()), milliseconds(0));
}

// Waits for `events` on `fd` until `deadline`; false with `why` when it passed.
bool wait_for(int fd, short events, Clock::time_point deadline, std::string* why) {
  for (;;) {
    const auto left = left_until(deadline);
    if (left.count() == 0) {
      *why = "no answer in time";
      return false;
    }
    pollfd p{fd, events, 0};
    const int chunk = left.count() < 0 ? 1000 : static_cast<int>(std::min<int64_t>(left.count(), 1000));
    const int ready = ::poll(&p, 1, chunk);
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) {
      *why = "poll: " + errno_text(errno);
      return false;
    }
  }
}

bool send_all(int fd, const std::string& bytes, Clock::time_point deadline, std::string* why) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_for(fd, POLLOUT, deadline, why)) return false;
    } else {
      *why = errno_text(errno);
      return false;
    }
  }
  return true;
}

bool recv_exact(int fd, char* dst, size_t nbytes, Clock::time_point deadline, std::string* why) {
  size_t done = 0;
  while (done < nbytes) {
    const ssize_t n = ::recv(fd, dst + done, nbytes - done, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n == 0) {
      *why = "it closed the connection";
      return false;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!wait_for(fd, POLLIN, deadline, why)) return false;
    } else {
      *why = errno_text(errno);
      return false;
    }
  }
  return true;
}

// One frame's body, at most `max_bytes` long.
bool recv_frame(int fd, uint32_t max_bytes, Clock::time_point deadline, std::string* body,
                std::string* why) {
  uint32_t n = 0;
  if (!recv_exact(fd, reinterpret_cast<char*>(&n), 4, deadline, why)) return false;
  if (n > max_bytes) {
    *why = "an answer of " + std::to_string(n) + " bytes, over the limit of " + std::to_string(max_bytes);
    return false;
  }
  body->resize(n);
  return recv_exact(fd, body->data(), n, deadline, why);
}

// A connected non-blocking socket to `a`, or an invalid one with `why`.
Fd connect_to(const SocketAddress& a, Clock::time_point deadline, std::string* why) {
  Fd fd(::socket(a.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    *why = "socket: " + errno_text(errno);
    return fd;
  }
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (::connect(fd.get(), a.get(), a.len) != 0) {
    if (errno != EINPROGRESS && errno != EINTR) {
      *why = errno_text(errno);
      return Fd();
    }
    if (!wait_for(fd.get(), POLLOUT, deadline, why)) return Fd();
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      *why = errno_text(err);
      return Fd();
    }
  }
  return fd;
}

class JobStore : public c10d::Store {
 public:
  // Connects and proves the job token; see connect_store() in store.h.
  JobStore(RendezvousInfo info, std::vector<SocketAddress> addresses, milliseconds timeout,
           std::shared_ptr<StoreServer> server)
      : c10d::Store(timeout), server_(std::move(server)), info_(std::move(info)),
        addresses_(std::move(addresses)) {
    where_ = server_ ? server_->address().text()
                     : info_.master_addr + ":" + std::to_string(info_.master_port);
    connect(timeout);
  }

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<JobStore>(info_, std::vector<SocketAddress>{connected_}, timeout_,
                                         server_);
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    call(Writer().u8(kSet).str(checked_key(key)).str(checked_value(value)), "set", timeout_);
  }

  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    std::string body = call(Writer().u8(kCompareSet).str(checked_key(key)).str(checked_value(expected))
                                .str(checked_value(desired)),
                            "compare_set", timeout_);
    Reader r(body);
    std::string v = r.str(kMaxValueBytes, "value");
    return std::vector<uint8_t>(v.begin(), v.end());
  }

  std::vector<uint8_t> get(const std::string& key) override {
    std::string body = call(Writer().u8(kGet).str(checked_key(key)).i64(timeout_.count()),
                            "get of '" + key.substr(0, 200) + "'", timeout_, /*waits=*/true);
    Reader r(body);
    std::string v = r.str(kMaxValueBytes, "value");
    return std::vector<uint8_t>(v.begin(), v.end());
  }

  int64_t add(const std::string& key, int64_t value) override {
    return Reader(call(Writer().u8(kAdd).str(checked_key(key)).i64(value), "add", timeout_)).i64();
  }

  bool deleteKey(const std::string& key) override {
    return Reader(call(Writer().u8(kDelete).str(checked_key(key)), "delete", timeout_)).u8() != 0;
  }

  bool check(const std::vector<std::string>& keys) override {
    return Reader(call(with_keys(kCheck, keys), "check", timeout_)).u8() != 0;
  }

  int64_t getNumKeys() override {
    return Reader(call(Writer().u8(kNumKeys), "num_keys", timeout_)).i64();
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    call(with_keys(kWait, keys).i64(timeout.count()), "wait", timeout, /*waits=*/true);
  }

 private:
  void connect(milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    const std::string who = "rendezvous: rank " + std::to_string(info_.rank);
    std::string last = "nothing answered";
    auto pause = milliseconds(50);
    for (;;) {
      for (const SocketAddress& a : addresses_) {
        std::string why;
        Fd fd = connect_to(a, deadline, &why);
        if (!fd.valid()) {
          last = a.text() + ": " + why;
          continue;
        }
        // The greeting is answered at once by a live store: give it its own short deadline.
        const auto greet_by = Clock::now() + kGreetingTimeout;
        std::string body;
        const std::string greeting =
            Writer().u64(kMagic).str(info_.job_token).i64(info_.rank).i64(info_.world_size).frame();
        if (!send_all(fd.get(), greeting, greet_by, &why) ||
            !recv_frame(fd.get(), kMaxGreetingBytes, greet_by, &body, &why)) {
          last = a.text() + ": " + why + " during the greeting";  // e.g. closed as the oldest stranger
          continue;
        }
        uint64_t magic = 0;
        uint8_t status = 0;
        std::string message;
        try {
          Reader r(body);
          magic = r.u64();
          status = r.u8();
          message = r.str(kMaxGreetingBytes, "message");
        } catch (const ProtocolError&) {
        }
        if (magic != kMagic)
          throw CommError(who + ": something other than an mfsdp store answers at " + a.text() +
                          " (MASTER_ADDR:MASTER_PORT); is another program using port " +
                          std::to_string(info_.master_port) + "?");
        if (status != kOk) throw CommError(who + " was refused by the store at " + a.text() + ": " + message);
        fd_ = std::move(fd);
        connected_ = a;
        return;
      }
      if (Clock::now() >= deadline)
        throw CommError(who + " could not reach the store at " + where_ + " within " +
                        std::to_string(timeout.count()) + " ms: " + last +
                        " (rank 0 serves it: has it started, and is MASTER_ADDR its address?)");
      std::this_thread::sleep_for(std::min(pause, std::max(left_until(deadline), milliseconds(1))));
      pause = std::min(pause * 2, milliseconds(1000));
    }
  }

  // Sends one request and returns the rest of its answer after the status. Throws CommError
  // when the store answers with an error or a timeout (the connection stays usable), or does not
  // answer in time (then the connection is broken: the answer could still come).
  std::string call(Writer request, const std::string& what, milliseconds limit, bool waits = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_.empty()) throw CommError(broken_);
    // A zero limit is c10d's "no timeout".
    const auto deadline = limit.count() <= 0 ? Clock::time_point::max()
                          : Clock::now() + limit + (waits ? kAnswerGrace : milliseconds(0));
    std::string why, body;
    if (!send_all(fd_.get(), request.frame(), deadline, &why) ||
        !recv_frame(fd_.get(), kMaxRequestBytes, deadline, &body, &why)) {
      broken_ = "rendezvous store at " + where_ + ": " + what + " failed: " + why +
                (why == "it closed the connection" ? " (rank 0 exited or failed)" : "");
      fd_.reset();
      throw CommError(broken_);
    }
    Reader r(body);
    const uint8_t status = r.u8();
    if (status == kOk) return body.substr(1);
    const std::string message = r.str(kMaxRequestBytes, "message");
    if (status == kTimedOut)
      throw CommError("rendezvous store at " + where_ + ": " + what + " timed out after " +
                      std::to_string(limit.count()) + " ms: " + message);
    broken_ = "rendezvous store at " + where_ + ": " + what + " refused: " + message;
    throw CommError(broken_);
  }

  static Writer with_keys(Op op, const std::vector<std::string>& keys) {
    Writer w;
    w.u8(op).u32(static_cast<uint32_t>(keys.size()));
    for (const auto& k : keys) w.str(checked_key(k));
    return w;
  }

  static const std::string& checked_key(const std::string& key) {
    if (key.size() > kMaxKeyBytes)
      throw std::invalid_argument("store key of " + std::to_string(key.size()) +
                                  " bytes is over the limit of " + std::to_string(kMaxKeyBytes));
    return key;
  }

  static std::string checked_value(const std::vector<uint8_t>& value) {
    if (value.size() > kMaxValueBytes)
      throw std::invalid_argument("store value of " + std::to_string(value.size()) +
                                  " bytes is over the limit of " + std::to_string(kMaxValueBytes));
    return std::string(value.begin(), value.end());
  }

  std::shared_ptr<StoreServer> server_;  // rank 0: the server this process runs; goes last
  RendezvousInfo info_;
  std::vector<SocketAddress> addresses_;
  SocketAddress connected_;
  std::string where_;  // "host:port", for messages
  std::mutex mutex_;
  Fd fd_;               // guarded by mutex_
  std::string broken_;  // why the connection cannot be used any more; guarded by mutex_
};

// How long a master name that does not resolve is asked again: on one node MASTER_ADDR names
// this host, whose name resolves now or never; a job of several nodes may start before the
// DNS entry of rank 0's node exists.
milliseconds resolve_window(const RendezvousInfo& info, milliseconds timeout) {
  return info.single_node() ? milliseconds(0) : std::min(timeout, kResolveWindow);
}

// torchrun's agent store (RendezvousInfo::agent_store): LibTorch's own c10d TCPStore client (the
// agent speaks its protocol, not this file's), this start's keys under a prefix of their own, in
// case the agent's store outlives the workers of one start with their keys (TCP mesh addresses
// that no longer answer).
c10::intrusive_ptr<c10d::Store> agent_store_client(const RendezvousInfo& info, milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(info.master_port);
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = timeout;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(info.master_addr, o);
    return c10::make_intrusive<c10d::PrefixStore>("mfsdp/start_" + std::to_string(info.restart_count), store);
  } catch (const c10::Error& e) {  // c10d's DistNetworkError and DistStoreError
    throw CommError("rank " + std::to_string(info.rank) + " could not reach torchrun's store at " + info.master_addr +
                    ":" + std::to_string(info.master_port) + " (TORCHELASTIC_USE_AGENT_STORE=True) within " +
                    std::to_string(timeout.count()) + " ms: " + e.what_without_backtrace());
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Store> connect_store(const RendezvousInfo& info, milliseconds timeout) {
  // A job of one process has no one to meet: a store in memory, and no port opened.
  if (info.world_size == 1) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    store->setTimeout(timeout);
    return store;
  }
  if (info.agent_store) return agent_store_client(info, timeout);
  std::vector<SocketAddress> addresses =
      resolve_master(info.master_addr, info.master_port, resolve_window(info, timeout));
  if (info.rank != 0) return c10::make_intrusive<JobStore>(info, std::move(addresses), timeout, nullptr);
  if (info.job_token.empty())
    std::fprintf(stderr,
                 "mfsdp: warning: this job has no job token (MFSDP_JOB_TOKEN; mfsdp-run makes one "
                 "on a single node, torchrun --standalone and Slurm give one): any process that "
                 "reaches %s:%d can join it\n",
                 info.master_addr.c_str(), info.master_port);
  auto server = std::make_shared<StoreServer>(addresses, info.job_token, info.world_size);
  std::vector<SocketAddress> own{server->address()};
  return c10::make_intrusive<JobStore>(info, std::move(own), timeout, std::move(server));
}

c10::intrusive_ptr<c10d::Store> connect_store_client(const RendezvousInfo& info,
                                                     milliseconds timeout) {
  if (info.agent_store) return agent_store_client(info, timeout);
  return c10::make_intrusive<JobStore>(
      info, resolve_master(info.master_addr, info.master_port, resolve_window(info, timeout)),
      timeout, nullptr);
}

}  // namespace mfsdp
