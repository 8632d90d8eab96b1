// fully_shard lifecycle and memory: hook order, storage really freed after forward, per-role
// bytes equal to the strategy's formula (computed here by hand, not from the layout code),
// bounded transient peak, second forward before backward, evaluation without grad, manual
// unshard/reshard, and shared parameters across units rejected.
#include <torch/torch.h>

#include "harness/dist_test.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/fsdp/recompute.h"
#include "mfsdp/optim/optim.h"

namespace {

using namespace torch;
using mfsdp::ShardingStrategy;

// Every unit holds one D x D bias-free weight: row size D, so the padded flat size of a unit is
// round_up(D*D, N*D) elements, whatever the implementation.
constexpr int64_t D = 10;

struct LayerImpl : mfsdp::ShardedModule<LayerImpl> {
  LayerImpl() { fc = register_module("fc", nn::Linear(nn::LinearOptions(D, D).bias(false))); }
  Tensor forward(Tensor x) { return torch::tanh(fc(x)); }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(Layer);

struct LayerStackImpl : nn::Module {
  LayerStackImpl() {
    inp = register_module("inp", nn::Linear(nn::LinearOptions(D, D).bias(false)));
    for (int i = 0; i < 2; ++i) layers.push_back(register_module("layer" + std::to_string(i), Layer()));
  }
  Tensor forward(Tensor x) {
    Tensor h = inp(x);
    for (auto& l : layers) {
      if (recompute_layers) {
        auto run = [&](const std::vector<Tensor>& a) { return std::vector<Tensor>{l->call(a[0])}; };
        h = mfsdp::recompute(run, {h})[0];
      } else {
        h = l->call(h);
      }
    }
    return h;
  }
  nn::Linear inp{nullptr};
  std::vector<Layer> layers;
  bool recompute_layers = false;
};
TORCH_MODULE(LayerStack);

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

mfsdp::FsdpHandle shard(LayerStack& net, mfsdp::Communicator& comm, ShardingStrategy s,
                        std::optional<at::ScalarType> param_dtype = std::nullopt,
                        std::shared_ptr<mfsdp::DeviceMesh> mesh = nullptr) {
  mfsdp::FullyShardOptions o;
  if (mesh) {
    o.mesh = mesh;
  } else {
    o.comm = borrow(comm);
  }
  o.strategy = s;
  o.mixed_precision.param_dtype = param_dtype;
  for (auto& l : net->layers) mfsdp::fully_shard(*l, o);
  return mfsdp::fully_shard(*net, o);
}

int64_t padded_unit_elements(int world) {
  const int64_t grid = world * D;
  return (D * D + grid - 1) / grid * grid;
}

Tensor step_input() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return at::randn({4, D}, gen);
}

}  // namespace

MFSDP_DIST_TEST(FullyShardLifecycle, HooksFireInOrder, {2}) {
  torch::manual_seed(0);
  LayerStack net;
  auto root = shard(net, comm, ShardingStrategy::kOptimGradsParams);
  root.record_events(true);
  mfsdp::call(*net, step_input()).sum().backward();
  // The root stays gathered from its forward into its backward (its backward comes first);
  // the layers are gathered again for backward.
  std::vector<std::string> want = {
      ":pre_forward",        ":all_gather",          "layer0:pre_forward",
      "layer0:all_gather",   "layer0:post_forward",  "layer1:pre_forward",
      "layer1:all_gather",   "layer1:post_forward",  ":post_forward",
      ":pre_backward",       "layer1:pre_backward",
      "layer1:all_gather",   "layer1:post_backward", "layer0:pre_backward",
      "layer0:all_gather",   "layer0:post_backward", ":post_backward",
      ":end_of_backward"};
  EXPECT_EQ(root.events(), want);
}

