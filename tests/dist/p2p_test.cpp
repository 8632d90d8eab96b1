// Point-to-point communication (Communicator::send_recv_async, send, recv): values of every
// dtype and size arrive intact, a batch may hold a ring's sends and receives at once, messages
// between a pair of ranks keep their order, p2p traffic among some ranks leaves the others'
// collectives in step, and bad calls and failures are errors naming the ranks.
#include <torch/torch.h>
#include <unistd.h>

#include <thread>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "mfsdp/comm/simulated_comm.h"

namespace {

using mfsdp::P2POp;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;

P2POp send_op(const at::Tensor& t, int peer) { return P2POp{P2POp::Kind::kSend, t, peer}; }
P2POp recv_op(const at::Tensor& t, int peer) { return P2POp{P2POp::Kind::kRecv, t, peer}; }

// Reproducible values for message `salt`, exact in every dtype used here (integers within bf16's
// 256; int64 values that need all eight bytes).
at::Tensor message(int64_t salt, at::IntArrayRef shape, at::ScalarType dtype) {
  const int64_t numel = c10::multiply_integers(shape);
  at::Tensor i = at::arange(numel, at::kLong);
  at::Tensor v = dtype == at::kLong ? (int64_t{1} << 40) * (salt + 1) + 3 * i
                                    : (7 * i + 13 * salt) % 200 - 100;
  return v.to(dtype).reshape(shape);
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_TRUE(at::equal(got, want)) << what;
}

}  // namespace

// Rank 0 sends each message to rank 1, which sends it back plus one: fp32, bf16 and int64, from
// empty (zero bytes) to 4 MiB (large messages take the mesh's held-back path).
MFSDP_DIST_TEST(P2P, PingPongEveryDtypeAndSize, {2}) {
  struct Case {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  const std::vector<Case> cases = {
      {at::kFloat, {5}},       {at::kBFloat16, {3, 7}},  {at::kLong, {4}},
      {at::kFloat, {0}},       {at::kBFloat16, {0, 3}},  {at::kLong, {0}},
      {at::kFloat, {1 << 20}}, {at::kBFloat16, {40000}}, {at::kLong, {3, 30000}}};
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    const std::string what = std::string(c10::toString(c.dtype)) + " " + c10::str(at::IntArrayRef(c.shape));
    const at::Tensor sent = message(static_cast<int64_t>(k), c.shape, c.dtype);
    at::Tensor buffer = at::full(c.shape, 99, c.dtype);
    if (comm.rank() == 0) {
      comm.send(sent, 1);
      comm.recv(buffer, 1);
      expect_equal(buffer, sent + 1, what + " back on rank 0");
    } else {
      comm.recv(buffer, 0);
      expect_equal(buffer, sent, what + " on rank 1");
      comm.send(buffer + 1, 0);
    }
  }
}

// Every rank sends to its right-hand neighbour and receives from its left-hand one in ONE batch:
// with blocking sends every rank would wait in its send for ever. 4 MiB, so that no send fits in
// the sockets' buffers.
MFSDP_DIST_TEST(P2P, RingInOneBatch, {2, 3, 4}) {
  const int n = comm.size(), rank = comm.rank();
  const int right = (rank + 1) % n, left = (rank + n - 1) % n;
  at::Tensor out = message(rank, {1 << 20}, at::kFloat);
  at::Tensor in = at::full({1 << 20}, 99.0f);
  comm.send_recv_async({send_op(out, right), recv_op(in, left)})->wait();
  expect_equal(in, message(left, {1 << 20}, at::kFloat), "ring, world " + std::to_string(n));
  // The receive first in the batch works the same.
  in.fill_(99);
  comm.send_recv_async({recv_op(in, left), send_op(out, right)})->wait();
  expect_equal(in, message(left, {1 << 20}, at::kFloat), "ring (receive first), world " + std::to_string(n));
}

