// Every collective x {fp32, bf16} x {equal, unequal, zero-length shards} x world sizes 1-4,
// checked against values each rank computes locally from every rank's (reproducible) input.
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>

#include "comm/cpu_communicator.h"
#include "harness/dist_test.h"

namespace {

using mfsdp::Communicator;
using mfsdp::ReduceOp;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16};

// Integer-valued data in [-8, 8]: exactly representable in bf16 and fp32, and so are their sums
// over 4 ranks, so sums can be compared exactly.
at::Tensor rank_input(int rank, int64_t numel, at::ScalarType dtype, int salt = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + 17 * salt + numel);
  return at::randint(-8, 9, {numel}, gen, at::kFloat).to(dtype);
}

// Count patterns per world size: equal, unequal, and with zero-length shards.
std::vector<std::pair<std::string, std::vector<int64_t>>> count_patterns(int world) {
  std::vector<int64_t> equal(world, 5), unequal, zeros;
  for (int r = 0; r < world; ++r) unequal.push_back(3 + 2 * r);
  for (int r = 0; r < world; ++r) zeros.push_back(r % 2 == 1 ? 0 : 4 + r);
  if (world == 1) zeros = {0};
  return {{"equal", equal}, {"unequal", unequal}, {"zero-length", zeros}};
}

int64_t sum_of(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }
int64_t offset_of(const std::vector<int64_t>& v, int r) {
  return std::accumulate(v.begin(), v.begin() + r, int64_t{0});
}

// Reference reduction over all ranks' inputs, in double, then rounded once to `dtype`.
at::Tensor reference_reduce(const std::function<at::Tensor(int)>& input_of, int world, ReduceOp op,
                            double prescale, at::ScalarType dtype) {
  at::Tensor acc;
  for (int r = 0; r < world; ++r) {
    at::Tensor x = input_of(r).to(at::kDouble) * prescale;
    acc = !acc.defined() ? x : (op == ReduceOp::kMax ? at::maximum(acc, x) : acc + x);
  }
  if (op == ReduceOp::kAvg) acc = acc / world;
  return acc.to(at::kFloat).to(dtype);
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_TRUE(at::equal(got, want)) << what << "\n got: " << got.to(at::kFloat)
                                    << "\nwant: " << want.to(at::kFloat);
}

std::string label(const char* op, at::ScalarType dtype, const std::string& pattern, int world) {
  return std::string(op) + " " + c10::toString(dtype) + " " + pattern + " shards, world " +
         std::to_string(world);
}

}  // namespace

MFSDP_DIST_TEST(Collectives, AllGather, {1, 2, 3, 4}) {
  const int world = comm.size(), rank = comm.rank();
  for (auto dtype : kDtypes) {
    for (auto& [pattern, counts] : count_patterns(world)) {
      at::Tensor want = at::empty({sum_of(counts)}, dtype);
      for (int r = 0; r < world; ++r)
        want.narrow(0, offset_of(counts, r), counts[r]).copy_(rank_input(r, counts[r], dtype));
      at::Tensor input = rank_input(rank, counts[rank], dtype);
      at::Tensor output = at::full({sum_of(counts)}, 99, dtype);
      mfsdp::AllGatherOptions options;
      options.counts = counts;
      comm.all_gather(output, input, options);
      expect_equal(output, want, label("all_gather", dtype, pattern, world));
      // In place: this rank's input already sits in its slot of the output.
      at::Tensor inplace = at::full({sum_of(counts)}, 99, dtype);
      at::Tensor slot = inplace.narrow(0, offset_of(counts, rank), counts[rank]);
      slot.copy_(input);
      comm.all_gather(inplace, slot, options);
      expect_equal(inplace, want, label("in-place all_gather", dtype, pattern, world));
    }
    // Equal shards without counts: output = world x input.
    at::Tensor input = rank_input(rank, 6, dtype, 1);
    at::Tensor output = at::empty({6 * world}, dtype);
    comm.all_gather(output, input);
    for (int r = 0; r < world; ++r)
      expect_equal(output.narrow(0, 6 * r, 6), rank_input(r, 6, dtype, 1),
                   label("all_gather (implicit counts)", dtype, "equal", world));
  }
}

