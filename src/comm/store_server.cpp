// How the server works: one thread, one poll() over the listener, an eventfd (the stop signal)
// and every connection, all non-blocking. A connection's bytes are buffered as they arrive
// (never ahead of them, whatever length a frame claims) and handled frame by frame; a get or
// wait for keys that do not exist yet parks its connection until a write makes them exist or
// its timeout passes. Deadlines close connections that dawdle; nothing else ever waits.
//
// Memory: all connections' unfinished requests together stay within kMaxBufferedBytes. The
// connection whose request began first (the oldest) may always read up to its frame limit, so
// some request always completes; the others share what is left and, once it is full, are not
// polled for input: their clients wait in send() (backpressure) instead of rank 0 buffering
// them. A connection that holds part of a request and sends nothing more while the buffers are
// full is closed after kStalledRequestTimeout, so silent holders cannot stall the ranks until
// kRequestTimeout. Buffers are given back to the system when they empty or their connection
// closes (PageAllocator), so rank 0's RSS goes back down after a large or hostile request.
#include "comm/store_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>

#include "comm/store_protocol.h"
#include "mfsdp/comm/comm.h"

namespace mfsdp {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using namespace store_wire;

constexpr Clock::time_point kNever = Clock::time_point::max();
constexpr size_t kReadChunk = 64 << 10;
constexpr int kReadChunksPerRound = 16;  // per connection and poll round, so none starves others
// What the oldest request may always hold (its frame limit and one byte past it), and what the
// greetings may hold (they are not held back: each is small and they are at most
// kMaxUnprovenConnections); the other connections share the rest of kMaxBufferedBytes.
constexpr size_t kOldestReserve = 4 + size_t{kMaxRequestBytes} + 1;
constexpr size_t kGreetingsReserve = kMaxUnprovenConnections * (4 + size_t{kMaxGreetingBytes} + 1);
static_assert(kMaxBufferedBytes >= kOldestReserve + kGreetingsReserve + 4 + kMaxValueBytes +
                                        kMaxKeyBytes + 64,
              "beside the oldest request, another that sets a value of the largest size fits");
constexpr size_t kSharedBytes = kMaxBufferedBytes - kOldestReserve - kGreetingsReserve;

// The connections' buffers take their large blocks straight from mmap and give them back with
// munmap, so what a connection held leaves rank 0's RSS when it is freed. From malloc it did
// not: glibc keeps freed blocks in the thread's arena (after large frees it raises its mmap and
// trim thresholds, up to 32 and 64 MiB), and rank 0 stayed 49 MiB larger after hostile
// connections had closed (tests/dist/rendezvous_security_test.cpp).
template <typename T>
struct PageAllocator {
  using value_type = T;
  static constexpr size_t kFromBytes = 64 << 10;  // smaller blocks: malloc, as std::allocator
  PageAllocator() = default;
  template <typename U>
  PageAllocator(const PageAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    void* p = bytes < kFromBytes ? std::malloc(bytes)
                                 : ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == nullptr || p == MAP_FAILED) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kFromBytes) {
      std::free(p);
    } else {
      ::munmap(p, bytes);
    }
  }
  friend bool operator==(const PageAllocator&, const PageAllocator&) { return true; }
  friend bool operator!=(const PageAllocator&, const PageAllocator&) { return false; }
};
using Buffer = std::basic_string<char, std::char_traits<char>, PageAllocator<char>>;

// Empties `b` and gives its memory back (clear() would keep the capacity).
void release(Buffer& b) { Buffer().swap(b); }

void put(Buffer& out, const std::string& frame) { out.append(frame.data(), frame.size()); }