// A pipeline's traffic: forward, rank r receives the activation from r - 1, adds r and sends it
// on to r + 1; backward, the gradient goes the other way, each rank adding its rank. 3 rounds,
// each stage sending its result while it already receives the next round's input (one batch, as
// Megatron's send_forward_recv_forward).
MFSDP_DIST_TEST(P2P, PipelineForwardAndBackward, {4}) {
  const int n = comm.size(), rank = comm.rank();
  const double stages_sum = n * (n - 1) / 2.0;  // 0 + 1 + ... + n-1
  auto start = [](int round) { return at::full({2, 3}, 10.0 * (round + 1)); };
  for (int round = 0; round < 3; ++round) {
    // Forward.
    at::Tensor act = rank == 0 ? start(round) : at::empty({2, 3});
    if (rank > 0) comm.recv(act, rank - 1);
    act.add_(rank);
    if (rank < n - 1) comm.send(act, rank + 1);
    if (rank == n - 1)
      expect_equal(act, start(round) + stages_sum, "forward, round " + std::to_string(round));
    // Backward: the last stage sends its output as the gradient.
    at::Tensor grad = rank == n - 1 ? act.clone() : at::empty({2, 3});
    if (rank < n - 1) comm.recv(grad, rank + 1);
    grad.add_(rank);
    if (rank > 0) comm.send(grad, rank - 1);
    if (rank == 0)
      expect_equal(grad, start(round) + 2 * stages_sum, "backward, round " + std::to_string(round));
  }
  // Overlapped: each middle stage sends round k's result and receives round k + 1's input in one
  // batch, asynchronously, while the first stage streams its inputs.
  const int rounds = 3;
  std::vector<at::Tensor> results;
  if (rank == 0) {
    for (int k = 0; k < rounds; ++k) comm.send(start(k) + rank, 1);
  } else {
    at::Tensor act = at::empty({2, 3});
    comm.recv(act, rank - 1);
    for (int k = 0; k < rounds; ++k) {
      at::Tensor done = act + rank;
      at::Tensor next = at::empty({2, 3});
      std::vector<P2POp> ops;
      if (rank < n - 1) ops.push_back(send_op(done, rank + 1));
      if (k + 1 < rounds) ops.push_back(recv_op(next, rank - 1));
      comm.send_recv_async(ops)->wait();
      if (rank == n - 1) results.push_back(done);
      act = next;
    }
    for (int k = 0; k < static_cast<int>(results.size()); ++k)
      expect_equal(results[k], start(k) + stages_sum, "overlapped forward, round " + std::to_string(k));
  }
}

// The k-th message rank 0 sends to rank 1 is rank 1's k-th receive from rank 0, however the two
// group them into batches: rank 0 issues 200 sends of varied sizes asynchronously (single sends,
// then batches of three), rank 1 receives them in batches of five and then one by one.
MFSDP_DIST_TEST(P2P, ManyMessagesArriveInOrder, {2}) {
  const int count = 200;
  auto shape = [](int k) { return std::vector<int64_t>{(k * 37) % 11}; };  // zero bytes included
  if (comm.rank() == 0) {
    std::vector<mfsdp::WorkHandle> works;
    for (int k = 0; k < count;) {
      std::vector<P2POp> ops;
      const int batch = k < count / 2 ? 1 : 3;
      for (int j = 0; j < batch && k < count; ++j, ++k)
        ops.push_back(send_op(message(k, shape(k), at::kFloat), 1));
      works.push_back(comm.send_recv_async(ops));
    }
    for (auto& w : works) w->wait();
  } else {
    std::vector<at::Tensor> got;
    std::vector<mfsdp::WorkHandle> works;
    for (int k = 0; k < count;) {
      std::vector<P2POp> ops;
      const int batch = k < count / 2 ? 5 : 1;
      for (int j = 0; j < batch && k < count; ++j, ++k) {
        got.push_back(at::full(shape(k), 99.0f));
        ops.push_back(recv_op(got.back(), 0));
      }
      works.push_back(comm.send_recv_async(ops));
    }
    for (auto& w : works) w->wait();
    for (int k = 0; k < count; ++k)
      expect_equal(got[k], message(k, shape(k), at::kFloat), "message " + std::to_string(k));
  }
}

