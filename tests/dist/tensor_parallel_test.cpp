// Tensor parallelism (mfsdp/models/tensor_parallel.h) against one process: every rank builds the
// same full tensors from fixed seeds, computes the reference with plain ATen on them, and checks
// its tensor-parallel forward outputs and gradients against the matching slices, for TP 2 and 4.
// The mappings are checked exactly on integer-valued data (sums of small integers are exact in
// fp32); the layers and losses within 1e-5 of the reference's largest magnitude. A shard cut from
// the wrong place must miss by far more than that, and bad sizes throw naming them.
#include "mfsdp/models/tensor_parallel.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "mfsdp/models/lm_loss.h"

namespace {

namespace tp = mfsdp::tensor_parallel;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;

at::Tensor ints(const std::vector<int64_t>& shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(-8, 9, shape, gen, at::kFloat);
}

at::Tensor normal(const std::vector<int64_t>& shape, uint64_t seed, double scale = 1.0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen) * scale;
}

// Same values, transposed strides: the mappings must not assume contiguous inputs.
at::Tensor strided(const at::Tensor& t) { return t.transpose(0, -1).contiguous().transpose(0, -1); }

// This rank's block `part` of `size` along `dim`.
at::Tensor block(const at::Tensor& t, int64_t dim, int part, int size) {
  const int64_t n = t.size(dim) / size;
  return t.narrow(dim, part * n, n);
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got, want)) << what << "\n got: " << got << "\nwant: " << want;
}

// Largest absolute difference relative to the reference's largest magnitude (at least 1).
double relative_error(const at::Tensor& got, const at::Tensor& want) {
  const double scale = std::max(1.0, want.abs().max().item<double>());
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() / scale;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what, double tol = 1e-5) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_LE(relative_error(got, want), tol) << what << "\n got: " << got << "\nwant: " << want;
}

std::string in_world(const std::string& what, const mfsdp::Communicator& comm) {
  return what + " (rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + ")";
}

// ---- Mappings -----------------------------------------------------------------------------------

// The sequence mappings along `dim` of a [4, 8, 8] tensor (every dim divides by 4), with
// contiguous or strided inputs and gradients. Inputs that differ per rank are seeded by rank.
void check_sequence_mappings(mfsdp::Communicator& comm, int64_t dim, bool strides, int salt) {
  const int world = comm.size(), rank = comm.rank();
  const std::vector<int64_t> full = {4, 8, 8};
  const int64_t d = dim < 0 ? dim + 3 : dim;
  std::vector<int64_t> part = full;
  part[d] /= world;
  auto maybe = [&](at::Tensor t) { return strides ? strided(t) : t; };
  auto of = [&](const std::vector<int64_t>& shape, int what, int r) {
    return maybe(ints(shape, 1000 * salt + 100 * what + r));
  };
  auto sum_over = [&](const std::vector<int64_t>& shape, int what) {
    at::Tensor s = at::zeros(shape);
    for (int r = 0; r < world; ++r) s += of(shape, what, r);
    return s;
  };
  auto cat_over = [&](const std::vector<int64_t>& shape, int what) {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < world; ++r) parts.push_back(of(shape, what, r));
    return at::cat(parts, d);
  };
  const std::string where = " along dim " + std::to_string(dim) + (strides ? ", strided" : "");
  {
    at::Tensor x = of(full, 1, 0).requires_grad_();
    at::Tensor y = tp::scatter_to_sequence_parallel_region(x, comm, dim);
    expect_equal(y, block(x.detach(), d, rank, world), in_world("scatter forward" + where, comm));
    y.backward(of(part, 2, rank));
    expect_equal(x.grad(), cat_over(part, 2), in_world("scatter backward (all-gather)" + where, comm));
  }
  {
    at::Tensor x = of(part, 3, rank).requires_grad_();
    at::Tensor y = tp::gather_from_sequence_parallel_region(x, comm, dim);
    expect_equal(y, cat_over(part, 3), in_world("gather forward" + where, comm));
    y.backward(of(full, 4, rank));
    expect_equal(x.grad(), block(sum_over(full, 4), d, rank, world),
                 in_world("gather backward (reduce-scatter)" + where, comm));
  }
  {
    at::Tensor x = of(part, 5, rank).requires_grad_();
    at::Tensor y =
        tp::gather_from_sequence_parallel_region(x, comm, dim, /*tensor_parallel_output_grad=*/false);
    const at::Tensor g = of(full, 6, 0);  // replicated computation after the gather: one gradient
    y.backward(g);
    expect_equal(x.grad(), block(g, d, rank, world), in_world("gather backward (split)" + where, comm));
  }
  {
    at::Tensor x = of(full, 7, rank).requires_grad_();
    at::Tensor y = tp::reduce_scatter_to_sequence_parallel_region(x, comm, dim);
    expect_equal(y, block(sum_over(full, 7), d, rank, world),
                 in_world("reduce-scatter forward" + where, comm));
    expect_equal(x.detach(), of(full, 7, rank), in_world("reduce-scatter leaves its input" + where, comm));
    y.backward(of(part, 8, rank));
    expect_equal(x.grad(), cat_over(part, 8), in_world("reduce-scatter backward (all-gather)" + where, comm));
  }
}

}  // namespace

