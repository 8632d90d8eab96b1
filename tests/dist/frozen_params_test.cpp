// Units that mix frozen (requires_grad == false) and trainable parameters (docs/fully_shard.md,
// "Frozen parameters and the reduction communicator"): a frozen weight may be read by a node of
// the unit's backward that runs after the last trainable parameter's gradient was accumulated, so
// the unit must stay gathered until its whole backward is done. Each model is built so that such
// a node exists; training over 2 ranks must equal one LibTorch process on the whole batch,
// gradient by gradient and weight by weight. Also: the reduction communicator is made by
// fully_shard.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "harness/dist_test.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/fsdp/recompute.h"
#include "mfsdp/optim/optim.h"

namespace {

using namespace torch;
using mfsdp::ShardingStrategy;

constexpr int64_t kIn = 5, D = 8, H = 12, kOut = 3, T = 4, R = 2;
constexpr int kSteps = 3, kMicro = 2, kPerMicro = 2;
constexpr double kLr = 0.02;

void freeze(nn::Module& m) {
  for (auto& p : m.parameters()) p.requires_grad_(false);
}

// "Freeze attention, train the MLP" in one unit: the MLP after the attention gets its gradients
// first, and only then does the attention's backward read its frozen q, k, v weights (to compute
// the gradient of the unit's input).
struct AttnMlpBlockImpl : mfsdp::ShardedModule<AttnMlpBlockImpl> {
  AttnMlpBlockImpl() {
    q = register_module("q", nn::Linear(D, D));
    k = register_module("k", nn::Linear(D, D));
    v = register_module("v", nn::Linear(D, D));
    fc1 = register_module("fc1", nn::Linear(D, H));
    fc2 = register_module("fc2", nn::Linear(H, D));
    freeze(*q);
    freeze(*k);
    freeze(*v);
  }
  Tensor forward(Tensor x) {  // [B, T, D]
    Tensor scores = torch::softmax(q(x).matmul(k(x).transpose(1, 2)) / std::sqrt(double(D)), -1);
    Tensor a = x + scores.matmul(v(x));
    return a + fc2(torch::tanh(fc1(a)));
  }
  nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(AttnMlpBlock);

// A unit with no trainable parameter at all (its backward still reads its weight).
struct FrozenBlockImpl : mfsdp::ShardedModule<FrozenBlockImpl> {
  FrozenBlockImpl() {
    fc = register_module("fc", nn::Linear(D, D));
    freeze(*fc);
  }
  Tensor forward(Tensor x) { return x + torch::tanh(fc(x)); }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(FrozenBlock);

// The root: a trainable input projection and head, and a frozen output scale (the root's input
// needs no gradient: its backward ends with the end-of-backward callback).
struct AttnNetImpl : nn::Module {
  AttnNetImpl() {
    embed = register_module("embed", nn::Linear(kIn, D));
    block0 = register_module("block0", AttnMlpBlock());
    mix = register_module("mix", FrozenBlock());
    block1 = register_module("block1", AttnMlpBlock());
    head = register_module("head", nn::Linear(D, kOut));
    scale = register_parameter("scale", torch::rand({kOut}) + 0.5, /*requires_grad=*/false);
  }
  Tensor forward(Tensor x, bool routed) {
    auto blocks = [this, routed](const std::vector<Tensor>& in) -> std::vector<Tensor> {
      if (!routed) return {block1->forward(mix->forward(block0->forward(in[0])))};
      return {block1->call(mix->call(block0->call(in[0])))};
    };
    Tensor h = embed(x);
    // By value: the recompute calls `blocks` again in backward, after this forward returned.
    h = routed && recompute ? mfsdp::recompute(blocks, {h})[0] : blocks({h})[0];
    return head(h) * scale;
  }
  std::vector<nn::Module*> units() { return {block0.get(), mix.get(), block1.get()}; }
  nn::Linear embed{nullptr}, head{nullptr};
  AttnMlpBlock block0{nullptr}, block1{nullptr};
  FrozenBlock mix{nullptr};
  Tensor scale;
  bool recompute = false;  // the blocks' activations recomputed in backward (mfsdp::recompute)
};
TORCH_MODULE(AttnNet);

// LoRA: y = x W^T + b + (x A^T) B^T with W, b frozen and A, B trainable. Autograd runs the
// adapter's nodes first (they were created last) and accumulates A and B before the node of
// x W^T, which reads W, runs.
struct LoraLinearImpl : nn::Module {
  LoraLinearImpl(int64_t in, int64_t out) {
    weight = register_parameter("weight", torch::randn({out, in}) / std::sqrt(double(in)), false);
    bias = register_parameter("bias", torch::randn({out}) * 0.1, false);
    lora_a = register_parameter("lora_a", torch::randn({R, in}) * 0.3);
    lora_b = register_parameter("lora_b", torch::randn({out, R}) * 0.3);  // not zero: A gets gradients too
  }
  Tensor forward(Tensor x) {
    Tensor base = torch::nn::functional::linear(x, weight, bias);
    return base + torch::nn::functional::linear(torch::nn::functional::linear(x, lora_a), lora_b);
  }
  Tensor weight, bias, lora_a, lora_b;
};
TORCH_MODULE(LoraLinear);

struct LoraBlockImpl : mfsdp::ShardedModule<LoraBlockImpl> {
  LoraBlockImpl() {
    up = register_module("up", LoraLinear(D, H));
    down = register_module("down", LoraLinear(H, D));
  }
  Tensor forward(Tensor x) { return x + down(torch::tanh(up(x))); }
  LoraLinear up{nullptr}, down{nullptr};
};
TORCH_MODULE(LoraBlock);

struct LoraNetImpl : nn::Module {
  LoraNetImpl() {
    embed = register_module("embed", nn::Linear(kIn, D));
    block0 = register_module("block0", LoraBlock());
    block1 = register_module("block1", LoraBlock());
    head = register_module("head", nn::Linear(D, kOut));
  }
  Tensor forward(Tensor x, bool routed) {
    auto blocks = [this, routed](const std::vector<Tensor>& in) -> std::vector<Tensor> {
      return {routed ? block1->call(block0->call(in[0])) : block1->forward(block0->forward(in[0]))};
    };
    Tensor h = embed(x);
    h = routed && recompute ? mfsdp::recompute(blocks, {h})[0] : blocks({h})[0];
    return head(h);
  }
  std::vector<nn::Module*> units() { return {block0.get(), block1.get()}; }
  nn::Linear embed{nullptr}, head{nullptr};
  LoraBlock block0{nullptr}, block1{nullptr};
  bool recompute = false;
};
TORCH_MODULE(LoraNet);

struct Batch {
  Tensor x, y;
};
Batch global_batch(int step, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step);
  const int64_t n = static_cast<int64_t>(world) * kMicro * kPerMicro;
  return {at::randn({n, T, kIn}, gen), at::randn({n, T, kOut}, gen)};
}

template <class Net>
Net make_net() {
  torch::manual_seed(11);
  return Net();
}

struct Trace {
  std::vector<std::map<std::string, Tensor>> grads;  // per step, trainable parameters only
  std::map<std::string, Tensor> params;              // after the last step
};

// One process, the whole global batch, torch::optim.
template <class Net>
Trace reference(int world, bool adamw) {
  Net net = make_net<Net>();
  std::vector<Tensor> trainable;
  for (auto& p : net->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  std::unique_ptr<optim::Optimizer> opt;
  if (adamw) {
    // eps 1e-3 (both sides): with 1e-8 Adam turns last-bit differences of near-zero gradients
    // (the summation order differs from one process to two) into whole steps, on some CPUs.
    opt = std::make_unique<optim::AdamW>(trainable, optim::AdamWOptions(kLr).weight_decay(0).eps(1e-3));
  } else {
    opt = std::make_unique<optim::SGD>(trainable, optim::SGDOptions(kLr).momentum(0.9));
  }
  Trace trace;
  for (int step = 0; step < kSteps; ++step) {
    Batch b = global_batch(step, world);
    opt->zero_grad();
    torch::mse_loss(net->forward(b.x, false), b.y).backward();
    std::map<std::string, Tensor> grads;
    for (auto& item : net->named_parameters())
      if (item.value().requires_grad()) grads[item.key()] = item.value().grad().detach().clone();
    trace.grads.push_back(std::move(grads));
    opt->step();
  }
  for (auto& item : net->named_parameters()) trace.params[item.key()] = item.value().detach().clone();
  return trace;
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got.to(kDouble) - want.to(kDouble)).abs().max().item<double>();
  const double scale = want.to(kDouble).abs().max().item<double>() + 1e-12;
  EXPECT_LE(err, 1e-5 * scale) << what << ": max abs error " << err << " (scale " << scale << ")";
}

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

size_t position(const std::vector<std::string>& events, const std::string& e) {
  return static_cast<size_t>(std::find(events.begin(), events.end(), e) - events.begin());
}

// Trains `Net` sharded over `comm` (2 micro-batches per step, the first without gradient sync)
// and checks every step's gradients (this rank's slice of each) and the final weights, frozen
// ones included, against reference(). Returns the last step's lifecycle events.
template <class Net>
std::vector<std::string> check_training(mfsdp::Communicator& comm, ShardingStrategy strategy, bool adamw,
                                        bool recompute = false) {
  const int world = comm.size(), rank = comm.rank();
  const std::string where = std::string(" (") + mfsdp::to_string(strategy) + (adamw ? ", AdamW" : ", SGD") +
                            (recompute ? ", recompute)" : ")");
  Net net = make_net<Net>();
  net->recompute = recompute;
  mfsdp::FullyShardOptions options;
  options.comm = borrow(comm);
  options.strategy = strategy;
  for (nn::Module* unit : net->units()) mfsdp::fully_shard(*unit, options);
  mfsdp::FsdpHandle root = mfsdp::fully_shard(*net, options);
  std::unique_ptr<mfsdp::DistributedOptimizer> opt;
  if (adamw) {
    mfsdp::AdamWOptions o;
    o.weight_decay = 0;
    o.eps = 1e-3;  // as the reference's
    opt = mfsdp::make_adamw(root, o);
  } else {
    mfsdp::SGDOptions o;
    o.momentum = 0.9;
    opt = mfsdp::make_sgd(root, o);
  }
  const Trace ref = reference<Net>(world, adamw);
  for (int step = 0; step < kSteps; ++step) {
    if (step == kSteps - 1) root.record_events(true);
    Batch b = global_batch(step, world);
    for (int m = 0; m < kMicro; ++m) {
      const int64_t first = (static_cast<int64_t>(rank) * kMicro + m) * kPerMicro;
      root.set_requires_gradient_sync(m == kMicro - 1);
      Tensor out = mfsdp::call(*net, b.x.narrow(0, first, kPerMicro), true);
      (torch::mse_loss(out, b.y.narrow(0, first, kPerMicro)) / kMicro).backward();
    }
    const auto shards = root.optimizer_shards();
    int checked = 0;
    for (const auto& s : root.local_shards()) {
      if (!s.requires_grad || s.local.numel() == 0) continue;
      const Tensor got = shards.at(s.shard_index).main_grad.narrow(0, s.shard_offset, s.local.numel());
      const Tensor want = ref.grads[step].at(s.name).reshape(-1).narrow(0, s.offset, s.local.numel());
      expect_close(got, want, "gradient of " + s.name + " at step " + std::to_string(step) + where);
      ++checked;
    }
    EXPECT_GT(checked, 0) << where;
    opt->step(kLr);
    root.zero_grad();
  }
  auto full = root.full_state_dict(/*all_ranks=*/true);
  EXPECT_EQ(full.size(), ref.params.size()) << where;
  for (const auto& [name, want] : ref.params) {
    if (!full.count(name)) {
      ADD_FAILURE() << "missing " << name << where;
      continue;
    }
    expect_close(full[name], want, name + " after training" + where);
  }
  return root.events();
}

// Says its tensors live on a GPU, so fully_shard makes it a reduction communicator, but is never
// given a tensor (the units it shards have no parameters): records the groups made from it.
class FakeGpuComm : public mfsdp::Communicator {
 public:
  explicit FakeGpuComm(std::vector<std::string>* made) : made_(made) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string backend() const override { return "nccl"; }
  at::Device device() const override { return at::Device(at::kCUDA, 0); }
  std::chrono::milliseconds default_timeout() const override { return std::chrono::seconds(5); }
  mfsdp::WorkHandle all_gather_async(const Tensor&, const Tensor&, const mfsdp::AllGatherOptions&) override {
    return fail();
  }
  mfsdp::WorkHandle reduce_scatter_async(const Tensor&, const Tensor&,
                                         const mfsdp::ReduceScatterOptions&) override {
    return fail();
  }
  mfsdp::WorkHandle all_reduce_async(const Tensor&, const mfsdp::AllReduceOptions&) override { return fail(); }
  mfsdp::WorkHandle broadcast_async(const Tensor&, const mfsdp::BroadcastOptions&) override { return fail(); }
  mfsdp::WorkHandle barrier_async(const mfsdp::BarrierOptions&) override { return fail(); }
  std::shared_ptr<mfsdp::Communicator> new_group(const std::vector<int>& ranks, const std::string& name) override {
    std::string what = name;
    for (int r : ranks) what += " " + std::to_string(r);
    made_->push_back(what);
    return std::make_shared<FakeGpuComm>(made_);
  }

