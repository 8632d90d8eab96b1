#include "comm/tcp_mesh.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "launch/socket_fd.h"
#include "mfsdp/comm/comm.h"

namespace mfsdp {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint64_t kHelloMagic = 0x6d66736470746d31;  // "mfsdptm1"
constexpr size_t kHeaderBytes = 16;                   // slot, payload bytes (host order: one ABI)
constexpr size_t kStageBytes = 256 << 10;             // per-peer read staging (headers, small ones)
constexpr size_t kDirectReadMin = 64 << 10;           // larger payload remainders are read in place
constexpr size_t kReadBudget = 64 << 20;              // per peer and poll round, for fairness
constexpr int kMaxIov = 64;                           // iovecs per sendmsg (32 queued messages)
constexpr size_t kHoldMin = 64 << 10;                 // early messages this large are held back
constexpr milliseconds kHoldGrace{2};                 // a wait blocked this long buffers them
constexpr milliseconds kHoldMax{20};                  // and so does holding them this long

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// First message on every connection, both ways: the connecting rank sends the acceptor's nonce
// (read from the store), the acceptor answers with its own identity.
struct Hello {
  uint64_t magic;
  uint64_t nonce;
  int32_t rank;
  int32_t size;
};
static_assert(sizeof(Hello) == 24, "Hello is sent as raw bytes");

struct PeerAddress {
  std::string host, port;
  uint64_t nonce = 0;
  sockaddr_storage addr{};
  socklen_t addr_len = 0;
};

std::string store_key(int rank) { return "tcp_mesh/" + std::to_string(rank); }

std::string join_ranks(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

milliseconds left_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  return std::max(left, milliseconds(1));
}

// Listens on an ephemeral port of the first address of `bind_host` that takes a socket.
Fd listen_on(const std::string& bind_host, int rank, std::string* host, std::string* port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(bind_host.c_str(), "0", &hints, &found); rc != 0)
    throw CommError("tcp mesh: rank " + std::to_string(rank) + " cannot resolve its address '" +
                    bind_host + "': " + gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> list(found, freeaddrinfo);
  std::string why = "no address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid() || ::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 ||
        ::listen(fd.get(), SOMAXCONN) != 0) {
      why = errno_text(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    char h[NI_MAXHOST], p[NI_MAXSERV];
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0 ||
        ::getnameinfo(reinterpret_cast<sockaddr*>(&bound), len, h, sizeof h, p, sizeof p,
                      NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
      why = "getsockname: " + errno_text(errno);
      continue;
    }
    *host = h;
    *port = p;
    return fd;
  }
  throw CommError("tcp mesh: rank " + std::to_string(rank) + " cannot listen on '" + bind_host +
                  "': " + why);
}

// Addresses the ranks below `rank` published (this rank connects to them).
std::vector<PeerAddress> lower_addresses(c10d::Store& store, int rank, Clock::time_point deadline,
                                         milliseconds timeout) {
  std::vector<PeerAddress> out(rank);
  if (rank == 0) return out;
  std::vector<std::string> keys;
  for (int r = 0; r < rank; ++r) keys.push_back(store_key(r));
  try {
    store.wait(keys, left_until(deadline));
  } catch (const std::exception& e) {
    std::vector<int> missing;
    for (int r = 0; r < rank; ++r) {
      bool there = false;
      try {
        there = store.check({keys[r]});
      } catch (const std::exception&) {
      }
      if (!there) missing.push_back(r);
    }
    throw CommError("tcp mesh: rank " + std::to_string(rank) + " found no address of rank(s) " +
                    join_ranks(missing) + " in the store within " +
                    std::to_string(timeout.count()) + " ms: " + e.what());
  }
  for (int r = 0; r < rank; ++r) {
    std::vector<uint8_t> v = store.get(keys[r]);
    std::istringstream in(std::string(v.begin(), v.end()));
    PeerAddress& a = out[r];
    if (!(in >> a.host >> a.port >> a.nonce))
      throw CommError("tcp mesh: rank " + std::to_string(rank) +
                      " read a malformed address of rank " + std::to_string(r) +
                      " from the store: '" + std::string(v.begin(), v.end()) +
                      "' (expected '<host> <port> <nonce>')");
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    if (int rc = ::getaddrinfo(a.host.c_str(), a.port.c_str(), &hints, &found); rc != 0)
      throw CommError("tcp mesh: rank " + std::to_string(rank) + " cannot use the address " +
                      a.host + ":" + a.port + " of rank " + std::to_string(r) + ": " +
                      gai_strerror(rc));
    std::memcpy(&a.addr, found->ai_addr, found->ai_addrlen);
    a.addr_len = found->ai_addrlen;
    freeaddrinfo(found);
  }
  return out;
}

// Connects this rank to every other: it connects to the lower ranks and accepts the higher
// ones, all at once in one poll loop (so no rank waits for another's sequential progress).
// Returns one connected non-blocking socket per peer (invalid at `rank`).
std::vector<Fd> connect_full_mesh(c10d::Store& store, int rank, int size,
                                  const std::string& bind_host, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::random_device entropy;
  const uint64_t nonce = (uint64_t{entropy()} << 32) ^ entropy() ^
                         static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  std::string host, port;
  Fd listener = listen_on(bind_host, rank, &host, &port);
  const std::string published = host + " " + port + " " + std::to_string(nonce);
  store.set(store_key(rank), std::vector<uint8_t>(published.begin(), published.end()));
  std::vector<PeerAddress> lower = lower_addresses(store, rank, deadline, timeout);

  enum Phase { kIdle, kConnecting, kHello, kReply };
  struct Outgoing {
    Fd fd;
    Phase phase = kIdle;
    size_t done = 0;
    Hello hello{}, reply{};
    Clock::time_point retry_at{};
    std::string last_error = "no answer";
  };
  struct Incoming {
    Fd fd;
    Hello hello{};
    size_t got = 0;
  };
  std::vector<Fd> peers(size);
  int connected = 0;
  std::vector<Outgoing> out(rank);
  std::vector<Incoming> pending;

  auto retry = [&](Outgoing& o, const std::string& why) {
    o.fd.reset();
    o.phase = kIdle;
    o.last_error = why;
    o.retry_at = Clock::now() + milliseconds(20);
  };
  // Drives one outgoing connection as far as it goes without blocking.
  auto advance = [&](int r, short revents) {
    Outgoing& o = out[r];
    if (o.phase == kConnecting) {
      if (!(revents & (POLLOUT | POLLERR | POLLHUP))) return;
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(o.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) return retry(o, errno_text(err));
      o.phase = kHello;
      o.done = 0;
    }
    if (o.phase == kHello) {
      const char* p = reinterpret_cast<const char*>(&o.hello);
      ssize_t n = ::send(o.fd.get(), p + o.done, sizeof(Hello) - o.done, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        return retry(o, errno_text(errno));
      }
      o.done += static_cast<size_t>(n);
      if (o.done < sizeof(Hello)) return;
      o.phase = kReply;
      o.done = 0;
      return;  // the answer comes later
    }
    if (o.phase == kReply && (revents & (POLLIN | POLLERR | POLLHUP))) {
      char* p = reinterpret_cast<char*>(&o.reply);
      ssize_t n = ::recv(o.fd.get(), p + o.done, sizeof(Hello) - o.done, 0);
      if (n == 0) return retry(o, "closed the connection during the handshake");
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        return retry(o, errno_text(errno));
      }
      o.done += static_cast<size_t>(n);
      if (o.done < sizeof(Hello)) return;
      const Hello& h = o.reply;
      if (h.magic != kHelloMagic || h.nonce != lower[r].nonce || h.rank != r || h.size != size)
        return retry(o, "a different process answered at that address (wrong handshake)");
      peers[r] = std::move(o.fd);
      ++connected;
    }
  };
  auto start = [&](int r) {
    Outgoing& o = out[r];
    const PeerAddress& a = lower[r];
    o.fd = Fd(::socket(a.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!o.fd.valid()) return retry(o, "socket: " + errno_text(errno));
    set_nodelay(o.fd.get());
    o.hello = Hello{kHelloMagic, a.nonce, rank, size};
    o.done = 0;
    if (::connect(o.fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), a.addr_len) == 0) {
      o.phase = kHello;
      advance(r, 0);
    } else if (errno == EINPROGRESS || errno == EINTR) {
      o.phase = kConnecting;
    } else {
      retry(o, errno_text(errno));
    }
  };
  // A complete hello from an accepted connection: keep it when it is a higher rank of this mesh.
  auto accept_hello = [&](Incoming& in) {
    const Hello& h = in.hello;
    if (h.magic != kHelloMagic || h.nonce != nonce || h.size != size || h.rank <= rank ||
        h.rank >= size)
      return;  // a stray connection: dropped with `in`
    Hello reply{kHelloMagic, nonce, rank, size};
    if (::send(in.fd.get(), &reply, sizeof reply, MSG_NOSIGNAL) != sizeof reply) return;
    if (!peers[h.rank].valid()) ++connected;
    peers[h.rank] = std::move(in.fd);  // a retried connection replaces a dead first one
  };

