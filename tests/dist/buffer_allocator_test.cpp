// Allocators of unsharded buffers: plain, double buffers and the trace-then-plan pool give the
// same losses and weights bit for bit, for every strategy, with prefetch and recompute; the pool
// serves later steps from its planned places, survives an evaluation pass between steps (falls
// back, then replays again), and its size is at most the plain path's transient peak plus
// alignment.
#include <torch/torch.h>

#include "harness/dist_test.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/fsdp/recompute.h"
#include "mfsdp/optim/optim.h"

namespace {

using namespace torch;
using mfsdp::BufferAllocatorKind;
using mfsdp::ShardingStrategy;

constexpr int64_t D = 12;

struct BlockImpl : mfsdp::ShardedModule<BlockImpl> {
  explicit BlockImpl(int64_t h) {
    fc1 = register_module("fc1", nn::Linear(D, h));
    fc2 = register_module("fc2", nn::Linear(h, D));
  }
  Tensor forward(Tensor x) { return x + fc2(torch::tanh(fc1(x))); }
  nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : nn::Module {
  NetImpl() {
    embed = register_module("embed", nn::Linear(D, D));
    for (int64_t h : {16, 16, 7}) blocks.push_back(register_module("b" + std::to_string(blocks.size()), Block(h)));
    head = register_module("head", nn::Linear(D, 2));
  }
  Tensor forward(Tensor x) {
    x = embed(x);
    for (auto& b : blocks) {
      if (recompute_blocks) {
        auto run = [b](const std::vector<Tensor>& a) mutable { return std::vector<Tensor>{b->call(a[0])}; };
        x = mfsdp::recompute(run, {x})[0];
      } else {
        x = b->call(x);
      }
    }
    return head(x);
  }
  nn::Linear embed{nullptr}, head{nullptr};
  std::vector<Block> blocks;
  bool recompute_blocks = false;
};
TORCH_MODULE(Net);

struct Run {
  Net net;
  mfsdp::FsdpHandle root;
  std::unique_ptr<mfsdp::DistributedOptimizer> opt;
};

Run make_run(mfsdp::Communicator& comm, ShardingStrategy s, BufferAllocatorKind kind, bool recompute) {
  torch::manual_seed(5);
  Run r{Net(), {}, nullptr};
  r.net->recompute_blocks = recompute;
  mfsdp::FullyShardOptions o;
  o.comm = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
  o.strategy = s;
  o.buffer_allocator = kind;
  for (auto& b : r.net->blocks) mfsdp::fully_shard(*b, o);
  r.root = mfsdp::fully_shard(*r.net, o);
  r.opt = mfsdp::make_adamw(r.root, {});
  return r;
}

Tensor batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + rank);
  return at::randn({4, D}, gen);
}

// Losses of `steps` steps, with an evaluation forward after each step in `evals`.
std::vector<double> train(mfsdp::Communicator& comm, Run& r, int steps, std::set<int> evals = {}) {
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    Tensor loss = mfsdp::call(*r.net, batch(step, comm.rank())).pow(2).mean();
    loss.backward();
    r.opt->step(1e-2);
    r.root.zero_grad();
    losses.push_back(loss.item<double>());
    if (evals.count(step)) {
      torch::NoGradGuard no_grad;
      losses.push_back(mfsdp::call(*r.net, batch(50 + step, comm.rank())).pow(2).mean().item<double>());
    }
  }
  return losses;
}

const char* name(BufferAllocatorKind k) {
  return k == BufferAllocatorKind::kPlain ? "plain" : k == BufferAllocatorKind::kDoubleBuffer ? "double" : "pool";
}

}  // namespace

