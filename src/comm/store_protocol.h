// The wire format of the job's rendezvous store, and the limits its server enforces
// (src/comm/store_server.h serves it, src/comm/store.cpp is its client).
//
// Every message is a frame: a 4-byte body length, then the body. A client's first frame is its
// greeting (magic, job token, rank, world size); the server answers with magic, a status and,
// when it refuses, why. Only then are requests served, one at a time per connection: an op byte
// and its fields, strings as a 4-byte length and the bytes, integers as 8 bytes. Host byte
// order: every rank of a job runs one build on one kind of machine (as in src/comm/tcp_mesh.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mfsdp/comm/rendezvous.h"

namespace mfsdp::store_wire {

constexpr uint64_t kMagic = 0x3173'6a70'6473'666d;  // "mfsdpjs1"

// A greeting is at most this long; nothing larger is read from a client that has not proved
// the job token, so a stranger costs the server at most this much memory per connection.
constexpr uint32_t kMaxGreetingBytes = 4096;
static_assert(kMaxGreetingBytes > kMaxJobTokenBytes + 64, "a greeting holds the longest token");
// Requests of a client that proved the token: keys and values at most this long.
constexpr uint32_t kMaxKeyBytes = 64 << 10;
constexpr uint32_t kMaxValueBytes = 16 << 20;
// The largest request (compare_set: a key and two values; wait/check: keys).
constexpr uint32_t kMaxRequestBytes = 2 * kMaxValueBytes + kMaxKeyBytes + 64;

// A connection must have proved the token this soon after it was accepted.
constexpr std::chrono::milliseconds kGreetingTimeout{10000};
// A request whose first byte arrived must be complete this soon, and an answer taken this soon.
constexpr std::chrono::milliseconds kRequestTimeout{60000};
// A connection that holds part of a request and sends nothing more for this long while the
// request buffers of all connections are full (kMaxBufferedBytes) is closed: it holds the
// others up. A rank sends a request whole, without pausing.
constexpr std::chrono::milliseconds kStalledRequestTimeout{5000};
// Connections that have not proved the token yet, at most; a new one closes the oldest.
constexpr size_t kMaxUnprovenConnections = 64;
// The unfinished requests and greetings of all connections together, at most this many bytes:
// without it every client with the token could make rank 0 hold a request of the largest size,
// and connections are not counted. It holds the greetings, one request of the largest size (so
// a rank that sends one is served in its turn) and beside it one that sets a value of the
// largest size (src/comm/store_server.cpp checks). When it is full, connections sending
// requests wait to be read.
constexpr size_t kMaxBufferedBytes = size_t{64} << 20;

enum Status : uint8_t { kOk = 0, kRefused = 1, kBadRequest = 2, kTimedOut = 3 };

enum Op : uint8_t {
  kSet = 1,         // key, value
  kGet = 2,         // key, timeout ms (0: none); waits for the key, answers its value
  kAdd = 3,         // key, delta; answers the new value
  kCheck = 4,       // key count, keys; answers 1 when all exist
  kWait = 5,        // key count, keys, timeout ms (0: none)
  kDelete = 6,      // key; answers 1 when it existed
  kNumKeys = 7,     // answers the number of keys
  kCompareSet = 8,  // key, expected, desired; answers the value now stored (c10d semantics)
};

// A malformed or oversized message.
class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Builds one frame.
class Writer {
 public:
  Writer() : bytes_(4, '\0') {}
  Writer& u8(uint8_t v) { return raw(&v, 1); }
  Writer& u32(uint32_t v) { return raw(&v, 4); }
  Writer& i64(int64_t v) { return raw(&v, 8); }
  Writer& u64(uint64_t v) { return raw(&v, 8); }
  Writer& str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    bytes_.append(s);
    return *this;
  }
  // The frame: the body's length, then the body.
  std::string frame() {
    const uint32_t n = static_cast<uint32_t>(bytes_.size() - 4);
    std::memcpy(bytes_.data(), &n, 4);
    return std::move(bytes_);
  }

 private:
  Writer& raw(const void* p, size_t n) {
    bytes_.append(static_cast<const char*>(p), n);
    return *this;
  }
  std::string bytes_;
};

// Reads the fields of one frame's body; throws ProtocolError past its end or over a limit.
class Reader {
 public:
  explicit Reader(const std::string& body) : Reader(body.data(), body.size()) {}
  Reader(const char* body, size_t size) : p_(body), left_(size) {}
  uint8_t u8() { return fixed<uint8_t>(); }
  uint32_t u32() { return fixed<uint32_t>(); }
  int64_t i64() { return fixed<int64_t>(); }
  uint64_t u64() { return fixed<uint64_t>(); }
  std::string str(uint32_t max_bytes, const char* what) {
    const uint32_t n = u32();
    if (n > max_bytes)
      throw ProtocolError(std::string(what) + " of " + std::to_string(n) +
                          " bytes is over the limit of " + std::to_string(max_bytes));
    if (n > left_) throw ProtocolError(std::string(what) + " runs past the end of the message");
    std::string s(p_, n);
    p_ += n;
    left_ -= n;
    return s;
  }
  bool done() const { return left_ == 0; }

 private:
  template <typename T>
  T fixed() {
    if (left_ < sizeof(T)) throw ProtocolError("message too short");
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    left_ -= sizeof(T);
    return v;
  }
  const char* p_;
  size_t left_;
};

}  // namespace mfsdp::store_wire