  std::vector<pollfd> fds;
  std::vector<int> owner;  // per pollfd: -1 listener, r < rank outgoing, -(2 + i) pending[i]
  while (connected < size - 1) {
    const auto now = Clock::now();
    if (now >= deadline) {
      std::ostringstream why;
      std::vector<int> missing;
      for (int r = 0; r < size; ++r)
        if (r != rank && !peers[r].valid()) missing.push_back(r);
      why << "tcp mesh: rank " << rank << " could not connect to rank(s) " << join_ranks(missing)
          << " within " << timeout.count() << " ms (it listens on " << host << ":" << port << ")";
      for (int r : missing) {
        if (r < rank)
          why << "; rank " << r << " at " << lower[r].host << ":" << lower[r].port << ": "
              << out[r].last_error;
        else
          why << "; rank " << r << " never connected";
      }
      throw CommError(why.str());
    }
    bool idle_retries = false;
    for (int r = 0; r < rank; ++r) {
      if (peers[r].valid() || out[r].phase != kIdle) continue;
      if (now >= out[r].retry_at) start(r);
      if (out[r].phase == kIdle) idle_retries = true;
    }
    fds.clear();
    owner.clear();
    fds.push_back({listener.get(), POLLIN, 0});
    owner.push_back(-1);
    for (int r = 0; r < rank; ++r) {
      if (peers[r].valid() || out[r].phase == kIdle) continue;
      fds.push_back({out[r].fd.get(), out[r].phase == kReply ? short(POLLIN) : short(POLLOUT), 0});
      owner.push_back(r);
    }
    for (size_t i = 0; i < pending.size(); ++i) {
      fds.push_back({pending[i].fd.get(), POLLIN, 0});
      owner.push_back(-2 - static_cast<int>(i));
    }
    auto wait = std::chrono::duration_cast<milliseconds>(deadline - now).count() + 1;
    if (idle_retries) wait = std::min<int64_t>(wait, 20);
    int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(wait, 1000)));
    if (ready < 0 && errno != EINTR)
      throw CommError("tcp mesh: rank " + std::to_string(rank) + ": poll: " + errno_text(errno));
    if (ready <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      if (owner[i] >= 0) {
        advance(owner[i], fds[i].revents);
      } else if (owner[i] <= -2) {
        Incoming& in = pending[-2 - owner[i]];
        ssize_t n = ::recv(in.fd.get(), reinterpret_cast<char*>(&in.hello) + in.got,
                           sizeof(Hello) - in.got, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          in.fd.reset();
        } else if (n > 0 && (in.got += static_cast<size_t>(n)) == sizeof(Hello)) {
          accept_hello(in);
          in.fd.reset();  // kept ones were moved out
        }
      }
    }
    // New connections last: `pending` grows here, after the loop above used its indices.
    if (fds[0].revents != 0) {
      for (;;) {
        int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        set_nodelay(fd);
        pending.push_back(Incoming{Fd(fd)});
      }
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [](const Incoming& in) { return !in.fd.valid(); }),
                  pending.end());
  }
  return peers;
}

