// Expert parallelism with FSDP on two meshes equals single-process training: a Qwen3-MoE-style
// model (q/k norms, 4 experts, top-2, balancing and z losses) trained 3 AdamW steps with 2
// micro-batches and active clipping gives the losses, gradient norms and weights of one process
// that computes every expert itself, for every sharding strategy, with the experts split over
// EP ranks and sharded over the expert-data-parallel ranks: world 2 (EP 2, EDP 1; EP 1, EDP 2)
// and world 4 (EP 2, EDP 2; EP 4, EDP 1, the layout whose gradients Megatron-FSDP doubled,
// MLM #6660).
#include <torch/torch.h>

#include "harness/dist_test.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/lm_loss.h"
#include "mfsdp/models/model_spec.h"
#include "mfsdp/models/moe.h"
#include "mfsdp/optim/optim.h"

namespace {

constexpr int kSteps = 3, kMicro = 2, kPerMicro = 2, kSeq = 8, kVocab = 64;
// AdamW's eps is 1e-3, not 1e-8 (as in parallel_llama_test.cpp): EP sums the experts' outputs and
// gradients in another order than one process, so a near-cancelling gradient element can flip sign
// by rounding, and with eps 1e-8 Adam turns that into a full step of lr either way (measured: an
// expert weight off by 1.2e-5 of its largest on AVX-512, 8.8e-6 on AVX2); eps 1e-3 keeps steps
// proportional to gradients (worst 1.5e-7), so weights compare at 1e-5 like the losses.
constexpr double kLr = 0.01, kWd = 0.1, kClip = 0.5, kEps = 1e-3;

mfsdp::ModelConfig moe_config() {
  return mfsdp::model_config_from_megatron({{"num_layers", 2},
                                            {"hidden_size", 32},
                                            {"num_attention_heads", 4},
                                            {"group_query_attention", true},
                                            {"num_query_groups", 2},
                                            {"padded_vocab_size", kVocab},
                                            {"swiglu", true},
                                            {"normalization", "RMSNorm"},
                                            {"seq_length", kSeq},
                                            {"init_method_std", 0.2},
                                            {"qk_layernorm", true},
                                            {"num_experts", 4},
                                            {"moe_router_topk", 2},
                                            {"moe_ffn_hidden_size", 16},
                                            {"untie_embeddings_and_output_weights", true}});
}

mfsdp::MoeConfig config_of(int64_t experts, int64_t top_k) {
  mfsdp::MoeConfig c;
  c.num_experts = experts;
  c.top_k = top_k;
  c.ffn_hidden_size = 4;
  return c;
}

mfsdp::ModelBuildOptions build_options(std::shared_ptr<mfsdp::Communicator> ep = nullptr) {
  mfsdp::ModelBuildOptions o;
  o.init_seed = 7;
  o.moe.aux_loss_coeff = 0.05;
  o.moe.z_loss_coeff = 0.01;
  o.expert_parallel = std::move(ep);
  return o;
}

// The token ids of (step, chunk): chunk c = rank x kMicro + micro-batch, kPerMicro sequences of
// kSeq + 1 tokens.
at::Tensor chunk_tokens(int step, int chunk) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + chunk);
  return at::randint(kVocab, {kPerMicro, kSeq + 1}, gen);
}

struct Trace {
  std::vector<double> losses, grad_norms;
  std::map<std::string, at::Tensor> params;
};

