// Full state dicts streamed one parameter group at a time and offloaded to the host
// (FsdpHandle::for_each_full_tensor and full_state_dict(FullStateDictOptions),
// include/mfsdp/fsdp/fully_shard.h), on 2 real processes:
//   - both give exactly the unsharded module's tensors (saved before fully_shard, and again after
//     load_full_state_dict of other values), under ZeRO-3, ZeRO-1 and no_shard, with shards that
//     split parameters unevenly, a bf16 unit, a frozen parameter and a buffer;
//   - the tensors handed to the callback never keep more than one group's gathered memory alive
//     (a storage watch that does fail on the map of full_state_dict(bool), which keeps them all);
//   - a callback that throws is rethrown after the last group, with the ranks still in step;
//   - a RolloutModel streamed from a sharded Llama equals the unsharded Llama.
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>

#include "harness/dist_test.h"
#include "harness/tiny_llama.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/models/model_spec.h"
#include "mfsdp/train/rollout_model.h"

namespace {

using namespace torch;
using State = std::map<std::string, Tensor>;

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

// No parameter's element count and no unit's total is even: every shard boundary of 2 ranks
// splits something, and every group is padded.
struct CellImpl : nn::Module {
  CellImpl(int64_t in, int64_t out) {
    fc = register_module("fc", nn::Linear(in, out));
    gain = register_parameter("gain", torch::randn({out}));
  }
  nn::Linear fc{nullptr};
  Tensor gain;
};
TORCH_MODULE(Cell);

// Units c0..c3 and the root (`head`, the buffer `steps`). c1's Linear is bf16 (a second group
// in its unit, gathered from fp32 main weights); with `freeze`, c2's gain is frozen (a group
// gathered from the model weights).
struct NetImpl : nn::Module {
  explicit NetImpl(bool freeze) {
    const int64_t dims[] = {5, 3, 7, 3, 5};
    for (int i = 0; i < 4; ++i) cells.push_back(register_module("c" + std::to_string(i), Cell(dims[i], dims[i + 1])));
    cells[1]->fc->to(kBFloat16);
    if (freeze) cells[2]->gain.set_requires_grad(false);
    head = register_parameter("head", torch::randn({5}));
    register_buffer("steps", torch::arange(3, kFloat) + 0.5);
  }
  std::vector<Cell> cells;
  Tensor head;
};
TORCH_MODULE(Net);

Net make_net(bool freeze = true) {
  torch::manual_seed(11);
  return Net(freeze);
}

// The reference: the unsharded module's parameters and buffers.
State state_of(nn::Module& m) {
  State out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value().detach().clone();
  return out;
}

mfsdp::FsdpHandle shard(Net& net, mfsdp::Communicator& comm, mfsdp::ShardingStrategy strategy) {
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);
  o.strategy = strategy;
  for (auto& c : net->cells) mfsdp::fully_shard(*c, o);
  return mfsdp::fully_shard(*net, o);
}

void expect_same(const State& got, const State& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, w] : want) {
    ASSERT_TRUE(got.count(name)) << what << ": no " << name;
    const Tensor& g = got.at(name);
    EXPECT_EQ(g.scalar_type(), w.scalar_type()) << what << ": " << name;
    EXPECT_TRUE(g.sizes().equals(w.sizes()) && torch::equal(g.cpu(), w)) << what << ": " << name;
  }
}

const mfsdp::ShardingStrategy kStrategies[] = {mfsdp::ShardingStrategy::kOptimGradsParams,
                                               mfsdp::ShardingStrategy::kOptim, mfsdp::ShardingStrategy::kNoShard};

// Every form of the full state dict, on every rank, against `want`.
void expect_full_state(const mfsdp::FsdpHandle& root, int rank, const State& want, const std::string& what) {
  for (bool all_ranks : {false, true}) {
    const bool receives = all_ranks || rank == 0;
    const std::string how = what + (all_ranks ? " all_ranks" : " rank 0");
    State streamed;
    root.for_each_full_tensor([&](const std::string& name, const Tensor& full) { streamed[name] = full.clone(); },
                              all_ranks);
    if (receives) expect_same(streamed, want, how + " streamed");
    else EXPECT_TRUE(streamed.empty()) << how << ": the callback ran on rank " << rank;

    // Collectives: every rank calls both before anything is checked.
    const State offloaded = root.full_state_dict(mfsdp::FullStateDictOptions{all_ranks, /*cpu_offload=*/true});
    const State on_device = root.full_state_dict(mfsdp::FullStateDictOptions{all_ranks, /*cpu_offload=*/false});
    if (!receives) {
      EXPECT_TRUE(offloaded.empty() && on_device.empty()) << how;
      continue;
    }
    expect_same(offloaded, want, how + " offloaded");
    for (const auto& [name, t] : offloaded) {
      EXPECT_TRUE(t.device().is_cpu()) << how << ": " << name;
      // Its own memory: not a view that keeps a whole gathered group (or the weights) alive.
      EXPECT_EQ(t.storage().nbytes(), t.nbytes()) << how << ": " << name;
    }
    expect_same(on_device, want, how + " on the device");
  }
}

