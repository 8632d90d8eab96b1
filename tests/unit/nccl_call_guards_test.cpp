// The issue/abort handshake and the RAII NCCL group of src/comm/nccl_call_guards.h, through
// fakes standing in for the NCCL calls (the fault seam: calls that throw or take their time).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_call_guards.h"
#include "mfsdp/comm/comm.h"

namespace {

using mfsdp::CommError;
using mfsdp::detail::IssueGate;
using mfsdp::detail::ScopedGroup;

TEST(IssueGate, AnAbortWaitsForTheCallBeingIssuedAndStopsLaterOnes) {
  IssueGate gate;
  std::atomic<bool> inside{false}, issue_returned{false}, aborted_while_inside{false};
  std::thread issuer([&] {
    gate.issue<CommError>([&] {
      inside = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a slow NCCL call
      issue_returned = true;
    });
  });
  while (!inside) std::this_thread::yield();
  const bool aborted = gate.abort("timed out on rank 1", [&] {
    if (!issue_returned) aborted_while_inside = true;  // what the gate must prevent
  });
  issuer.join();
  EXPECT_TRUE(aborted);
  EXPECT_FALSE(aborted_while_inside);
  try {
    gate.issue<CommError>([] { FAIL() << "issued on an aborted communicator"; });
    FAIL() << "no error after the abort";
  } catch (const CommError& e) {
    EXPECT_EQ(std::string(e.what()), "timed out on rank 1");
  }
}

TEST(IssueGate, AbortsOnceKeepingTheFirstReason) {
  IssueGate gate;
  int aborts = 0;
  EXPECT_TRUE(gate.abort("first", [&] { ++aborts; }));
  EXPECT_FALSE(gate.abort("second", [&] { ++aborts; }));
  EXPECT_EQ(aborts, 1);
  EXPECT_EQ(gate.reason(), "first");
  EXPECT_TRUE(gate.aborted());
}

TEST(IssueGate, AQueryNeitherWaitsForAnIssueNorRunsAfterAnAbort) {
  IssueGate gate;
  std::atomic<bool> inside{false}, release{false};
  std::thread issuer([&] {
    gate.issue<CommError>([&] {
      inside = true;
      while (!release) std::this_thread::yield();  // a call polling until its deadline
    });
  });
  while (!inside) std::this_thread::yield();
  int queries = 0;
  EXPECT_FALSE(gate.try_query([&] { ++queries; }));  // returns at once instead of waiting
  release = true;
  issuer.join();
  EXPECT_TRUE(gate.try_query([&] { ++queries; }));
  gate.abort("error", [] {});
  EXPECT_FALSE(gate.try_query([&] { ++queries; }));  // the communicator is gone
  EXPECT_EQ(queries, 1);
}

TEST(IssueGate, ReturnsWhatTheIssueReturns) {
  IssueGate gate;
  EXPECT_EQ(gate.issue<CommError>([] { return 7; }), 7);
}

TEST(ScopedGroup, ClosesTheGroupWhenACallInsideThrows) {
  std::vector<std::string> calls;
  auto start = [&] { calls.push_back("start"); };
  auto end = [&] { calls.push_back("end"); };
  EXPECT_THROW(
      {
        ScopedGroup group(start, end);
        calls.push_back("send");
        throw CommError("ncclSend: invalid argument");  // a failed check inside the group
      },
      CommError);
  EXPECT_EQ(calls, (std::vector<std::string>{"start", "send", "end"}));
}

TEST(ScopedGroup, EndsOnceAndReportsTheEndsError) {
  int ends = 0;
  auto start = [] {};
  auto failing_end = [&] {
    ++ends;
    throw CommError("ncclGroupEnd: remote error");
  };
  {
    ScopedGroup group(start, failing_end);
    EXPECT_THROW(group.end(), CommError);
  }  // the destructor must not end it a second time
  EXPECT_EQ(ends, 1);
}

TEST(ScopedGroup, AStartThatThrowsOpensNoGroup) {
  int ends = 0;
  auto start = [] { throw CommError("ncclGroupStart failed"); };
  auto end = [&] { ++ends; };
  EXPECT_THROW(ScopedGroup group(start, end), CommError);
  EXPECT_EQ(ends, 0);
}

}  // namespace
