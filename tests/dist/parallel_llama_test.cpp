// Tensor and context parallelism in the Llama family, with FSDP over the data-parallel (and
// context-parallel) ranks, equal single-process training: a grouped-query model with q/k norms
// (whose gradients each TP rank holds only part of) trained 3 AdamW steps with 2 micro-batches
// and active clipping gives the losses, gradient norms and weights of one plain LibTorch process
// (torch::optim::AdamW and clip_grad_norm_ over the whole model) on the mesh in Megatron's order
// (tensor-parallel ranks adjacent, then context-parallel, then data-parallel):
//  - TP 2 (world 2) and TP 2 x DP 2 (world 4), with and without sequence parallelism, tied and
//    untied embeddings, every sharding strategy; the run that skips the gradient sum of the
//    partial parameters is shown to miss, so the comparison can fail;
//  - CP 2 (world 2) with all-gather and ring attention, causal and packed sequences, CP 2 x DP 2
//    and TP 2 x CP 2 (world 4); FSDP shards over DP x CP as Megatron-FSDP does.
// The initial weights gathered from the TP slices equal the one-process weights exactly.
#include <torch/torch.h>

#include "harness/dist_test.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/generate.h"
#include "mfsdp/models/lm_loss.h"
#include "mfsdp/models/model_spec.h"
#include "mfsdp/models/tensor_parallel.h"
#include "mfsdp/models/tensor_parallel_training.h"
#include "mfsdp/optim/optim.h"

namespace {

constexpr int kSteps = 3, kMicro = 2, kPerMicro = 2, kSeq = 8, kVocab = 64;
// AdamW's eps is 1e-3 here, not 1e-8: TP sums a row-parallel product and the cross entropy in
// another order than one process, so a gradient element that nearly cancels (1e-7 of its terms)
// comes out with another last bit, and with eps 1e-8 Adam's g / sqrt(v) turns that into a
// step of up to lr in either direction (measured: a handful of elements of 20k off by up to
// 6e-4 after 3 steps, everything else within 1e-5). eps 1e-3 keeps such elements' steps
// proportional to their gradients, so the weights compare at 1e-5 as the losses do.
constexpr double kLr = 0.01, kWd = 0.1, kClip = 0.5, kEps = 1e-3;

mfsdp::ModelConfig llama_config(bool tied) {
  return mfsdp::model_config_from_megatron({{"num_layers", 2},
                                            {"hidden_size", 32},
                                            {"ffn_hidden_size", 48},
                                            {"num_attention_heads", 4},
                                            {"group_query_attention", true},
                                            {"num_query_groups", 2},
                                            {"padded_vocab_size", kVocab},
                                            {"swiglu", true},
                                            {"normalization", "RMSNorm"},
                                            {"seq_length", kSeq},
                                            {"init_method_std", 0.2},
                                            {"qk_layernorm", true},
                                            {"untie_embeddings_and_output_weights", !tied}});
}

mfsdp::ModelBuildOptions build_options() {
  mfsdp::ModelBuildOptions o;
  o.init_seed = 11;
  return o;
}

// The token ids of (step, chunk): chunk c = data-parallel rank x kMicro + micro-batch.
at::Tensor chunk_tokens(int step, int chunk) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + chunk);
  return at::randint(kVocab, {kPerMicro, kSeq + 1}, gen);
}

// Packed rows: two samples of 3 and 5 tokens in each row, positions restarting per sample.
mfsdp::SequenceLayout packed_layout() {
  mfsdp::SequenceLayout layout;
  const at::Tensor segments = at::tensor({0, 0, 0, 1, 1, 1, 1, 1}, at::kLong);
  const at::Tensor positions = at::tensor({0, 1, 2, 0, 1, 2, 3, 4}, at::kLong);
  layout.segment_ids = segments.unsqueeze(0).expand({kPerMicro, kSeq}).contiguous();
  layout.position_ids = positions.unsqueeze(0).expand({kPerMicro, kSeq}).contiguous();
  return layout;
}

struct Trace {
  std::vector<double> losses, grad_norms;
  std::map<std::string, at::Tensor> initial, params;
};

