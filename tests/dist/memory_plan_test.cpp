// The memory plan (include/mfsdp/fsdp/memory_plan.h; mfsdp-pretrain --memory-plan) against what runs.
// For every strategy, fp32 and bf16, untied and tied embeddings, one and two micro-batches per
// step: the planned per-rank bytes of every role equal FsdpHandle::memory() and the optimizer's
// state after two steps of mfsdp-pretrain's own TrainingRun, and the planned transient peak equals
// the measured one; on 1-4 real ranks (real processes) and as rank 0 of simulated 8- and 64-rank
// jobs; and for MoE models with the experts split over 1, 2 or 4 ranks. The comparison can fail:
// a plan with one unit too few or one layer too many does not match
// (MemoryPlan.CatchesAPlanOffByOneUnit).
#include <torch/torch.h>

#include <sstream>

#include "harness/dist_test.h"
#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/fsdp/memory_plan.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/train/model_memory_plan.h"
#include "mfsdp/train/training_run.h"

namespace {

using mfsdp::MemoryPlan;
using mfsdp::PretrainArgs;

struct Variant {
  std::string strategy;
  bool bf16 = false, tied = false;
  int64_t micro_batches = 1;
  int64_t expert_parallel = 0;  // 0: dense; else 4 experts split over this many ranks
  int64_t instances = 1;        // HSDP instances (--num-distributed-optimizer-instances)
  std::string outer = "no_shard";
  int64_t pipeline = 1;         // pipeline stages (--pipeline-model-parallel-size)
  std::string describe(int world) const {
    return strategy + (bf16 ? " bf16" : " fp32") + (tied ? " tied" : " untied") + ", " +
           std::to_string(micro_batches) + " micro-batch(es), " + std::to_string(world) + " ranks" +
           (expert_parallel ? ", MoE EP " + std::to_string(expert_parallel) : "") +
           (instances > 1 ? ", HSDP " + std::to_string(instances) + " instances, outer " + outer : "") +
           (pipeline > 1 ? ", PP " + std::to_string(pipeline) : "");
  }
};

std::vector<Variant> every_variant() {
  std::vector<Variant> out;
  for (const char* s : {"no_shard", "optim", "optim_grads", "optim_grads_params"})
    for (bool bf16 : {false, true})
      for (bool tied : {false, true})
        for (int64_t micro : {1, 2}) out.push_back({s, bf16, tied, micro});
  return out;
}

// MoE variants: every strategy, the experts split over 1 rank (inside their layer's unit) up to
// every rank (EP = world: expert groups of one rank), one and two micro-batches.
std::vector<Variant> moe_variants(int world) {
  std::vector<Variant> out;
  for (const char* s : {"no_shard", "optim", "optim_grads", "optim_grads_params"})
    for (int64_t ep = 1; ep <= world; ep *= 2)
      for (int64_t micro : {1, 2}) out.push_back({s, /*bf16=*/micro == 2, /*tied=*/false, micro, ep});
  return out;
}

// HSDP: every strategy inside 2 instances, and HFSDP (outer optim) in fp32 and bf16, one and two
// micro-batches.
std::vector<Variant> hybrid_variants() {
  std::vector<Variant> out;
  for (const char* s : {"no_shard", "optim", "optim_grads", "optim_grads_params"})
    out.push_back({s, false, false, 2, 0, 2, "no_shard"});
  for (bool bf16 : {false, true})
    for (int64_t micro : {1, 2}) out.push_back({"optim_grads_params", bf16, false, micro, 0, 2, "optim"});
  return out;
}

// HSDP with expert parallelism: the experts' own [instances, expert-data-parallel] mesh, every
// strategy inside, and HFSDP.
std::vector<Variant> hybrid_moe_variants() {
  std::vector<Variant> out;
  for (const char* s : {"no_shard", "optim", "optim_grads", "optim_grads_params"})
    out.push_back({s, false, false, 2, 2, 2, "no_shard"});
  for (bool bf16 : {false, true}) out.push_back({"optim_grads_params", bf16, false, 2, 2, 2, "optim"});
  return out;
}

// Pipeline parallelism: every strategy, tied (each end's embedding a unit) and untied, on 2
// stages; the stage of each rank planned on its own.
std::vector<Variant> pipeline_variants() {
  std::vector<Variant> out;
  for (const char* s : {"no_shard", "optim", "optim_grads", "optim_grads_params"})
    for (bool tied : {false, true}) out.push_back({s, /*bf16=*/tied, tied, 2, 0, 1, "no_shard", 2});
  return out;
}

// A small Llama whose sizes pad differently on 3, 8 and 64 ranks (vocab 64 x hidden 24).
PretrainArgs tiny_args(const Variant& v, int world) {
  PretrainArgs a;
  a.num_layers = 2;
  a.hidden_size = 24;
  a.num_attention_heads = 4;
  a.group_query_attention = true;
  a.num_query_groups = 2;
  a.swiglu = true;
  a.ffn_hidden_size = 40;
  a.seq_length = 8;
  a.vocab_size = 64;
  a.make_vocab_size_divisible_by = 64;
  a.micro_batch_size = 1;
  a.global_batch_size = v.micro_batches * world / v.pipeline;
  a.pipeline_model_parallel_size = v.pipeline;
  a.train_iters = 2;
  a.untie_embeddings_and_output_weights = !v.tied;
  a.data_parallel_sharding_strategy = v.strategy;
  a.bf16 = v.bf16;
  a.device = "cpu";
  a.num_distributed_optimizer_instances = v.instances;
  a.outer_dp_sharding_strategy = v.outer;
  if (v.expert_parallel > 0) {
    a.num_experts = 4;
    a.moe_router_topk = 2;
    a.moe_ffn_hidden_size = 16;
    a.expert_model_parallel_size = v.expert_parallel;
  }
  mfsdp::validate_training_args(a, world, 0);
  return a;
}

// The plan mfsdp-pretrain prints for these flags on `world` ranks.
MemoryPlan plan_of(const PretrainArgs& a, int world, int rank = 0) {
  const mfsdp::ParallelDims dims = mfsdp::parallel_dims(a, a, world);
  return mfsdp::plan_training_memory(mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size), a, dims,
                                     mfsdp::shard_options_from_args(a, a, a, a.calculate_per_token_loss),
                                     a.num_micro_batches, /*stage=*/rank / (world / dims.pp));
}

