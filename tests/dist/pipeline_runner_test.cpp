// run_pipeline (include/mfsdp/train/pipeline_runner.h) on real ranks, one pipeline stage per
// process over CPU communicators, each stage a small Linear chain sharded with fully_shard over a
// group of its own rank: the forwards and backwards each stage actually runs follow Megatron's
// non-interleaved 1F1B (P = 2 and 4, 8 micro-batches), stage 0 holds at most P micro-batches'
// activations, the summed loss and every stage's gradients equal one process running the whole
// chain micro-batch by micro-batch, gradient sync is on for each chunk's last backward only, and
// a chunk output of the wrong shape or dtype is a std::logic_error naming both.
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/unit_state.h"
#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/train/pipeline_runner.h"
#include "mfsdp/train/pipeline_schedule.h"

namespace {

using mfsdp::PipelineAction;
using mfsdp::PipelineStep;

constexpr int64_t kMicroBatches = 8;
constexpr int64_t kHidden = 8;
const std::vector<int64_t> kActivationShape = {2, 3, kHidden};  // [B, T, H]

// Megatron-LM's forward_backward_pipelining_without_interleaving
// (megatron/core/pipeline_parallel/schedules.py), worked out by hand for 8 micro-batches:
// num_warmup_microbatches = min(P - s - 1, m) forwards, then for i in [0, m - warm-up) the steady
// pair (forward of micro-batch i + warm-up, backward of micro-batch i), then the cool-down
// backwards. The same sequences as tests/unit/pipeline_schedule_test.cpp.
std::string megatron_one_f_one_b(int stages, int stage) {
  static const std::map<std::pair<int, int>, std::string> by_hand = {
      {{2, 0}, "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"},
      {{2, 1}, "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"},
      // P = 4: stage 0 warms up with 3 forwards, the last stage with none.
      {{4, 0}, "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"},
      {{4, 1}, "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"},
      {{4, 2}, "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"},
      {{4, 3}, "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"},
  };
  return by_hand.at({stages, stage});
}

std::string spell(const std::vector<PipelineAction>& schedule) {
  std::string s;
  for (const PipelineAction& a : schedule) {
    if (!s.empty()) s += ' ';
    s += a.step == PipelineStep::kForward ? 'F' : 'B';
    s += std::to_string(a.micro_batch);
  }
  return s;
}

// One pipeline stage: two Linear(8, 8) with a tanh between them, its weights drawn from a seed of
// its own, so that every rank and the one-process reference build the same stage s.
struct StageImpl : torch::nn::Module {
  explicit StageImpl(int stage) {
    torch::manual_seed(1000 + stage);
    a = register_module("a", torch::nn::Linear(kHidden, kHidden));
    b = register_module("b", torch::nn::Linear(kHidden, kHidden));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Stage);

// The first stage's input of micro-batch m: the layout's shape, or with `variable` lengths (as
// --variable-seq-lengths is for) a sequence of 1 + m % 3 tokens.
at::Tensor input_of(int64_t micro_batch, bool variable = false) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + micro_batch);
  std::vector<int64_t> shape = kActivationShape;
  if (variable) shape[1] = 1 + micro_batch % 3;
  return at::randn(shape, gen);
}

// The loss of one micro-batch from the last stage's output: its sum of squares over the
// micro-batches (each micro-batch's loss already divided, as Megatron's loss function does).
at::Tensor loss_of(const at::Tensor& output) { return output.pow(2).sum() / static_cast<double>(kMicroBatches); }

// What each stage saw, in the order it happened: "F<m>" when the forward of micro-batch m ran (the
// ChunkForward callback), "B<m>" when its backward reached the chunk's output (RecordBackward),
// and for each backward whether the stage's root had gradient sync on.
struct Record {
  std::vector<std::string> events;
  std::vector<bool> sync_at_backward;
  mfsdp::FsdpHandle* root = nullptr;
};
Record* g_record = nullptr;  // this rank's (each rank is a process of its own)