MFSDP_DIST_TEST(Collectives, ReduceScatter, {1, 2, 3, 4}) {
  const int world = comm.size(), rank = comm.rank();
  for (auto dtype : kDtypes) {
    for (auto& [pattern, counts] : count_patterns(world)) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        for (double prescale : {1.0, 0.5}) {
          const int64_t total = sum_of(counts);
          auto input_of = [&](int r) { return rank_input(r, total, dtype); };
          at::Tensor input = input_of(rank);
          at::Tensor input_before = input.clone();
          at::Tensor output = at::full({counts[rank]}, 99, dtype);
          mfsdp::ReduceScatterOptions options;
          options.op = op;
          options.prescale = prescale;
          options.counts = counts;
          comm.reduce_scatter(output, input, options);
          at::Tensor want = reference_reduce(input_of, world, op, prescale, dtype)
                                .narrow(0, offset_of(counts, rank), counts[rank]);
          std::string what = label("reduce_scatter", dtype, pattern, world) + " op " +
                             mfsdp::to_string(op) + " prescale " + std::to_string(prescale);
          if (op == ReduceOp::kAvg && world == 3) {
            // x/3 is inexact: one rounding in fp32 then one to the dtype.
            EXPECT_TRUE(at::allclose(output.to(at::kFloat), want.to(at::kFloat), 1e-2, 1e-6)) << what;
          } else {
            expect_equal(output, want, what);
          }
          expect_equal(input, input_before, what + ": input must not change");
        }
      }
    }
  }
}

MFSDP_DIST_TEST(Collectives, AllReduce, {1, 2, 3, 4}) {
  const int world = comm.size(), rank = comm.rank();
  for (auto dtype : kDtypes) {
    for (int64_t numel : {0, 1, 3, 7, 1000}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        auto input_of = [&](int r) { return rank_input(r, numel, dtype, 2); };
        at::Tensor tensor = input_of(rank);
        comm.all_reduce(tensor, {op});
        at::Tensor want = reference_reduce(input_of, world, op, 1.0, dtype);
        std::string what = label("all_reduce", dtype, std::to_string(numel) + "-element", world) +
                           " op " + mfsdp::to_string(op);
        if (op == ReduceOp::kAvg && world == 3) {
          EXPECT_TRUE(at::allclose(tensor.to(at::kFloat), want.to(at::kFloat), 1e-2, 1e-6)) << what;
        } else {
          expect_equal(tensor, want, what);
        }
      }
    }
  }
  // A 2-D tensor and an integer tensor reduce the same way.
  at::Tensor counts = at::full({2, 3}, rank + 1, at::kLong);
  comm.all_reduce(counts);
  EXPECT_TRUE(at::equal(counts, at::full({2, 3}, world * (world + 1) / 2, at::kLong)));
}

// bf16 partial sums must not be rounded to bf16 on the way: 256 + 1 + 1 + 1 is 259 (then 260 in
// bf16), while bf16 accumulation gives 256 at every step. Same for fp16 near 2048.
MFSDP_DIST_TEST(Collectives, Bf16ReductionsAccumulateInFp32, {2, 3, 4}) {
  const int world = comm.size(), rank = comm.rank();
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    const double big = dtype == at::kBFloat16 ? 256 : 2048;
    auto input_of = [&](int r) { return at::full({2 * world}, r == 0 ? big : 1.0, dtype); };
    double exact = big + (world - 1);
    at::Tensor want = at::full({2 * world}, exact, at::kFloat).to(dtype);  // rounded once

    at::Tensor tensor = input_of(rank);
    comm.all_reduce(tensor);
    expect_equal(tensor, want, std::string("all_reduce ") + c10::toString(dtype));

    at::Tensor shard = at::empty({2}, dtype);
    comm.reduce_scatter(shard, input_of(rank));
    expect_equal(shard, want.narrow(0, 0, 2), std::string("reduce_scatter ") + c10::toString(dtype));
  }
}

