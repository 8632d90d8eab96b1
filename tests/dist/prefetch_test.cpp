// All-gather prefetch (overlap): the next unit's weights are gathered while the current one
// computes, in the execution order recorded on the first step (not the registration order);
// backward follows the reverse order in which the units' forwards finished; the first unit's
// gather starts when the optimizer step ends (all_gather_in_start_param_sync). Prefetching
// changes no number: losses and weights equal the path without it, with and without activation
// recompute, with an evaluation pass between steps; every unit is gathered exactly twice per
// step, except the two whose backward comes first (kept from forward); memory stays bounded.
#include <torch/torch.h>

#include <algorithm>

#include "harness/dist_test.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/fsdp/recompute.h"
#include "mfsdp/optim/optim.h"

namespace {

using namespace torch;
using mfsdp::ShardingStrategy;

constexpr int64_t D = 12;

struct BlockImpl : mfsdp::ShardedModule<BlockImpl> {
  BlockImpl() { fc = register_module("fc", nn::Linear(D, D)); }
  Tensor forward(Tensor x) { return x + torch::tanh(fc(x)); }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

// Blocks registered b0, b1, b2 but run b2, b0, b1: prefetching must follow the run.
struct NetImpl : nn::Module {
  NetImpl() {
    embed = register_module("embed", nn::Linear(D, D));  // recompute needs an input that requires grad
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("b" + std::to_string(i), Block()));
    head = register_module("head", nn::Linear(D, 2));
  }
  Tensor forward(Tensor x) {
    x = embed(x);
    for (int i : {2, 0, 1}) {
      if (recompute_blocks) {
        auto run = [this, i](const std::vector<Tensor>& a) { return std::vector<Tensor>{blocks[i]->call(a[0])}; };
        x = mfsdp::recompute(run, {x})[0];
      } else {
        x = blocks[i]->call(x);
      }
    }
    return head(x);
  }
  std::vector<Block> blocks;
  nn::Linear embed{nullptr}, head{nullptr};
  bool recompute_blocks = false;
};
TORCH_MODULE(Net);

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

struct Run {
  Net net;
  mfsdp::FsdpHandle root;
  std::unique_ptr<mfsdp::DistributedOptimizer> opt;
};

Run make_run(mfsdp::Communicator& comm, ShardingStrategy s, bool prefetch, bool start_param_sync,
             bool recompute) {
  torch::manual_seed(3);
  Run r{Net(), {}, nullptr};
  r.net->recompute_blocks = recompute;
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);
  o.strategy = s;
  o.prefetch = prefetch;
  o.all_gather_in_start_param_sync = start_param_sync;
  for (auto& b : r.net->blocks) mfsdp::fully_shard(*b, o);
  r.root = mfsdp::fully_shard(*r.net, o);
  r.opt = mfsdp::make_adamw(r.root, {});
  return r;
}

Tensor batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank);
  return at::randn({4, D}, gen);
}

// Losses of `steps` steps; an evaluation forward (no grad) after step `eval_after` if >= 0.
std::vector<double> train(mfsdp::Communicator& comm, Run& r, int steps, int eval_after = -1) {
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    Tensor loss = mfsdp::call(*r.net, batch(step, comm.rank())).pow(2).mean();
    loss.backward();
    r.opt->step(1e-2);
    r.root.zero_grad();
    losses.push_back(loss.item<double>());
    if (step == eval_after) {
      torch::NoGradGuard no_grad;
      losses.push_back(mfsdp::call(*r.net, batch(99, comm.rank())).pow(2).mean().item<double>());
    }
  }
  return losses;
}

size_t index_of(const std::vector<std::string>& events, const std::string& e, size_t from = 0) {
  auto it = std::find(events.begin() + static_cast<std::ptrdiff_t>(from), events.end(), e);
  return static_cast<size_t>(it - events.begin());
}

}  // namespace

MFSDP_DIST_TEST(Prefetch, ChangesNoNumberForAnyStrategyRecomputeOrEvaluation, {1, 2, 3}) {
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptimGrads,
                             ShardingStrategy::kOptimGradsParams})
    for (bool recompute : {false, true}) {
      Run plain = make_run(comm, s, false, false, recompute);
      const auto want = train(comm, plain, 4, /*eval_after=*/1);
      const auto want_params = plain.root.full_state_dict(true);
      for (auto [prefetch, start_sync] : {std::pair{true, true}, {true, false}, {false, true}}) {
        Run r = make_run(comm, s, prefetch, start_sync, recompute);
        const std::string what = std::string(mfsdp::to_string(s)) + (recompute ? " recompute" : "") +
                                 " prefetch " + std::to_string(prefetch) + " start_param_sync " +
                                 std::to_string(start_sync);
        EXPECT_EQ(train(comm, r, 4, 1), want) << what;  // bit for bit: the same arithmetic
        for (auto& [name, t] : r.root.full_state_dict(true))
          EXPECT_TRUE(torch::equal(t, want_params.at(name))) << name << " " << what;
      }
    }
}