// Live bytes of the storages of the tensors seen so far, except the persistent ones (the
// module's weights and buffers, which every form may view). A storage is alive while anything
// (the callback's caller included) still references it.
class StorageWatch {
 public:
  explicit StorageWatch(const mfsdp::FsdpHandle& root) {
    for (const auto& s : root.local_shards()) persistent_.insert(s.local.storage().unsafeGetStorageImpl());
    for (const auto& [name, b] : root.buffers()) persistent_.insert(b.storage().unsafeGetStorageImpl());
  }
  void see(const Tensor& t) {
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    if (persistent_.count(impl)) return;
    auto it = seen_.find(impl);
    if (it == seen_.end() || it->second.expired()) seen_.insert_or_assign(impl, t.storage().getWeakStorageImpl());
    int64_t live = 0;
    for (const auto& [p, weak] : seen_)
      if (!weak.expired()) live += static_cast<int64_t>(p->nbytes());
    peak_ = std::max(peak_, live);
  }
  int64_t peak() const { return peak_; }

 private:
  std::set<const c10::StorageImpl*> persistent_;
  std::map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> seen_;
  int64_t peak_ = 0;
};

// The bytes of the largest group's gather: a sharded main-weight shard times the ranks (every
// group of a model without frozen parameters has one); nothing is gathered unsharded.
int64_t largest_group_bytes(const mfsdp::FsdpHandle& root, int world) {
  int64_t largest = 0;
  for (const auto& s : root.optimizer_shards())
    if (!s.replicated) largest = std::max<int64_t>(largest, static_cast<int64_t>(s.main_weight.nbytes()) * world);
  return largest;
}

}  // namespace

MFSDP_DIST_TEST(FullStateDict, StreamedAndOffloadedEqualTheUnshardedModule, {2}) {
  for (auto strategy : kStrategies) {
    const std::string what = mfsdp::to_string(strategy);
    Net net = make_net();
    const State initial = state_of(*net);
    mfsdp::FsdpHandle root = shard(net, comm, strategy);
    expect_full_state(root, comm.rank(), initial, what + " initial");

    // Other values, loaded into the shards: the forms read the shards, not leftovers.
    State loaded;
    for (const auto& [name, t] : initial)
      loaded[name] = (t.to(kFloat) * -3 + torch::arange(t.numel(), kFloat).view(t.sizes()) / 7).to(t.scalar_type());
    root.load_full_state_dict(loaded);
    expect_full_state(root, comm.rank(), loaded, what + " loaded");
  }
}

MFSDP_DIST_TEST(FullStateDict, HoldsAtMostOneGroupAtATime, {2}) {
  for (auto strategy : kStrategies) {
    const std::string what = mfsdp::to_string(strategy);
    Net net = make_net(/*freeze=*/false);
    mfsdp::FsdpHandle root = shard(net, comm, strategy);
    const int64_t group = largest_group_bytes(root, comm.size());
    // While a tensor is visited, one group's gather plus that tensor when converted to its
    // original dtype (c1's bf16 Linear, gathered as fp32) may be alive, nothing more.
    int64_t converted = 0;
    for (const auto& p : net->cells[1]->fc->parameters()) converted = std::max<int64_t>(converted, p.nbytes());
    StorageWatch streamed(root);
    root.for_each_full_tensor([&](const std::string&, const Tensor& full) { streamed.see(full); }, true);
    EXPECT_LE(streamed.peak(), group + converted) << what;
    if (strategy != mfsdp::ShardingStrategy::kNoShard) {
      EXPECT_GE(streamed.peak(), group) << what << ": the gathers were not seen";
      // The same watch over full_state_dict(bool), whose map keeps every group on the device.
      StorageWatch kept(root);
      for (const auto& [name, t] : root.full_state_dict(/*all_ranks=*/true)) kept.see(t);
      EXPECT_GT(kept.peak(), group + converted) << what << ": the watch misses groups kept alive";
    }
  }
}

MFSDP_DIST_TEST(FullStateDict, AThrowingCallbackLeavesTheRanksInStep, {2}) {
  Net net = make_net();
  const State initial = state_of(*net);
  mfsdp::FsdpHandle root = shard(net, comm, mfsdp::ShardingStrategy::kOptimGradsParams);
  int calls = 0;
  auto visit = [&](const std::string& name, const Tensor&) {
    ++calls;
    if (comm.rank() == 0) throw std::runtime_error("cannot keep " + name);
  };
  if (comm.rank() == 0) {
    EXPECT_THROW(root.for_each_full_tensor(visit, true), std::runtime_error);
    EXPECT_EQ(calls, 1);  // no visit after the first failure
  } else {
    root.for_each_full_tensor(visit, true);
    EXPECT_EQ(calls, static_cast<int>(initial.size()));
  }
  // Every group's collective ran on both ranks: the next gather pairs up.
  expect_same(root.full_state_dict(mfsdp::FullStateDictOptions{true, true}), initial, "after a throw");
}

MFSDP_DIST_TEST(FullStateDict, RolloutModelStreamedFromTheShardsEqualsTheUnshardedLlama, {2}) {
  mfsdp::LlamaConfig c = mfsdp::testing::tiny_llama_config();
  mfsdp::LlamaOptions options;
  options.init_seed = 5;
  mfsdp::LlamaForCausalLM plain(c, options), policy(c, options);
  State want;
  for (const auto& [name, t] : mfsdp::model_tensors(*plain)) want[name] = t.detach().clone();
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);
  mfsdp::FsdpHandle root = mfsdp::shard_llama(policy, o);
  mfsdp::RolloutModel rollout(mfsdp::llama_model_config(c), comm.device());
  for (int load = 0; load < 2; ++load) {  // again after release(), which frees every tensor
    rollout.load_from(root);
    State got;
    for (const auto& [name, t] : mfsdp::model_tensors(rollout.model())) got[name] = t;
    expect_same(got, want, "load " + std::to_string(load));
    rollout.release();
  }
}