// Under ZeRO-3 a unit's parameters are views of a buffer whose storage is really released after
// its forward (0 bytes), and restored for backward; gradients still come out right.
MFSDP_DIST_TEST(FullyShardLifecycle, ParametersAreFreedAfterForward, {2, 3}) {
  torch::manual_seed(0);
  LayerStack net;
  auto root = shard(net, comm, ShardingStrategy::kOptimGradsParams);
  for (auto& l : net->layers) EXPECT_EQ(l->fc->weight.storage().nbytes(), 0u) << "at rest";
  Tensor out = mfsdp::call(*net, step_input());
  for (auto& l : net->layers) {
    EXPECT_EQ(l->fc->weight.storage().nbytes(), 0u) << "after forward";
    EXPECT_EQ(l->fc->weight.sizes(), (std::vector<int64_t>{D, D}));  // shape kept for autograd
  }
  out.sum().backward();
  for (auto& l : net->layers) EXPECT_EQ(l->fc->weight.storage().nbytes(), 0u) << "after backward";
  // Manual unshard/reshard (FSDP2's controls) brings the real values back.
  auto full = root.full_state_dict(/*all_ranks=*/true);
  auto layer0 = mfsdp::handle_of(*net->layers[0]);
  layer0.unshard();
  EXPECT_TRUE(at::equal(net->layers[0]->fc->weight.detach(), full["layer0.fc.weight"]));
  layer0.reshard();
  EXPECT_EQ(net->layers[0]->fc->weight.storage().nbytes(), 0u);
}

// Bytes per role after a step equal the formula of each strategy (fp32 params: main weights
// alias the model weights, so they add nothing; P = padded elements per unit, 3 units).
MFSDP_DIST_TEST(FullyShardLifecycle, MemoryMatchesFormula, {1, 2, 3, 4}) {
  const int world = comm.size();
  const int64_t P = padded_unit_elements(world), units = 3, f32 = 4, bf16 = 2;
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptim,
                             ShardingStrategy::kOptimGrads, ShardingStrategy::kOptimGradsParams}) {
    for (bool mixed : {false, true}) {
      torch::manual_seed(0);
      LayerStack net;
      auto root = shard(net, comm, s, mixed ? std::optional(at::kBFloat16) : std::nullopt);
      mfsdp::AdamWOptions adamw;
      auto opt = mfsdp::make_adamw(root, adamw);
      mfsdp::call(*net, step_input()).sum().backward();
      opt->step(1e-3);
      root.zero_grad();

      const int64_t full = units * P, shard = units * P / world;
      const bool params_sharded = s == ShardingStrategy::kOptimGradsParams;
      const bool grads_sharded = s == ShardingStrategy::kOptimGrads || params_sharded;
      const bool main_sharded = s != ShardingStrategy::kNoShard;
      const int64_t model_el = params_sharded ? shard : full;
      const int64_t main_el = main_sharded ? shard : full;
      int64_t state = 0;
      for (auto& [name, tensors] : opt->state())
        for (auto& t : tensors) state += t.nbytes();

      auto m = root.memory();
      std::string what = std::string(mfsdp::to_string(s)) + (mixed ? " bf16" : " fp32") +
                         ", world " + std::to_string(world);
      EXPECT_EQ(m.model_weights, model_el * (mixed ? bf16 : f32)) << what;
      EXPECT_EQ(m.main_weights, mixed ? main_el * f32 : 0) << what;  // fp32: aliases model weights
      EXPECT_EQ(m.main_grads, (grads_sharded ? shard : full) * f32) << what;
      EXPECT_EQ(state, 2 * main_el * f32) << what;  // exp_avg + exp_avg_sq
      // Between steps only the first unit's all-gather (all_gather_in_start_param_sync) is alive.
      EXPECT_EQ(m.transient_now, params_sharded ? P * (mixed ? bf16 : f32) : 0) << what;
    }
  }
}

// The transient peak under ZeRO-3: the root's own weights and gradients, plus at most two
// layers' (the one in backward and one whose reduce-scatter is in flight).
MFSDP_DIST_TEST(FullyShardLifecycle, TransientPeakIsBounded, {2, 3}) {
  torch::manual_seed(0);
  LayerStack net;
  auto root = shard(net, comm, ShardingStrategy::kOptimGradsParams);
  root.reset_peak();
  mfsdp::call(*net, step_input()).sum().backward();
  const int64_t unit_bytes = padded_unit_elements(comm.size()) * 4;  // weights or grads of one unit
  const int64_t root_wg = 2 * unit_bytes, layer_wg = 2 * unit_bytes;
  auto m = root.memory();
  EXPECT_GT(m.transient_peak, 0);
  EXPECT_LE(m.transient_peak, root_wg + 2 * layer_wg);
  EXPECT_EQ(m.transient_now, 0);
}