// --grad-reduce-in-bf16: bf16 stays bf16 on the links (shared memory, or TCP under the Tcp.
// prefix) and is summed in fp32 by the receiver, so a bf16 reduce-scatter or all-reduce moves
// exactly half the bytes of the same fp32 one.
MFSDP_DIST_TEST(Collectives, Bf16ReductionsSendHalfTheBytesOfFp32, {2, 3}) {
  const int64_t numel = 3 * 4096 * comm.size();
  auto bytes_of = [&](at::ScalarType dtype, bool all_reduce) {
    at::Tensor in = rank_input(comm.rank(), numel, dtype);
    comm.barrier();
    const int64_t before = mfsdp::cpu_bytes_sent(comm);
    if (all_reduce) {
      comm.all_reduce(in);
    } else {
      at::Tensor out = at::empty({numel / comm.size()}, in.options());
      comm.reduce_scatter(out, in);
    }
    return mfsdp::cpu_bytes_sent(comm) - before;
  };
  for (bool all_reduce : {false, true}) {
    const int64_t fp32 = bytes_of(at::kFloat, all_reduce), bf16 = bytes_of(at::kBFloat16, all_reduce);
    EXPECT_GT(fp32, 0);
    EXPECT_EQ(2 * bf16, fp32) << (all_reduce ? "all_reduce" : "reduce_scatter") << ": bf16 sent " << bf16
                              << " bytes, fp32 " << fp32;
  }
}

MFSDP_DIST_TEST(Collectives, Broadcast, {1, 2, 3, 4}) {
  const int world = comm.size(), rank = comm.rank();
  for (auto dtype : kDtypes) {
    for (int root = 0; root < world; ++root) {
      for (int64_t numel : {0, 1, 257}) {
        at::Tensor want = rank_input(root, numel, dtype, 3);
        at::Tensor tensor = rank == root ? want.clone() : at::full({numel}, 99, dtype);
        comm.broadcast(tensor, {root});
        expect_equal(tensor, want, label("broadcast", dtype, "root " + std::to_string(root), world));
      }
    }
  }
}

// No rank leaves the barrier before every rank has entered it: each rank leaves a marker file
// before the barrier and checks all markers after it.
MFSDP_DIST_TEST(Collectives, Barrier, {1, 2, 3, 4}) {
  namespace fs = std::filesystem;
  const fs::path dir = mfsdp::testing::shared_temp_dir();
  for (int round = 0; round < 3; ++round) {
    // Later ranks arrive later, so an early exit from the barrier would find markers missing.
    std::this_thread::sleep_for(std::chrono::milliseconds(50 * comm.rank()));
    std::ofstream(dir / ("arrived_" + std::to_string(round) + "_" + std::to_string(comm.rank())));
    comm.barrier();
    for (int r = 0; r < comm.size(); ++r)
      EXPECT_TRUE(fs::exists(dir / ("arrived_" + std::to_string(round) + "_" + std::to_string(r))))
          << "rank " << comm.rank() << " left barrier " << round << " before rank " << r
          << " entered it";
  }
}

// Async work progresses on the communication thread: without calling wait(), is_completed()
// becomes true. (If the op only ran inside wait(), this loop would reach its deadline.)
MFSDP_DIST_TEST(Collectives, AsyncOpsProgressWithoutWait, {1, 2, 3}) {
  const int world = comm.size();
  at::Tensor a = at::full({1 << 16}, comm.rank() + 1.0, at::kFloat);
  at::Tensor b_in = at::full({4 * world}, 1.0, at::kBFloat16);
  at::Tensor b_out = at::empty({4}, at::kBFloat16);
  at::Tensor c_in = at::full({8}, comm.rank(), at::kFloat);
  at::Tensor c_out = at::empty({8 * world}, at::kFloat);
  // Several ops in flight at once, completed in issue order.
  auto wa = comm.all_reduce_async(a);
  auto wb = comm.reduce_scatter_async(b_out, b_in);
  auto wc = comm.all_gather_async(c_out, c_in);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!wc->is_completed()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline)
        << "async all_gather made no progress without wait()";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(wa->is_completed());  // FIFO: issued earlier, finished earlier
  EXPECT_TRUE(wb->is_completed());
  wa->wait();
  wb->wait();
  wc->wait();
  EXPECT_TRUE(at::equal(a, at::full({1 << 16}, world * (world + 1) / 2.0, at::kFloat)));
  EXPECT_TRUE(at::equal(b_out, at::full({4}, world, at::kBFloat16)));
  for (int r = 0; r < world; ++r)
    EXPECT_TRUE(at::equal(c_out.narrow(0, 8 * r, 8), at::full({8}, r, at::kFloat)));
}

