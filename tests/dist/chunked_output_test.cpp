// The fused output layer and loss (mfsdp/models/chunked_output.h) against the plain composition
// in fp64: logits = hidden @ weight^T / temperature over the whole vocabulary, log_softmax at the
// targets and the entropy, and autograd's gradients of a weighted sum of both to the hidden
// states and the weight. On 1 rank and vocabulary-parallel over 2 and 4 (each rank its rows of the
// same full weight), with chunks of a few rows (uneven, the last one short), ignored targets and
// a temperature; bf16 within bf16's rounding. A wrong rescale of the running sums, a dropped
// chunk or a missing all-reduce misses by far more than the tolerance.
#include "mfsdp/models/chunked_output.h"

#include <torch/torch.h>

#include <string>

#include "harness/dist_test.h"
#include "harness/expect_error.h"

namespace {

at::Tensor normal(const std::vector<int64_t>& shape, uint64_t seed, double scale = 1.0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen) * scale;
}

double relative_error(const at::Tensor& got, const at::Tensor& want) {
  const double scale = std::max(1.0, want.abs().max().item<double>());
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() / scale;
}

struct Reference {
  at::Tensor log_probs, entropy, grad_hidden, grad_weight;
};

// The plain composition in fp64 over the full vocabulary; the loss it differentiates is
// sum(a * log_probs + b * entropy) with fixed per-token weights a, b.
Reference plain(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double temperature,
                const at::Tensor& a, const at::Tensor& b) {
  at::Tensor h = hidden.to(at::kDouble).detach().requires_grad_();
  at::Tensor w = weight.to(at::kDouble).detach().requires_grad_();
  at::Tensor log_p = at::log_softmax(at::linear(h, w) / temperature, -1);
  at::Tensor valid = targets.ne(-100);
  at::Tensor lp = log_p.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1) * valid;
  at::Tensor ent = -(log_p.exp() * log_p).sum(-1);
  (a.to(at::kDouble) * lp + b.to(at::kDouble) * ent).sum().backward();
  return {lp.detach(), ent.detach(), h.grad(), w.grad()};
}

void check(mfsdp::Communicator& comm, at::ScalarType dtype, double tol, int64_t chunk_elements) {
  const int tp = comm.size(), rank = comm.rank();
  const int64_t batch = 2, seq = 5, hidden_size = 8, vocab = tp == 1 ? 37 : 36;  // 36: 2 and 4 ranks
  at::Tensor hidden = normal({batch, seq, hidden_size}, 1, 1.0);
  at::Tensor weight = normal({vocab, hidden_size}, 2, 0.7);
  at::Tensor targets = at::randint(0, vocab, {batch, seq}, at::make_generator<at::CPUGeneratorImpl>(3), at::kLong);
  targets[0][1] = -100;
  targets[1][4] = -100;
  const at::Tensor a = normal({batch, seq}, 4), b = normal({batch, seq}, 5);
  const double temperature = 0.7;
  const Reference want = plain(hidden.to(dtype), weight.to(dtype), targets, temperature, a, b);

  const int64_t rows = vocab / tp;
  at::Tensor h = hidden.to(dtype).requires_grad_();
  at::Tensor w = weight.narrow(0, rank * rows, rows).to(dtype).contiguous().requires_grad_();
  mfsdp::ChunkedOutputOptions o;
  o.temperature = temperature;
  o.entropy = true;
  o.chunk_elements = chunk_elements;
  o.tensor_parallel = &comm;
  mfsdp::TokenStats got = mfsdp::chunked_output_token_stats(h, w, targets, o);
  ASSERT_EQ(got.log_probs.scalar_type(), at::kFloat);
  EXPECT_LT(relative_error(got.log_probs, want.log_probs), tol) << got.log_probs << "\n" << want.log_probs;
  EXPECT_LT(relative_error(got.entropy, want.entropy), tol) << got.entropy << "\n" << want.entropy;
  (a * got.log_probs + b * got.entropy).sum().backward();
  // The hidden states' gradient is this rank's partial sum (the caller's region entry sums it).
  at::Tensor grad_h = h.grad().to(at::kFloat).contiguous();
  if (tp > 1) comm.all_reduce(grad_h, {});
  EXPECT_LT(relative_error(grad_h, want.grad_hidden), tol);
  EXPECT_LT(relative_error(w.grad(), want.grad_weight.narrow(0, rank * rows, rows)), tol);

  // Without the entropy: log-probs only, and their gradient alone.
  o.entropy = false;
  at::Tensor h2 = hidden.to(dtype).requires_grad_();
  at::Tensor w2 = w.detach().clone().requires_grad_();
  mfsdp::TokenStats only = mfsdp::chunked_output_token_stats(h2, w2, targets, o);
  EXPECT_FALSE(only.entropy.defined());
  const Reference lp_only = plain(hidden.to(dtype), weight.to(dtype), targets, temperature, a, at::zeros_like(b));
  (a * only.log_probs).sum().backward();
  EXPECT_LT(relative_error(w2.grad(), lp_only.grad_weight.narrow(0, rank * rows, rows)), tol);
}

MFSDP_DIST_TEST(ChunkedOutput, EqualsThePlainCompositionInChunks, {1, 2, 4}) {
  // 10 tokens: 30 elements are 3 rows a chunk (a short last chunk); 1 element: one row a chunk;
  // the default: the whole vocabulary in one chunk.
  for (int64_t chunk : {int64_t{30}, int64_t{1}, int64_t{0}}) {
    SCOPED_TRACE("chunk_elements " + std::to_string(chunk));
    check(comm, at::kFloat, 2e-6, chunk);
  }
  check(comm, at::kBFloat16, 3e-2, 30);
}

TEST(ChunkedOutput, BadInputsAreNamed) {
  at::Tensor h = at::zeros({1, 2, 4}), w = at::zeros({5, 4});
  mfsdp::testing::expect_contains(
      mfsdp::testing::error_of([&] { mfsdp::chunked_output_token_stats(h, w, at::tensor({1, 5}, at::kLong).view({1, 2})); }),
      {"target 5 is outside the vocabulary [0, 5)"});
  mfsdp::testing::expect_contains(
      mfsdp::testing::error_of([&] { mfsdp::chunked_output_token_stats(h, at::zeros({5, 3}), at::zeros({1, 2}, at::kLong)); }),
      {"expected hidden [B, T, H], weight [V, H] and targets [B, T], found [1, 2, 4], [5, 3] and [1, 2]"});
}

}  // namespace