// Identity at a chunk's output whose backward records that the chunk's backward started.
struct RecordBackward : torch::autograd::Function<RecordBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t micro_batch) {
    ctx->saved_data["micro_batch"] = micro_batch;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    g_record->events.push_back("B" + std::to_string(ctx->saved_data["micro_batch"].toInt()));
    g_record->sync_at_backward.push_back(g_record->root->state().requires_gradient_sync());
    return {grads[0], at::Tensor()};
  }
};

// Forwards done whose backward has not run, at most, over `events`.
int64_t peak_in_flight(const std::vector<std::string>& events) {
  int64_t now = 0, peak = 0;
  for (const std::string& e : events) {
    now += e[0] == 'F' ? 1 : -1;
    peak = std::max(peak, now);
  }
  return peak;
}

std::string join(const std::vector<std::string>& events) {
  std::string s;
  for (const std::string& e : events) s += (s.empty() ? "" : " ") + e;
  return s;
}

// This rank's gradient of every parameter of its stage, by name ("a.weight", ...): on a group of
// one rank each parameter's shard is all of it, in the main gradients the optimizer would read.
std::map<std::string, at::Tensor> gradients_of(const mfsdp::FsdpHandle& root) {
  const std::vector<mfsdp::OptimizerShard> shards = root.optimizer_shards();
  std::map<std::string, at::Tensor> grads;
  for (const mfsdp::LocalShard& p : root.local_shards()) {
    EXPECT_EQ(p.local.numel(), c10::multiply_integers(p.global_shape)) << p.name;
    const at::Tensor& main_grad = shards.at(static_cast<size_t>(p.shard_index)).main_grad;
    grads[p.name] = main_grad.narrow(0, p.shard_offset, p.local.numel()).reshape(p.global_shape).clone();
  }
  return grads;
}

struct Reference {
  double loss = 0;
  std::vector<std::map<std::string, at::Tensor>> grads;  // per stage, by name
};

// One process, every stage built from its seed, forward and backward of the whole chain one
// micro-batch after the other.
Reference one_process(int stages, bool variable = false) {
  std::vector<Stage> chain;
  for (int s = 0; s < stages; ++s) chain.emplace_back(s);
  Reference ref;
  for (int64_t m = 0; m < kMicroBatches; ++m) {
    at::Tensor h = input_of(m, variable);
    for (Stage& stage : chain) h = stage->forward(h);
    at::Tensor loss = loss_of(h);
    loss.backward();
    ref.loss += loss.item<float>();
  }
  for (Stage& stage : chain) {
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : stage->named_parameters()) grads[p.key()] = p.value().grad().clone();
    ref.grads.push_back(std::move(grads));
  }
  return ref;
}

std::vector<int> all_ranks(int n) {
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(r);
  return ranks;
}

// The pipeline over the world's ranks (stage s on rank s) and this rank's FSDP group of one rank.
struct Setup {
  mfsdp::PipelineLayout layout;
  std::shared_ptr<mfsdp::Communicator> own_group;
};
Setup setup(mfsdp::Communicator& comm) {
  Setup s;
  s.layout.forward = comm.new_group(all_ranks(comm.size()), "pipeline_forward");
  s.layout.backward = comm.new_group(all_ranks(comm.size()), "pipeline_backward");
  s.own_group = comm.new_group({comm.rank()}, "data_parallel");
  s.layout.stages = comm.size();
  s.layout.stage = comm.rank();
  s.layout.activation_shape = kActivationShape;
  s.layout.activation_options = at::TensorOptions().dtype(at::kFloat);
  return s;
}

mfsdp::FsdpHandle shard(Stage& stage, const std::shared_ptr<mfsdp::Communicator>& group) {
  mfsdp::FullyShardOptions options;
  options.comm = group;
  return mfsdp::fully_shard(*stage, options);
}

}  // namespace