MFSDP_DIST_TEST(Prefetch, FollowsExecutionOrderAndGathersEachUnitTwicePerStep, {2}) {
  for (bool recompute : {false, true}) {
    Run r = make_run(comm, ShardingStrategy::kOptimGradsParams, true, true, recompute);
    train(comm, r, 1);  // records the order
    r.root.record_events(true);
    train(comm, r, 1);
    const auto ev = r.root.events();
    std::string trace;
    for (const auto& e : ev) trace += e + " ";
    SCOPED_TRACE((recompute ? "recompute: " : "") + trace);

    // Forward: each unit's gather is started while the unit before it (in run order) computes.
    const std::vector<std::string> run_order = {"", "b2", "b0", "b1"};
    for (size_t k = 0; k + 1 < run_order.size(); ++k) {
      const size_t fwd = index_of(ev, run_order[k] + ":pre_forward");
      const size_t prefetch = index_of(ev, run_order[k + 1] + ":prefetch");
      EXPECT_LT(fwd, prefetch) << run_order[k + 1] << " prefetched before " << run_order[k] << " ran";
      EXPECT_LT(prefetch, index_of(ev, run_order[k + 1] + ":pre_forward"));
    }
    // Backward runs the root (it encloses the others), then b1, b0, b2. The first two stay
    // gathered from their forward; each later one is gathered while the one before it computes.
    const size_t backward = index_of(ev, ":pre_backward");
    const size_t end = index_of(ev, ":end_of_backward");
    ASSERT_LT(end, ev.size());
    const std::vector<std::string> backward_order = {"", "b1", "b0", "b2"};
    for (size_t k = 0; k + 1 < backward_order.size(); ++k)
      EXPECT_LT(index_of(ev, backward_order[k] + ":pre_backward"),
                index_of(ev, backward_order[k + 1] + ":pre_backward")) << backward_order[k + 1];
    for (const std::string kept : {"", "b1"})
      EXPECT_GT(index_of(ev, kept + ":all_gather", backward), end) << kept << " gathered again";
    for (size_t k = 2; k < backward_order.size(); ++k) {
      const size_t prefetch = index_of(ev, backward_order[k] + ":prefetch", backward);
      EXPECT_LT(index_of(ev, backward_order[k - 1] + ":pre_backward"), prefetch) << backward_order[k];
      EXPECT_LT(prefetch, index_of(ev, backward_order[k] + ":pre_backward")) << backward_order[k];
    }
    // No redundant gathers, with or without recompute: 2 per unit and step, 1 for the two kept
    // from forward to backward (the root's was started by the previous optimizer step).
    for (const std::string unit : {"b0", "b2"})
      EXPECT_EQ(std::count(ev.begin(), ev.end(), unit + ":all_gather"), 2) << unit;
    EXPECT_EQ(std::count(ev.begin(), ev.end(), std::string("b1:all_gather")), 1);
    EXPECT_EQ(std::count(ev.begin(), ev.end(), std::string(":all_gather")), 1);
  }
}

// After a training forward only the root and the last unit to finish its forward (b1) stay
// gathered; after an evaluation forward (no grad) nothing does.
MFSDP_DIST_TEST(Prefetch, KeepsOnlyTheFirstUnitsOfBackwardGatheredAfterForward, {2}) {
  Run r = make_run(comm, ShardingStrategy::kOptimGradsParams, true, false, false);
  train(comm, r, 1);  // records the order
  const int64_t grid = comm.size() * D;
  const int64_t block = ((D * D + D + grid - 1) / grid * grid) * 4;
  const int64_t root = ((D * D + D + 2 * D + 2 + grid - 1) / grid * grid) * 4;
  {
    torch::NoGradGuard no_grad;
    mfsdp::call(*r.net, batch(7, comm.rank()));
    EXPECT_EQ(r.root.memory().transient_now, 0) << "evaluation keeps nothing";
  }
  Tensor loss = mfsdp::call(*r.net, batch(8, comm.rank())).pow(2).mean();
  EXPECT_EQ(r.root.memory().transient_now, root + block) << "the root and b1";
  EXPECT_GT(r.net->blocks[1]->fc->weight.storage().nbytes(), 0u);
  EXPECT_EQ(r.net->blocks[0]->fc->weight.storage().nbytes(), 0u);
  EXPECT_EQ(r.net->blocks[2]->fc->weight.storage().nbytes(), 0u);
  loss.backward();
  EXPECT_EQ(r.root.memory().transient_now, 0) << "all resharded after backward";
}