// One process, every expert, every chunk of the global batch in turn: each chunk's loss and its
// balancing losses weigh 1 / chunks, as the ranks' micro-batches do together.
Trace reference(int world) {
  const mfsdp::ModelConfig config = moe_config();
  std::shared_ptr<mfsdp::CausalLM> model = config.spec->build(config, build_options());
  std::vector<at::Tensor> decay, no_decay;
  for (auto& p : model->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(kLr).weight_decay(kWd).eps(kEps)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(kLr).weight_decay(0).eps(kEps)));
  torch::optim::AdamW opt(groups, torch::optim::AdamWOptions(kLr).eps(kEps));
  const int chunks = world * kMicro;
  model->set_aux_loss_scale(1.0 / chunks);
  Trace trace;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    double loss = 0;
    for (int c = 0; c < chunks; ++c) {
      const at::Tensor t = chunk_tokens(step, c);
      at::Tensor l = mfsdp::lm_loss(model->forward(t.narrow(1, 0, kSeq)), t.narrow(1, 1, kSeq)) / chunks;
      l.backward();
      loss += l.item<double>();
    }
    trace.grad_norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kClip));
    opt.step();
    trace.losses.push_back(loss);
  }
  for (const auto& item : model->named_parameters()) trace.params[item.key()] = item.value().detach().clone();
  return trace;
}

void check_expert_parallel(mfsdp::Communicator& comm, int ep, mfsdp::ShardingStrategy strategy) {
  const int world = comm.size(), rank = comm.rank();
  const std::string where = " (world " + std::to_string(world) + ", EP " + std::to_string(ep) + ", " +
                            mfsdp::to_string(strategy) + ")";
  auto world_comm = std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
  auto mesh = std::make_shared<mfsdp::DeviceMesh>(world_comm, std::vector<int>{world / ep, ep},
                                                  std::vector<std::string>{"edp", "ep"});
  const mfsdp::ModelConfig config = moe_config();
  std::shared_ptr<mfsdp::CausalLM> model = config.spec->build(config, build_options(mesh->get("ep")));
  mfsdp::FullyShardOptions options;
  options.comm = world_comm;
  options.strategy = strategy;
  mfsdp::FullyShardOptions experts = options;
  experts.comm = mesh->get("edp");
  mfsdp::FsdpHandle root = mfsdp::shard_model(*model, options, &experts);
  mfsdp::AdamWOptions adamw;
  adamw.weight_decay = kWd;
  adamw.eps = kEps;
  std::unique_ptr<mfsdp::DistributedOptimizer> opt = mfsdp::make_adamw(root, adamw);
  model->set_aux_loss_scale(1.0 / kMicro);  // the gradients' 1 / world does the rest

  Trace got;
  for (int step = 0; step < kSteps; ++step) {
    double local = 0;
    for (int m = 0; m < kMicro; ++m) {
      root.set_requires_gradient_sync(m == kMicro - 1);
      const at::Tensor t = chunk_tokens(step, rank * kMicro + m);
      at::Tensor l = mfsdp::lm_loss(model->call(t.narrow(1, 0, kSeq)), t.narrow(1, 1, kSeq)) / kMicro;
      l.backward();
      local += l.item<double>();
    }
    got.grad_norms.push_back(opt->clip_grad_norm(kClip));
    opt->step(kLr);
    root.zero_grad();
    at::Tensor sum = at::full({1}, local / world, at::kDouble);
    comm.all_reduce(sum);
    got.losses.push_back(sum.item<double>());
  }

  const Trace want = reference(world);
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], 1e-5 * want.losses[s]) << "loss of step " << s << where;
    EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], 1e-5 * want.grad_norms[s]) << "grad norm of step " << s << where;
    EXPECT_GT(want.grad_norms[s], kClip) << "clipping must be active";
  }
  // Dense parameters and this rank's experts, gathered over their own groups.
  const std::map<std::string, at::Tensor> full = root.full_state_dict(/*all_ranks=*/true);
  int experts_here = 0;
  for (const auto& [name, value] : full) {
    ASSERT_TRUE(want.params.count(name)) << "unexpected parameter " << name << where;
    const at::Tensor& ref = want.params.at(name);
    const double err = (value.to(at::kDouble) - ref.to(at::kDouble)).abs().max().item<double>();
    const double scale = ref.to(at::kDouble).abs().max().item<double>() + 1e-12;
    EXPECT_LE(err, 1e-5 * scale) << name << where;
    experts_here += name.find(".experts.") != std::string::npos;
  }
  // 2 layers x 4 / ep experts x 3 weights, and every dense parameter.
  EXPECT_EQ(experts_here, 2 * (4 / ep) * 3) << where;
  EXPECT_EQ(full.size() - experts_here, want.params.size() - 2 * 4 * 3) << where;
}