MFSDP_DIST_TEST(PipelineRunner, OneFOneBOnRealRanksMatchesMegatronAndOneProcess, {2, 4}) {
  const int P = comm.size(), s = comm.rank();
  const bool first = s == 0, last = s == P - 1;
  Setup st = setup(comm);
  Stage stage(s);
  mfsdp::FsdpHandle root = shard(stage, st.own_group);
  Record record;
  record.root = &root;
  g_record = &record;

  const std::vector<PipelineAction> schedule = mfsdp::one_f_one_b(P, s, kMicroBatches);
  const at::Tensor loss = mfsdp::run_pipeline(
      st.layout, schedule, [&](int, bool last_of_chunk, bool) { root.set_requires_gradient_sync(last_of_chunk); },
      [&](int chunk, int64_t m, const at::Tensor& input) {
        EXPECT_EQ(chunk, 0);
        EXPECT_EQ(input.defined(), !first) << "micro-batch " << m;
        if (input.defined()) {
          EXPECT_EQ(input.sizes().vec(), kActivationShape) << "micro-batch " << m;
          EXPECT_TRUE(input.requires_grad()) << "micro-batch " << m;
        }
        record.events.push_back("F" + std::to_string(m));
        const at::Tensor out = RecordBackward::apply(mfsdp::call(*stage, first ? input_of(m) : input), m);
        if (!last) return mfsdp::ChunkOutput{out, {}, {}};
        const at::Tensor l = loss_of(out);
        return mfsdp::ChunkOutput{{}, l, l.detach()};
      });
  g_record = nullptr;
  const std::string where = "stage " + std::to_string(s) + " of " + std::to_string(P);

  // 1. What ran, in order, is Megatron's 1F1B (by hand), and what one_f_one_b says.
  EXPECT_EQ(join(record.events), megatron_one_f_one_b(P, s)) << where;
  EXPECT_EQ(join(record.events), spell(schedule)) << where;

  // 2. Stage 0 keeps min(P, m) = P micro-batches' activations at most; stage s, P - s.
  EXPECT_EQ(peak_in_flight(record.events), std::min<int64_t>(P - s, kMicroBatches)) << where;
  EXPECT_EQ(peak_in_flight(record.events), mfsdp::in_flight_peak(schedule)) << where;  // what --memory-plan prints
  if (first) {
    EXPECT_EQ(peak_in_flight(record.events), P) << where;
  }

  // 4. Gradient sync on for the chunk's last backward (micro-batch 7) only: the root's flag as
  // each backward reached the chunk's output. (Over a group of one rank the gradients alone
  // cannot tell sync on every backward from sync on the last one; sync on any earlier backward
  // alone loses the later micro-batches' gradients, which 3 catches as well.)
  std::vector<bool> want_sync(kMicroBatches, false);
  want_sync.back() = true;
  EXPECT_EQ(record.sync_at_backward, want_sync) << where;

  // 3. The summed loss on the last stage (zero elsewhere) and this stage's gradients equal one
  // process's.
  const Reference ref = one_process(P);
  ASSERT_EQ(loss.scalar_type(), at::kDouble);
  ASSERT_EQ(loss.dim(), 0);
  if (last) {
    EXPECT_NEAR(loss.item<double>(), ref.loss, 1e-6) << where;
    EXPECT_GT(ref.loss, 0.1);  // not vacuous
  } else {
    EXPECT_EQ(loss.item<double>(), 0.0) << where;
  }
  const std::map<std::string, at::Tensor> grads = gradients_of(root);
  const std::map<std::string, at::Tensor>& want = ref.grads.at(static_cast<size_t>(s));
  ASSERT_EQ(grads.size(), want.size()) << where;
  for (const auto& [name, g] : want) {
    ASSERT_TRUE(grads.count(name)) << where << ": no gradient of " << name;
    const at::Tensor& got = grads.at(name);
    ASSERT_EQ(got.sizes(), g.sizes()) << where << " " << name;
    EXPECT_GT(g.abs().max().item<double>(), 1e-3) << where << " " << name << ": reference gradient ~0";
    EXPECT_LE((got.to(at::kDouble) - g.to(at::kDouble)).abs().max().item<double>(), 1e-6)
        << where << " " << name;
  }
}