MFSDP_DIST_TEST(BufferAllocator, EveryAllocatorGivesThePlainLosses, {1, 2, 3}) {
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptimGrads,
                             ShardingStrategy::kOptimGradsParams})
    for (bool recompute : {false, true}) {
      Run plain = make_run(comm, s, BufferAllocatorKind::kPlain, recompute);
      const auto want = train(comm, plain, 5, {2});
      const auto want_params = plain.root.full_state_dict(true);
      for (auto kind : {BufferAllocatorKind::kDoubleBuffer, BufferAllocatorKind::kTracePool}) {
        Run r = make_run(comm, s, kind, recompute);
        const std::string what = std::string(mfsdp::to_string(s)) + " " + name(kind) + (recompute ? " recompute" : "");
        EXPECT_EQ(train(comm, r, 5, {2}), want) << what;
        for (auto& [n, t] : r.root.full_state_dict(true)) EXPECT_TRUE(torch::equal(t, want_params.at(n))) << n << " " << what;
        const auto m = r.root.memory();
        EXPECT_GT(m.buffer_pool, 0) << what;
        EXPECT_GT(m.pooled_buffers, 0) << what;
      }
    }
}

MFSDP_DIST_TEST(BufferAllocator, TracePoolReplaysAndSurvivesAnEvaluationPass, {2}) {
  Run plain = make_run(comm, ShardingStrategy::kOptimGradsParams, BufferAllocatorKind::kPlain, false);
  Run pool = make_run(comm, ShardingStrategy::kOptimGradsParams, BufferAllocatorKind::kTracePool, false);
  // Steps 1 and 2: no plan yet (the first has no prefetch; the second is traced).
  EXPECT_EQ(train(comm, pool, 2), train(comm, plain, 2));
  EXPECT_LE(pool.root.memory().pooled_buffers, 1) << "at most the next step's first prefetch is planned";
  plain.root.reset_peak();
  EXPECT_EQ(train(comm, pool, 1), train(comm, plain, 1));
  auto m = pool.root.memory();
  const int64_t plain_before = m.plain_buffers;
  EXPECT_GT(m.pooled_buffers, 0) << "step 3 replays the plan";
  EXPECT_GT(m.buffer_pool, 0);
  // The pool is no larger than the plain path's peak of live buffers (plus alignment).
  EXPECT_LE(m.buffer_pool, plain.root.memory().transient_peak + 64 * 16);
  // Fully planned: a steady step needs no plain allocation.
  EXPECT_EQ(train(comm, pool, 1), train(comm, plain, 1));
  EXPECT_EQ(pool.root.memory().plain_buffers, plain_before) << "a steady step allocated outside the pool";

  // An evaluation pass between steps: the step strays from the plan, falls back, and is right.
  EXPECT_EQ(train(comm, pool, 2, {0}), train(comm, plain, 2, {0}));
  const auto after_eval = pool.root.memory();
  EXPECT_GT(after_eval.plain_buffers, plain_before) << "the evaluation pass was served outside the plan";
  // ... and the next steady step is on the plan again.
  const int64_t pooled = after_eval.pooled_buffers, plain_count = after_eval.plain_buffers;
  EXPECT_EQ(train(comm, pool, 1), train(comm, plain, 1));
  EXPECT_GT(pool.root.memory().pooled_buffers, pooled);
  EXPECT_EQ(pool.root.memory().plain_buffers, plain_count);
  for (auto& [n, t] : pool.root.full_state_dict(true)) EXPECT_TRUE(torch::equal(t, plain.root.full_state_dict(true).at(n))) << n;
}

MFSDP_DIST_TEST(BufferAllocator, DoubleBuffersServeEverySteadyStep, {2, 3}) {
  Run r = make_run(comm, ShardingStrategy::kOptimGradsParams, BufferAllocatorKind::kDoubleBuffer, false);
  train(comm, r, 2);
  const auto m = r.root.memory();
  train(comm, r, 2);
  const auto later = r.root.memory();
  // Classes (dtype, role, size): weights and gradients of the root, of b0/b1 (equal sizes) and
  // of b2; with prefetch at most two buffers of a class are alive, so no request falls back.
  EXPECT_GT(m.buffer_pool, 0);
  EXPECT_EQ(later.buffer_pool, m.buffer_pool) << "the double buffers do not grow";
  EXPECT_EQ(later.plain_buffers, 0);
  EXPECT_GT(later.pooled_buffers, m.pooled_buffers);
}