enum class Status { kPending, kDone, kFailed };

struct RecvOp {
  uint64_t slot = 0;
  char* dst = nullptr;
  size_t nbytes = 0;
  Status status = Status::kPending;
  std::string error;
  // post_recv is copying its message (which arrived whole) out of the buffer, outside the lock:
  // the receive has its bytes, so the peer's stream ending meanwhile must not fail it.
  bool delivering = false;
};

struct SendOp {
  uint64_t header[2] = {0, 0};  // slot, payload bytes
  const char* src = nullptr;
  size_t nbytes = 0;
  size_t sent = 0;  // of kHeaderBytes + nbytes
  Status status = Status::kPending;
  std::string error;
};

// A message that arrived before its receive was posted.
struct Unexpected {
  uint64_t slot = 0;
  std::unique_ptr<char[]> data;
  size_t nbytes = 0;
  bool complete = false;
  std::shared_ptr<RecvOp> claimed;  // posted while the message was still arriving
};

}  // namespace

struct TcpMesh::State {
  struct Peer {
    Fd fd;
    bool open = false;       // false: never connected (self) or its stream ended; guarded
    std::string error;       // why the stream ended; guarded by mutex
    std::string send_error;  // why writing failed (reading goes on: what the peer sent before
                             // it went away is still delivered); guarded by mutex

    // Guarded by mutex. Sends in posting order until waited; [unsent, end) are not fully
    // written; `writing`: a thread is in sendmsg on this socket.
    std::deque<std::shared_ptr<SendOp>> sends;
    size_t unsent = 0;
    bool writing = false;
    // Guarded by mutex. Receives in posting order until waited; per slot, the posted receives
    // no message matched yet and the arrived messages no receive claimed yet.
    std::deque<std::shared_ptr<RecvOp>> recvs;
    std::map<uint64_t, std::deque<std::shared_ptr<RecvOp>>> unmatched;
    std::map<uint64_t, std::deque<std::shared_ptr<Unexpected>>> unexpected;

    // The incoming stream. Only the progress thread reads from the socket and writes these;
    // it does so under the mutex (wait_recv reads them for its messages), except for `stage`,
    // which is its own.
    std::unique_ptr<char[]> stage;
    size_t stage_begin = 0, stage_end = 0;
    bool in_payload = false;
    std::shared_ptr<RecvOp> cur_op;               // the message lands in a posted receive
    std::shared_ptr<Unexpected> cur_unexpected;   // or in a buffer of its own
    char* cur_dst = nullptr;                      // null: discarded (a size mismatch)
    size_t cur_remaining = 0;
    // A large message (header read) that no posted receive matched and none other was posted
    // for: its payload stays in the socket (the sender's writes stall) until its receive is
    // posted and it is read into place, saving a buffer and a copy when the receiver is only a
    // little behind. It is buffered after all when a receive of another slot is posted for this
    // peer, when a wait on this mesh has been blocked for kHoldGrace (what it waits for may
    // depend on the sender getting on), after kHoldMax (the same through anything else: another
    // mesh, the store, the caller), or when the connection reports an error.
    bool held = false;
    uint64_t held_slot = 0;
    Clock::time_point held_since{};
  };