// Work issued on the caller's thread while the communication thread is busy keeps its order
// across ranks, and tensors that require grad can be reduced (grad buffers are leaves).
MFSDP_DIST_TEST(Collectives, ManyAsyncOpsInOrder, {2, 4}) {
  std::vector<at::Tensor> tensors;
  std::vector<mfsdp::WorkHandle> works;
  for (int i = 0; i < 50; ++i) {
    tensors.push_back(at::full({i + 1}, i * 1.0 + comm.rank(), at::kFloat));
    works.push_back(comm.all_reduce_async(tensors.back()));
  }
  // A synchronous call while async work is queued runs after it (same order on every rank).
  at::Tensor sync = at::full({5}, 1.0 + comm.rank());
  comm.all_reduce(sync);
  for (auto& w : works) EXPECT_TRUE(w->is_completed());
  for (auto& w : works) w->wait();
  const int world = comm.size();
  EXPECT_TRUE(at::equal(sync, at::full({5}, world * (world + 1) / 2.0)));
  for (int i = 0; i < 50; ++i)
    EXPECT_TRUE(at::equal(tensors[i], at::full({i + 1}, world * i + world * (world - 1) / 2.0)))
        << "op " << i;
  at::Tensor leaf = torch::ones({3}, torch::requires_grad());
  comm.all_reduce(leaf);
  EXPECT_TRUE(at::equal(leaf.detach(), at::full({3}, 1.0 * world)));
}

// Large transfers are pipelined in segments of >= 1 MiB; several segments per step, uneven and
// not a multiple of the segment size, must still land exactly.
MFSDP_DIST_TEST(Collectives, LargeBuffersSpanSeveralSegments, {2, 3}) {
  const int world = comm.size(), rank = comm.rank();
  std::vector<int64_t> counts;
  for (int r = 0; r < world; ++r) counts.push_back(700001 + 250000 * r);  // 2.7 .. 4.7 MiB fp32
  const int64_t total = sum_of(counts);
  for (auto dtype : kDtypes) {
    auto input_of = [&](int r) { return rank_input(r, total, dtype, 4); };
    at::Tensor want = reference_reduce(input_of, world, ReduceOp::kSum, 1.0, dtype);

    at::Tensor shard = at::empty({counts[rank]}, dtype);
    mfsdp::ReduceScatterOptions rs;
    rs.counts = counts;
    comm.reduce_scatter(shard, input_of(rank), rs);
    expect_equal(shard, want.narrow(0, offset_of(counts, rank), counts[rank]),
                 label("large reduce_scatter", dtype, "unequal", world));

    at::Tensor full = input_of(rank);
    comm.all_reduce(full);
    expect_equal(full, want, label("large all_reduce", dtype, "", world));

    at::Tensor gathered = at::empty({total}, dtype);
    mfsdp::AllGatherOptions ag;
    ag.counts = counts;
    comm.all_gather(gathered, want.narrow(0, offset_of(counts, rank), counts[rank]), ag);
    expect_equal(gathered, want, label("large all_gather", dtype, "unequal", world));
  }
}

