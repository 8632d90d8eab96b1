// The launchers' rendezvous across nodes: how the mfsdp-run of every node of a job with
// --nnodes > 1 and --max-restarts agree on each round (start) of the job's ranks
// (docs/launcher.md, "Restarts across nodes").
//
// Node 0's launcher serves a tiny line protocol on MASTER_ADDR:--rdzv-port (RendezvousServer);
// every launcher, node 0's included, asks it over TCP, one connection per request
// (RendezvousClient): "join k" until every node has joined round k (then all start their ranks
// with the round's MASTER_PORT), "poll k" every --monitor-interval while the ranks run (a higher
// round means another node's ranks failed: stop ours), "fail k" when a rank here failed (the
// server announces round k+1), "done k" when every rank here exited 0, "interrupt k" after
// SIGINT/SIGTERM (the job ends on every node: an interrupt is never restarted).
//
// What the server accepts: a request names the job token, the node count and --max-restarts,
// which must be its own; at most 64 connections wait at a time, each must send its one line
// (at most 8 KiB) within kRendezvousRequestTimeout. One thread polls non-blocking sockets, so no
// client holds up another. Every client request has a timeout, and so does every wait built on
// them.
//
// Torch-free (mfsdp-run links only mfsdp_launch); the code is src/launch/launcher_rendezvous.cpp.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

namespace mfsdp::launch {

// How long a client request takes at most by default, and how long the server waits for a
// connection's request line before it closes the connection.
inline constexpr std::chrono::seconds kRendezvousRequestTimeout{2};

// Who asks: the same job token, node count and --max-restarts on every node; node_rank and a
// random id of this launcher process (two launchers given one --node-rank are told apart).
struct RendezvousIdentity {
  int nnodes = 1;
  int max_restarts = 0;
  int node_rank = 0;
  std::string launcher_id;
  std::string token;
};

// The server's answer to one request.
struct RendezvousReply {
  enum Kind { kGo, kWait, kRound, kAbort, kError } kind = kError;
  int round = 0;
  int master_port = 0;   // kGo: the round's MASTER_PORT
  int done = 0;          // kRound: nodes whose ranks all exited 0 in `round`
  int failed_by = -1;    // kRound: the node whose failure started `round`, -1 for round 0
  std::string text;      // kWait: the nodes not joined yet ("1,3"); kAbort/kError: why
};

// Node 0's side. Serves from a thread of its own until destroyed.
//
// The rounds: a join of the running round is answered "wait" with the nodes not joined yet,
// and "go" with the round's MASTER_PORT once every node has joined it (a join of a round the job
// has left gets the job's state instead). When nodes are still missing after join_timeout
// (counted from the round's beginning), the next join ends the job ("abort" naming them).
// "fail k" of the running round begins round k+1 with a new MASTER_PORT (pick_free_port(),
// neither the server's port nor round k's); past --max-restarts no node joins it and every
// launcher ends on its own. The job ends ("abort" with the reason) after an interrupt on any
// node, or when a round would have to start without a node whose ranks all exited 0. Requests of
// another token, node count or --max-restarts are refused ("error ...") and noted on stderr (the
// first five, then one a minute at most).
class RendezvousServer {
 public:
  struct Config {
    int nnodes = 1;
    int max_restarts = 0;
    std::string token;
    int first_master_port = 0;                   // round 0's MASTER_PORT
    std::chrono::milliseconds join_timeout{600000};  // every node must join a round within this
  };

  // Listens on host:port, where host (MASTER_ADDR) must be an address of this host, and starts
  // serving. Throws std::runtime_error naming the address when it cannot (the host does not
  // resolve, the port is in use, the address is not this host's).
  RendezvousServer(const std::string& host, int port, Config config);
  // Stops serving (the thread ends at once) and closes the listening socket.
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  // The address it listens on, "HOST:PORT" ("[HOST]:PORT" for IPv6).
  const std::string& address() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Every node's side: one request at a time to node 0's launcher (the monitor thread and the main
// thread may both ask; their requests take turns).
class RendezvousClient {
 public:
  RendezvousClient(std::string host, int port, RendezvousIdentity identity);
  ~RendezvousClient();
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  // "HOST:PORT" of node 0's launcher, as given.
  std::string server_text() const;
  const RendezvousIdentity& identity() const { return identity_; }

  // One request ("join", "poll", "fail", "done" or "interrupt" of `round`; `arg` is the signal of
  // an interrupt), on a connection of its own, answered within `timeout`: each resolved address
  // of the host is tried in turn, all before the one deadline (the host is resolved again on the
  // next request when none answered). A reply it does not know comes back as kError. Throws
  // std::runtime_error naming node 0's address and the reason (it does not resolve, refused,
  // timed out, closed without a reply) when no answer came.
  RendezvousReply request(const std::string& verb, int round, int arg = 0,
                          std::chrono::milliseconds timeout = kRendezvousRequestTimeout);

 private:
  struct Addresses;  // host:port resolved, kept between requests

  const std::string host_;
  const int port_;
  const RendezvousIdentity identity_;
  std::mutex mutex_;  // one request at a time
  std::unique_ptr<Addresses> addresses_;
};

}  // namespace mfsdp::launch