std::map<std::string, at::Tensor> weights(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

// One process, the whole model, every chunk of the global batch in turn.
Trace reference(int dp, bool tied, bool packed) {
  const mfsdp::ModelConfig config = llama_config(tied);
  std::shared_ptr<mfsdp::CausalLM> model = config.spec->build(config, build_options());
  std::vector<at::Tensor> decay, no_decay;
  for (auto& p : model->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(kLr).weight_decay(kWd).eps(kEps)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(kLr).weight_decay(0).eps(kEps)));
  torch::optim::AdamW opt(groups, torch::optim::AdamWOptions(kLr));
  Trace trace;
  trace.initial = weights(*model);
  const int chunks = dp * kMicro;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    double loss = 0;
    for (int c = 0; c < chunks; ++c) {
      const at::Tensor t = chunk_tokens(step, c);
      const at::Tensor ids = t.narrow(1, 0, kSeq);
      at::Tensor logits = packed ? model->forward(ids, packed_layout()) : model->forward(ids);
      at::Tensor l = mfsdp::lm_loss(logits, t.narrow(1, 1, kSeq)) / chunks;
      l.backward();
      loss += l.item<double>();
    }
    trace.grad_norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kClip));
    opt.step();
    trace.losses.push_back(loss);
  }
  trace.params = weights(*model);
  return trace;
}

struct Layout {
  int tp = 2;
  int cp = 1;
  mfsdp::context_parallel::CpAlgorithm algorithm = mfsdp::context_parallel::CpAlgorithm::kAllGather;
  bool packed = false;
  bool sp = false;
  bool tied = false;
  bool deferred = false;
  mfsdp::ShardingStrategy strategy = mfsdp::ShardingStrategy::kOptimGradsParams;
  bool sum_partial = true;  // false: the broken run, which must miss
};

std::string describe(const Layout& l, int world) {
  return " (world " + std::to_string(world) + ", TP " + std::to_string(l.tp) + (l.sp ? " + SP" : "") + ", CP " +
         std::to_string(l.cp) +
         (l.cp > 1 ? (l.algorithm == mfsdp::context_parallel::CpAlgorithm::kRing ? " ring" : " all-gather") : "") +
         (l.packed ? ", packed" : "") +
         (l.tied ? ", tied" : ", untied") + (l.deferred ? ", deferred init" : "") + ", " +
         mfsdp::to_string(l.strategy) + (l.sum_partial ? "" : ", partial gradients NOT summed") + ")";
}

double relative(const at::Tensor& got, const at::Tensor& want) {
  const double err = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  return err / (want.to(at::kDouble).abs().max().item<double>() + 1e-12);
}