namespace {

// Rows rank `src` sends to rank `dst` in each all-to-all split pattern, known to every rank.
int64_t a2a_rows(const std::string& pattern, int src, int dst, int world) {
  if (pattern == "uneven") return 1 + (2 * src + 3 * dst) % 4;
  if (pattern == "zero") {
    // Rank 0 sends nothing at all, the last rank receives nothing at all, and a few more pairs
    // exchange nothing.
    if (src == 0 || dst == world - 1 || (src + dst) % 3 == 0) return 0;
    return 1 + (src * dst) % 3;
  }
  return 0;  // "empty": no rows anywhere
}

// Row `row` of rank `rank`'s all-to-all input (trailing shape `trailing`): values from (rank,
// row, column) that differ between neighbouring ranks and rows, exact in every dtype tested.
at::Tensor a2a_rows_of(int rank, int64_t rows, at::IntArrayRef trailing, at::ScalarType dtype) {
  std::vector<int64_t> shape = {rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  const int64_t row_numel = c10::multiply_integers(trailing);
  at::Tensor r = at::arange(rows, at::kLong).view({rows, 1});
  at::Tensor c = at::arange(row_numel, at::kLong).view({1, row_numel});
  at::Tensor v;
  if (dtype == at::kLong) v = 1000000 * (rank + 1) + 1000 * r + c;  // unique per element
  else if (dtype == at::kBool) v = (rank + 2 * r + c) % 3 == 0;
  else v = (31 * rank + 7 * r + 3 * c) % 256 - 128;  // integers, exact in bf16
  return v.to(dtype).reshape(shape);
}

struct A2ACase {
  std::string what;
  std::vector<int64_t> in_splits, out_splits;  // empty for equal splits
  at::Tensor input, output, want;
};

// Rank `rank`'s call and, independently of any communicator, what it must receive: the
// matching rows of every rank's input, built from (rank, row).
A2ACase a2a_case(const std::string& pattern, int rank, int world, at::IntArrayRef trailing,
                 at::ScalarType dtype) {
  A2ACase c;
  c.what = "all_to_all_single " + std::string(c10::toString(dtype)) + " " + pattern + " splits, rows " +
           c10::str(trailing) + ", world " + std::to_string(world) + ", rank " + std::to_string(rank);
  auto rows = [&](int src, int dst) {
    return pattern == "equal" ? int64_t{2} : a2a_rows(pattern, src, dst, world);
  };
  int64_t in_rows = 0;
  for (int r = 0; r < world; ++r) in_rows += rows(rank, r);
  std::vector<at::Tensor> parts;
  for (int q = 0; q < world; ++q) {
    int64_t q_total = 0, q_offset = 0;
    for (int r = 0; r < world; ++r) q_total += rows(q, r);
    for (int r = 0; r < rank; ++r) q_offset += rows(q, r);
    parts.push_back(a2a_rows_of(q, q_total, trailing, dtype).narrow(0, q_offset, rows(q, rank)));
  }
  c.want = at::cat(parts);
  if (pattern != "equal") {
    for (int r = 0; r < world; ++r) {
      c.in_splits.push_back(rows(rank, r));
      c.out_splits.push_back(rows(r, rank));
    }
  }
  c.input = a2a_rows_of(rank, in_rows, trailing, dtype);
  c.output = at::full_like(c.want, 1);  // anything left unwritten shows
  return c;
}

}  // namespace

// all_to_all_single against the reference exchange: uneven, zero (a rank that sends nothing,
// one that receives nothing, 0-row tensors) and equal splits (no split vectors), 1-D and 2-D
// rows, four dtypes, the synchronous form and several asynchronous ones in flight at once.
MFSDP_DIST_TEST(Collectives, AllToAllSingle, {1, 2, 3, 4}) {
  const int world = comm.size(), rank = comm.rank();
  std::vector<A2ACase> cases;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong, at::kBool})
    for (const char* pattern : {"uneven", "zero", "empty", "equal"})
      for (std::vector<int64_t> trailing : {std::vector<int64_t>{}, {3}, {2, 5}})
        cases.push_back(a2a_case(pattern, rank, world, trailing, dtype));
  for (A2ACase& c : cases) {
    at::Tensor input_before = c.input.clone();
    comm.all_to_all_single(c.output, c.input, {c.in_splits, c.out_splits});
    expect_equal(c.output, c.want, c.what);
    expect_equal(c.input, input_before, c.what + ": input must not change");
  }
  std::vector<mfsdp::WorkHandle> works;
  for (A2ACase& c : cases) {
    c.output.fill_(1);
    works.push_back(comm.all_to_all_single_async(c.output, c.input, {c.in_splits, c.out_splits}));
  }
  for (auto& w : works) w->wait();
  for (A2ACase& c : cases) expect_equal(c.output, c.want, "async " + c.what);
}