struct Measured {
  int64_t model_weights = 0, main_weights = 0, main_grads = 0, optimizer_state = 0, transient_peak = 0;
};

// Two training steps of the trainer's own run (the plan is of a step from the second on).
Measured measure(const PretrainArgs& a, const std::shared_ptr<mfsdp::Communicator>& comm) {
  std::ostringstream log;
  mfsdp::TrainingRun run(a, mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size), comm, log, /*per_token_loss=*/false);
  torch::manual_seed(comm->rank());
  for (int64_t it = 1; it <= a.train_iters && run.pipeline().forward; ++it)
    run.pipeline_step(it, a.num_micro_batches, [&](int chunk, int64_t, const at::Tensor& input) {
      at::Tensor tokens = torch::randint(0, a.vocab_size, {a.micro_batch_size, a.seq_length + 1});
      run.model()->select_pipeline_chunk(chunk);
      at::Tensor out = run.model()->call(input.defined() ? input : tokens.narrow(1, 0, a.seq_length));
      if (!run.model()->pipeline_chunk()->output) return mfsdp::ChunkOutput{out, {}, {}};
      at::Tensor loss = mfsdp::lm_loss(out, tokens.narrow(1, 1, a.seq_length)) / static_cast<double>(a.num_micro_batches);
      return mfsdp::ChunkOutput{{}, loss, loss.detach()};
    });
  for (int64_t it = 1; it <= a.train_iters && !run.pipeline().forward; ++it)
    run.step(it, a.num_micro_batches, [&](int64_t) {
      at::Tensor tokens = torch::randint(0, a.vocab_size, {a.micro_batch_size, a.seq_length + 1});
      at::Tensor logits = run.model()->call(tokens.narrow(1, 0, a.seq_length));
      at::Tensor loss = mfsdp::lm_loss(logits, tokens.narrow(1, 1, a.seq_length)) / static_cast<double>(a.num_micro_batches);
      loss.backward();
      return loss.detach();
    });
  const mfsdp::MemoryReport m = run.root().memory();
  Measured out{m.model_weights, m.main_weights, m.main_grads, 0, m.transient_peak};
  for (auto& [name, tensors] : run.optimizer().state())
    for (auto& t : tensors) out.optimizer_state += t.nbytes();
  return out;
}

