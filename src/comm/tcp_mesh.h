// Tagged point-to-point byte transfers between every pair of ranks over TCP: the transport of
// the CPU communicator (src/comm/cpu_communicator.h) for bulk data between hosts (and on one
// host when MFSDP_SHM=0) and for broadcast and barrier everywhere.
//
// Model. One TCP connection per pair of ranks carries framed messages (a 16-byte header: slot,
// byte count; then the payload). A receive matches the oldest unmatched message with the same
// slot from the same peer; messages of different slots may arrive and be received in any order.
// A posted receive gets its payload straight from the socket. A message that arrives before its
// receive is posted is buffered and copied on post; a large one (>= 64 KiB) is first held back in
// the socket (the sender's writes wait) until its receive is posted, which saves the buffer and
// the copy when the receiver is only a little behind (ranks drift between collectives); it is
// buffered after all once a receive of another slot is posted for that peer, after 20 ms, or
// after 2 ms of any wait on this mesh being blocked (so holding back never deadlocks, e.g. two
// ranks that wait for their sends before posting their receives). Per peer, posted operations
// are waited in posting order: wait_recv(peer) completes the oldest unwaited receive posted for
// `peer`, wait_send(peer) the oldest unwaited send (sends to one peer complete in posting order,
// when the kernel took their last byte).
//
// Threads. One progress thread per mesh (not per peer) polls all sockets (non-blocking,
// TCP_NODELAY) and an eventfd: it reads every peer's stream as data arrives (but for a held-back
// message; so two ranks sending to each other cannot deadlock in the kernel's socket buffers) and
// writes queued sends when their socket has room. post_send first tries one non-blocking write on
// the caller's thread when nothing is queued for that peer, which saves a thread hand-off for
// small messages. Callers block only in wait_recv/wait_send (a condition variable). Posting everything of a
// pipelined step and then waiting segment by segment overlaps the transfer of segment k+1 (on the
// progress thread) with whatever the caller does with segment k.
//
// Contracts.
//  - A posted buffer must stay valid (and a send's bytes unchanged) until its wait returns, or
//    until any wait of the mesh threw (see failures). Zero-byte messages are allowed.
//  - post_* and wait_* may be called from several threads, but the per-peer posting order is the
//    order the calls happened in; the CPU communicator calls them from one thread at a time.
//  - Failures. A peer whose connection ends (EOF, reset: it exited or closed its mesh) fails its
//    unfinished operations at once, naming it; messages it completed before are still delivered.
//    A wait that does not complete within its timeout fails, naming slot, size and peer. A
//    receive whose size differs from its message fails naming both sizes. Any wait that throws (CommError) breaks the whole mesh:
//    before it throws, the mesh stops touching every buffer of unfinished operations and shuts
//    its connections down (so peers fail at once instead of at their timeout), and every later
//    call throws the first error. Posting to an out-of-range peer or to oneself, or waiting with
//    nothing posted, is a programming error (std::logic_error / std::invalid_argument).
//  - The destructor closes the sockets and joins the progress thread without waiting for
//    anything (never hangs on gone peers); no call may be in flight then. Unwaited operations
//    are abandoned.
//  - Writes use MSG_NOSIGNAL: a gone peer is an error, never SIGPIPE.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace mfsdp {

class TcpMesh {
 public:
  // Collective over the `size` ranks sharing `store`: listens on an ephemeral port of
  // `bind_host` (a host name or numeric address; its first resolved address), publishes
  // "<address> <port> <nonce>" under "tcp_mesh/<rank>" in `store`, and connects to every other
  // rank (the higher rank of a pair connects, the lower accepts). The handshake carries the
  // ranks, the world size and the acceptor's nonce from the store, so a stray connection is
  // dropped rather than taken for a peer. Throws CommError naming the missing ranks when the
  // mesh is not complete within `timeout`. size == 1 gives a mesh with no peers.
  static std::unique_ptr<TcpMesh> connect(c10d::Store& store, int rank, int size,
                                          const std::string& bind_host,
                                          std::chrono::milliseconds timeout);
  ~TcpMesh();
  TcpMesh(const TcpMesh&) = delete;
  TcpMesh& operator=(const TcpMesh&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Receive the next message with `slot` from `peer` (exactly `nbytes` bytes) into `dst`.
  void post_recv(int peer, uint64_t slot, void* dst, size_t nbytes);
  // Send `nbytes` bytes at `src` to `peer` as a message with `slot`.
  void post_send(int peer, uint64_t slot, const void* src, size_t nbytes);
  // Block until the oldest unwaited receive (send) posted for `peer` completed; throws
  // CommError when it failed or did not complete within `timeout` (> 0).
  void wait_recv(int peer, std::chrono::milliseconds timeout);
  void wait_send(int peer, std::chrono::milliseconds timeout);

 private:
  struct State;
  TcpMesh(int rank, int size, std::unique_ptr<State> state);

  int rank_, size_;
  std::unique_ptr<State> state_;  // sockets, queues, the progress thread (tcp_mesh.cpp)
};

}  // namespace mfsdp