 private:
  static mfsdp::WorkHandle fail() { throw std::logic_error("FakeGpuComm moves no tensor"); }
  std::vector<std::string>* made_;
};

struct EmptyUnitImpl : mfsdp::ShardedModule<EmptyUnitImpl> {
  Tensor forward(Tensor x) { return x * 2; }
};
TORCH_MODULE(EmptyUnit);

struct EmptyNetImpl : mfsdp::ShardedModule<EmptyNetImpl> {
  EmptyNetImpl() {
    dense = register_module("dense", EmptyUnit());
    experts = register_module("experts", EmptyUnit());
  }
  Tensor forward(Tensor x) { return experts->call(dense->call(x)); }
  EmptyUnit dense{nullptr}, experts{nullptr};
};
TORCH_MODULE(EmptyNet);

}  // namespace

// The gradient-reduction communicator (a second communicator beside the shard group, for its
// own stream on CUDA) is made by fully_shard, where every rank calls new_group in the same
// order: one per shard group, shared by every unit over it, with resources of its own; a
// training step makes none (not at the first reduction inside backward, as it used to be).
TEST(ReductionCommunicator, MadeByFullyShardOncePerShardGroup) {
  std::vector<std::string> made;
  auto data = std::make_shared<FakeGpuComm>(&made), experts = std::make_shared<FakeGpuComm>(&made);
  EmptyNet net;
  mfsdp::FullyShardOptions o;
  o.comm = data;
  mfsdp::fully_shard(*net->dense, o);
  EXPECT_EQ(made, std::vector<std::string>{"fsdp_reduce_scatter 0 1"});
  mfsdp::FullyShardOptions e = o;
  e.comm = experts;
  mfsdp::fully_shard(*net->experts, e);
  EXPECT_EQ(made.size(), 2u) << "one for the other shard group";
  mfsdp::fully_shard(*net, o);
  EXPECT_EQ(made.size(), 2u) << "the root shares the first unit's";
  Tensor x = torch::ones({3}, torch::requires_grad());
  net->call(x).sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), torch::full({3}, 4.0)));
  EXPECT_EQ(made.size(), 2u) << "made during a training step";
}