// "" when the plan says what was measured, else the roles that differ.
std::string mismatch(const MemoryPlan& plan, const Measured& m) {
  std::ostringstream s;
  auto check = [&](const char* role, int64_t planned, int64_t measured) {
    if (planned != measured) s << role << ": planned " << planned << " B, measured " << measured << " B; ";
  };
  check("model weights", plan.model_weights, m.model_weights);
  check("main weights", plan.main_weights, m.main_weights);
  check("main grads", plan.main_grads, m.main_grads);
  check("optimizer state", plan.optimizer_state, m.optimizer_state);
  check("transient peak", plan.transient_peak, m.transient_peak);
  return s.str();
}

void expect_plan_matches(const std::shared_ptr<mfsdp::Communicator>& comm, const std::vector<Variant>& variants) {
  for (const Variant& v : variants) {
    const PretrainArgs a = tiny_args(v, comm->size());
    const MemoryPlan plan = plan_of(a, comm->size(), comm->rank());
    Measured measured = measure(a, comm);
    EXPECT_GT(measured.transient_peak, 0) << v.describe(comm->size());
    // Under pipeline parallelism the plan runs each micro-batch's forward and backward in turn,
    // not 1F1B's warm-up forwards first: its transient peak bounds the real one from above.
    if (v.pipeline > 1) {
      EXPECT_GE(plan.transient_peak, measured.transient_peak) << v.describe(comm->size());
      measured.transient_peak = plan.transient_peak;
    }
    EXPECT_EQ(mismatch(plan, measured), "") << v.describe(comm->size()) << "\n" << mfsdp::format_memory_plan(plan);
  }
}

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

}  // namespace

MFSDP_DIST_TEST(MemoryPlan, EqualsWhatRealRanksHold, {1, 2, 3, 4}) { expect_plan_matches(borrow(comm), every_variant()); }

// Each pipeline stage's plan against its ranks (2 stages; x DP 2 on 4 ranks): every persistent
// byte, and the transient peak from above.
MFSDP_DIST_TEST(MemoryPlan, EqualsWhatEachPipelineStageHolds, {2, 4}) {
  expect_plan_matches(borrow(comm), pipeline_variants());
}

// Under expert parallelism: the experts' units over their expert-data-parallel group, inside
// their layers, the rest over every rank.
MFSDP_DIST_TEST(MemoryPlan, EqualsWhatRealRanksHoldUnderExpertParallelism, {2, 4}) {
  expect_plan_matches(borrow(comm), moe_variants(comm.size()));
}

// Under hybrid sharding: 2 instances of 2 ranks (HSDP and HFSDP).
MFSDP_DIST_TEST(MemoryPlan, EqualsWhatRealRanksHoldUnderHybridSharding, {4}) {
  expect_plan_matches(borrow(comm), hybrid_variants());
}

MFSDP_DIST_TEST(MemoryPlan, EqualsWhatRealRanksHoldUnderHybridShardingWithExperts, {4}) {
  expect_plan_matches(borrow(comm), hybrid_moe_variants());
}