// Trains the layout and returns the largest relative weight error against one process (after
// checking losses, norms and the initial weights).
double train_and_compare(mfsdp::Communicator& comm, const Layout& l) {
  namespace cp_ns = mfsdp::context_parallel;
  const int world = comm.size(), dp = world / (l.tp * l.cp);
  const std::string where = describe(l, world);
  auto world_comm = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
  // Megatron's order: tensor-parallel ranks vary fastest, then context-parallel, then data.
  auto mesh = std::make_shared<mfsdp::DeviceMesh>(world_comm, std::vector<int>{dp, l.cp, l.tp},
                                                  std::vector<std::string>{"dp", "cp", "tp"});
  // FSDP shards over DP x CP: the ranks with this rank's tensor-parallel coordinate.
  auto fsdp_mesh = std::make_shared<mfsdp::DeviceMesh>(world_comm, std::vector<int>{dp * l.cp, l.tp},
                                                       std::vector<std::string>{"dp_cp", "tp"});
  const std::shared_ptr<mfsdp::Communicator> tp = mesh->get("tp"), cp = mesh->get("cp");
  EXPECT_EQ(tp->rank(), comm.rank() % l.tp) << where;
  EXPECT_EQ(cp->rank(), comm.rank() / l.tp % l.cp) << where;
  const mfsdp::ModelConfig config = llama_config(l.tied);
  mfsdp::ModelBuildOptions build = build_options();
  build.tensor_parallel = tp;
  build.sequence_parallel = l.sp;
  build.deferred_init = l.deferred;
  build.context_parallel = cp;
  build.context_parallel_algorithm = l.algorithm;
  std::shared_ptr<mfsdp::CausalLM> model = config.spec->build(config, build);
  mfsdp::FullyShardOptions options;
  options.comm = fsdp_mesh->get("dp_cp");
  options.strategy = l.strategy;
  mfsdp::FsdpHandle root = mfsdp::shard_model(*model, options);
  mfsdp::AdamWOptions adamw;
  adamw.weight_decay = kWd;
  adamw.eps = kEps;
  std::unique_ptr<mfsdp::DistributedOptimizer> opt = mfsdp::make_adamw(root, adamw);
  mfsdp::set_model_parallel_norm(*model, root, *opt);

  const Trace want = reference(dp, l.tied, l.packed);
  const auto initial = mfsdp::gather_tensor_parallel(*model, root.full_state_dict(/*all_ranks=*/true));
  EXPECT_EQ(initial.size(), want.initial.size()) << where;
  for (const auto& [name, value] : initial) {
    EXPECT_TRUE(want.initial.count(name)) << name << where;
    if (want.initial.count(name)) {
      EXPECT_TRUE(at::equal(value, want.initial.at(name))) << "initial " << name << where;
    }
  }

  Trace got;
  const int dp_rank = mesh->get("dp")->rank();
  for (int step = 0; step < kSteps; ++step) {
    double local = 0;
    for (int m = 0; m < kMicro; ++m) {
      root.set_requires_gradient_sync(m == kMicro - 1);
      const at::Tensor t = chunk_tokens(step, dp_rank * kMicro + m);
      // This rank's chunks of the sequence: ids, labels and the layout alike. Each CP rank's
      // loss is the mean over its own tokens; FSDP's 1 / (DP x CP) averages them.
      auto mine = [&](const at::Tensor& x) { return cp_ns::shard_sequence(x, 1, l.cp, cp->rank()); };
      const at::Tensor ids = mine(t.narrow(1, 0, kSeq)), labels = mine(t.narrow(1, 1, kSeq));
      mfsdp::SequenceLayout layout;
      if (l.packed) {
        layout.segment_ids = mine(packed_layout().segment_ids);
        layout.position_ids = mine(packed_layout().position_ids);
      }
      at::Tensor logits = l.packed ? model->call(ids, layout) : model->call(ids);
      EXPECT_EQ(logits.size(-1), kVocab / l.tp) << "no rank forms the full-vocabulary logits" << where;
      EXPECT_EQ(logits.size(1), kSeq / l.cp) << where;
      at::Tensor loss = mfsdp::tensor_parallel::vocab_parallel_lm_loss(logits, labels, *tp) / kMicro;
      loss.backward();
      local += loss.item<double>();
    }
    if (l.sum_partial) mfsdp::sum_partial_gradients(*model, root);
    got.grad_norms.push_back(opt->clip_grad_norm(kClip));
    opt->step(kLr);
    root.zero_grad();
    at::Tensor sum = at::full({1}, local / (dp * l.cp), at::kDouble);
    fsdp_mesh->get("dp_cp")->all_reduce(sum);
    got.losses.push_back(sum.item<double>());
  }

  if (l.sum_partial)
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(got.losses[s], want.losses[s], 1e-5 * want.losses[s]) << "loss of step " << s << where;
      EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], 1e-5 * want.grad_norms[s])
          << "grad norm of step " << s << where;
      EXPECT_GT(want.grad_norms[s], kClip) << "clipping must be active";
    }
  const auto full = mfsdp::gather_tensor_parallel(*model, root.full_state_dict(/*all_ranks=*/true));
  EXPECT_EQ(full.size(), want.params.size()) << where;
  double worst = 0;
  for (const auto& [name, value] : full) {
    if (!want.params.count(name)) {
      ADD_FAILURE() << "unexpected parameter " << name << where;
      continue;
    }
    const double err = relative(value, want.params.at(name));
    worst = std::max(worst, err);
    if (l.sum_partial) {
      EXPECT_LE(err, 1e-5) << name << where;
    }
  }
  return worst;
}