// Only ranks 0 and 1 exchange messages (three async batches, one of them large, queued ahead of
// the collectives), ranks 2 and 3 none; then all four reduce, gather and broadcast; then ranks 2
// and 3 exchange while 0 and 1 do not. Were a p2p batch to take a collective sequence number, the
// exchanging ranks would be three collectives ahead of the others, and the collectives would fail
// or mix data up.
MFSDP_DIST_TEST(P2P, SomeRanksExchangingKeepCollectivesInStep, {4}) {
  const int rank = comm.rank();
  mfsdp::AllReduceOptions sum;
  sum.timeout = std::chrono::seconds(20);  // a desynchronised collective fails, not after a minute
  auto collectives = [&](int round) {
    const std::string what = ", round " + std::to_string(round);
    at::Tensor t = at::full({1000}, rank + 1.0 + round);
    comm.all_reduce(t, sum);
    expect_equal(t, at::full({1000}, 10.0 + 4 * round), "all_reduce" + what);
    at::Tensor gathered = at::empty({4 * 3});
    comm.all_gather(gathered, at::full({3}, rank * 1.0 + round));
    for (int r = 0; r < 4; ++r)
      expect_equal(gathered.narrow(0, 3 * r, 3), at::full({3}, r * 1.0 + round), "all_gather" + what);
    at::Tensor b = rank == 3 ? message(round, {17}, at::kLong) : at::zeros({17}, at::kLong);
    comm.broadcast(b, {3});
    expect_equal(b, message(round, {17}, at::kLong), "broadcast" + what);
  };
  struct Exchange {
    int peer = -1;
    std::vector<at::Tensor> in;
    std::vector<mfsdp::WorkHandle> works;
  };
  // Ranks a and b send each other three messages (one batch each), not waited for yet.
  auto start = [&](int a, int b, int salt) {
    Exchange e;
    if (rank != a && rank != b) return e;
    e.peer = rank == a ? b : a;
    for (int k = 0; k < 3; ++k) {
      const std::vector<int64_t> size = {k == 1 ? 300000 : 5};
      e.in.push_back(at::empty(size));
      at::Tensor out = message(10 * rank + k + salt, size, at::kFloat);
      e.works.push_back(comm.send_recv_async({send_op(out, e.peer), recv_op(e.in.back(), e.peer)}));
    }
    return e;
  };
  auto finish = [&](const Exchange& e, int salt) {
    for (auto& w : e.works) w->wait();
    for (int k = 0; k < static_cast<int>(e.in.size()); ++k)
      expect_equal(e.in[k], message(10 * e.peer + k + salt, e.in[k].sizes(), at::kFloat),
                   "message " + std::to_string(k) + " from rank " + std::to_string(e.peer));
  };
  Exchange first = start(0, 1, 0);
  collectives(0);
  finish(first, 0);
  Exchange second = start(2, 3, 5);
  collectives(1);
  finish(second, 5);
}