TEST(MemoryPlan, EqualsWhatASimulatedRankHolds) {
  for (int world : {8, 64}) expect_plan_matches(mfsdp::make_simulated_communicator(0, world), every_variant());
}

// The comparison above fails when the plan is off by one unit: one unit too few (lm_head's
// parameters planned in the root) or one decoder layer too many.
TEST(MemoryPlan, CatchesAPlanOffByOneUnit) {
  auto comm = mfsdp::make_simulated_communicator(0, 4);
  for (const char* strategy : {"optim", "optim_grads_params"}) {
    const PretrainArgs a = tiny_args({strategy}, comm->size());
    const Measured measured = measure(a, comm);
    ASSERT_EQ(mismatch(plan_of(a, comm->size()), measured), "") << strategy;

    mfsdp::ModelBuildOptions deferred;
    deferred.deferred_init = true;
    const mfsdp::ModelConfig config = mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size);
    std::shared_ptr<mfsdp::CausalLM> model = config.spec->build(config, deferred);
    mfsdp::StepShape one_unit_too_few = mfsdp::training_step_shape(*model, a, a.num_micro_batches);
    one_unit_too_few.forward_order.pop_back();  // lm_head
    const MemoryPlan too_few = mfsdp::plan_memory(
        *model, one_unit_too_few, mfsdp::shard_options_from_args(a, a, a, false), comm->size());
    EXPECT_NE(mismatch(too_few, measured), "") << strategy;

    PretrainArgs one_more_layer = a;
    ++one_more_layer.num_layers;
    EXPECT_NE(mismatch(plan_of(one_more_layer, comm->size()), measured), "") << strategy;
  }
}

// The table names every group and its sizes; the totals are the sums of its rows.
TEST(MemoryPlan, TableListsEveryGroupAndTheTotals) {
  const PretrainArgs a = tiny_args({"optim_grads_params", true, false, 1}, 64);
  const MemoryPlan plan = plan_of(a, 64);
  ASSERT_EQ(plan.groups.size(), 5u);  // root (final norm), embed_tokens, 2 layers, lm_head
  int64_t model = 0, main = 0, grads = 0, state = 0;
  for (const mfsdp::GroupMemory& g : plan.groups) {
    EXPECT_EQ(g.padded, g.shard * 64) << g.first_param;
    EXPECT_GE(g.padded, g.used) << g.first_param;
    model += g.model_weights;
    main += g.main_weights;
    grads += g.main_grads;
    state += g.optimizer_state;
  }
  EXPECT_EQ(model, plan.model_weights);
  EXPECT_EQ(main, plan.main_weights);
  EXPECT_EQ(grads, plan.main_grads);
  EXPECT_EQ(state, plan.optimizer_state);
  // vocab 64 x hidden 24 = 1536 elements on 64 ranks: 24 each, bf16 model weights, fp32 main
  // weights, grads and two AdamW states.
  const mfsdp::GroupMemory& embed = plan.groups[1];
  EXPECT_EQ(embed.first_param, "model.embed_tokens.weight");
  EXPECT_EQ(embed.shard, 24);
  EXPECT_EQ(embed.model_weights, 24 * 2);
  EXPECT_EQ(embed.main_weights, 24 * 4);
  EXPECT_EQ(embed.main_grads, 24 * 4);
  EXPECT_EQ(embed.optimizer_state, 2 * 24 * 4);
  EXPECT_EQ(embed.gathered_weights, 1536 * 2);
  const std::string table = mfsdp::format_memory_plan(plan);
  for (const char* text : {"(root)             model.norm.weight", "model.embed_tokens weight",
                           "model.layers.1     self_attn.q_proj.weight", "lm_head            weight", "transient peak",
                           "optim_grads_params"})
    EXPECT_NE(table.find(text), std::string::npos) << text << "\n" << table;
}