// Equal tokens, compared in a time that does not depend on where they differ.
bool same_token(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

struct Connection {
  Fd fd;
  std::string peer;      // the client's address, for messages
  bool proven = false;   // its greeting proved the job token
  bool closing = false;  // close once `out` is sent (after a refusal or a bad request)
  bool dead = false;
  Buffer in;   // received, not handled yet
  uint64_t in_started = 0;          // when `in` last went from empty to not: the request's turn
  Clock::time_point last_byte{};    // when bytes last arrived
  bool held_back = false;           // this poll round: not polled for input (the buffers are full)
  Buffer out;  // to send, from out_done on
  size_t out_done = 0;
  // Before the proof: when the greeting is due. After: when a started request or an answer
  // not taken yet is due; kNever while idle.
  Clock::time_point deadline = kNever;
  // A get or wait for keys that do not exist yet.
  bool parked = false;
  Op parked_op = kWait;
  std::vector<std::string> parked_keys;
  Clock::time_point parked_until = kNever;
};

// One line on stderr for each refused or dropped client: the first few, then one a minute
// (a flood of strangers must not flood the job's log).
class Notes {
 public:
  explicit Notes(std::string where) : where_(std::move(where)) {}
  void operator()(const std::string& line) {
    const auto now = Clock::now();
    if (printed_ >= 5 && now - last_ < std::chrono::minutes(1)) {
      ++suppressed_;
      return;
    }
    std::string text = "mfsdp: rendezvous store on " + where_ + ": " + line;
    if (suppressed_ > 0) text += " (" + std::to_string(suppressed_) + " more not shown)";
    std::fprintf(stderr, "%s\n", text.c_str());
    std::fflush(stderr);
    ++printed_;
    last_ = now;
    suppressed_ = 0;
  }

 private:
  std::string where_;
  int printed_ = 0;
  int64_t suppressed_ = 0;
  Clock::time_point last_{};
};

class Server {
 public:
  Server(int listener, int wake, std::string where, std::string token, int world_size)
      : listener_(listener), wake_(wake), where_(std::move(where)), token_(std::move(token)),
        world_size_(world_size), note_(where_) {}

  // Serves until the eventfd is written.
  void run() {
    std::vector<pollfd> fds;
    std::vector<Connection*> polled;
    for (;;) {
      Clock::time_point now = Clock::now();
      fds.clear();
      polled.clear();
      fds.push_back({wake_, POLLIN, 0});
      fds.push_back({listener_, static_cast<short>(now >= accept_paused_until_ ? POLLIN : 0), 0});
      Clock::time_point next = now + milliseconds(1000);
      plan_reads();
      for (auto& c : conns_) {
        // A connection held back is still told about its peer closing (POLLRDHUP), so what it
        // holds is freed at once.
        c->held_back = !c->closing && c->proven && c.get() != oldest_ && shared_left_ < kReadChunk;
        short events = c->closing ? 0 : c->held_back ? POLLRDHUP : POLLIN;
        if (c->out_done < c->out.size()) events |= POLLOUT;
        fds.push_back({c->fd.get(), events, 0});
        polled.push_back(c.get());
        next = std::min({next, c->deadline, c->parked_until});
      }
      const auto wait = std::chrono::duration_cast<milliseconds>(next - now).count();
      const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 0)) + 1);
      if (ready < 0 && errno != EINTR) {
        note_("poll failed: " + errno_text(errno) + "; the store stops");
        return;
      }
      if (fds[0].revents != 0) return;  // stop
      now = Clock::now();
      for (size_t i = 0; i < polled.size(); ++i) {
        Connection& c = *polled[i];
        const short rev = fds[i + 2].revents;
        if (c.dead) continue;  // dropped while another connection was handled
        // Its client went away while it waited to be read: its request cannot complete.
        if (c.held_back && (rev & (POLLRDHUP | POLLHUP | POLLERR))) {
          drop(c, "");
          continue;
        }
        if (rev & (POLLIN | POLLHUP | POLLERR)) receive(c, now);
        if (!c.dead && (rev & POLLOUT)) flush(c, now);
      }
      for (auto& c : conns_)
        if (!c->dead) handle_frames(*c, now);
      expire(now);
      if (fds[1].revents != 0) accept_all(now);
      conns_.erase(std::remove_if(conns_.begin(), conns_.end(),
                                  [](const std::unique_ptr<Connection>& c) { return c->dead; }),
                   conns_.end());
    }
  }

 private:
  void drop(Connection& c, const std::string& why) {
    if (!why.empty()) note_(why);
    c.fd.reset();
    c.dead = true;
    release(c.in);  // now, not when the connection is erased: the budget counts it until then
    release(c.out);
    c.out_done = 0;
  }

  // This round's oldest request and what the others may still read (kSharedBytes less what
  // all but the oldest hold; greetings counted too, though they are not held back).
  void plan_reads() {
    oldest_ = nullptr;
    for (auto& c : conns_)
      if (!c->dead && c->proven && !c->closing && !c->in.empty() &&
          (oldest_ == nullptr || c->in_started < oldest_->in_started))
        oldest_ = c.get();
    size_t others = 0;
    for (auto& c : conns_)
      if (!c->dead && c.get() != oldest_) others += c->in.size();
    shared_left_ = others < kSharedBytes ? kSharedBytes - others : 0;
  }

  void accept_all(Clock::time_point now) {
    for (;;) {
      sockaddr_storage from{};
      socklen_t len = sizeof from;
      const int fd = ::accept4(listener_, reinterpret_cast<sockaddr*>(&from), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          note_("cannot accept connections: " + errno_text(errno) + "; trying again in 100 ms");
          accept_paused_until_ = now + milliseconds(100);  // else poll() wakes at once, forever
        }
        return;
      }
      auto c = std::make_unique<Connection>();
      c->fd = Fd(fd);
      SocketAddress peer;
      peer.addr = from;
      peer.len = len;
      c->peer = peer.text();
      c->deadline = now + kGreetingTimeout;
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      // Strangers cannot pile up: past the limit, the one waiting longest makes room.
      Connection* oldest = nullptr;
      size_t unproven = 0;
      for (auto& o : conns_) {
        if (o->dead || o->proven) continue;
        ++unproven;
        if (oldest == nullptr || o->deadline < oldest->deadline) oldest = o.get();
      }
      if (unproven >= kMaxUnprovenConnections)
        drop(*oldest, std::to_string(unproven) + " connections have not proved the job token; "
                      "closed the oldest, from " + oldest->peer);
      conns_.push_back(std::move(c));
    }
  }

  // Buffers what has arrived, up to one byte past one frame of the largest size this
  // connection may send (a client sends its next request only after the answer to the last):
  // handle_frames() then refuses what is too large.
  // The oldest request and greetings read up to their limit; the others no more than the
  // shared bytes left.
  void receive(Connection& c, Clock::time_point now) {
    const size_t limit = frame_limit(c);
    const bool shares = c.proven && &c != oldest_;
    char buf[kReadChunk];
    for (int round = 0; round < kReadChunksPerRound && c.in.size() <= limit; ++round) {
      const size_t room = std::min({sizeof buf, limit + 1 - c.in.size(),
                                    shares ? shared_left_ : sizeof buf});
      if (room == 0) return;  // the next round holds it back, or reads it when there is room
      const ssize_t n = ::recv(c.fd.get(), buf, room, 0);
      if (n > 0) {
        if (c.in.empty()) c.in_started = ++requests_started_;
        c.in.append(buf, static_cast<size_t>(n));
        c.last_byte = now;
        if (&c != oldest_) shared_left_ -= std::min(shared_left_, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      return drop(c, "");  // the client closed the connection (or it failed): nothing to say
    }
  }

  static size_t frame_limit(const Connection& c) {
    return 4 + size_t{c.proven ? kMaxRequestBytes : kMaxGreetingBytes};
  }

  void handle_frames(Connection& c, Clock::time_point now) {
    while (!c.dead && !c.parked && !c.closing && c.in.size() >= 4) {
      uint32_t n = 0;
      std::memcpy(&n, c.in.data(), 4);
      if (!c.proven && n > kMaxGreetingBytes)
        return drop(c, "a client from " + c.peer + " opened with a message of " +
                           std::to_string(n) + " bytes, not an mfsdp greeting (at most " +
                           std::to_string(kMaxGreetingBytes) + "); closed");
      if (c.proven && n > kMaxRequestBytes)
        return refuse(c, kBadRequest, "a request of " + std::to_string(n) +
                                          " bytes is over the limit of " +
                                          std::to_string(kMaxRequestBytes), now);
      if (c.in.size() < 4 + size_t{n}) break;
      Buffer body;
      if (c.in.size() == 4 + size_t{n}) {  // the usual case: no copy of a large request
        body.swap(c.in);
        body.erase(0, 4);
      } else {
        body = c.in.substr(4, n);
        c.in.erase(0, 4 + size_t{n});
      }
      if (c.proven) c.deadline = kNever;
      try {
        if (c.proven) {
          handle_request(c, body, now);
        } else {
          handle_greeting(c, body, now);
        }
      } catch (const ProtocolError& e) {
        if (!c.proven)
          return drop(c, "a client from " + c.peer + " is not an mfsdp rank (" + e.what() +
                             "); closed");
        refuse(c, kBadRequest, e.what(), now);
      }
      release(body);
    }
    if (c.dead) return;
    if (c.in.empty()) release(c.in);
    if (c.in.size() > frame_limit(c))
      return drop(c, "a client from " + c.peer + " sent more than one " +
                         (c.proven ? "request" : "greeting") + " without waiting for the answer; closed");
    // A request that has begun to arrive must be complete in time.
    if (c.proven && !c.in.empty() && c.deadline == kNever) c.deadline = now + kRequestTimeout;
  }

  void handle_greeting(Connection& c, const Buffer& body, Clock::time_point now) {
    Reader r(body.data(), body.size());
    if (r.u64() != kMagic) throw ProtocolError("no mfsdp greeting");
    const std::string token = r.str(kMaxJobTokenBytes, "job token");
    const int64_t rank = r.i64();
    const int64_t world = r.i64();
    std::string refusal, reason;  // what the client is told, what this job's log says
    if (!same_token(token, token_)) {
      refusal = "it serves another job (the job token differs): does another job use port " +
                port() + "? give each job its own MASTER_PORT (mfsdp-run --master-port)";
      reason = "wrong job token (a rank of another job on this port?)";
    } else if (world != world_size_) {
      refusal = "it serves a job of " + std::to_string(world_size_) + " ranks, this rank says " +
                std::to_string(world);
      reason = "world size " + std::to_string(world) + ", not " + std::to_string(world_size_);
    } else if (rank < 0 || rank >= world) {
      refusal = "rank " + std::to_string(rank) + " is outside the job's ranks";
      reason = refusal;
    }
    if (!refusal.empty()) {
      note_("refused a client from " + c.peer + ": " + reason);
      put(c.out, Writer().u64(kMagic).u8(kRefused).str(refusal).frame());
      c.closing = true;
      flush(c, now);
      return;
    }
    c.proven = true;
    c.deadline = kNever;
    put(c.out, Writer().u64(kMagic).u8(kOk).str("").frame());
    flush(c, now);
  }

  void handle_request(Connection& c, const Buffer& body, Clock::time_point now) {
    Reader r(body.data(), body.size());
    const auto op = static_cast<Op>(r.u8());
    switch (op) {
      case kSet: {
        std::string key = r.str(kMaxKeyBytes, "key");
        std::string value = r.str(kMaxValueBytes, "value");
        data_[std::move(key)] = std::move(value);
        answer(c, Writer().u8(kOk), now);
        return changed(now);
      }
      case kGet: {
        std::string key = r.str(kMaxKeyBytes, "key");
        const int64_t timeout_ms = r.i64();
        return park(c, kGet, {std::move(key)}, timeout_ms, now);
      }
      case kAdd: {
        const std::string key = r.str(kMaxKeyBytes, "key");
        const int64_t delta = r.i64();
        int64_t value = 0;
        if (auto it = data_.find(key); it != data_.end()) value = integer_of(key, it->second);
        value += delta;
        data_[key] = std::to_string(value);
        answer(c, Writer().u8(kOk).i64(value), now);
        return changed(now);
      }
      case kCheck: {
        const std::vector<std::string> keys = read_keys(r);
        answer(c, Writer().u8(kOk).u8(all_exist(keys) ? 1 : 0), now);
        return;
      }
      case kWait: {
        std::vector<std::string> keys = read_keys(r);
        const int64_t timeout_ms = r.i64();
        return park(c, kWait, std::move(keys), timeout_ms, now);
      }
      case kDelete: {
        const std::string key = r.str(kMaxKeyBytes, "key");
        answer(c, Writer().u8(kOk).u8(data_.erase(key) > 0 ? 1 : 0), now);
        return;
      }
      case kNumKeys:
        answer(c, Writer().u8(kOk).i64(static_cast<int64_t>(data_.size())), now);
        return;
      case kCompareSet: {
        const std::string key = r.str(kMaxKeyBytes, "key");
        std::string expected = r.str(kMaxValueBytes, "expected value");
        std::string desired = r.str(kMaxValueBytes, "desired value");
        // c10d's semantics: a missing key counts as holding the empty value.
        auto it = data_.find(key);
        const bool matches = it == data_.end() ? expected.empty() : it->second == expected;
        if (!matches) {
          answer(c, Writer().u8(kOk).str(it == data_.end() ? expected : it->second), now);
          return;
        }
        data_[key] = desired;
        answer(c, Writer().u8(kOk).str(desired), now);
        return changed(now);
      }
    }
    throw ProtocolError("unknown request " + std::to_string(static_cast<int>(op)));
  }

  static std::vector<std::string> read_keys(Reader& r) {
    const uint32_t n = r.u32();
    std::vector<std::string> keys;  // no reserve(n): n is the client's claim
    for (uint32_t i = 0; i < n; ++i) keys.push_back(r.str(kMaxKeyBytes, "key"));
    return keys;
  }

  static int64_t integer_of(const std::string& key, const std::string& value) {
    try {
      size_t used = 0;
      const int64_t v = std::stoll(value, &used);
      if (used == value.size()) return v;
    } catch (const std::exception&) {
    }
    throw ProtocolError("add to key '" + key.substr(0, 200) + "', which holds no integer");
  }

  bool all_exist(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(),
                       [&](const std::string& k) { return data_.count(k) > 0; });
  }

  // Answers a get or wait now if its keys exist, else when they do or at its timeout.
  void park(Connection& c, Op op, std::vector<std::string> keys, int64_t timeout_ms,
            Clock::time_point now) {
    c.parked = true;
    c.parked_op = op;
    c.parked_keys = std::move(keys);
    // 0 (or anything past a year, which would overflow the clock) waits for ever, as c10d's.
    constexpr int64_t kYearMs = int64_t{365} * 24 * 3600 * 1000;
    c.parked_until = timeout_ms > 0 && timeout_ms < kYearMs ? now + milliseconds(timeout_ms) : kNever;
    try_unpark(c, now);
  }

  void try_unpark(Connection& c, Clock::time_point now) {
    if (!c.parked || !all_exist(c.parked_keys)) return;
    Writer w;
    w.u8(kOk);
    if (c.parked_op == kGet) w.str(data_.at(c.parked_keys.front()));
    c.parked = false;
    c.parked_keys.clear();
    c.parked_until = kNever;
    answer(c, std::move(w), now);
  }

  // A key was written: answer the gets and waits it completes.
  void changed(Clock::time_point now) {
    for (auto& c : conns_)
      if (!c->dead) try_unpark(*c, now);
  }

  void expire(Clock::time_point now) {
    for (auto& cp : conns_) {
      Connection& c = *cp;
      if (c.dead) continue;
      // Part of a request, then nothing, while the others wait for room: it is not held back
      // by the server (nothing of it waits in its socket), so its client stopped sending.
      if (c.proven && !c.in.empty() && !c.closing && shared_left_ < kReadChunk &&
          now - c.last_byte >= kStalledRequestTimeout && unread_bytes(c) == 0) {
        drop(c, "a rank's connection from " + c.peer + " held " + std::to_string(c.in.size()) +
                    " bytes of an unfinished request and sent nothing for " +
                    std::to_string(kStalledRequestTimeout.count()) + " ms while the store's " +
                    "request buffers (" + std::to_string(kMaxBufferedBytes >> 20) +
                    " MiB for all connections) were full; closed");
        continue;
      }
      if (now >= c.deadline) {
        drop(c, c.proven ? "a rank's connection from " + c.peer + " left a request or an " +
                               "answer unfinished for " + std::to_string(kRequestTimeout.count()) +
                               " ms; closed"
                         : "a client from " + c.peer + " did not prove the job token within " +
                               std::to_string(kGreetingTimeout.count()) + " ms; closed");
        continue;
      }
      if (c.parked && now >= c.parked_until) {
        std::string missing;
        for (const auto& k : c.parked_keys) {
          if (data_.count(k) > 0) continue;
          if (missing.size() > 400) {
            missing += ", ...";
            break;
          }
          missing += (missing.empty() ? "" : ", ") + k.substr(0, 200);
        }
        c.parked = false;
        c.parked_keys.clear();
        c.parked_until = kNever;
        answer(c, Writer().u8(kTimedOut).str("no key " + missing), now);
      }
    }
  }

  // Bytes that arrived on c's socket and are not read yet (-1: unknown).
  static int unread_bytes(const Connection& c) {
    int n = 0;
    return ::ioctl(c.fd.get(), FIONREAD, &n) == 0 ? n : -1;
  }

  void answer(Connection& c, Writer w, Clock::time_point now) {
    put(c.out, w.frame());
    flush(c, now);
  }

  // An answer that says what was wrong, then the connection closes.
  void refuse(Connection& c, Status status, const std::string& why, Clock::time_point now) {
    note_("closed a rank's connection from " + c.peer + ": " + why);
    release(c.in);  // nothing more is read from it
    put(c.out, Writer().u8(status).str(why).frame());
    c.closing = true;
    flush(c, now);
  }

  void flush(Connection& c, Clock::time_point now) {
    while (c.out_done < c.out.size()) {
      const ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_done, c.out.size() - c.out_done,
                               MSG_NOSIGNAL);
      if (n > 0) {
        c.out_done += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (c.proven && c.deadline == kNever) c.deadline = now + kRequestTimeout;
        return;
      } else {
        return drop(c, "");
      }
    }
    release(c.out);
    c.out_done = 0;
    if (c.closing) return drop(c, "");
    if (c.proven && c.in.empty()) c.deadline = kNever;
  }

  std::string port() const { return where_.substr(where_.rfind(':') + 1); }

  const int listener_;
  const int wake_;
  const std::string where_;
  const std::string token_;
  const int world_size_;
  Notes note_;
  std::map<std::string, std::string> data_;
  std::vector<std::unique_ptr<Connection>> conns_;
  Clock::time_point accept_paused_until_{};
  Connection* oldest_ = nullptr;  // this round's oldest request (plan_reads)
  size_t shared_left_ = 0;        // what connections other than the oldest may still read
  uint64_t requests_started_ = 0;
};

}  // namespace