  State(int rank, int size, std::vector<Fd> fds) : rank_(rank), peers_(size) {
    for (int p = 0; p < size; ++p) {
      peers_[p].open = fds[p].valid();
      peers_[p].fd = std::move(fds[p]);
    }
    wake_fd_ = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!wake_fd_.valid())
      throw CommError("tcp mesh: rank " + std::to_string(rank) + ": eventfd: " + errno_text(errno));
    if (size > 1) thread_ = std::thread([this] { progress_loop(); });
  }

  ~State() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      wake_locked();
    }
    if (thread_.joinable()) thread_.join();
    // Sockets close with the Fds; peers see EOF and fail whatever they still wait for from us.
  }

  // ---- caller side ----------------------------------------------------------------------------

  void post_recv(int peer, uint64_t slot, void* dst, size_t nbytes) {
    std::unique_lock<std::mutex> lock(mutex_);
    check_usable(peer, "post_recv");
    Peer& p = peers_[peer];
    auto op = std::make_shared<RecvOp>();
    op->slot = slot;
    op->dst = static_cast<char*>(dst);
    op->nbytes = nbytes;
    p.recvs.push_back(op);
    auto it = p.unexpected.find(slot);
    if (it != p.unexpected.end()) {
      std::shared_ptr<Unexpected> u = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) p.unexpected.erase(it);
      if (u->nbytes != nbytes) {
        fail_op(*op, size_mismatch(peer, slot, nbytes, u->nbytes));
      } else if (u->complete) {
        // Copy on post; the buffer is ours alone now, the destination the caller's. The peer
        // may close meanwhile (fail_peer): `delivering` keeps it from failing this receive.
        op->delivering = true;
        lock.unlock();
        if (nbytes > 0) std::memcpy(dst, u->data.get(), nbytes);
        lock.lock();
        op->delivering = false;
        if (op->status == Status::kPending) op->status = Status::kDone;
        cv_.notify_all();
      } else if (!p.open) {
        fail_op(*op, p.error);
      } else {
        u->claimed = op;  // the progress thread copies it over when the rest has arrived
      }
    } else if (!p.open) {
      fail_op(*op, p.error);
    } else if (p.held && p.held_slot == slot) {
      // The held-back message is this one: it is read straight into place.
      p.held = false;
      if (p.cur_remaining != nbytes) {
        fail_op(*op, size_mismatch(peer, slot, nbytes, p.cur_remaining));  // payload discarded
      } else {
        p.cur_op = op;
        p.cur_dst = op->dst;
      }
      wake_locked();
    } else {
      if (p.held && !buffer_current(peer, p.held_slot, p.cur_remaining)) return;
      wake_locked();  // (when held: polling the peer again)
      p.unmatched[slot].push_back(op);
    }
  }

  void post_send(int peer, uint64_t slot, const void* src, size_t nbytes) {
    std::unique_lock<std::mutex> lock(mutex_);
    check_usable(peer, "post_send");
    Peer& p = peers_[peer];
    auto op = std::make_shared<SendOp>();
    op->header[0] = slot;
    op->header[1] = nbytes;
    op->src = static_cast<const char*>(src);
    op->nbytes = nbytes;
    const bool idle = p.unsent == p.sends.size() && !p.writing;
    p.sends.push_back(op);
    if (!p.open) return fail_op(*op, p.error);
    if (!p.send_error.empty()) return fail_op(*op, p.send_error);
    // Nothing ahead of it: try to write it from this thread (no hand-off for small messages).
    if (idle) write_peer(lock, peer, /*once=*/true);
    if (p.open && p.send_error.empty() && !broken_ && p.unsent < p.sends.size()) wake_locked();
  }

  void wait_recv(int peer, milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    check_usable(peer, "wait_recv");
    Peer& p = peers_[peer];
    if (p.recvs.empty())
      throw std::logic_error("tcp mesh: wait_recv(" + std::to_string(peer) +
                             ") with no receive posted for that rank");
    wait_oldest(lock, p.recvs, timeout, [] {}, [&](std::ostream& why, const RecvOp& op) {
      why << "no message with slot " << op.slot << " (" << op.nbytes << " bytes) from rank "
          << peer << " within " << timeout.count() << " ms";
      if (p.in_payload && p.cur_op.get() == &op)
        why << " (" << op.nbytes - p.cur_remaining << " bytes of it arrived)";
    });
  }

  void wait_send(int peer, milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    check_usable(peer, "wait_send");
    Peer& p = peers_[peer];
    if (p.sends.empty())
      throw std::logic_error("tcp mesh: wait_send(" + std::to_string(peer) +
                             ") with no send posted to that rank");
    auto done = [&p] {
      if (p.unsent > 0) --p.unsent;
    };
    wait_oldest(lock, p.sends, timeout, done, [&](std::ostream& why, const SendOp& op) {
      const size_t payload_sent = op.sent > kHeaderBytes ? op.sent - kHeaderBytes : 0;
      why << "could not send slot " << op.header[0] << " (" << op.nbytes << " bytes, "
          << payload_sent << " sent) to rank " << peer << " within " << timeout.count()
          << " ms: rank " << peer << " is not reading";
    });
  }

 private:
  void check_usable(int peer, const char* call) {
    if (peer < 0 || peer >= static_cast<int>(peers_.size()) || peer == rank_)
      throw std::invalid_argument("tcp mesh: " + std::string(call) + " with rank " +
                                  std::to_string(peer) + " on rank " + std::to_string(rank_) +
                                  " of " + std::to_string(peers_.size()) +
                                  " (expected another rank of the mesh)");
    if (broken_) throw CommError("the tcp mesh is broken by an earlier failure: " + broken_msg_);
  }

  std::string size_mismatch(int peer, uint64_t slot, size_t posted, size_t sent) const {
    return "size mismatch on slot " + std::to_string(slot) + " from rank " + std::to_string(peer) +
           ": rank " + std::to_string(rank_) + " posted a receive of " + std::to_string(posted) +
           " bytes, rank " + std::to_string(peer) + " sent " + std::to_string(sent) + " bytes";
  }

  template <class Op>
  void fail_op(Op& op, const std::string& why) {
    if (op.status != Status::kPending) return;
    op.status = Status::kFailed;
    op.error = why;
    cv_.notify_all();
  }

  // Waits for the oldest unwaited operation of `ops` (one peer's receives or sends). Done: pops
  // it and runs `done`. Otherwise breaks the mesh with why: the operation's own error, an
  // earlier break, or `describe_timeout` of what did not complete in time.
  template <class Op, class Done, class DescribeTimeout>
  void wait_oldest(std::unique_lock<std::mutex>& lock, std::deque<std::shared_ptr<Op>>& ops,
                   milliseconds timeout, Done done, DescribeTimeout describe_timeout) {
    std::shared_ptr<Op> op = ops.front();
    wait_for(lock, op->status, timeout);
    if (op->status == Status::kDone) {
      ops.pop_front();
      done();
      return;
    }
    std::ostringstream why;
    if (op->status == Status::kFailed) {
      why << op->error;
    } else if (broken_) {
      why << "the tcp mesh broke meanwhile: " << broken_msg_;
    } else {
      describe_timeout(why, *op);
    }
    fail_mesh(lock, why.str());
  }

  void wait_for(std::unique_lock<std::mutex>& lock, const Status& status, milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    auto finished = [&] { return status != Status::kPending || broken_; };
    if (cv_.wait_for(lock, std::min(timeout, kHoldGrace), finished)) return;
    // Blocked: what we wait for may need a rank whose messages we hold back to get on. Those
    // held now are buffered; those held later, after kHoldGrace (see progress_loop).
    for (int q = 0; q < static_cast<int>(peers_.size()); ++q) {
      Peer& p = peers_[q];
      if (p.held && buffer_current(q, p.held_slot, p.cur_remaining)) wake_locked();
    }
    ++blocked_waiters_;
    cv_.wait_until(lock, deadline, finished);
    --blocked_waiters_;
  }

  // A wait failed: the mesh is broken. Shuts the connections down (peers fail at once), waits
  // until no thread touches a caller's buffer any more, and throws `why`.
  [[noreturn]] void fail_mesh(std::unique_lock<std::mutex>& lock, const std::string& why) {
    if (!broken_) {
      broken_ = true;
      broken_msg_ = why;
      for (Peer& p : peers_)
        if (p.fd.valid()) ::shutdown(p.fd.get(), SHUT_RDWR);
      wake_locked();
      cv_.notify_all();
    }
    cv_.wait(lock, [&] { return io_users_ == 0; });
    throw CommError(why);
  }

  // Peer `peer`'s connection ended: its unfinished operations fail with `why` (messages that
  // completed before stay deliverable, also one post_recv is copying out right now).
  void fail_peer(int peer, const std::string& why) {
    Peer& p = peers_[peer];
    if (!p.open) return;
    p.open = false;
    p.error = why;
    for (auto& op : p.recvs)
      if (!op->delivering) fail_op(*op, why);
    if (!p.writing)  // else the writer fails them once it has counted what it wrote
      for (size_t i = p.unsent; i < p.sends.size(); ++i) fail_op(*p.sends[i], why);
    p.unmatched.clear();
    cv_.notify_all();
  }

  std::string closed_by(int peer) const {
    return "rank " + std::to_string(peer) +
           " closed the connection (it exited, crashed or closed its communicator)";
  }

  void wake_locked() {
    if (wake_pending_) return;
    wake_pending_ = true;
    uint64_t one = 1;
    ssize_t n = ::write(wake_fd_.get(), &one, sizeof one);
    (void)n;  // a full counter still wakes the poll
  }

  // Runs `f` (which touches a caller's buffer) unless the mesh is broken; fail_mesh waits for
  // every such `f` to end before it throws, so no buffer is touched after a wait failed.
  template <class F>
  bool touching_user_memory(std::unique_lock<std::mutex>& lock, F&& f) {
    if (broken_) return false;
    ++io_users_;
    lock.unlock();
    f();
    lock.lock();
    if (--io_users_ == 0 && broken_) cv_.notify_all();
    return !broken_;
  }

  // Writes queued sends of `peer` until all are written, the socket is full or it failed (or
  // one sendmsg when `once`). Lock held on entry and exit.
  void write_peer(std::unique_lock<std::mutex>& lock, int peer, bool once) {
    Peer& p = peers_[peer];
    while (!broken_ && p.open && p.send_error.empty() && !p.writing && p.unsent < p.sends.size()) {
      iovec iov[kMaxIov];
      int n_iov = 0;
      for (size_t i = p.unsent; i < p.sends.size() && n_iov + 2 <= kMaxIov; ++i) {
        SendOp& op = *p.sends[i];
        size_t off = op.sent;
        if (off < kHeaderBytes) {
          iov[n_iov++] = {reinterpret_cast<char*>(op.header) + off, kHeaderBytes - off};
          off = kHeaderBytes;
        }
        if (op.nbytes > off - kHeaderBytes)
          iov[n_iov++] = {const_cast<char*>(op.src) + (off - kHeaderBytes),
                          op.nbytes - (off - kHeaderBytes)};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n_iov;
      ssize_t n = -1;
      int err = 0;
      p.writing = true;
      const bool whole = touching_user_memory(lock, [&] {
        n = ::sendmsg(p.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        err = errno;
      });
      p.writing = false;
      if (!whole) return;  // broken: the sends are abandoned
      // Bytes the kernel took count even when the peer went away meanwhile (it may well have
      // read them); fail_peer leaves the sends to the writer while one writes. A write error
      // fails the sends only: the read side goes on until the stream ends.
      size_t left = n > 0 ? static_cast<size_t>(n) : 0;
      bool finished = false;
      while (left > 0) {
        SendOp& op = *p.sends[p.unsent];
        const size_t take = std::min(left, kHeaderBytes + op.nbytes - op.sent);
        op.sent += take;
        left -= take;
        if (op.sent == kHeaderBytes + op.nbytes) {
          op.status = Status::kDone;
          ++p.unsent;
          finished = true;
        }
      }
      if (finished) cv_.notify_all();
      if (n < 0 && err != EINTR && err != EAGAIN && err != EWOULDBLOCK && p.send_error.empty())
        p.send_error = err == EPIPE || err == ECONNRESET ? closed_by(peer)
                                                         : "sending to rank " + std::to_string(peer) +
                                                               " failed: " + errno_text(err);
      const std::string& gone = !p.open ? p.error : p.send_error;
      if (!gone.empty()) {
        for (size_t i = p.unsent; i < p.sends.size(); ++i) fail_op(*p.sends[i], gone);
        return;
      }
      if (once || (n < 0 && err != EINTR)) return;  // EAGAIN: the socket is full
    }
  }

  // ---- progress thread ------------------------------------------------------------------------

  void progress_loop() {
    std::vector<pollfd> fds;
    std::vector<int> owner;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      // Held messages are buffered after kHoldMax, or kHoldGrace while a wait is blocked; the
      // poll wakes up for the first one due.
      int poll_ms = -1;
      const auto now = Clock::now();
      const auto hold_limit = blocked_waiters_ > 0 ? kHoldGrace : kHoldMax;
      for (int q = 0; q < static_cast<int>(peers_.size()) && !broken_; ++q) {
        Peer& p = peers_[q];
        if (!p.held || !p.open) continue;
        const auto left = p.held_since + hold_limit - now;
        if (left <= Clock::duration::zero()) {
          buffer_current(q, p.held_slot, p.cur_remaining);
        } else {
          const int ms = static_cast<int>(std::chrono::ceil<milliseconds>(left).count());
          poll_ms = poll_ms < 0 ? ms : std::min(poll_ms, ms);
        }
      }
      fds.clear();
      owner.clear();
      fds.push_back({wake_fd_.get(), POLLIN, 0});
      owner.push_back(-1);
      if (!broken_) {
        for (int q = 0; q < static_cast<int>(peers_.size()); ++q) {
          Peer& p = peers_[q];
          if (!p.open) continue;
          short events = p.held ? 0 : POLLIN;  // (errors are reported anyway)
          if (p.unsent < p.sends.size() && !p.writing && p.send_error.empty()) events |= POLLOUT;
          fds.push_back({p.fd.get(), events, 0});
          owner.push_back(q);
        }
      }
      wake_pending_ = false;
      lock.unlock();
      int ready = ::poll(fds.data(), fds.size(), poll_ms);
      if (ready > 0 && fds[0].revents != 0) {
        uint64_t count;
        ssize_t n = ::read(wake_fd_.get(), &count, sizeof count);
        (void)n;
      }
      for (size_t i = 1; ready > 0 && i < fds.size(); ++i) {
        const short ev = fds[i].revents;
        if (ev & (POLLHUP | POLLERR)) {
          lock.lock();
          Peer& p = peers_[owner[i]];
          if (p.held) buffer_current(owner[i], p.held_slot, p.cur_remaining);  // to see the error
          lock.unlock();
        }
        if (ev & (POLLIN | POLLHUP | POLLERR)) read_peer(owner[i]);
        if (ev & POLLOUT) {
          lock.lock();
          write_peer(lock, owner[i], /*once=*/false);
          lock.unlock();
        }
      }
      lock.lock();
    }
  }

  // Reads what `peer` sent until its socket is drained (or the round's budget is spent).
  void read_peer(int peer) {
    Peer& p = peers_[peer];
    if (!p.stage) p.stage.reset(new char[kStageBytes]);
    size_t budget = kReadBudget;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!broken_ && p.open) {
      if (!consume_staged(lock, peer) || budget == 0 || p.held) return;
      if (p.in_payload && !redirect_claimed(lock, peer)) return;
      ssize_t n;
      int err = 0;
      if (p.in_payload && p.cur_dst != nullptr && p.cur_remaining >= kDirectReadMin) {
        // Large remainder: straight into its destination, no staging copy.
        char* dst = p.cur_dst;
        const size_t want = std::min(p.cur_remaining, budget);
        if (!touching_user_memory(lock, [&] {
              n = ::recv(p.fd.get(), dst, want, MSG_DONTWAIT);
              err = errno;
            }))
          return;
        if (n > 0) {
          p.cur_dst += n;
          p.cur_remaining -= static_cast<size_t>(n);
          budget -= static_cast<size_t>(n);
          if (p.cur_remaining == 0) finish_message(lock, peer);
          continue;
        }
      } else {
        if (p.stage_begin == p.stage_end) p.stage_begin = p.stage_end = 0;
        // Only a partial header can be left over: move it to the front.
        if (p.stage_begin > 0) {
          std::memmove(p.stage.get(), p.stage.get() + p.stage_begin, p.stage_end - p.stage_begin);
          p.stage_end -= p.stage_begin;
          p.stage_begin = 0;
        }
        char* at = p.stage.get() + p.stage_end;
        const size_t room = kStageBytes - p.stage_end;
        lock.unlock();  // the stage is this thread's own
        n = ::recv(p.fd.get(), at, room, MSG_DONTWAIT);
        err = errno;
        lock.lock();
        if (n > 0) {
          p.stage_end += static_cast<size_t>(n);
          budget -= std::min(budget, static_cast<size_t>(n));
          continue;
        }
      }
      if (broken_) return;
      if (n == 0) return fail_peer(peer, closed_by(peer));
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      return fail_peer(peer, err == ECONNRESET ? closed_by(peer)
                                               : "receiving from rank " + std::to_string(peer) +
                                                     " failed: " + errno_text(err));
    }
  }

  // Handles the staged bytes: headers start messages, payload bytes go to their destination.
  // Returns false when the mesh broke. Lock held on entry and exit.
  bool consume_staged(std::unique_lock<std::mutex>& lock, int peer) {
    Peer& p = peers_[peer];
    for (;;) {
      if (p.held) return true;
      const size_t avail = p.stage_end - p.stage_begin;
      if (!p.in_payload) {
        if (avail < kHeaderBytes) return true;
        uint64_t header[2];
        std::memcpy(header, p.stage.get() + p.stage_begin, kHeaderBytes);
        p.stage_begin += kHeaderBytes;
        if (!start_message(peer, header[0], header[1])) return false;
        if (p.cur_remaining == 0) finish_message(lock, peer);
        continue;
      }
      if (avail == 0) return true;
      if (!redirect_claimed(lock, peer)) return false;
      const size_t take = std::min(avail, p.cur_remaining);
      if (p.cur_dst != nullptr) {
        const char* from = p.stage.get() + p.stage_begin;
        char* to = p.cur_dst;
        if (!touching_user_memory(lock, [&] { std::memcpy(to, from, take); })) return false;
        p.cur_dst += take;
      }
      p.stage_begin += take;
      p.cur_remaining -= take;
      if (p.cur_remaining == 0) finish_message(lock, peer);
      if (broken_) return false;
    }
  }

  // A receive was posted for the early message that is still arriving: what arrived is copied
  // over, the rest is read straight into the receive's buffer. (The early buffer is allocated but
  // not touched beyond what arrived, so a receive posted a little late costs little.) Lock held;
  // false: the mesh broke.
  bool redirect_claimed(std::unique_lock<std::mutex>& lock, int peer) {
    Peer& p = peers_[peer];
    if (!p.cur_unexpected || !p.cur_unexpected->claimed) return true;
    std::shared_ptr<Unexpected> u = std::move(p.cur_unexpected);
    p.cur_unexpected.reset();
    std::shared_ptr<RecvOp> op = std::move(u->claimed);
    u->claimed.reset();
    const size_t got = u->nbytes - p.cur_remaining;
    p.cur_op = op;
    p.cur_dst = op->dst + got;
    return got == 0 ||
           touching_user_memory(lock, [&] { std::memcpy(op->dst, u->data.get(), got); });
  }

  // A header arrived: find where its payload goes. Lock held.
  bool start_message(int peer, uint64_t slot, uint64_t nbytes) {
    Peer& p = peers_[peer];
    p.in_payload = true;
    p.cur_remaining = nbytes;
    p.cur_dst = nullptr;
    auto it = p.unmatched.find(slot);
    if (it != p.unmatched.end()) {
      std::shared_ptr<RecvOp> op = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) p.unmatched.erase(it);
      if (op->nbytes != nbytes) {
        fail_op(*op, size_mismatch(peer, slot, op->nbytes, nbytes));  // payload discarded
      } else {
        p.cur_op = std::move(op);
        p.cur_dst = p.cur_op->dst;
      }
      return true;
    }
    // (Only while part of it is still in the socket, which then wakes the poll once it is
    // released; a message wholly in the stage is buffered.)
    if (nbytes >= kHoldMin && p.unmatched.empty() && p.stage_end - p.stage_begin < nbytes) {
      p.held = true;  // until its receive is posted (see `held`)
      p.held_slot = slot;
      p.held_since = Clock::now();
      return true;
    }
    return buffer_current(peer, slot, nbytes);
  }

  // The current message (its header read, none of its payload consumed) goes to a buffer of
  // its own. Lock held; false: no memory for it (the peer failed).
  bool buffer_current(int peer, uint64_t slot, uint64_t nbytes) {
    Peer& p = peers_[peer];
    p.held = false;
    auto u = std::make_shared<Unexpected>();
    u->slot = slot;
    u->nbytes = nbytes;
    u->data.reset(new (std::nothrow) char[std::max<uint64_t>(nbytes, 1)]);
    if (!u->data) {
      fail_peer(peer, "cannot buffer a message of " + std::to_string(nbytes) + " bytes (slot " +
                          std::to_string(slot) + ") from rank " + std::to_string(peer) +
                          " that arrived before its receive was posted: out of memory");
      return false;
    }
    p.cur_unexpected = u;
    p.cur_dst = u->data.get();
    p.unexpected[slot].push_back(std::move(u));
    return true;
  }

  // The current message's payload is complete. Lock held.
  void finish_message(std::unique_lock<std::mutex>& lock, int peer) {
    Peer& p = peers_[peer];
    std::shared_ptr<RecvOp> op = std::move(p.cur_op);
    std::shared_ptr<Unexpected> u = std::move(p.cur_unexpected);
    p.in_payload = false;
    p.cur_dst = nullptr;
    p.cur_op.reset();
    p.cur_unexpected.reset();
    if (u) {
      u->complete = true;
      op = std::move(u->claimed);  // posted while it arrived (and taken out of `unexpected`)
      if (op && op->nbytes > 0 &&
          !touching_user_memory(lock, [&] { std::memcpy(op->dst, u->data.get(), op->nbytes); }))
        return;
    }
    if (op && op->status == Status::kPending) {
      op->status = Status::kDone;
      cv_.notify_all();
    }
  }

  const int rank_;
  std::vector<Peer> peers_;  // [size]; peers_[rank_] is unused
  Fd wake_fd_;               // eventfd: wakes the progress thread's poll

  std::mutex mutex_;
  std::condition_variable cv_;  // an op finished, the mesh broke, or io_users_ dropped to 0
  bool broken_ = false;         // guarded by mutex_
  std::string broken_msg_;      // guarded by mutex_
  int io_users_ = 0;            // threads touching a caller's buffer; guarded by mutex_
  bool stopping_ = false;       // guarded by mutex_
  bool wake_pending_ = false;   // an eventfd write the progress thread has not polled yet
  int blocked_waiters_ = 0;     // waits blocked for more than kHoldGrace; guarded by mutex_

  std::thread thread_;  // last: starts after everything it uses exists
};

