// A dead or silent peer is an error within the timeout, never a hang; bad arguments are
// rejected before any traffic with a message naming the problem.
#include <torch/torch.h>
#include <unistd.h>

#include <thread>

#include "harness/dist_test.h"

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

// The last rank exits in the middle of the job; the others' next collective fails naming the
// operation and the exit, and later calls fail at once because the communicator is broken.
// The exit is noticed, not waited out: the collective timeout is the harness's minute, and
// start-up has its own (CommOptions::rendezvous_timeout), so a slow start on a loaded machine
// fails nothing (this test used 3 s for both, and failed when start-up took longer).
MFSDP_DIST_TEST(CommFailures, PeerExitMidCollectiveIsAnError, {2, 3, 4}) {
  const int last = comm.size() - 1;
  at::Tensor t = at::ones({1 << 12});
  comm.all_reduce(t);  // everyone is connected and working
  if (comm.rank() == last) {
    // Die after the other ranks have started the next all-reduce (its traffic is partial).
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    _exit(0);
  }
  try {
    comm.all_reduce(t);
    ADD_FAILURE() << "all_reduce succeeded although rank " << last << " exited";
  } catch (const mfsdp::CommError& e) {
    std::string msg = e.what();
    EXPECT_TRUE(contains(msg, "all_reduce")) << msg;
    EXPECT_TRUE(contains(msg, "rank " + std::to_string(comm.rank()))) << msg;
    EXPECT_TRUE(contains(msg, "exited")) << msg;
  }
  try {
    comm.barrier();
    ADD_FAILURE() << "barrier succeeded on a broken communicator";
  } catch (const mfsdp::CommError& e) {
    EXPECT_TRUE(contains(e.what(), "broken")) << e.what();
  }
}

// A peer that is alive but never joins: the others time out and name the peer they waited on.
MFSDP_DIST_TEST_OPTS(CommFailures, SilentPeerTimesOut, mfsdp::testing::short_timeout({2})) {
  at::Tensor t = at::ones({16});
  if (comm.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(6000));  // twice the timeout
    _exit(0);
  }
  try {
    at::Tensor out = at::empty({32});
    comm.all_gather(out, t);
    ADD_FAILURE() << "all_gather succeeded without rank 1";
  } catch (const mfsdp::CommError& e) {
    std::string msg = e.what();
    EXPECT_TRUE(contains(msg, "all_gather")) << msg;
    EXPECT_TRUE(contains(msg, "rank 1")) << msg;
    EXPECT_TRUE(contains(msg, "3000 ms")) << msg;
  }
}

MFSDP_DIST_TEST(CommFailures, BadArgumentsAreRejectedBeforeTraffic, {2}) {
  auto expect_invalid = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "expected std::invalid_argument mentioning '" << part << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_TRUE(contains(e.what(), part)) << e.what();
    }
  };
  at::Tensor in = at::ones({4}), out = at::empty({8});
  expect_invalid([&] { comm.all_gather(at::empty({7}), in); }, "output has 7 elements");
  expect_invalid([&] { comm.all_gather(out, in.to(at::kBFloat16)); }, "dtype");
  expect_invalid([&] { comm.all_gather(out, in, {{4}}); }, "counts has 1 entries");
  expect_invalid([&] { comm.reduce_scatter(at::empty({3}), at::ones({8})); }, "output has 3");
  expect_invalid([&] { comm.reduce_scatter(at::empty({2}), at::ones({5})); }, "not divisible");
  expect_invalid([&] { comm.all_reduce(at::ones({4}, at::kInt), {mfsdp::ReduceOp::kAvg}); },
                 "floating-point");
  expect_invalid([&] { comm.all_reduce(at::ones({4, 4}).t()); }, "not contiguous");
  expect_invalid([&] { comm.broadcast(in, {5}); }, "root 5");
  // The communicator still works afterwards.
  comm.all_reduce(in);
  EXPECT_TRUE(at::equal(in, at::full({4}, 2.0)));
}