// A second forward before backward, then an evaluation forward under no-grad, give the same
// gradients as the same computation on a plain module.
MFSDP_DIST_TEST(FullyShardLifecycle, SecondForwardAndEvalWork, {1, 2, 3}) {
  const int world = comm.size();
  for (ShardingStrategy s : {ShardingStrategy::kOptimGrads, ShardingStrategy::kOptimGradsParams}) {
    torch::manual_seed(0);
    LayerStack ref;
    torch::manual_seed(0);
    LayerStack net;
    auto root = shard(net, comm, s);
    mfsdp::SGDOptions sgd;
    auto opt = mfsdp::make_sgd(root, sgd);
    Tensor x1 = step_input(), x2 = step_input() * 2;
    // Sharded: every rank computes the same loss, so averaged gradients equal the local ones.
    Tensor loss = mfsdp::call(*net, x1).pow(2).sum() + mfsdp::call(*net, x2).sum();
    loss.backward();
    opt->step(0.1);
    root.zero_grad();
    Tensor eval_out;
    {
      torch::NoGradGuard no_grad;
      eval_out = mfsdp::call(*net, x1);
    }
    // Reference.
    Tensor ref_loss = ref->forward(x1).pow(2).sum() + ref->forward(x2).sum();
    ref_loss.backward();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : ref->parameters()) p -= 0.1 * p.grad();
    }
    Tensor ref_eval = ref->forward(x1).detach();
    EXPECT_TRUE(at::allclose(eval_out, ref_eval, 1e-5, 1e-6))
        << mfsdp::to_string(s) << " world " << world << "\n" << eval_out << "\n" << ref_eval;
    auto full = root.full_state_dict(true);
    for (auto& item : ref->named_parameters())
      EXPECT_TRUE(at::allclose(full[item.key()], item.value().detach(), 1e-5, 1e-6)) << item.key();
  }
}

// Gradient sync on every micro-batch (communication per micro-batch) accumulates the same as
// syncing once.
// (Also under HSDP on 4 ranks, 2 replicas x 2 shards.)
MFSDP_DIST_TEST(FullyShardLifecycle, SyncEveryMicroBatchEqualsSyncOnce, {2, 3, 4}) {
  std::shared_ptr<mfsdp::DeviceMesh> mesh;
  if (comm.size() == 4)
    mesh = std::make_shared<mfsdp::DeviceMesh>(borrow(comm), std::vector<int>{2, 2},
                                               std::vector<std::string>{"dp_outer", "dp_shard"});
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptim,
                             ShardingStrategy::kOptimGrads, ShardingStrategy::kOptimGradsParams}) {
    std::vector<std::map<std::string, Tensor>> results;
    for (bool every : {true, false}) {
      torch::manual_seed(0);
      LayerStack net;
      auto root = shard(net, comm, s, std::nullopt, mesh);
      mfsdp::SGDOptions sgd;
      auto opt = mfsdp::make_sgd(root, sgd);
      for (int m = 0; m < 3; ++m) {
        root.set_requires_gradient_sync(every || m == 2);
        Tensor x = step_input() * (1 + m + comm.rank());
        mfsdp::call(*net, x).pow(2).mean().backward();
      }
      opt->step(0.5);
      root.zero_grad();
      results.push_back(root.full_state_dict(true));
    }
    for (auto& [name, t] : results[0])
      EXPECT_TRUE(at::allclose(t, results[1][name], 1e-5, 1e-6)) << mfsdp::to_string(s) << " " << name;
  }
}

// A parameter shared by a layer unit and the root would be freed while the root still uses it:
// fully_shard refuses it, naming both names.
MFSDP_DIST_TEST(FullyShardLifecycle, ParameterSharedAcrossUnitsIsRejected, {1}) {
  torch::manual_seed(0);
  LayerStack net;
  net->register_parameter("tied", net->layers[0]->fc->weight);  // the root reuses a layer's weight
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);
  for (auto& l : net->layers) mfsdp::fully_shard(*l, o);
  try {
    mfsdp::fully_shard(*net, o);
    ADD_FAILURE() << "shared parameter accepted";
  } catch (const std::invalid_argument& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("'tied'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("layer0.fc.weight"), std::string::npos) << msg;
  }
}

// A weight tied inside one unit (one tensor registered as "a.w" and "b.w", like an embedding
// reused as the output layer) is one flat-buffer entry and trains like the single-process model.
struct HolderImpl : nn::Module {
  explicit HolderImpl(Tensor w) { register_parameter("w", w); }
};
TORCH_MODULE(Holder);

