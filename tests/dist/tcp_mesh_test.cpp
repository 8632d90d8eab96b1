// The CPU communicator's TCP transport (src/comm/tcp_mesh.h), exercised directly: slot matching
// in any order, messages that arrive before their receive, size mismatches, very large and
// zero-byte messages, pipelined segments, a dead or silent peer, stray connections during the
// rendezvous and a rendezvous that misses a rank. Each test builds its meshes over the store of
// the harness's world communicator (another client of the store that rank 0 serves), under keys of
// its own. (tests/dist/collectives_test.cpp runs every collective over it with MFSDP_SHM=0.)
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <numeric>
#include <sstream>
#include <thread>

#include "comm/store.h"
#include "comm/tcp_mesh.h"
#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "mfsdp/comm/rendezvous.h"

namespace {

using mfsdp::TcpMesh;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr milliseconds kTimeout{60000};

// The harness's store (rank 0 serves it for the world communicator), under `name`.
c10::intrusive_ptr<c10d::Store> store_for(const std::string& name) {
  auto base = mfsdp::connect_store_client(mfsdp::rendezvous_from_env(), kTimeout);
  return c10::make_intrusive<c10d::PrefixStore>("tcp_mesh_test/" + name, base);
}

std::unique_ptr<TcpMesh> mesh_for(const mfsdp::Communicator& comm, const std::string& name,
                                  milliseconds timeout = kTimeout) {
  auto store = store_for(name);
  return TcpMesh::connect(*store, comm.rank(), comm.size(), "127.0.0.1", timeout);
}

// Reproducible bytes of message (from, to, slot).
std::vector<uint8_t> payload(int from, int to, uint64_t slot, size_t nbytes) {
  std::vector<uint8_t> v(nbytes);
  uint32_t x = static_cast<uint32_t>(from * 7919 + to * 104729 + slot * 31 + 1);
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

// Slots match regardless of order: rank 0 sends slot 2 (3 MiB) then slot 1 (1 MiB); rank 1
// posts slot 1 then slot 2, before the messages arrive, while they arrive, or long after (then
// the large messages were first held back in the socket, then buffered). Two messages with one
// slot match two receives of it in order.
MFSDP_DIST_TEST(TcpMesh, OutOfOrderSlotsDeliverTheRightBytes, {2}) {
  auto mesh = mesh_for(comm, "order");
  const int peer = 1 - comm.rank();
  enum When { kBefore, kWhile, kAfter };
  for (When when : {kBefore, kWhile, kAfter}) {
    SCOPED_TRACE(when == kBefore ? "receives posted before the messages"
                 : when == kWhile ? "receives posted while they arrive"
                                  : "receives posted long after the messages");
    const uint64_t base = 100 * when;
    auto one = payload(0, 1, base + 1, 1 << 20), two = payload(0, 1, base + 2, 3 << 20);
    auto three_a = payload(0, 1, base + 3, 10), three_b = payload(0, 1, base + 4, 10);
    if (comm.rank() == 1) {
      std::vector<uint8_t> got1(one.size()), got2(two.size()), got3a(10), got3b(10);
      if (when == kWhile) {
        comm.barrier();  // rank 0 starts sending
        std::this_thread::sleep_for(milliseconds(5));
      }
      if (when == kAfter) {
        comm.barrier();  // rank 0 has sent everything
        std::this_thread::sleep_for(milliseconds(100));
      }
      mesh->post_recv(peer, base + 1, got1.data(), got1.size());
      mesh->post_recv(peer, base + 2, got2.data(), got2.size());
      mesh->post_recv(peer, base + 3, got3a.data(), 10);
      mesh->post_recv(peer, base + 3, got3b.data(), 10);
      if (when == kBefore) comm.barrier();  // now rank 0 sends
      for (int i = 0; i < 4; ++i) mesh->wait_recv(peer, kTimeout);
      EXPECT_EQ(got1, one);
      EXPECT_EQ(got2, two);
      EXPECT_EQ(got3a, three_a);
      EXPECT_EQ(got3b, three_b);
    } else {
      if (when != kAfter) comm.barrier();
      mesh->post_send(peer, base + 2, two.data(), two.size());
      mesh->post_send(peer, base + 1, one.data(), one.size());
      mesh->post_send(peer, base + 3, three_a.data(), 10);
      mesh->post_send(peer, base + 3, three_b.data(), 10);
      for (int i = 0; i < 4; ++i) mesh->wait_send(peer, kTimeout);
      if (when == kAfter) comm.barrier();
    }
    comm.barrier();
  }
}

// Every rank sends to every other rank at once (messages of 0 B to 3 MiB) before anyone posts a
// receive: nobody blocks, everything is buffered, and later receives copy the right bytes.
MFSDP_DIST_TEST(TcpMesh, UnexpectedMessagesAreBufferedUntilPosted, {2, 3, 4}) {
  auto mesh = mesh_for(comm, "unexpected");
  const int n = comm.size(), me = comm.rank();
  const std::vector<size_t> sizes = {0, 1, 100 << 10, 3 << 20};
  std::vector<std::vector<uint8_t>> sent;
  for (int q = 0; q < n; ++q) {
    if (q == me) continue;
    for (size_t i = 0; i < sizes.size(); ++i) {
      sent.push_back(payload(me, q, i, sizes[i]));
      mesh->post_send(q, i, sent.back().data(), sizes[i]);
    }
  }
  for (int q = 0; q < n; ++q)
    for (size_t i = 0; q != me && i < sizes.size(); ++i) mesh->wait_send(q, kTimeout);
  comm.barrier();
  std::this_thread::sleep_for(milliseconds(100));  // all of it has arrived by now
  for (int q = 0; q < n; ++q) {
    if (q == me) continue;
    std::vector<std::vector<uint8_t>> got;
    for (size_t i = sizes.size(); i-- > 0;) {  // reverse slot order, too
      got.emplace_back(sizes[i], 0xEE);
      mesh->post_recv(q, i, got.back().data(), sizes[i]);
    }
    for (size_t i = 0; i < sizes.size(); ++i) mesh->wait_recv(q, kTimeout);
    for (size_t i = 0; i < sizes.size(); ++i)
      EXPECT_EQ(got[sizes.size() - 1 - i], payload(q, me, i, sizes[i]))
          << "slot " << i << " from rank " << q;
  }
  comm.barrier();
}

// Two ranks (or a ring) that each send a large message and wait for it to be sent before they
// post the receive for the peer's message: the messages held back in the sockets are buffered
// once a wait is blocked, so neither waits for the other forever.
MFSDP_DIST_TEST(TcpMesh, SendersThatWaitBeforeReceivingDoNotDeadlock, {2, 3}) {
  auto mesh = mesh_for(comm, "senders");
  const int n = comm.size(), me = comm.rank();
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  const size_t nbytes = 32 << 20;
  std::vector<uint8_t> out = payload(me, right, 9, nbytes), in(nbytes);
  const auto start = Clock::now();
  mesh->post_send(right, 9, out.data(), nbytes);
  mesh->wait_send(right, kTimeout);
  mesh->post_recv(left, 9, in.data(), nbytes);
  mesh->wait_recv(left, kTimeout);
  EXPECT_LT(seconds_since(start), 10.0);
  EXPECT_EQ(in, payload(left, me, 9, nbytes));
  comm.barrier();
}

// A receive whose size differs from the message fails naming both sizes and the peer, whether
// it was posted before the message (checked at the header), while a large one is held back in
// the socket, or after it arrived (checked on post); then the mesh is broken.
MFSDP_DIST_TEST(TcpMesh, SizeMismatchIsAnError, {2}) {
  enum When { kBefore, kWhile, kAfter };
  for (size_t sent : {size_t{100}, size_t{4} << 20}) {
    for (When when : {kBefore, kWhile, kAfter}) {
      const std::string name = "mismatch-" + std::to_string(sent) + "-" + std::to_string(when);
      SCOPED_TRACE(name);
      auto mesh = mesh_for(comm, name);
      std::vector<uint8_t> buf(sent, 7);
      if (comm.rank() == 1) {
        if (when == kBefore) mesh->post_recv(0, 7, buf.data(), 64);
        comm.barrier();
        if (when == kWhile) std::this_thread::sleep_for(milliseconds(5));
        if (when == kAfter) {
          comm.barrier();  // rank 0 has sent it
          std::this_thread::sleep_for(milliseconds(100));
        }
        if (when != kBefore) mesh->post_recv(0, 7, buf.data(), 64);
        const std::string msg = error_of([&] { mesh->wait_recv(0, kTimeout); });
        expect_contains(msg, {"size mismatch", "slot 7", "64 bytes",
                              std::to_string(sent) + " bytes", "rank 0"});
        expect_contains(error_of([&] { mesh->post_recv(0, 8, buf.data(), 1); }),
                        {"broken", "64 bytes"});
      } else {
        comm.barrier();
        mesh->post_send(1, 7, buf.data(), sent);
        // Rank 1's failed receive breaks its mesh, which shuts the connection down: a large
        // send may not get through.
        const std::string msg = error_of([&] { mesh->wait_send(1, kTimeout); });
        if (msg != "<no exception>") expect_contains(msg, {"rank 1 closed the connection"});
        if (when == kAfter) comm.barrier();
      }
      comm.barrier();
    }
  }
}

// 256 MiB each way at once between two ranks (partial reads and writes, no deadlock of two
// senders), received into place.
MFSDP_DIST_TEST(TcpMesh, Transfers256MiBBothWays, {2}) {
  auto mesh = mesh_for(comm, "large");
  const int peer = 1 - comm.rank();
  const int64_t numel = (int64_t{256} << 20) / 4;
  at::Tensor out = at::arange(numel, at::kInt).add_(comm.rank() * 1000);
  at::Tensor in = at::zeros({numel}, at::kInt);
  comm.barrier();
  const auto start = Clock::now();
  mesh->post_recv(peer, 1, in.data_ptr(), in.nbytes());
  mesh->post_send(peer, 1, out.data_ptr(), out.nbytes());
  mesh->wait_recv(peer, kTimeout);
  mesh->wait_send(peer, kTimeout);
  const double s = seconds_since(start);
  EXPECT_TRUE(at::equal(in, at::arange(numel, at::kInt).add_(peer * 1000)));
  std::printf("rank %d: 256 MiB each way in %.3f s (%.2f GB/s per direction)\n", comm.rank(), s,
              (256 << 20) / s / 1e9);
  comm.barrier();
}

// Zero-byte messages (null buffers) match by slot like any other, between non-empty ones.
MFSDP_DIST_TEST(TcpMesh, ZeroByteMessages, {2}) {
  auto mesh = mesh_for(comm, "zero");
  const int peer = 1 - comm.rank();
  std::vector<uint8_t> a = payload(comm.rank(), peer, 1, 5), b(5, 0);
  for (uint64_t slot : {10, 11, 12}) mesh->post_send(peer, slot, nullptr, 0);
  mesh->post_send(peer, 1, a.data(), a.size());
  mesh->post_send(peer, 13, nullptr, 0);
  mesh->post_recv(peer, 13, nullptr, 0);
  mesh->post_recv(peer, 1, b.data(), b.size());
  for (uint64_t slot : {12, 10, 11}) mesh->post_recv(peer, slot, nullptr, 0);
  for (int i = 0; i < 5; ++i) mesh->wait_recv(peer, kTimeout);
  for (int i = 0; i < 5; ++i) mesh->wait_send(peer, kTimeout);
  EXPECT_EQ(b, payload(peer, comm.rank(), 1, 5));
  comm.barrier();
}

// The ring reduce-scatter's pattern: post all segments' receives and sends, then wait segment
// by segment (working on each while the next arrives); plus a burst of tiny messages.
MFSDP_DIST_TEST(TcpMesh, PipelinedSegmentsAroundARing, {2, 3}) {
  auto mesh = mesh_for(comm, "ring");
  const int n = comm.size(), me = comm.rank();
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  const int segments = 16;
  const size_t seg = (1 << 20) + 3;
  std::vector<std::vector<uint8_t>> out, in(segments, std::vector<uint8_t>(seg));
  for (int k = 0; k < segments; ++k) mesh->post_recv(left, k, in[k].data(), seg);
  for (int k = 0; k < segments; ++k) {
    out.push_back(payload(me, right, k, seg));
    mesh->post_send(right, k, out.back().data(), seg);
  }
  for (int k = 0; k < segments; ++k) {
    mesh->wait_recv(left, kTimeout);
    EXPECT_EQ(in[k], payload(left, me, k, seg)) << "segment " << k;
  }
  for (int k = 0; k < segments; ++k) mesh->wait_send(right, kTimeout);

  const int tiny = 2000;
  std::vector<uint64_t> sent(tiny), got(tiny, 0);
  for (int i = 0; i < tiny; ++i) {
    sent[i] = uint64_t(me) << 32 | i;
    mesh->post_send(right, 1000 + i, &sent[i], 8);
    mesh->post_recv(left, 1000 + i, &got[i], 8);
  }
  for (int i = 0; i < tiny; ++i) {
    mesh->wait_send(right, kTimeout);
    mesh->wait_recv(left, kTimeout);
    ASSERT_EQ(got[i], uint64_t(left) << 32 | i) << "message " << i;
  }
  comm.barrier();
}

// The last rank sends one message and exits. The others still receive that message, and a
// receive it never sent fails within a fraction of the (long) timeout, naming it; the mesh is
// broken afterwards.
MFSDP_DIST_TEST(TcpMesh, PeerExitIsDetectedQuickly, {2, 3}) {
  auto mesh = mesh_for(comm, "exit");
  const int last = comm.size() - 1;
  comm.barrier();  // every mesh is connected
  if (comm.rank() == last) {
    uint64_t bye = 42;
    for (int q = 0; q < last; ++q) mesh->post_send(q, 1, &bye, 8);
    for (int q = 0; q < last; ++q) mesh->wait_send(q, kTimeout);
    std::fflush(stdout);
    _exit(0);
  }
  std::this_thread::sleep_for(milliseconds(200));  // it is gone by now
  uint64_t got = 0;
  mesh->post_recv(last, 1, &got, 8);
  mesh->wait_recv(last, kTimeout);
  EXPECT_EQ(got, 42u);
  mesh->post_recv(last, 2, &got, 8);
  const auto start = Clock::now();
  const std::string msg = error_of([&] { mesh->wait_recv(last, kTimeout); });
  EXPECT_LT(seconds_since(start), 5.0) << msg;
  expect_contains(msg, {"rank " + std::to_string(last), "closed the connection"});
  expect_contains(error_of([&] { mesh->post_send(last, 3, &got, 8); }), {"broken"});
}

// A message that arrived whole before its receive is posted is delivered even when the peer
// closes its mesh while the receive copies it out of its buffer (the copy runs outside the lock;
// the end of the stream must not fail a receive whose message is already here). Rank 0 posts the
// receive of a buffered 64 MiB message right after asking rank 1 to close, so the end of the
// stream arrives during the copy.
MFSDP_DIST_TEST(TcpMesh, BufferedMessageSurvivesThePeerClosingDuringItsCopy, {2}) {
  const size_t big = 64 << 20;
  auto sent = payload(1, 0, 1, big);
  for (int round = 0; round < 5; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    auto mesh = mesh_for(comm, "close_during_copy_" + std::to_string(round));
    uint64_t go = 7;
    if (comm.rank() == 1) {
      mesh->post_send(0, 1, sent.data(), big);
      mesh->wait_send(0, kTimeout);
      comm.barrier();
      mesh->post_recv(0, 2, &go, 8);
      mesh->wait_recv(0, kTimeout);
      mesh.reset();  // closes the connection while rank 0 copies the message
    } else {
      comm.barrier();
      std::this_thread::sleep_for(milliseconds(100));  // all of it is buffered by now
      std::vector<uint8_t> got(big, 0xEE);
      mesh->post_send(1, 2, &go, 8);
      mesh->post_recv(1, 1, got.data(), big);
      mesh->wait_recv(1, kTimeout);
      mesh->wait_send(1, kTimeout);
      EXPECT_TRUE(got == sent);
    }
    comm.barrier();
  }
}

// A peer that is alive but sends nothing: the wait fails at its timeout, naming slot and peer.
MFSDP_DIST_TEST(TcpMesh, SilentPeerTimesOut, {2}) {
  auto mesh = mesh_for(comm, "silent");
  if (comm.rank() == 0) {
    uint64_t x = 0;
    mesh->post_recv(1, 5, &x, 8);
    const auto start = Clock::now();
    const std::string msg = error_of([&] { mesh->wait_recv(1, milliseconds(500)); });
    const double s = seconds_since(start);
    EXPECT_GE(s, 0.45) << msg;
    EXPECT_LT(s, 3.0) << msg;
    expect_contains(msg, {"no message with slot 5", "rank 1", "500 ms"});
  }
  comm.barrier();
}

// Connections that are not a peer of this mesh (garbage, a wrong nonce, one that never speaks)
// are dropped during the rendezvous; the real peer still connects.
MFSDP_DIST_TEST(TcpMesh, StrayConnectionsAreNotTakenForPeers, {2}) {
  auto store = store_for("stray");
  std::vector<int> strays;
  if (comm.rank() == 1) {
    // Connect to rank 0's published address before rank 1 itself does.
    std::vector<uint8_t> v = store->get("tcp_mesh/0");
    std::istringstream address(std::string(v.begin(), v.end()));
    std::string host, port;
    address >> host >> port;
    addrinfo hints{}, *ai = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    ASSERT_EQ(getaddrinfo(host.c_str(), port.c_str(), &hints, &ai), 0);
    struct Hello {
      uint64_t magic, nonce;
      int32_t rank, size;
    };
    const Hello wrong_nonce{0x6d66736470746d31, 12345, 1, 2};
    const std::string garbage(24, 'x');
    for (int i = 0; i < 3; ++i) {
      int fd = socket(ai->ai_family, SOCK_STREAM, 0);
      ASSERT_EQ(connect(fd, ai->ai_addr, ai->ai_addrlen), 0) << std::strerror(errno);
      if (i == 0) {
        ASSERT_EQ(send(fd, &wrong_nonce, sizeof wrong_nonce, 0), 24);
      } else if (i == 1) {
        ASSERT_EQ(send(fd, garbage.data(), garbage.size(), 0), 24);
      }
      strays.push_back(fd);  // i == 2 stays silent
    }
    freeaddrinfo(ai);
    std::this_thread::sleep_for(milliseconds(200));
  }
  auto mesh = TcpMesh::connect(*store, comm.rank(), comm.size(), "127.0.0.1", kTimeout);
  uint64_t mine = 100 + comm.rank(), theirs = 0;
  const int peer = 1 - comm.rank();
  mesh->post_send(peer, 1, &mine, 8);
  mesh->post_recv(peer, 1, &theirs, 8);
  mesh->wait_recv(peer, kTimeout);
  mesh->wait_send(peer, kTimeout);
  EXPECT_EQ(theirs, 100u + peer);
  for (int fd : strays) close(fd);
  comm.barrier();
}

// A rank that never joins: the others' connect fails within its timeout, naming it, whether it
// is above them (they wait for its connection) or below (they wait for its address).
MFSDP_DIST_TEST(TcpMesh, MissingRankFailsTheRendezvousNamingIt, {3}) {
  for (int absent : {2, 0}) {
    SCOPED_TRACE("rank " + std::to_string(absent) + " absent");
    if (comm.rank() != absent) {
      auto store = store_for("missing-" + std::to_string(absent));
      const auto start = Clock::now();
      const std::string msg = error_of([&] {
        TcpMesh::connect(*store, comm.rank(), comm.size(), "127.0.0.1", milliseconds(1000));
      });
      EXPECT_LT(seconds_since(start), 5.0) << msg;
      expect_contains(msg, {"rank(s) " + std::to_string(absent), "1000 ms"});
    }
    comm.barrier();
  }
}