// Slices larger than a shared-memory slot's part take several rounds there, and TCP messages of
// several MiB; neither may lose or misplace a byte. Also counts the bytes put on the links:
// exactly the rows sent to other ranks (the own rows are a local copy).
MFSDP_DIST_TEST(Collectives, AllToAllSingleLargeSlices, {2, 3}) {
  const int world = comm.size(), rank = comm.rank();
  auto rows = [](int src, int dst) -> int64_t { return 300000 + 100000 * ((src + 2 * dst) % 3); };
  auto splits_of = [&](int q) {  // rank q's input_split_sizes
    std::vector<int64_t> v;
    for (int r = 0; r < world; ++r) v.push_back(rows(q, r));
    return v;
  };
  auto input_of = [&](int q) { return rank_input(q, 2 * sum_of(splits_of(q)), at::kFloat, 5).view({-1, 2}); };
  std::vector<int64_t> out_splits;
  std::vector<at::Tensor> parts;
  for (int q = 0; q < world; ++q) {
    out_splits.push_back(rows(q, rank));
    parts.push_back(input_of(q).narrow(0, offset_of(splits_of(q), rank), rows(q, rank)));
  }
  const at::Tensor want = at::cat(parts);
  at::Tensor output = at::full_like(want, 99);
  comm.barrier();
  const int64_t before = mfsdp::cpu_bytes_sent(comm);
  comm.all_to_all_single(output, input_of(rank), {splits_of(rank), out_splits});
  const int64_t sent = mfsdp::cpu_bytes_sent(comm) - before;
  expect_equal(output, want, "large all_to_all_single, world " + std::to_string(world));
  EXPECT_EQ(sent, (sum_of(splits_of(rank)) - rows(rank, rank)) * 2 * 4);
}

namespace {

// Rank 1 sends rank 0 `rows_1_to_0` rows where rank 0 expects 2 (the ranks' splits disagree):
// rank 0's call must fail with CommError naming both ranks, at once (not at the harness's
// one-minute timeout), and write nothing past the rows it expects. The other ranks may see the
// error in the all-to-all or only in their next collective (their peer broke off), but at once
// too. They stay alive meanwhile, as in a job: a peer that exits is noticed whatever else went
// wrong.
void expect_split_mismatch_fails(Communicator& comm, int64_t rows_1_to_0) {
  const int world = comm.size(), rank = comm.rank();
  std::vector<int64_t> in_splits(world, 2), out_splits(world, 2);
  if (rank == 1) in_splits[0] = rows_1_to_0;
  at::Tensor input = at::ones({sum_of(in_splits), 4});
  at::Tensor output = at::zeros({sum_of(out_splits) + 1, 4});  // a guard row past the end
  const auto start = std::chrono::steady_clock::now();
  try {
    comm.all_to_all_single(output.narrow(0, 0, sum_of(out_splits)), input, {in_splits, out_splits});
    ASSERT_NE(rank, 0) << "rank 0 expected 2 rows from rank 1, got " << rows_1_to_0 << ", and did not notice";
    comm.barrier();
    ADD_FAILURE() << "rank " << rank << ": the barrier after a failed all_to_all_single succeeded";
  } catch (const mfsdp::CommError& e) {
    const std::string msg = e.what();
    if (rank == 0) {
      EXPECT_NE(msg.find("all_to_all_single"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "not at once";
  EXPECT_TRUE(at::equal(output[-1], at::zeros({4}))) << "rank " << rank << ": data landed past the output";
}

}  // namespace

MFSDP_DIST_TEST(Collectives, AllToAllSingleFewerRowsThanExpectedIsAnError, {2, 3}) {
  expect_split_mismatch_fails(comm, 1);
}
MFSDP_DIST_TEST(Collectives, AllToAllSingleMoreRowsThanExpectedIsAnError, {2, 3}) {
  expect_split_mismatch_fails(comm, 3);
}
// The empty message: skipped on one side only, rank 0 would wait out the timeout.
MFSDP_DIST_TEST(Collectives, AllToAllSingleNoRowsWhereSomeExpectedIsAnError, {2, 3}) {
  expect_split_mismatch_fails(comm, 0);
}