TcpMesh::TcpMesh(int rank, int size, std::unique_ptr<State> state)
    : rank_(rank), size_(size), state_(std::move(state)) {}

TcpMesh::~TcpMesh() = default;

std::unique_ptr<TcpMesh> TcpMesh::connect(c10d::Store& store, int rank, int size,
                                          const std::string& bind_host,
                                          std::chrono::milliseconds timeout) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("tcp mesh: rank " + std::to_string(rank) + " of " +
                                std::to_string(size) + " is not a rank of the mesh");
  std::vector<Fd> fds =
      size > 1 ? connect_full_mesh(store, rank, size, bind_host, timeout) : std::vector<Fd>(1);
  return std::unique_ptr<TcpMesh>(
      new TcpMesh(rank, size, std::make_unique<State>(rank, size, std::move(fds))));
}

void TcpMesh::post_recv(int peer, uint64_t slot, void* dst, size_t nbytes) {
  state_->post_recv(peer, slot, dst, nbytes);
}
void TcpMesh::post_send(int peer, uint64_t slot, const void* src, size_t nbytes) {
  state_->post_send(peer, slot, src, nbytes);
}
void TcpMesh::wait_recv(int peer, std::chrono::milliseconds timeout) {
  state_->wait_recv(peer, timeout);
}
void TcpMesh::wait_send(int peer, std::chrono::milliseconds timeout) {
  state_->wait_send(peer, timeout);
}

}  // namespace mfsdp
