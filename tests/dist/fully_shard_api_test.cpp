// The public fully_shard API around the core: containers and holders that route forwards
// through the runtime (MFSDP_MODULE, mfsdp::Sequential), the optimizer bound to the root
// (make_adamw(root, ...)) with its after-step hook apart from refresh_model_weights(), setters
// that act on one unit or its subtree (recurse), the device check, and adopting a unit that
// already ran as a root, and a backward that throws. References are the same modules run
// without fully_shard.
#include <torch/torch.h>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/fsdp/sequential.h"

namespace {

using namespace torch;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
constexpr int64_t D = 8;

struct CellImpl : mfsdp::ShardedModule<CellImpl> {
  CellImpl() { fc = register_module("fc", nn::Linear(D, D)); }
  Tensor forward(Tensor x) { return torch::tanh(fc(x)); }
  nn::Linear fc{nullptr};
};
MFSDP_MODULE(Cell);

// cells(x) through mfsdp::Sequential, then a routed holder call, then the root's own head.
struct StackImpl : nn::Module {
  StackImpl() {
    cells = register_module("cells", mfsdp::Sequential(Cell(), Cell()));
    last = register_module("last", Cell());
    head = register_module("head", nn::Linear(D, 1));
  }
  Tensor forward(Tensor x) {
    Tensor h = cells(x);
    // Thrown in backward after the root and `last` began theirs, before `cells` did.
    if (fail_in_backward) h.register_hook([](Tensor) -> Tensor { throw std::runtime_error("hook failed"); });
    return head(last(h));
  }
  mfsdp::Sequential cells{nullptr};
  Cell last{nullptr};
  nn::Linear head{nullptr};
  bool fail_in_backward = false;
};
TORCH_MODULE(Stack);

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

Stack make_stack() {
  torch::manual_seed(5);
  return Stack();
}

mfsdp::FsdpHandle shard(Stack& net, mfsdp::Communicator& comm) {
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);  // ZeRO-3: a bypassed unit would read freed weights
  for (auto& child : net->cells->children()) mfsdp::fully_shard(*child, o);
  mfsdp::fully_shard(*net->last, o);
  return mfsdp::fully_shard(*net, o);
}

Tensor input() { return torch::linspace(-1, 1, 4 * D).view({4, D}); }

bool has_event(const std::vector<std::string>& events, const std::string& needle) {
  return std::find(events.begin(), events.end(), needle) != events.end();
}

MFSDP_DIST_TEST(FullyShardApi, SequentialAndHoldersRouteThroughTheRuntime, {1, 2}) {
  Stack plain = make_stack();
  Tensor want = plain->forward(input());
  Stack net = make_stack();
  auto root = shard(net, comm);
  root.record_events(true);
  Tensor got = mfsdp::call(*net, input());
  EXPECT_TRUE(torch::allclose(got, want, 1e-6, 1e-6));
  for (const char* unit : {"cells.0", "cells.1", "last"})
    EXPECT_TRUE(has_event(root.events(), std::string(unit) + ":pre_forward")) << unit << " bypassed";
}

MFSDP_DIST_TEST(FullyShardApi, OptimizerHookPrefetchesButRefreshDoesNot, {2}) {
  Stack net = make_stack();
  auto root = shard(net, comm);
  auto opt = mfsdp::make_adamw(root, {});
  for (int step = 0; step < 2; ++step) {
    mfsdp::call(*net, input()).sum().backward();
    root.record_events(true);  // clears
    opt->step(1e-2);
    root.zero_grad();
  }
  // After the second step the order is known: the hook starts the first unit's all-gather.
  EXPECT_TRUE(has_event(root.events(), ":prefetch")) << "no all-gather started by the step hook";
  root.record_events(true);
  root.refresh_model_weights();  // what a checkpoint load runs
  EXPECT_TRUE(root.events().empty()) << "refresh_model_weights started " << root.events().front();
}

MFSDP_DIST_TEST(FullyShardApi, RecurseChoosesTheUnitOrItsSubtree, {2}) {
  Stack net = make_stack();
  auto root = shard(net, comm);
  auto gathered_after_eval = [&] {
    torch::NoGradGuard no_grad;
    mfsdp::call(*net, input());
    const int64_t now = root.memory().transient_now;
    for (const char* unit : {"cells.0", "cells.1", "last"}) {
      auto* m = unit[0] == 'l' ? static_cast<nn::Module*>(net->last.get()) : net->cells->children()[unit[6] - '0'].get();
      mfsdp::handle_of(*m).reshard();
    }
    root.reshard();
    return now;
  };
  root.set_reshard_after_forward(false, /*recurse=*/false);
  const int64_t root_only = gathered_after_eval();
  root.set_reshard_after_forward(false);  // recurse: every unit
  const int64_t all = gathered_after_eval();
  EXPECT_GT(root_only, 0);
  EXPECT_GT(all, root_only) << "the units under the root were resharded although recurse was on";

  // Gradient sync off for the root alone: its gradients wait, its children reduce theirs.
  root.set_requires_gradient_sync(false, /*recurse=*/false);
  mfsdp::call(*net, input()).sum().backward();
  auto shards = root.optimizer_shards();  // units in creation order: cells.0, cells.1, last, root
  ASSERT_EQ(shards.size(), 4u);
  for (size_t i = 0; i < 3; ++i) EXPECT_GT(shards[i].main_grad.abs().sum().item<double>(), 0) << i;
  EXPECT_EQ(shards[3].main_grad.abs().sum().item<double>(), 0) << "the root reduced without sync";
}

// A backward that throws midway (autograd then runs no end-of-backward callback) leaves no unit
// stuck: after zero_grad the next step gives the weights of an unsharded copy's step.
MFSDP_DIST_TEST(FullyShardApi, AThrowingBackwardDoesNotPoisonTheNextStep, {1, 2}) {
  Stack net = make_stack();
  auto root = shard(net, comm);
  mfsdp::SGDOptions sgd;
  auto opt = mfsdp::make_sgd(root, sgd);
  net->fail_in_backward = true;
  EXPECT_THROW(mfsdp::call(*net, input()).sum().backward(), std::exception);
  net->fail_in_backward = false;
  root.zero_grad();
  root.record_events(true);
  mfsdp::call(*net, input()).sum().backward();
  EXPECT_TRUE(has_event(root.events(), ":abandon_backward"));
  opt->step(0.1);

  Stack plain = make_stack();
  plain->forward(input()).sum().backward();
  torch::optim::SGD reference(plain->parameters(), torch::optim::SGDOptions(0.1));
  reference.step();
  const auto got = root.full_state_dict(/*all_ranks=*/true);
  for (const auto& p : plain->named_parameters())
    EXPECT_TRUE(torch::allclose(got.at(p.key()), p.value(), 1e-6, 1e-6)) << p.key();
}

MFSDP_DIST_TEST(FullyShardApi, BadDeviceAndLateAdoptionAreErrors, {1}) {
  {
    Stack net = make_stack();
    mfsdp::FullyShardOptions o;
    o.comm = borrow(comm);
    o.device = at::Device(at::kCUDA, 0);
    expect_contains(error_of([&] { mfsdp::fully_shard(*net->last, o); }),
                    {"options.device is cuda:0", "works on cpu"});
  }
  Stack net = make_stack();
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);
  mfsdp::fully_shard(*net->last, o);
  mfsdp::call(*net->last, input());  // `last` runs as its own root
  expect_contains(error_of([&] { mfsdp::fully_shard(*net, o); }), {"unit 'last'", "already used as a root"});
}

}  // namespace