// World 1 too: every mapping is then the identity.
MFSDP_DIST_TEST(TensorParallel, MappingsForwardAndBackward, {1, 2, 4}) {
  const int world = comm.size(), rank = comm.rank();
  const std::vector<int64_t> full = {2, 8, 8}, part = {2, 8, 8 / world};
  auto of = [&](const std::vector<int64_t>& shape, int what, int r) { return ints(shape, 100 * what + r); };
  auto sum_over = [&](const std::vector<int64_t>& shape, int what) {
    at::Tensor s = at::zeros(shape);
    for (int r = 0; r < world; ++r) s += of(shape, what, r);
    return s;
  };
  {
    at::Tensor x = of(full, 1, 0).requires_grad_();
    at::Tensor y = tp::copy_to_tensor_parallel_region(x, comm);
    expect_equal(y, x.detach(), in_world("copy_to forward (identity)", comm));
    y.backward(of(full, 2, rank));
    expect_equal(x.grad(), sum_over(full, 2), in_world("copy_to backward (all-reduce)", comm));
  }
  {
    at::Tensor x = of(full, 3, rank).requires_grad_();
    at::Tensor y = tp::reduce_from_tensor_parallel_region(x, comm);
    expect_equal(y, sum_over(full, 3), in_world("reduce_from forward (all-reduce)", comm));
    expect_equal(x.detach(), of(full, 3, rank), in_world("reduce_from leaves its input", comm));
    y.backward(of(full, 4, rank));
    expect_equal(x.grad(), of(full, 4, rank), in_world("reduce_from backward (identity)", comm));
  }
  {
    at::Tensor x = of(part, 5, rank).requires_grad_();
    at::Tensor y = tp::gather_from_tensor_parallel_region(x, comm);
    std::vector<at::Tensor> parts;
    for (int r = 0; r < world; ++r) parts.push_back(of(part, 5, r));
    expect_equal(y, at::cat(parts, -1), in_world("gather_from_tensor_parallel forward (last dim)", comm));
    const at::Tensor g = of(full, 6, 0);
    y.backward(g);
    expect_equal(x.grad(), block(g, 2, rank, world),
                 in_world("gather_from_tensor_parallel backward (split)", comm));
  }
  {
    at::Tensor x = of(full, 7, 0).requires_grad_();
    at::Tensor y = tp::scatter_to_tensor_parallel_region(x, comm);
    expect_equal(y, block(x.detach(), 2, rank, world), in_world("scatter_to_tensor_parallel forward", comm));
    y.backward(of(part, 8, rank));
    std::vector<at::Tensor> parts;
    for (int r = 0; r < world; ++r) parts.push_back(of(part, 8, r));
    expect_equal(x.grad(), at::cat(parts, -1),
                 in_world("scatter_to_tensor_parallel backward (all-gather)", comm));
  }
  int salt = 10;
  for (int64_t dim : {int64_t{1}, int64_t{0}, int64_t{2}, int64_t{-1}})
    for (bool strides : {false, true}) check_sequence_mappings(comm, dim, strides, salt++);
}