struct TiedImpl : nn::Module {
  TiedImpl() {
    Tensor w = torch::randn({D, D}) * 0.3;
    a = register_module("a", Holder(w));
    b = register_module("b", Holder(w));
  }
  Tensor forward(Tensor x) {
    Tensor h = torch::tanh(torch::nn::functional::linear(x, a->named_parameters()["w"]));
    return torch::nn::functional::linear(h, b->named_parameters()["w"].t());
  }
  Holder a{nullptr}, b{nullptr};
};
TORCH_MODULE(Tied);

MFSDP_DIST_TEST(FullyShardLifecycle, WeightTiedWithinAUnitTrains, {1, 2, 3}) {
  torch::manual_seed(0);
  Tied ref;
  torch::manual_seed(0);
  Tied net;
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);
  auto root = mfsdp::fully_shard(*net, o);
  mfsdp::SGDOptions sgd;
  auto opt = mfsdp::make_sgd(root, sgd);
  for (int step = 0; step < 2; ++step) {
    mfsdp::call(*net, step_input()).pow(2).mean().backward();
    opt->step(0.3);
    root.zero_grad();
    ref->forward(step_input()).pow(2).mean().backward();
    torch::NoGradGuard no_grad;
    for (auto& p : ref->parameters())
      if (p.grad().defined()) {
        p -= 0.3 * p.grad();
        p.grad().zero_();
      }
  }
  auto full = root.full_state_dict(true);
  EXPECT_EQ(full.count("b.w"), 0u) << "a tied tensor is reported once, under its first name";
  EXPECT_TRUE(at::allclose(full.at("a.w"), ref->a->named_parameters()["w"].detach(), 1e-5, 1e-6));
}

// Loading a full state dict into the shards, then gathering it back, returns the same values;
// local shards are exactly the rank's element ranges of the full tensors; bad state dicts are
// rejected naming the parameter, before anything is changed.
MFSDP_DIST_TEST(FullyShardLifecycle, FullStateDictRoundTripAndLocalShards, {1, 2, 3, 4}) {
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptim,
                             ShardingStrategy::kOptimGrads, ShardingStrategy::kOptimGradsParams}) {
    torch::manual_seed(1);
    LayerStack source;
    std::map<std::string, Tensor> wanted;
    for (auto& item : source->named_parameters()) wanted[item.key()] = item.value().detach().clone();

    torch::manual_seed(2);  // different initial values
    LayerStack net;
    auto root = shard(net, comm, s);
    auto before = root.full_state_dict(true);

    auto missing = wanted;
    missing.erase("inp.weight");
    EXPECT_THROW(root.load_full_state_dict(missing), std::invalid_argument);
    auto misshaped = wanted;
    misshaped["layer1.fc.weight"] = torch::zeros({D, D + 1});
    try {
      root.load_full_state_dict(misshaped);
      ADD_FAILURE() << "mis-shaped parameter accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("layer1.fc.weight"), std::string::npos) << e.what();
    }
    auto extra = wanted;
    extra["nope"] = torch::zeros({1});
    EXPECT_THROW(root.load_full_state_dict(extra), std::invalid_argument);
    for (auto& [name, t] : root.full_state_dict(true))
      EXPECT_TRUE(at::equal(t, before[name])) << "a rejected load changed " << name;

    root.load_full_state_dict(wanted);
    auto back = root.full_state_dict(true);
    for (auto& [name, t] : wanted) EXPECT_TRUE(at::equal(back.at(name), t)) << mfsdp::to_string(s) << " " << name;
    // The loaded weights are the ones the forward uses.
    Tensor x = step_input();
    EXPECT_TRUE(at::allclose(mfsdp::call(*net, x), source->forward(x), 1e-6, 1e-7)) << mfsdp::to_string(s);

    for (const auto& shard_view : root.local_shards()) {
      Tensor full = wanted.at(shard_view.name).reshape(-1);
      ASSERT_LE(shard_view.offset + shard_view.local.numel(), full.numel()) << shard_view.name;
      EXPECT_TRUE(at::equal(shard_view.local, full.narrow(0, shard_view.offset, shard_view.local.numel())))
          << shard_view.name;
    }
    // Every element of every parameter is held by exactly one rank (sharded) or all (no_shard).
    std::map<std::string, int64_t> held;
    for (const auto& v : root.local_shards()) held[v.name] = v.local.numel();
    for (auto& [name, n] : held) {
      Tensor count = at::full({1}, n, at::kLong);
      comm.all_reduce(count);
      int64_t expected = wanted.at(name).numel() * (s == ShardingStrategy::kNoShard ? comm.size() : 1);
      EXPECT_EQ(count.item<int64_t>(), expected) << mfsdp::to_string(s) << " " << name;
    }
  }
}

