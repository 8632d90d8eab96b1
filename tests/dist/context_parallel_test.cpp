// Context parallelism (mfsdp/models/context_parallel.h) against one process: every rank builds the
// same full q, k, v from fixed seeds, computes plain ATen causal attention over the whole sequence
// with a mask this test builds itself (the rules of SequenceLayout::allowed_keys, written out
// again here), and checks its context-parallel output and dq/dk/dv on its own tokens within 1e-5
// of the reference's largest magnitude (at least 1), fp32, for both algorithms (all-gather and
// ring) at CP 2 and 4: causal only, right-padded rows, packed samples (segment ids). The layout
// is checked against Megatron's written out by hand; a wrong layout must miss by far more than
// the tolerance; bad sizes throw naming them.
#include "mfsdp/models/context_parallel.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "mfsdp/comm/comm.h"

namespace {

namespace cp = mfsdp::context_parallel;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;

constexpr int64_t kBatch = 2, kSeq = 16, kHeadDim = 8;

at::Tensor normal(const std::vector<int64_t>& shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

// Largest absolute difference relative to the reference's largest magnitude (at least 1).
double relative_error(const at::Tensor& got, const at::Tensor& want) {
  const double scale = std::max(1.0, want.abs().max().item<double>());
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() / scale;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what, double tol = 1e-5) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::isfinite(got).all().item<bool>()) << what << ": not finite\n" << got;
  EXPECT_LE(relative_error(got, want), tol) << what << "\n got: " << got << "\nwant: " << want;
}

std::string in_world(const std::string& what, const mfsdp::Communicator& comm) {
  return what + " (rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + ")";
}

const char* name_of(cp::CpAlgorithm a) { return a == cp::CpAlgorithm::kRing ? "ring" : "all-gather"; }

// One attention problem over the full sequence: inputs, optional per-token masks, and the upstream
// gradient of the output.
struct Problem {
  int64_t q_heads = 4, kv_heads = 2;
  at::Tensor q, k, v, grad_out;  // [B, H, S, D]
  at::Tensor real;               // [B, S] bool, undefined: no padding
  at::Tensor segments;           // [B, S] int64, undefined: one sample per row
};

// `value_dim`: each value head's width (kHeadDim unless given: multi-head latent attention's
// values are narrower or wider than its queries and keys).
Problem make_problem(int64_t q_heads, int64_t kv_heads, uint64_t seed, int64_t value_dim = kHeadDim) {
  Problem p;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.q = normal({kBatch, q_heads, kSeq, kHeadDim}, seed);
  p.k = normal({kBatch, kv_heads, kSeq, kHeadDim}, seed + 1);
  p.v = normal({kBatch, kv_heads, kSeq, value_dim}, seed + 2);
  p.grad_out = normal({kBatch, q_heads, kSeq, value_dim}, seed + 3);
  return p;
}

// Row b has `lengths[b]` real tokens, then padding.
at::Tensor right_padded(const std::vector<int64_t>& lengths) {
  at::Tensor real = at::zeros({kBatch, kSeq}, at::kBool);
  for (int64_t b = 0; b < kBatch; ++b) real[b].narrow(0, 0, lengths[b]).fill_(true);
  return real;
}

// Row b packs samples of the given lengths (summing to kSeq), numbered 0, 1, ...
at::Tensor packed(const std::vector<std::vector<int64_t>>& lengths) {
  at::Tensor seg = at::zeros({kBatch, kSeq}, at::kLong);
  for (int64_t b = 0; b < kBatch; ++b) {
    int64_t at = 0, id = 0;
    for (int64_t n : lengths[b]) {
      seg[b].narrow(0, at, n).fill_(id++);
      at += n;
    }
  }
  return seg;
}

// The reference's mask, element by element: query i sees key j when j <= i, j is a token and
// both are in the same sample; every query sees itself.
at::Tensor reference_mask(const Problem& p) {
  at::Tensor mask = at::zeros({kBatch, 1, kSeq, kSeq}, at::kBool);
  auto m = mask.accessor<bool, 4>();
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t i = 0; i < kSeq; ++i)
      for (int64_t j = 0; j < kSeq; ++j) {
        const bool token = !p.real.defined() || p.real[b][j].item<bool>();
        const bool same =
            !p.segments.defined() || p.segments[b][i].item<int64_t>() == p.segments[b][j].item<int64_t>();
        m[b][0][i][j] = (j <= i && token && same) || i == j;
      }
  return mask;
}