namespace {

// ---- Column -> row MLP --------------------------------------------------------------------------

constexpr int64_t kBatch = 2, kSeq = 8, kHidden = 16, kFfn = 32;

struct Mlp {
  at::Tensor x, w1, b1, w2, b2, gy;  // full tensors; gy: the gradient of the output
};

Mlp full_mlp() {
  return {normal({kBatch, kSeq, kHidden}, 1),
          normal({kFfn, kHidden}, 2, 0.3),
          normal({kFfn}, 3),
          normal({kHidden, kFfn}, 4, 0.3),
          normal({kHidden}, 5),
          normal({kBatch, kSeq, kHidden}, 6)};
}

struct MlpResult {
  at::Tensor y, dx, dw1, db1, dw2, db2;
};

MlpResult reference_mlp(const Mlp& m) {
  at::Tensor x = m.x.clone().requires_grad_(), w1 = m.w1.clone().requires_grad_(),
             b1 = m.b1.clone().requires_grad_(), w2 = m.w2.clone().requires_grad_(),
             b2 = m.b2.clone().requires_grad_();
  at::Tensor y = at::linear(at::gelu(at::linear(x, w1, b1)), w2, b2);
  (y * m.gy).sum().backward();
  return {y.detach(), x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
}

// The MLP on this rank's shards; `w2_part` picks which rank's columns of w2 it holds (its own
// unless a test breaks the split on purpose), `x_part` which part of the sequence it is given.
MlpResult parallel_mlp(const Mlp& m, mfsdp::Communicator& comm, bool sequence_parallel, int w2_part,
                       int x_part) {
  const int world = comm.size(), rank = comm.rank();
  at::Tensor w1 = tp::column_shard(m.w1, rank, world).requires_grad_();
  at::Tensor b1 = tp::column_shard(m.b1, rank, world).requires_grad_();
  at::Tensor w2 = tp::row_shard(m.w2, w2_part, world).requires_grad_();
  at::Tensor b2 = m.b2.clone().requires_grad_();
  at::Tensor x = (sequence_parallel ? block(m.x, 1, x_part, world).clone() : m.x.clone()).requires_grad_();
  at::Tensor h = tp::column_parallel_linear(x, w1, b1, comm, sequence_parallel);
  EXPECT_EQ(h.sizes().vec(), std::vector<int64_t>({kBatch, kSeq, kFfn / world})) << "column-parallel output";
  at::Tensor y = tp::row_parallel_linear(at::gelu(h), w2, b2, comm, sequence_parallel);
  (y * (sequence_parallel ? block(m.gy, 1, rank, world) : m.gy)).sum().backward();
  return {y.detach(), x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
}

void check_mlp(mfsdp::Communicator& comm, bool sequence_parallel) {
  const int world = comm.size(), rank = comm.rank();
  const std::string mode = sequence_parallel ? " (sequence parallel)" : "";
  const Mlp m = full_mlp();
  const MlpResult want = reference_mlp(m);
  const MlpResult got = parallel_mlp(m, comm, sequence_parallel, rank, rank);
  auto mine = [&](const at::Tensor& t) { return sequence_parallel ? block(t, 1, rank, world) : t; };
  expect_close(got.y, mine(want.y), in_world("output" + mode, comm));
  expect_close(got.dx, mine(want.dx), in_world("input gradient" + mode, comm));
  expect_close(got.dw1, tp::column_shard(want.dw1, rank, world),
               in_world("column weight gradient" + mode, comm));
  expect_close(got.db1, tp::column_shard(want.db1, rank, world),
               in_world("column bias gradient" + mode, comm));
  expect_close(got.dw2, tp::row_shard(want.dw2, rank, world), in_world("row weight gradient" + mode, comm));
  // Under sequence parallelism each rank's bias gradient covers its part of the sequence only.
  at::Tensor db2 = got.db2.clone();
  if (sequence_parallel) comm.all_reduce(db2);
  expect_close(db2, want.db2, in_world("row bias gradient" + mode, comm));
}

}  // namespace

MFSDP_DIST_TEST(TensorParallel, ColumnRowMlp, {2, 4}) { check_mlp(comm, /*sequence_parallel=*/false); }

MFSDP_DIST_TEST(TensorParallel, ColumnRowMlpSequenceParallel, {2, 4}) {
  check_mlp(comm, /*sequence_parallel=*/true);
}

// Column-parallel with gather_output, row-parallel splitting a full input itself.
MFSDP_DIST_TEST(TensorParallel, LinearGatherOutputAndSplitInput, {2, 4}) {
  const int world = comm.size(), rank = comm.rank();
  const Mlp m = full_mlp();
  {
    at::Tensor x = m.x.clone().requires_grad_(), w = m.w1.clone().requires_grad_(),
               b = m.b1.clone().requires_grad_();
    const at::Tensor g = normal({kBatch, kSeq, kFfn}, 7);
    at::Tensor want = at::linear(x, w, b);
    (want * g).sum().backward();
    at::Tensor xs = m.x.clone().requires_grad_();
    at::Tensor ws = tp::column_shard(m.w1, rank, world).requires_grad_();
    at::Tensor bs = tp::column_shard(m.b1, rank, world).requires_grad_();
    at::Tensor got = tp::column_parallel_linear(xs, ws, bs, comm, false, /*gather_output=*/true);
    (got * g).sum().backward();
    expect_close(got, want.detach(), in_world("gathered column output", comm));
    expect_close(xs.grad(), x.grad(), in_world("gathered column input gradient", comm));
    expect_close(ws.grad(), tp::column_shard(w.grad(), rank, world),
                 in_world("gathered column weight gradient", comm));
    expect_close(bs.grad(), tp::column_shard(b.grad(), rank, world),
                 in_world("gathered column bias gradient", comm));
  }
  {
    const at::Tensor full_in = normal({kBatch, kSeq, kFfn}, 8);
    at::Tensor x = full_in.clone().requires_grad_(), w = m.w2.clone().requires_grad_();
    at::Tensor want = at::linear(x, w, m.b2);
    (want * m.gy).sum().backward();
    at::Tensor xs = full_in.clone().requires_grad_();
    at::Tensor ws = tp::row_shard(m.w2, rank, world).requires_grad_();
    at::Tensor got = tp::row_parallel_linear(xs, ws, m.b2, comm, false, /*input_is_parallel=*/false);
    (got * m.gy).sum().backward();
    expect_close(got, want.detach(), in_world("row output from a full input", comm));
    expect_close(xs.grad(), x.grad(), in_world("row full-input gradient", comm));
    expect_close(ws.grad(), tp::row_shard(w.grad(), rank, world), in_world("row weight gradient", comm));
  }
}

namespace {

// ---- Vocabulary-parallel embedding and cross entropy --------------------------------------------

constexpr int64_t kVocab = 32;

// [2, 8] ids hitting every rank's range for TP 2 and 4, with a repeated id (two gradient rows
// into one weight row).
at::Tensor token_ids() {
  at::Tensor ids = (at::arange(kBatch * kSeq, at::kLong) * 3 % kVocab).view({kBatch, kSeq});
  ids[1][7] = ids[0][0].item<int64_t>();
  return ids;
}

void check_embedding(mfsdp::Communicator& comm, bool sequence_parallel) {
  const int world = comm.size(), rank = comm.rank();
  const std::string mode = sequence_parallel ? " (sequence parallel)" : "";
  const at::Tensor ids = token_ids();
  const int64_t per_rank = kVocab / world;
  for (int r = 0; r < world; ++r)
    ASSERT_TRUE((ids.ge(r * per_rank) & ids.lt((r + 1) * per_rank)).any().item<bool>())
        << "no id of rank " << r;
  const at::Tensor table = normal({kVocab, 8}, 11), g = normal({kBatch, kSeq, 8}, 12);
  at::Tensor w = table.clone().requires_grad_();
  at::Tensor want = at::embedding(w, ids);
  (want * g).sum().backward();
  at::Tensor shard = tp::vocab_shard(table, rank, world).requires_grad_();
  at::Tensor got = tp::vocab_parallel_embedding(ids, shard, comm, sequence_parallel);
  auto mine = [&](const at::Tensor& t) { return sequence_parallel ? block(t, 1, rank, world) : t; };
  (got * mine(g)).sum().backward();
  expect_close(got, mine(want.detach()), in_world("embedding output" + mode, comm));
  expect_close(shard.grad(), tp::vocab_shard(w.grad(), rank, world),
               in_world("embedding gradient" + mode, comm));
}

}  // namespace

MFSDP_DIST_TEST(TensorParallel, VocabParallelEmbedding, {2, 4}) {
  check_embedding(comm, false);
  check_embedding(comm, true);
  // Ids outside the vocabulary belong to no rank: zero rows.
  at::Tensor shard = tp::vocab_shard(normal({kVocab, 8}, 11), comm.rank(), comm.size());
  at::Tensor out = tp::vocab_parallel_embedding(at::tensor({kVocab, int64_t{-1}, int64_t{3}}), shard, comm);
  expect_equal(out.narrow(0, 0, 2), at::zeros({2, 8}), in_world("rows of ids outside the vocabulary", comm));
}

namespace {

// Targets [2, 8] with every rank's range hit and two ignored tokens.
at::Tensor targets(int64_t ignore_index) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
  at::Tensor t = at::randint(kVocab, {kBatch, kSeq}, gen);
  for (int r = 0; r < 4; ++r) t[0][r] = r * (kVocab / 4) + 1;
  t[1][2] = ignore_index;
  t[1][5] = ignore_index;
  return t;
}

void check_cross_entropy(mfsdp::Communicator& comm, double offset, int64_t ignore_index) {
  const int world = comm.size(), rank = comm.rank();
  const std::string mode =
      " (logits + " + std::to_string(offset) + ", ignore " + std::to_string(ignore_index) + ")";
  const at::Tensor logits = normal({kBatch, kSeq, kVocab}, 22, 3.0) + offset, t = targets(ignore_index);
  const at::Tensor weights = normal({kBatch, kSeq}, 23);  // an uneven gradient per token
  at::Tensor full = logits.clone().requires_grad_();
  at::Tensor want =
      at::cross_entropy_loss(full.view({-1, kVocab}), t.view({-1}), {}, at::Reduction::None, ignore_index)
          .view({kBatch, kSeq});
  (want * weights).sum().backward();
  at::Tensor shard = block(logits, 2, rank, world).clone().requires_grad_();
  at::Tensor got = tp::vocab_parallel_cross_entropy(shard, t, comm, ignore_index);
  (got * weights).sum().backward();
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  expect_close(got, want.detach(), in_world("per-token loss" + mode, comm));
  const at::Tensor ignored = got.detach().masked_select(t.eq(ignore_index));
  EXPECT_GE(ignored.numel(), 2);
  expect_equal(ignored, at::zeros_like(ignored), in_world("ignored losses", comm));
  expect_close(shard.grad(), block(full.grad(), 2, rank, world), in_world("logits gradient" + mode, comm));
}

}  // namespace

MFSDP_DIST_TEST(TensorParallel, VocabParallelCrossEntropy, {2, 4}) {
  const int world = comm.size(), rank = comm.rank();
  check_cross_entropy(comm, 0.0, -100);
  check_cross_entropy(comm, 1000.0, -100);  // exp() would overflow without the max
  check_cross_entropy(comm, 0.0, 5);        // an ignore index inside the vocabulary

  // The LM losses against lm_loss / lm_loss_sum on the full logits.
  const at::Tensor logits = normal({kBatch, kSeq, kVocab}, 24, 2.0), t = targets(-100);
  at::Tensor full = logits.clone().requires_grad_();
  at::Tensor want = mfsdp::lm_loss(full, t);
  want.backward();
  at::Tensor shard = block(logits, 2, rank, world).clone().requires_grad_();
  at::Tensor got = tp::vocab_parallel_lm_loss(shard, t, comm);
  got.backward();
  expect_close(got, want.detach(), in_world("lm loss", comm));
  expect_close(shard.grad(), block(full.grad(), 2, rank, world), in_world("lm loss gradient", comm));

  const mfsdp::TokenLossSum want_sum = mfsdp::lm_loss_sum(logits, t);
  const mfsdp::TokenLossSum got_sum = tp::vocab_parallel_lm_loss_sum(block(logits, 2, rank, world), t, comm);
  expect_close(got_sum.sum, want_sum.sum, in_world("lm loss sum", comm));
  expect_equal(got_sum.num_tokens, want_sum.num_tokens, in_world("lm loss token count", comm));
  EXPECT_EQ(got_sum.num_tokens.scalar_type(), at::kLong);

  // Every label ignored: NaN, as lm_loss.
  const at::Tensor ignored = at::full({kBatch, kSeq}, -100, at::kLong);
  EXPECT_TRUE(std::isnan(mfsdp::lm_loss(logits, ignored).item<double>()));
  EXPECT_TRUE(
      std::isnan(tp::vocab_parallel_lm_loss(block(logits, 2, rank, world), ignored, comm).item<double>()));

  // bf16 logits: the loss is computed in fp32 from the bf16 values; the gradient comes back in bf16.
  const at::Tensor low = logits.to(at::kBFloat16);
  at::Tensor low_full = low.to(at::kFloat).requires_grad_();
  at::Tensor low_want =
      at::cross_entropy_loss(low_full.view({-1, kVocab}), t.view({-1}), {}, at::Reduction::None, -100)
          .view({kBatch, kSeq});
  low_want.sum().backward();
  at::Tensor low_shard = block(low, 2, rank, world).clone().requires_grad_();
  at::Tensor low_got = tp::vocab_parallel_cross_entropy(low_shard, t, comm);
  low_got.sum().backward();
  EXPECT_EQ(low_got.scalar_type(), at::kFloat);
  EXPECT_EQ(low_shard.grad().scalar_type(), at::kBFloat16);
  expect_close(low_got, low_want.detach(), in_world("bf16 per-token loss", comm));
  expect_close(low_shard.grad().to(at::kFloat), block(low_full.grad(), 2, rank, world),
               in_world("bf16 gradient", comm), 1e-2);
}

// The comparisons above can fail: a split taken from the wrong place misses the reference by far
// more than their tolerance.
MFSDP_DIST_TEST(TensorParallel, BrokenSplitIsCaught, {2, 4}) {
  const int world = comm.size(), rank = comm.rank(), other = (rank + 1) % world;
  const Mlp m = full_mlp();
  const MlpResult want = reference_mlp(m);
  EXPECT_LE(relative_error(parallel_mlp(m, comm, false, rank, rank).y, want.y), 1e-5) << "control";
  // Row shard from another rank's columns of w2.
  EXPECT_GT(relative_error(parallel_mlp(m, comm, false, other, rank).y, want.y), 1e-2)
      << in_world("row shard from the wrong columns", comm);
  // Under sequence parallelism, another rank's part of the sequence.
  EXPECT_GT(relative_error(parallel_mlp(m, comm, true, rank, other).y, block(want.y, 1, rank, world)), 1e-2)
      << in_world("the wrong part of the sequence", comm);
  // An embedding shard of another rank's vocabulary.
  const at::Tensor table = normal({kVocab, 8}, 11), ids = token_ids();
  at::Tensor got = tp::vocab_parallel_embedding(ids, tp::vocab_shard(table, other, world), comm);
  EXPECT_GT(relative_error(got, at::embedding(table, ids)), 1e-2)
      << in_world("vocab shard of the wrong rows", comm);
  // Logits of another rank's vocabulary.
  const at::Tensor logits = normal({kBatch, kSeq, kVocab}, 22, 3.0), t = targets(-100);
  at::Tensor loss = tp::vocab_parallel_cross_entropy(block(logits, 2, other, world).contiguous(), t, comm);
  EXPECT_GT(relative_error(loss, at::cross_entropy_loss(logits.view({-1, kVocab}), t.view({-1}), {},
                                                        at::Reduction::None, -100)
                                     .view({kBatch, kSeq})),
            1e-2)
      << in_world("logits of the wrong vocabulary", comm);
}

TEST(TensorParallel, ShardArgumentErrors) {
  const at::Tensor w = at::zeros({10, 6});
  expect_contains(error_of([&] { tp::column_shard(w, 0, 4); }), {"column_shard", "10", "[10, 6]", "4"});
  expect_contains(error_of([&] { tp::row_shard(w, 0, 4); }), {"row_shard", "6", "[10, 6]", "4"});
  expect_contains(error_of([&] { tp::vocab_shard(at::zeros({30, 8}), 1, 4); }), {"vocab_shard", "30", "4"});
  expect_contains(error_of([&] { tp::column_shard(w, 2, 2); }), {"rank 2", "[0, 2)"});
  expect_contains(error_of([&] { tp::row_shard(at::zeros({6}), 0, 2); }), {"row_shard", "[6]"});
  EXPECT_THROW(tp::column_shard(w, 0, 4), std::invalid_argument);
  EXPECT_THROW(tp::row_shard(w, 0, 4), std::invalid_argument);
  EXPECT_THROW(tp::vocab_shard(at::zeros({30, 8}), 0, 4), std::invalid_argument);
  // The shards are copies: a parameter made of one does not hold the full tensor.
  at::Tensor s = tp::row_shard(w, 1, 2);
  EXPECT_TRUE(s.is_contiguous());
  EXPECT_NE(s.data_ptr(), w.data_ptr());
  EXPECT_TRUE(at::equal(tp::column_shard(at::arange(6), 1, 3), at::arange(2, 4)));
}

// Every check runs before any collective, so the ranks stay in step after each throw.
MFSDP_DIST_TEST(TensorParallel, ArgumentErrors, {2}) {
  auto invalid = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("wrong exception type: ") + e.what();
    }
    return std::string("<no exception>");
  };
  const at::Tensor odd = at::zeros({2, 3, 4});
  expect_contains(invalid([&] { tp::scatter_to_sequence_parallel_region(odd, comm); }),
                  {"scatter_to_sequence_parallel_region", "[2, 3, 4]", "(3)", "size 2"});
  expect_contains(invalid([&] {
                    tp::reduce_scatter_to_sequence_parallel_region(at::zeros({2, 5, 4}), comm);
                  }),
                  {"reduce_scatter_to_sequence_parallel_region", "(5)", "size 2"});
  expect_contains(invalid([&] { tp::scatter_to_sequence_parallel_region(odd, comm, 3); }),
                  {"dim 3", "[2, 3, 4]"});
  expect_contains(invalid([&] {
                    tp::scatter_to_tensor_parallel_region(at::zeros({2, 4, 3}), comm);
                  }),
                  {"(3)", "size 2"});
  const at::Tensor x = at::zeros({2, 4, 8}), w = at::zeros({6, 8});
  expect_contains(invalid([&] { tp::column_parallel_linear(x, w, {}, comm, true, true); }),
                  {"gather_output"});
  expect_contains(invalid([&] {
                    tp::row_parallel_linear(x, at::zeros({8, 4}), {}, comm, true, false);
                  }),
                  {"input_is_parallel"});
  expect_contains(invalid([&] {
                    tp::column_parallel_linear(at::zeros({2, 4, 5}), w, {}, comm);
                  }),
                  {"[2, 4, 5]", "[6, 8]"});
  expect_contains(invalid([&] { tp::column_parallel_linear(x, w, at::zeros({5}), comm); }),
                  {"bias [5]", "[6, 8]"});
  // A full input of 8 features is split into 4 per rank: a weight shard of 8 columns does not fit.
  expect_contains(invalid([&] {
                    tp::row_parallel_linear(x, at::zeros({6, 8}), {}, comm, false, false);
                  }),
                  {"[2, 4, 8]", "[6, 8]"});
  expect_contains(invalid([&] {
                    tp::vocab_parallel_embedding(at::zeros({2, 4}, at::kLong), at::zeros({8}), comm);
                  }),
                  {"[8]"});
  const at::Tensor logits = at::zeros({2, 4, 16});
  expect_contains(invalid([&] {
                    tp::vocab_parallel_cross_entropy(logits, at::zeros({2, 5}, at::kLong), comm);
                  }),
                  {"[2, 4, 16]", "[2, 5]"});
  expect_contains(invalid([&] {
                    tp::vocab_parallel_cross_entropy(logits, at::full({2, 4}, 32, at::kLong), comm);
                  }),
                  {"target 32", "[0, 32)"});
  expect_contains(invalid([&] {
                    tp::vocab_parallel_lm_loss(at::zeros({8, 16}), at::zeros({8}, at::kLong), comm);
                  }),
                  {"vocab_parallel_lm_loss", "[8, 16]"});
  // Still in step: one more collective succeeds.
  at::Tensor one = at::ones({1});
  comm.all_reduce(one);
  EXPECT_EQ(one.item<float>(), 2.0f);
}