// Gradient accumulation: after a backward without gradient sync the first two units of the
// forward order (the root and b2) stay gathered for the next micro-batch, which therefore
// gathers neither; numbers equal the run without prefetching (which keeps nothing), also when
// an optimizer step follows a backward without sync (the kept weights would be stale).
MFSDP_DIST_TEST(Prefetch, MicroBatchesWithoutSyncKeepTheFirstUnitsAndChangeNoNumber, {2, 3}) {
  auto run = [&](bool prefetch, std::vector<std::string>* events) {
    Run r = make_run(comm, ShardingStrategy::kOptimGradsParams, prefetch, true, false);
    std::vector<double> losses;
    for (int step = 0; step < 4; ++step) {
      if (step == 2 && events) r.root.record_events(true);
      for (int micro = 0; micro < 3; ++micro) {
        // Step 1 never syncs: its optimizer step follows a backward without sync.
        r.root.set_requires_gradient_sync(micro == 2 && step != 1);
        Tensor loss = mfsdp::call(*r.net, batch(10 * step + micro, comm.rank())).pow(2).mean();
        loss.backward();
        losses.push_back(loss.item<double>());
      }
      r.opt->step(1e-2);
      r.root.zero_grad();
      if (step == 2 && events) {
        *events = r.root.events();
        r.root.record_events(false);
      }
    }
    for (const auto& [name, value] : r.root.full_state_dict(/*all_ranks=*/true))
      losses.push_back(value.sum().item<double>());
    return losses;
  };
  std::vector<std::string> ev;
  const auto with = run(true, &ev);
  EXPECT_EQ(with, run(false, nullptr));
  std::string trace;
  for (const auto& e : ev) trace += e + " ";
  SCOPED_TRACE(trace);
  // Micro-batches 2 and 3 of the step gather neither the root nor b2 in forward; b0 and b1
  // are gathered in every forward and backward but b1's backward (kept from its forward).
  EXPECT_EQ(std::count(ev.begin(), ev.end(), std::string(":all_gather")), 1) << "start_param_sync";
  EXPECT_EQ(std::count(ev.begin(), ev.end(), std::string("b2:all_gather")), 1 + 3);
  EXPECT_EQ(std::count(ev.begin(), ev.end(), std::string("b0:all_gather")), 3 + 3);
  EXPECT_EQ(std::count(ev.begin(), ev.end(), std::string("b1:all_gather")), 3);
}

MFSDP_DIST_TEST(Prefetch, StartParamSyncLeavesOnlyTheFirstUnitInFlight, {2}) {
  for (bool start_sync : {true, false}) {
    Run r = make_run(comm, ShardingStrategy::kOptimGradsParams, true, start_sync, false);
    train(comm, r, 2);
    auto m = r.root.memory();
    // The root owns embed and head; with the option, exactly its gather is alive.
    const int64_t grid = comm.size() * D;
    const int64_t root_bytes = ((D * D + D + 2 * D + 2 + grid - 1) / grid * grid) * 4;
    if (start_sync) {
      EXPECT_GT(m.transient_now, 0);
      EXPECT_LE(m.transient_now, root_bytes) << "only the root's weights";
    } else {
      EXPECT_EQ(m.transient_now, 0) << "off: nothing in flight between steps";
    }
  }
}

MFSDP_DIST_TEST(Prefetch, TransientPeakStaysWithinTwoLayersBesidesTheRoot, {2, 3}) {
  Run r = make_run(comm, ShardingStrategy::kOptimGradsParams, true, true, false);
  train(comm, r, 1);
  r.root.reset_peak();
  train(comm, r, 2);
  // A block unit: D x D weight + D bias, padded to the world; weights or grads in fp32.
  const int64_t grid = comm.size() * D;
  const int64_t block = ((D * D + D + grid - 1) / grid * grid) * 4;
  const int64_t root = ((D * D + D + 2 * D + 2 + grid - 1) / grid * grid) * 4;
  // Backward: root weights + grads, the computing block's weights + grads, the previous block's
  // gradients in their reduce-scatter, the next block's weights prefetched: 2 blocks' W+G.
  EXPECT_LE(r.root.memory().transient_peak, 2 * root + 2 * 2 * block);
}