// A sharded model's state (buffers, communicator reference) goes away with the model.
MFSDP_DIST_TEST(FullyShardLifecycle, StateIsFreedWithTheModule, {1, 2}) {
  auto counted = std::make_shared<int>(0);
  auto comm_ref = std::shared_ptr<mfsdp::Communicator>(counted, &comm);  // counts references
  for (int i = 0; i < 3; ++i) {
    auto net = std::make_shared<LayerStackImpl>();
    mfsdp::FullyShardOptions o;
    o.comm = comm_ref;
    for (auto& l : net->layers) mfsdp::fully_shard(*l, o);
    auto root = mfsdp::fully_shard(*net, o);
    EXPECT_GT(counted.use_count(), 2);
  }
  EXPECT_EQ(counted.use_count(), 2) << "unit states outlived their modules";  // `counted` + comm_ref
}

// With bf16 parameters, micro-batches accumulated without sync are summed in fp32: 300 gradients
// of exactly 1 give 300 (bf16 accumulation stops at 256).
MFSDP_DIST_TEST(FullyShardLifecycle, Bf16AccumulationWithoutSyncIsExact, {1, 2}) {
  struct ScaleImpl : nn::Module {
    ScaleImpl() { w = register_parameter("w", torch::ones({2, 1})); }
    Tensor forward(Tensor x) { return (x * w.t()).sum(); }
    Tensor w;
  };
  auto net = std::make_shared<ScaleImpl>();
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);
  o.mixed_precision.param_dtype = at::kBFloat16;
  o.gradient_scaling = mfsdp::GradientScaling::kNone;
  auto root = mfsdp::fully_shard(*net, o);
  const int micro = 300;
  for (int m = 0; m < micro; ++m) {
    root.set_requires_gradient_sync(m == micro - 1);
    mfsdp::call(*net, torch::ones({1, 2})).backward();  // d/dw = 1 per element
  }
  double total = 0;
  for (auto& shard : root.optimizer_shards()) total += shard.main_grad.sum().item<double>();
  Tensor all = at::full({1}, total, at::kDouble);
  comm.all_reduce(all);
  // Each of the 2 elements receives 300 per rank, summed over ranks (no scaling).
  EXPECT_EQ(all.item<double>(), 2.0 * micro * comm.size());
}

// Full activation recompute of every layer: same gradients as without, and each layer is
// all-gathered exactly twice per step either way (forward, then recompute = backward).
MFSDP_DIST_TEST(FullyShardLifecycle, RecomputeGivesSameGradientsWithoutExtraAllGathers, {1, 2, 3}) {
  std::vector<std::map<std::string, Tensor>> results;
  std::vector<std::vector<std::string>> traces;
  for (bool use_recompute : {false, true}) {
    torch::manual_seed(0);
    LayerStack net;
    auto root = shard(net, comm, ShardingStrategy::kOptimGradsParams);
    mfsdp::SGDOptions sgd;
    auto opt = mfsdp::make_sgd(root, sgd);
    root.record_events(true);
    net->recompute_layers = use_recompute;
    Tensor out = mfsdp::call(*net, step_input() * (1 + comm.rank()));
    out.pow(2).sum().backward();
    traces.push_back(root.events());
    opt->step(0.1);
    root.zero_grad();
    results.push_back(root.full_state_dict(true));
  }
  for (auto& [name, t] : results[0])
    EXPECT_TRUE(at::allclose(t, results[1][name], 1e-6, 1e-7)) << name;
  for (const char* layer : {"layer0:all_gather", "layer1:all_gather"}) {
    for (size_t r = 0; r < 2; ++r) {
      auto n = std::count(traces[r].begin(), traces[r].end(), std::string(layer));
      EXPECT_EQ(n, 2) << layer << (r ? " with" : " without") << " recompute";
    }
  }
}