const std::vector<mfsdp::ShardingStrategy> kStrategies = {
    mfsdp::ShardingStrategy::kNoShard, mfsdp::ShardingStrategy::kOptim, mfsdp::ShardingStrategy::kOptimGrads,
    mfsdp::ShardingStrategy::kOptimGradsParams};

}  // namespace

MFSDP_DIST_TEST(MoeExpertParallel, EveryStrategyMatchesOneProcessAtWorld2, {2}) {
  for (int ep : {2, 1})
    for (auto s : kStrategies) check_expert_parallel(comm, ep, s);
}

MFSDP_DIST_TEST(MoeExpertParallel, EveryStrategyMatchesOneProcessAtWorld4, {4}) {
  for (int ep : {2, 4})
    for (auto s : kStrategies) check_expert_parallel(comm, ep, s);
}

// Context parallelism splits each sequence's tokens over the ranks: each rank's balancing and
// z-losses (over its rows, the counts summed over the group) average over the ranks to the
// losses of the whole sequences computed in one process (Megatron's losses over its tp_cp
// group), and so do their gradients; with and without padding, per batch and per sequence.
MFSDP_DIST_TEST(MoeContextParallel, EachRanksLossesAverageToTheWholeSequences, {2, 4}) {
  const int cp = comm.size(), rank = comm.rank();
  const int64_t batch = 3, length = 8 * cp, experts = 6, top_k = 2;
  at::manual_seed(11);  // every rank draws the same whole batch
  const at::Tensor logits = at::randn({batch, length, experts}, at::kDouble);
  at::Tensor valid = at::rand({batch, length}) > 0.3;
  // This rank's rows of every sequence (any split works; the chunks of a load-balanced split
  // are rows too).
  const at::Tensor mine = at::arange(rank * (length / cp), (rank + 1) * (length / cp));
  for (const bool padded : {false, true})
    for (int kind = 0; kind < 3; ++kind) {
      SCOPED_TRACE(std::string(padded ? "padded, " : "") + (kind == 0 ? "aux" : kind == 1 ? "seq_aux" : "z"));
      auto loss_of = [&](const at::Tensor& l, const at::Tensor& v, mfsdp::Communicator* group) {
        const mfsdp::Routing r = mfsdp::route(l.reshape({-1, experts}), config_of(experts, top_k), 0.0);
        const at::Tensor mask = padded ? v.reshape({-1}) : at::Tensor();
        if (kind == 0) return mfsdp::load_balancing_loss(r, top_k, mask, group);
        if (kind == 1) return mfsdp::sequence_load_balancing_loss(r, top_k, l.size(0), mask, group);
        return mfsdp::z_loss(r.logits, mask, group);
      };
      at::Tensor whole_logits = logits.clone().requires_grad_(true);
      const at::Tensor whole = loss_of(whole_logits, valid, nullptr);
      whole.backward();
      at::Tensor part_logits = logits.index_select(1, mine).clone().requires_grad_(true);
      at::Tensor part = loss_of(part_logits, valid.index_select(1, mine), &comm) / cp;  // the reduction's mean
      part.backward();
      at::Tensor sum = part.detach().clone();
      comm.all_reduce(sum);
      // The router computes in fp32: the sums of another split agree to its rounding.
      EXPECT_NEAR(sum.item<double>(), whole.item<double>(), 1e-6 * std::abs(whole.item<double>()));
      EXPECT_TRUE(at::allclose(part_logits.grad(), whole_logits.grad().index_select(1, mine), 1e-5, 1e-8))
          << (part_logits.grad() - whole_logits.grad().index_select(1, mine)).abs().max().item<double>() << " of "
          << whole_logits.grad().abs().max().item<double>();
    }
}