const std::vector<mfsdp::ShardingStrategy> kStrategies = {
    mfsdp::ShardingStrategy::kNoShard, mfsdp::ShardingStrategy::kOptim, mfsdp::ShardingStrategy::kOptimGrads,
    mfsdp::ShardingStrategy::kOptimGradsParams};

}  // namespace

MFSDP_DIST_TEST(TensorParallelModel, Tp2MatchesOneProcess, {2}) {
  for (bool sp : {false, true})
    for (bool tied : {false, true}) {
      Layout l;
      l.sp = sp;
      l.tied = tied;
      l.deferred = sp;
      train_and_compare(comm, l);
    }
  // Without the sum over TP ranks of the q/k-norm (and, with SP, every norm) gradients, the
  // weights drift far past the tolerance: the check above can fail.
  for (bool sp : {false, true}) {
    Layout broken;
    broken.sp = sp;
    broken.sum_partial = false;
    EXPECT_GT(train_and_compare(comm, broken), 1e-3) << describe(broken, comm.size());
  }
}

MFSDP_DIST_TEST(TensorParallelModel, Tp2TimesDp2EveryStrategyMatchesOneProcess, {4}) {
  for (auto s : kStrategies)
    for (bool sp : {false, true}) {
      Layout l;
      l.sp = sp;
      l.strategy = s;
      train_and_compare(comm, l);
    }
}

MFSDP_DIST_TEST(ContextParallelModel, Cp2MatchesOneProcessWithBothAlgorithms, {2}) {
  for (auto algorithm : {mfsdp::context_parallel::CpAlgorithm::kAllGather, mfsdp::context_parallel::CpAlgorithm::kRing})
    for (bool packed : {false, true}) {
      Layout l;
      l.tp = 1;
      l.cp = 2;
      l.algorithm = algorithm;
      l.packed = packed;
      train_and_compare(comm, l);
    }
}

MFSDP_DIST_TEST(ContextParallelModel, Cp2TimesDp2AndTp2TimesCp2MatchOneProcess, {4}) {
  for (auto s : kStrategies) {
    Layout l;
    l.tp = 1;
    l.cp = 2;
    l.strategy = s;
    train_and_compare(comm, l);
  }
  Layout both;
  both.cp = 2;
  both.sp = true;
  both.packed = true;
  both.algorithm = mfsdp::context_parallel::CpAlgorithm::kRing;
  train_and_compare(comm, both);
}

// Generation from a tensor-parallel model (each rank's logits are its vocabulary slice) samples
// the same tokens as one process: greedy, and sampled with the same seed on every rank.
MFSDP_DIST_TEST(TensorParallelModel, GeneratesTheTokensOfOneProcess, {2}) {
  auto world = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
  const mfsdp::ModelConfig config = llama_config(false);
  std::shared_ptr<mfsdp::CausalLM> whole = config.spec->build(config, build_options());
  mfsdp::ModelBuildOptions split = build_options();
  split.tensor_parallel = world;
  std::shared_ptr<mfsdp::CausalLM> sliced = config.spec->build(config, split);
  at::NoGradGuard no_grad;
  for (bool greedy : {true, false}) {
    mfsdp::GenerateOptions o;
    o.max_new_tokens = 6;
    o.greedy = greedy;
    o.seed = 5;
    const std::vector<int64_t> prompt = {3, 14, 15, 9, 2};
    EXPECT_EQ(mfsdp::generate(*sliced, prompt, o), mfsdp::generate(*whole, prompt, o)) << "greedy " << greedy;
  }
}

// Megatron's checks: a split dimension that does not divide by TP is refused, naming it.
TEST(TensorParallelModel, SizesThatDoNotDivideAreRefusedNamingTheField) {
  const mfsdp::ModelConfig config = llama_config(false);
  auto three = mfsdp::make_simulated_communicator(0, 3);
  try {
    mfsdp::ModelBuildOptions o = build_options();
    o.tensor_parallel = three;
    config.spec->build(config, o);
    ADD_FAILURE() << "TP 3 of 4 heads was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("num_attention_heads (4)"), std::string::npos) << e.what();
  }
}