// Megatron's --variable-seq-lengths: micro-batches of 1, 2 and 3 tokens, each activation's shape
// sent ahead of it. Every stage receives the shape its predecessor produced (no stage but the
// first knows it), and the loss and gradients still equal one process's; without variable shapes
// the same run is refused at its first send.
MFSDP_DIST_TEST(PipelineRunner, VariableShapesTravelAheadOfTheirActivations, {2, 4}) {
  const int P = comm.size(), s = comm.rank();
  const bool first = s == 0, last = s == P - 1;
  Setup st = setup(comm);
  st.layout.variable_shapes = true;
  Stage stage(s);
  mfsdp::FsdpHandle root = shard(stage, st.own_group);
  const at::Tensor loss = mfsdp::run_pipeline(
      st.layout, mfsdp::one_f_one_b(P, s, kMicroBatches),
      [&](int, bool last_of_chunk, bool) { root.set_requires_gradient_sync(last_of_chunk); },
      [&](int, int64_t m, const at::Tensor& input) {
        if (input.defined()) {
          EXPECT_EQ(input.sizes().vec(), input_of(m, true).sizes().vec()) << "stage " << s << ", micro-batch " << m;
        }
        const at::Tensor out = mfsdp::call(*stage, first ? input_of(m, true) : input);
        if (!last) return mfsdp::ChunkOutput{out, {}, {}};
        const at::Tensor l = loss_of(out);
        return mfsdp::ChunkOutput{{}, l, l.detach()};
      });
  const std::string where = "stage " + std::to_string(s) + " of " + std::to_string(P);
  const Reference ref = one_process(P, /*variable=*/true);
  if (last) EXPECT_NEAR(loss.item<double>(), ref.loss, 1e-6) << where;
  const std::map<std::string, at::Tensor> grads = gradients_of(root);
  for (const auto& [name, g] : ref.grads.at(static_cast<size_t>(s)))
    EXPECT_LE((grads.at(name).to(at::kDouble) - g.to(at::kDouble)).abs().max().item<double>(), 1e-6)
        << where << " " << name;

  // Fixed shapes: stage 0's first output ([2, 1, 8]) is not the layout's, before any send.
  if (!first) return;
  st.layout.variable_shapes = false;
  const std::string error = mfsdp::testing::error_of([&] {
    mfsdp::run_pipeline(st.layout, mfsdp::one_f_one_b(P, s, kMicroBatches), [](int, bool, bool) {},
                        [&](int, int64_t m, const at::Tensor&) {
                          return mfsdp::ChunkOutput{mfsdp::call(*stage, input_of(m, true)), {}, {}};
                        });
  });
  mfsdp::testing::expect_contains(error, {"micro-batch 0", "[2, 1, 8]", "[2, 3, 8]"});
}

// A stage whose output is not the layout's activation shape (or dtype) fails before anything is
// sent, naming what it returned and what the next stage expects. Stage 0 of 2; stage 1 never
// runs (the error is raised before the first send, so it would only wait).
MFSDP_DIST_TEST(PipelineRunner, WrongActivationShapeOrDtypeIsALogicErrorNamingBoth, {2}) {
  Setup st = setup(comm);
  Stage stage(comm.rank());
  mfsdp::FsdpHandle root = shard(stage, st.own_group);
  if (comm.rank() != 0) return;
  const std::vector<PipelineAction> schedule = mfsdp::one_f_one_b(2, 0, kMicroBatches);
  auto run = [&](const std::function<at::Tensor(const at::Tensor&)>& reshape) {
    try {
      mfsdp::run_pipeline(st.layout, schedule, [&](int, bool last, bool) { root.set_requires_gradient_sync(last); },
                          [&](int, int64_t m, const at::Tensor&) {
        return mfsdp::ChunkOutput{reshape(mfsdp::call(*stage, input_of(m))), {}, {}};
      });
    } catch (const std::logic_error& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "run_pipeline accepted a wrong activation";
    return std::string();
  };
  // [2, 3, 5] instead of [2, 3, 8].
  const std::string shape = run([](const at::Tensor& out) { return out.narrow(-1, 0, 5); });
  mfsdp::testing::expect_contains(shape, {"stage 0", "micro-batch 0", "[2, 3, 5]", "[2, 3, 8]"});
  // Double instead of Float.
  const std::string dtype = run([](const at::Tensor& out) { return out.to(at::kDouble); });
  mfsdp::testing::expect_contains(dtype, {"Double", "Float", "[2, 3, 8]"});
}