// Sizes that differ: the receiver fails at once with a CommError naming the operation, both
// ranks and both sizes; the sender's next call fails too (the receiver broke off), not at a
// timeout.
MFSDP_DIST_TEST(P2P, SizeMismatchIsAnError, {2}) {
  const auto start = std::chrono::steady_clock::now();
  if (comm.rank() == 0) {
    const std::string msg = error_of([&] { comm.recv(at::empty({8}), 1); });  // 32 bytes
    expect_contains(msg, {"send_recv", "rank 0", "rank 1", "32 bytes", "16 bytes"});
    expect_contains(error_of([&] { comm.send(at::empty({4}), 1); }), {"broken"});
  } else {
    try {
      comm.send(at::ones({4}), 0);  // 16 bytes; may complete before rank 0 notices
      comm.barrier();
      ADD_FAILURE() << "rank 1: a barrier after the mismatched send succeeded";
    } catch (const mfsdp::CommError&) {
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "not at once";
}

// A peer that exits while a receive from it is pending: the receive fails with a CommError naming
// the peer, at once rather than at the (20 s) timeout.
MFSDP_DIST_TEST(P2P, PeerExitFailsAPendingRecv, {2}) {
  comm.barrier();  // both connected and working
  if (comm.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    _exit(0);
  }
  const auto start = std::chrono::steady_clock::now();
  mfsdp::P2POptions options;
  options.timeout = std::chrono::seconds(20);
  const std::string msg = error_of([&] { comm.recv(at::empty({16}), 1, options); });
  expect_contains(msg, {"send_recv", "rank 0", "receiving from rank 1", "exited"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << msg;
}

// A peer that is alive but never sends: the receive fails at its own timeout (P2POptions), naming
// the peer and the timeout.
MFSDP_DIST_TEST(P2P, SilentPeerTimesOut, {2}) {
  comm.barrier();
  if (comm.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(3000));
    _exit(0);
  }
  mfsdp::P2POptions options;
  options.timeout = std::chrono::milliseconds(1000);
  expect_contains(error_of([&] { comm.recv(at::empty({16}), 1, options); }),
                  {"send_recv", "receiving from rank 1", "1000 ms"});
}

// Bad ops are std::invalid_argument naming the op's index and the problem, before any traffic:
// the communicator works afterwards.
MFSDP_DIST_TEST(P2P, BadOpsAreRejectedBeforeTraffic, {1, 2}) {
  const int rank = comm.rank(), n = comm.size();
  const int other = (rank + 1) % n;
  auto invalid = [&](const std::vector<P2POp>& ops) {
    try {
      comm.send_recv_async(ops)->wait();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("<no std::invalid_argument>");
  };
  const at::Tensor t = at::ones({4});
  expect_contains(invalid({send_op(t, rank)}), {"send_recv", "op 0", "this rank itself"});
  expect_contains(invalid({recv_op(t, -1)}), {"send_recv", "op 0", "outside [0, " + std::to_string(n) + ")"});
  if (n > 1) {
    // The first op is fine; the second is the one named.
    expect_contains(invalid({send_op(t, other), recv_op(at::empty({4}), n)}),
                    {"op 1", "recv from rank " + std::to_string(n), "outside"});
    expect_contains(invalid({send_op(at::ones({4, 4}).t(), other)}), {"op 0", "not contiguous"});
    expect_contains(invalid({recv_op(at::empty({4}, at::kMeta), other)}), {"op 0", "meta"});
    expect_contains(invalid({send_op(at::Tensor(), other)}), {"op 0", "undefined"});
  }
  comm.send_recv_async({})->wait();  // an empty batch is fine
  if (n > 1) {
    at::Tensor in = at::zeros({4});
    comm.send_recv_async({send_op(t * (rank + 1), other), recv_op(in, other)})->wait();
    expect_equal(in, at::full({4}, other + 1.0), "after the rejected calls");
  }
}

// The simulated communicator has no peers: a send moves nothing, a receive gets zeros; bad ops
// fail as on a real one.
TEST(P2P, SimulatedRecvZeroFillsAndSendIsANoOp) {
  auto comm = mfsdp::make_simulated_communicator(1, 4);
  at::Tensor in = at::full({2, 3}, 7.0), out = at::full({5}, 3.0, at::kBFloat16);
  comm->send_recv_async({recv_op(in, 0), send_op(out, 2)})->wait();
  EXPECT_TRUE(at::equal(in, at::zeros({2, 3})));
  EXPECT_TRUE(at::equal(out, at::full({5}, 3.0, at::kBFloat16)));
  at::Tensor single = at::ones({3}, at::kLong);
  comm->recv(single, 3);
  EXPECT_TRUE(at::equal(single, at::zeros({3}, at::kLong)));
  comm->send(single, 0);
  expect_contains(error_of([&] { comm->send(single, 1); }), {"send_recv", "op 0", "itself"});
  expect_contains(error_of([&] { comm->recv(single, 4); }), {"send_recv", "outside [0, 4)"});
}