StoreServer::StoreServer(const std::vector<SocketAddress>& addresses, std::string job_token,
                         int world_size)
    : job_token_(std::move(job_token)), world_size_(world_size) {
  std::string why = "no address";
  for (const SocketAddress& a : addresses) {
    Fd fd(::socket(a.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) {
      why = a.text() + ": socket: " + errno_text(errno);
      continue;
    }
    int one = 1;  // a port left in TIME_WAIT by an earlier job may be used again at once
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), a.get(), a.len) != 0 || ::listen(fd.get(), SOMAXCONN) != 0) {
      const int err = errno;
      // A port in use is the answer, not a reason to try the name's other addresses: a second
      // job must fail here rather than listen beside the first on another address family.
      if (err == EADDRINUSE)
        throw CommError("rendezvous: rank 0 cannot serve the store on " + a.text() + ": port " +
                        a.text().substr(a.text().rfind(':') + 1) + " is in use (another job, " +
                        "or a process of an earlier one, listens there); give each job its own " +
                        "MASTER_PORT (mfsdp-run --master-port)");
      why = a.text() + ": " + errno_text(err);
      continue;
    }
    address_.len = sizeof address_.addr;
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&address_.addr), &address_.len) != 0) {
      why = a.text() + ": getsockname: " + errno_text(errno);
      continue;
    }
    listener_ = std::move(fd);
    break;
  }
  if (!listener_.valid())
    throw CommError("rendezvous: rank 0 cannot serve the store: MASTER_ADDR must be an address "
                    "of rank 0's host (" + why + ")");
  wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_.valid()) throw CommError("rendezvous: eventfd: " + errno_text(errno));
  thread_ = std::thread([this] {
    Server server(listener_.get(), wake_.get(), address_.text(), job_token_, world_size_);
    try {
      server.run();
    } catch (const std::exception& e) {  // e.g. out of memory: say so rather than terminate
      std::fprintf(stderr, "mfsdp: rendezvous store on %s stopped: %s\n", address_.text().c_str(),
                   e.what());
    }
  });
}

StoreServer::~StoreServer() {
  const uint64_t one = 1;
  ssize_t ignored = ::write(wake_.get(), &one, sizeof one);
  (void)ignored;
  thread_.join();
}

}  // namespace mfsdp
