// The CPU communicator's shared-memory data path (src/comm/shm_exchange.h): used when every
// rank is on this host, unlinked from /dev/shm as soon as all ranks mapped it, off with
// MFSDP_SHM=0; collectives larger than a slot run in many rounds with ranks whose slices end at
// different rounds (or are empty), checked exactly against values each rank computes locally.
// (tests/dist/collectives_test.cpp runs every collective through it, and again over TCP.)
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "harness/dist_test.h"

namespace {

using mfsdp::ReduceOp;

// The /proc/self/maps line of a mapping whose path contains `part` ("" when none).
std::string mapping(const std::string& part) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.find(part) != std::string::npos) return line;
  return "";
}

bool shm_disabled() {
  const char* env = std::getenv("MFSDP_SHM");
  return env != nullptr && std::string(env) == "0";
}

// Integer values in [-8, 8]: sums over a few ranks are exact in fp32 and bf16.
at::Tensor rank_input(int rank, int64_t numel, at::ScalarType dtype, int salt) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7919 * rank + salt);
  return at::randint(-8, 9, {numel}, gen, at::kFloat).to(dtype);
}

// More than one 4 MiB slot of fp32 per rank, so several rounds; uneven, one rank empty.
std::vector<int64_t> large_counts(int world) {
  std::vector<int64_t> counts;
  for (int r = 0; r < world; ++r) counts.push_back(r == 1 ? 0 : (int64_t{5} << 20) / (r + 1) + 7 * r);
  return counts;
}

int64_t offset_of(const std::vector<int64_t>& c, int r) {
  int64_t o = 0;
  for (int i = 0; i < r; ++i) o += c[i];
  return o;
}

}  // namespace

MFSDP_DIST_TEST(ShmExchange, MappedOnOneHostAndUnlinked, {1, 2, 3}) {
  at::Tensor t = at::ones({8});
  comm.all_reduce(t);  // every rank has finished connecting
  const std::string line = mapping("/dev/shm/mfsdp-");
  if (comm.size() > 1 && !shm_disabled()) {
    EXPECT_NE(line, "") << "no shared segment mapped";
    EXPECT_NE(line.find("(deleted)"), std::string::npos) << "still in /dev/shm: " << line;
  } else {
    EXPECT_EQ(line, "") << "mapped although " << (comm.size() == 1 ? "alone" : "MFSDP_SHM=0");
  }
  EXPECT_TRUE(at::equal(t, at::full({8}, comm.size(), at::kFloat)));
}

// CommOptions::shared_memory wins over MFSDP_SHM: set to the opposite of what the variable says
// (this test runs with it unset and, as Tcp.ShmExchange.*, with MFSDP_SHM=0).
static mfsdp::testing::DistOptions option_against_the_variable() {
  mfsdp::testing::DistOptions o;
  o.world_sizes = {2};
  o.shared_memory = shm_disabled();
  return o;
}

MFSDP_DIST_TEST_OPTS(ShmExchange, MappedOrNotAsTheOptionSaysWhateverTheVariable, option_against_the_variable()) {
  at::Tensor t = at::ones({8});
  comm.all_reduce(t);
  const std::string line = mapping("/dev/shm/mfsdp-");
  if (shm_disabled())
    EXPECT_NE(line, "") << "CommOptions::shared_memory true, MFSDP_SHM=0: no segment mapped";
  else
    EXPECT_EQ(line, "") << "CommOptions::shared_memory false: mapped " << line;
  EXPECT_TRUE(at::equal(t, at::full({8}, 2, at::kFloat)));
}

MFSDP_DIST_TEST(ShmExchange, LargeUnevenCollectivesSpanManyRounds, {2, 3}) {
  const int world = comm.size(), rank = comm.rank();
  const auto counts = large_counts(world);
  const int64_t total = offset_of(counts, world);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    // all_gather: every slice from its owner.
    at::Tensor out = at::full({total}, 99, dtype);
    mfsdp::AllGatherOptions ag;
    ag.counts = counts;
    comm.all_gather(out, rank_input(rank, counts[rank], dtype, 1), ag);
    for (int r = 0; r < world; ++r)
      EXPECT_TRUE(at::equal(out.narrow(0, offset_of(counts, r), counts[r]),
                            rank_input(r, counts[r], dtype, 1)))
          << "all_gather " << c10::toString(dtype) << " slice of rank " << r;

    // reduce_scatter (sum with a prescale of 0.5, and max): this rank's slice of every input.
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      at::Tensor mine = at::empty({counts[rank]}, dtype);
      mfsdp::ReduceScatterOptions rs;
      rs.counts = counts;
      rs.op = op;
      rs.prescale = op == ReduceOp::kSum ? 0.5 : 1.0;
      comm.reduce_scatter(mine, rank_input(rank, total, dtype, 2), rs);
      at::Tensor want;
      for (int q = 0; q < world; ++q) {
        at::Tensor x = rank_input(q, total, dtype, 2).narrow(0, offset_of(counts, rank), counts[rank]).to(at::kDouble);
        want = !want.defined() ? x : (op == ReduceOp::kMax ? at::maximum(want, x) : want + x);
      }
      want = (want * rs.prescale).to(dtype);
      EXPECT_TRUE(at::equal(mine, want)) << "reduce_scatter " << mfsdp::to_string(op) << " "
                                         << c10::toString(dtype);
    }

    // all_reduce: bf16 accumulates in fp32 (rounded once).
    at::Tensor all = rank_input(rank, total, dtype, 3);
    comm.all_reduce(all);
    at::Tensor want = at::zeros({total}, at::kDouble);
    for (int q = 0; q < world; ++q) want += rank_input(q, total, dtype, 3).to(at::kDouble);
    EXPECT_TRUE(at::equal(all, want.to(dtype))) << "all_reduce " << c10::toString(dtype);
  }
}

// Ranks that disagree on a collective's sizes (each call valid on its own rank) run different
// numbers of rounds; the next collective's rounds must not be taken for this one's data: both
// ranks fail naming the disagreement instead of exchanging wrong bytes.
MFSDP_DIST_TEST_OPTS(ShmExchange, RanksThatDisagreeOnSizesFail, mfsdp::testing::short_timeout({2})) {
  ASSERT_FALSE(shm_disabled()) << "this test is about the shared-memory path";
  const std::vector<int64_t> counts =
      comm.rank() == 0 ? std::vector<int64_t>{int64_t{6} << 20, 0} : std::vector<int64_t>{1, 0};
  mfsdp::AllGatherOptions ag;
  ag.counts = counts;
  try {
    at::Tensor out = at::zeros({counts[0] + counts[1]});
    comm.all_gather(out, at::ones({counts[comm.rank()]}), ag);
    at::Tensor next = at::zeros({2 * 1024});
    comm.all_gather(next, at::ones({1024}));
    ADD_FAILURE() << "collectives of different sizes succeeded";
  } catch (const mfsdp::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("disagree"), std::string::npos) << e.what();
  }
}