// ZeRO-3: frozen attention and a trainable MLP in one unit, a unit that is all frozen between
// two of them, a frozen parameter in the root; also with the blocks recomputed in backward (their
// backward then runs inside the recompute's own), and under ZeRO-2 and no_shard.
MFSDP_DIST_TEST(FrozenParams, FrozenAttentionTrainableMlpMatchesSingleProcess, {2}) {
  const auto events = check_training<AttnNet>(comm, ShardingStrategy::kOptimGradsParams, /*adamw=*/true);
  std::string trace;
  for (const auto& e : events) trace += e + " ";
  SCOPED_TRACE(trace);
  // Each unit's gradients are reduced (and its weights released) once its own backward is done,
  // before the backward of the unit before it starts (the reduction overlaps that unit's compute);
  // the all-frozen unit is released there too rather than at the end of the backward.
  const size_t end = position(events, ":end_of_backward");
  ASSERT_LT(end, events.size());
  EXPECT_LT(position(events, "block1:post_backward"), position(events, "mix:pre_backward"));
  EXPECT_LT(position(events, "mix:post_backward"), position(events, "block0:pre_backward"));
  EXPECT_LT(position(events, "block0:post_backward"), end);
  check_training<AttnNet>(comm, ShardingStrategy::kOptimGradsParams, /*adamw=*/false, /*recompute=*/true);
  check_training<AttnNet>(comm, ShardingStrategy::kOptimGrads, /*adamw=*/false);
  check_training<AttnNet>(comm, ShardingStrategy::kNoShard, /*adamw=*/true);
}

// LoRA adapters (frozen base weight, trainable low-rank A and B) under every strategy, and
// recomputed under ZeRO-3.
MFSDP_DIST_TEST(FrozenParams, LoraAdapterMatchesSingleProcess, {2}) {
  for (auto s : {ShardingStrategy::kOptimGradsParams, ShardingStrategy::kOptimGrads, ShardingStrategy::kOptim,
                 ShardingStrategy::kNoShard}) {
    const auto events = check_training<LoraNet>(comm, s, /*adamw=*/s != ShardingStrategy::kOptimGrads);
    if (s == ShardingStrategy::kOptimGradsParams) {
      EXPECT_LT(position(events, "block1:post_backward"), position(events, "block0:pre_backward"));
      EXPECT_LT(position(events, "block0:post_backward"), position(events, ":end_of_backward"));
    }
  }
  check_training<LoraNet>(comm, ShardingStrategy::kOptimGradsParams, /*adamw=*/true, /*recompute=*/true);
}