struct Result {
  at::Tensor out, dq, dk, dv;
};

// Plain attention over the full sequence: matmul, masked fp32 softmax, matmul.
Result reference(const Problem& p) {
  at::Tensor q = p.q.clone().requires_grad_(), k = p.k.clone().requires_grad_(),
             v = p.v.clone().requires_grad_();
  const int64_t group = p.q_heads / p.kv_heads;
  at::Tensor head_of =
      at::arange(p.q_heads, at::kLong).div(group, "floor");  // query head h reads key head h / G
  at::Tensor kk = k.index_select(1, head_of), vv = v.index_select(1, head_of);
  at::Tensor scores = at::matmul(q, kk.transpose(2, 3)) / std::sqrt(static_cast<double>(kHeadDim));
  scores = scores.masked_fill(reference_mask(p).logical_not(), -std::numeric_limits<double>::infinity());
  at::Tensor out = at::matmul(at::softmax(scores, -1, at::kFloat), vv);
  (out * p.grad_out).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// This rank's part of the problem through cp_attention, with `positions` as the global positions
// its tokens claim (default: the balanced layout's).
Result context_parallel(const Problem& p, mfsdp::Communicator& comm, cp::CpAlgorithm algorithm,
                        at::Tensor positions = at::Tensor()) {
  const int world = comm.size(), rank = comm.rank();
  auto mine = [&](const at::Tensor& t, int64_t dim) { return cp::shard_sequence(t, dim, world, rank); };
  at::Tensor q = mine(p.q, 2).clone().requires_grad_(), k = mine(p.k, 2).clone().requires_grad_(),
             v = mine(p.v, 2).clone().requires_grad_();
  cp::CpAttentionOptions o;
  o.algorithm = algorithm;
  if (p.real.defined()) o.key_padding_mask = mine(p.real, 1);
  if (p.segments.defined()) o.segment_ids = mine(p.segments, 1);
  if (!positions.defined()) positions = cp::cp_positions(kSeq, world, rank);
  at::Tensor out = cp::cp_attention(q, k, v, positions, comm, o);
  (out * mine(p.grad_out, 2)).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

void check_against_reference(const Problem& p, mfsdp::Communicator& comm, const std::string& what) {
  const int world = comm.size(), rank = comm.rank();
  const Result want = reference(p);
  auto mine = [&](const at::Tensor& t) { return cp::shard_sequence(t, 2, world, rank); };
  for (cp::CpAlgorithm algorithm : {cp::CpAlgorithm::kAllGather, cp::CpAlgorithm::kRing}) {
    const Result got = context_parallel(p, comm, algorithm);
    const std::string where = what + ", " + name_of(algorithm);
    expect_close(got.out, mine(want.out), in_world(where + ": output", comm));
    expect_close(got.dq, mine(want.dq), in_world(where + ": dq", comm));
    expect_close(got.dk, mine(want.dk), in_world(where + ": dk", comm));
    expect_close(got.dv, mine(want.dv), in_world(where + ": dv", comm));
  }
}

}  // namespace

// ---- Layout -------------------------------------------------------------------------------------

// Megatron's load-balanced layout, written out by hand: 2 x CP chunks, rank r holds chunks r and
// 2 x CP - 1 - r.
TEST(ContextParallel, PositionsMatchMegatronLayout) {
  auto expect_positions = [](int64_t s, int size, int rank, std::vector<int64_t> want) {
    at::Tensor got = cp::cp_positions(s, size, rank);
    EXPECT_EQ(got.scalar_type(), at::kLong);
    EXPECT_TRUE(at::equal(got, at::tensor(want, at::kLong)))
        << "S=" << s << " CP=" << size << " rank " << rank << ": " << got;
  };
  expect_positions(8, 2, 0, {0, 1, 6, 7});
  expect_positions(8, 2, 1, {2, 3, 4, 5});
  expect_positions(16, 4, 0, {0, 1, 14, 15});
  expect_positions(16, 4, 1, {2, 3, 12, 13});
  expect_positions(16, 4, 2, {4, 5, 10, 11});
  expect_positions(16, 4, 3, {6, 7, 8, 9});
  expect_positions(12, 2, 0, {0, 1, 2, 9, 10, 11});
  expect_positions(12, 2, 1, {3, 4, 5, 6, 7, 8});
  expect_positions(4, 1, 0, {0, 1, 2, 3});
  // shard_sequence cuts the same tokens.
  at::Tensor seq = at::arange(16, at::kLong).view({1, 16, 1}).expand({2, 16, 3}).contiguous();
  for (int size : {1, 2, 4, 8})
    for (int rank = 0; rank < size; ++rank)
      EXPECT_TRUE(at::equal(cp::shard_sequence(seq, 1, size, rank).select(2, 1).select(0, 0),
                            cp::cp_positions(16, size, rank)))
          << "CP=" << size << " rank " << rank;
}

// shard_sequence then unshard_sequence (one process, every rank's part) gives the input back,
// along any dim, negative dims too, and gradients flow back unchanged.
TEST(ContextParallel, ShardUnshardRoundTrip) {
  at::Tensor x = normal({2, 3, 16, 4}, 5);
  for (int size : {1, 2, 4, 8})
    for (int64_t dim : {2, -2}) {
      std::vector<at::Tensor> parts;
      for (int rank = 0; rank < size; ++rank) parts.push_back(cp::shard_sequence(x, dim, size, rank));
      EXPECT_TRUE(at::equal(cp::unshard_sequence(parts, dim), x)) << "CP=" << size << " dim " << dim;
    }
  at::Tensor y = normal({16, 5}, 6).requires_grad_();
  std::vector<at::Tensor> parts;
  for (int rank = 0; rank < 4; ++rank) parts.push_back(cp::shard_sequence(y, 0, 4, rank));
  at::Tensor g = normal({16, 5}, 7);
  cp::unshard_sequence(parts, 0).backward(g);
  EXPECT_TRUE(at::equal(y.grad(), g));
}

// Shard then gather over the group is the input on every rank. Backward: summed over ranks by
// default (each rank's gradient of the full sequence differs), or this rank's part of the one
// replicated gradient.
MFSDP_DIST_TEST(ContextParallel, GatherSequenceRoundTrip, {2, 4}) {
  const int world = comm.size(), rank = comm.rank();
  const at::Tensor x = normal({2, 16, 3}, 11);
  {
    at::Tensor local = cp::shard_sequence(x, 1, world, rank).clone().requires_grad_();
    at::Tensor full = cp::gather_sequence(local, 1, comm);
    EXPECT_TRUE(at::equal(full, x)) << in_world("gather forward", comm);
    const at::Tensor g = normal({2, 16, 3}, 12);
    full.backward(g * static_cast<double>(rank + 1));  // rank r's gradient: (r + 1) g
    const double sum = world * (world + 1) / 2.0;
    expect_close(local.grad(), cp::shard_sequence(g, 1, world, rank) * sum,
                 in_world("gather backward (sum)", comm));
  }
  {
    at::Tensor local = cp::shard_sequence(x, -2, world, rank).clone().requires_grad_();
    at::Tensor full = cp::gather_sequence(local, -2, comm, /*sum_grad=*/false);
    EXPECT_TRUE(at::equal(full, x)) << in_world("gather forward (dim -2)", comm);
    const at::Tensor g = normal({2, 16, 3}, 13);
    full.backward(g);
    EXPECT_TRUE(at::equal(local.grad(), cp::shard_sequence(g, 1, world, rank)))
        << in_world("gather backward (replicated)", comm);
  }
  {  // integer tensors (token ids, masks) gather too
    at::Tensor ids = at::arange(32, at::kLong).view({2, 16});
    EXPECT_TRUE(at::equal(cp::gather_sequence(cp::shard_sequence(ids, 1, world, rank), 1, comm), ids))
        << in_world("gather of int64", comm);
  }
}

// ---- Attention against one process --------------------------------------------------------------

// World 1 too: nothing is exchanged, the same masks apply.
MFSDP_DIST_TEST(ContextParallel, CausalMatchesSingleProcess, {1, 2, 4}) {
  check_against_reference(make_problem(4, 2, 100), comm, "causal, GQA 4/2");
  check_against_reference(make_problem(2, 2, 200), comm, "causal, MHA 2/2");
  check_against_reference(make_problem(4, 1, 300), comm, "causal, MQA 4/1");
}

// Values of another width than queries and keys (multi-head latent attention's v_head_dim).
MFSDP_DIST_TEST(ContextParallel, ValuesOfTheirOwnWidthMatchSingleProcess, {1, 2}) {
  check_against_reference(make_problem(4, 4, 150, kHeadDim / 2), comm, "MHA, values half as wide");
  Problem p = make_problem(4, 2, 250, kHeadDim + 4);
  p.segments = packed({{5, 7, 4}, {9, 7}});
  check_against_reference(p, comm, "GQA, packed, values wider");
}

// Right-padded rows: padding is never a key; a padding query sees only itself (its output is
// its own value row, as the single-process model gives), so nothing is NaN.
MFSDP_DIST_TEST(ContextParallel, PaddingMatchesSingleProcess, {2, 4}) {
  Problem p = make_problem(4, 2, 400);
  p.real = right_padded({16, 11});
  check_against_reference(p, comm, "right padding 16/11");
  p.real = right_padded({5, 1});  // whole chunks of padding on some ranks
  check_against_reference(p, comm, "right padding 5/1");
}

// Packed samples: a query sees only keys of its own segment; also with padding after the last.
MFSDP_DIST_TEST(ContextParallel, PackedSequencesMatchSingleProcess, {2, 4}) {
  Problem p = make_problem(4, 2, 500);
  p.segments = packed({{5, 7, 4}, {9, 7}});
  check_against_reference(p, comm, "packed 5+7+4 / 9+7");
  p.segments = packed({{3, 3, 3, 3, 4}, {1, 14, 1}});
  p.real = right_padded({12, 15});
  check_against_reference(p, comm, "packed and padded");
}

// Per-row positions ([B, T_local]) give the same as shared ones ([T_local]).
MFSDP_DIST_TEST(ContextParallel, PerRowPositions, {2}) {
  const int world = comm.size(), rank = comm.rank();
  Problem p = make_problem(4, 2, 600);
  p.segments = packed({{6, 10}, {16}});
  const at::Tensor rows = cp::cp_positions(kSeq, world, rank).unsqueeze(0).expand({kBatch, -1});
  const Result want = reference(p);
  for (cp::CpAlgorithm algorithm : {cp::CpAlgorithm::kAllGather, cp::CpAlgorithm::kRing}) {
    const Result got = context_parallel(p, comm, algorithm, rows);
    expect_close(got.out, cp::shard_sequence(want.out, 2, world, rank), in_world(name_of(algorithm), comm));
    expect_close(got.dk, cp::shard_sequence(want.dk, 2, world, rank), in_world(name_of(algorithm), comm));
  }
}

// Claiming the wrong global positions (contiguous slices instead of the balanced chunks the data
// was cut into) must miss the reference by a large margin on some rank, for both algorithms.
MFSDP_DIST_TEST(ContextParallel, BrokenLayoutIsCaught, {2, 4}) {
  const int world = comm.size(), rank = comm.rank();
  const Problem p = make_problem(4, 2, 700);
  const Result want = reference(p);
  const int64_t local = kSeq / world;
  const at::Tensor wrong = at::arange(rank * local, (rank + 1) * local, at::kLong);
  for (cp::CpAlgorithm algorithm : {cp::CpAlgorithm::kAllGather, cp::CpAlgorithm::kRing}) {
    const Result got = context_parallel(p, comm, algorithm, wrong);
    at::Tensor error = at::tensor({relative_error(got.out, cp::shard_sequence(want.out, 2, world, rank)),
                                   relative_error(got.dk, cp::shard_sequence(want.dk, 2, world, rank))},
                                  at::kDouble)
                           .to(at::kFloat);
    mfsdp::AllReduceOptions o;
    o.op = mfsdp::ReduceOp::kMax;
    comm.all_reduce(error, o);
    EXPECT_GT(error[0].item<double>(), 0.05) << in_world(std::string(name_of(algorithm)) + ": output", comm);
    EXPECT_GT(error[1].item<double>(), 0.05) << in_world(std::string(name_of(algorithm)) + ": dk", comm);
  }
}

// ---- Argument errors ----------------------------------------------------------------------------

TEST(ContextParallel, ChunkingArgumentErrors) {
  expect_contains(error_of([] { cp::cp_positions(12, 4, 0); }), {"S = 12", "CP = 4", "2 x CP = 8"});
  expect_contains(error_of([] { cp::cp_positions(6, 2, 1); }), {"S = 6", "CP = 2"});
  expect_contains(error_of([] { cp::cp_positions(8, 2, 2); }), {"rank 2", "[0, 2)"});
  expect_contains(error_of([] { cp::cp_positions(8, 0, 0); }), {"size 0"});
  expect_contains(error_of([] {
                    cp::shard_sequence(at::zeros({2, 10}), 1, 4, 0);
                  }),
                  {"shard_sequence", "S = 10", "CP = 4"});
  expect_contains(error_of([] { cp::shard_sequence(at::zeros({2, 8}), 2, 2, 0); }), {"seq_dim 2", "[2, 8]"});
  expect_contains(error_of([] { cp::shard_sequence(at::zeros({2, 8}), 1, 2, -1); }), {"rank -1"});
  expect_contains(error_of([] {
                    cp::unshard_sequence({at::zeros({2, 4}), at::zeros({2, 6})}, 1);
                  }),
                  {"part 1", "[2, 6]", "[2, 4]"});
  expect_contains(error_of([] {
                    cp::unshard_sequence({at::zeros({2, 3}), at::zeros({2, 3})}, 1);
                  }),
                  {"3 tokens"});
  expect_contains(error_of([] { cp::unshard_sequence({}, 0); }), {"no parts"});
}

// Checked before any collective, so every rank throws the same and the group stays usable.
MFSDP_DIST_TEST(ContextParallel, AttentionArgumentErrors, {2}) {
  const at::Tensor q = at::zeros({2, 4, 4, 8}), k = at::zeros({2, 2, 4, 8}),
                   pos = cp::cp_positions(8, 2, comm.rank());
  expect_contains(error_of([&] {
                    cp::cp_attention(q.view({8, 4, 8}), k, k, pos, comm);
                  }),
                  {"cp_attention", "[8, 4, 8]"});
  expect_contains(error_of([&] {
                    cp::cp_attention(at::zeros({2, 3, 4, 8}), k, k, pos, comm);
                  }),
                  {"[2, 3, 4, 8]", "[2, 2, 4, 8]", "multiple"});
  expect_contains(error_of([&] {
                    cp::cp_attention(q, k, at::zeros({2, 2, 5, 8}), pos, comm);
                  }),
                  {"[2, 2, 5, 8]"});
  expect_contains(error_of([&] { cp::cp_attention(q, k, k, at::arange(5, at::kLong), comm); }),
                  {"global_query_positions", "[5]", "[4]"});
  expect_contains(error_of([&] { cp::cp_attention(q, k, k, pos.to(at::kFloat), comm); }), {"integer"});
  cp::CpAttentionOptions o;
  o.key_padding_mask = at::ones({2, 8}, at::kBool);
  expect_contains(error_of([&] { cp::cp_attention(q, k, k, pos, comm, o); }),
                  {"key_padding_mask", "[2, 8]", "[2, 4]"});
  o.key_padding_mask = at::Tensor();
  o.segment_ids = at::zeros({4}, at::kLong);
  expect_contains(error_of([&] { cp::cp_attention(q, k, k, pos, comm, o); }), {"segment_ids", "[4]"});
  // The group still works after the refusals.
  at::Tensor out = cp::cp_attention(q, k, k, pos, comm);
  EXPECT_EQ(out.sizes(), q.sizes());
}
