// ParallelPlan (include/mfsdp/models/parallel_plan.h): its rules, and the Llama family's plan
// applied to a model (tensor parallelism, with MLA too, and expert parallelism), checked
// parameter by parameter against Megatron's layout written out here
// (ColumnParallelLinear: rows, RowParallelLinear: input columns, VocabParallelEmbedding: rows,
// the rest whole) and against the one-rank model's values (a slice starts from them).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "harness/expect_error.h"
#include "harness/tiny_llama.h"
#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/models/mla_attention.h"

namespace {

using mfsdp::ParallelPlan;
using mfsdp::TensorParallelBoundary;
using mfsdp::TensorParallelism;
using mfsdp::TensorParallelSplit;
using mfsdp::testing::error_of;

TEST(ParallelPlan, FirstMatchingRuleDecidesAndExpertsSplitOnlyWhenAsked) {
  ParallelPlan plan;
  plan.experts = {{"*.experts.*.up.*", TensorParallelSplit::kRows}, {"*.experts.*", TensorParallelSplit::kColumns}};
  plan.tensor_parallel = {{"a.up.weight", TensorParallelSplit::kColumns}, {"*.up.*", TensorParallelSplit::kRows}};
  plan.partial_gradients = {"*.q_norm.weight"};
  plan.sequence_partial_gradients = {"*norm.weight"};
  plan.boundaries = {{"a", TensorParallelBoundary::kRegion}, {"*", TensorParallelBoundary::kInput}};
  const TensorParallelism none;
  TensorParallelism tp{mfsdp::make_simulated_communicator(1, 2), /*sequence=*/false, /*experts_split=*/false};
  EXPECT_EQ(plan.split("b.up.weight", none), TensorParallelSplit::kReplicated);
  EXPECT_EQ(plan.split("a.up.weight", tp), TensorParallelSplit::kColumns);
  EXPECT_EQ(plan.split("b.up.bias", tp), TensorParallelSplit::kRows);
  EXPECT_EQ(plan.split("b.down.weight", tp), TensorParallelSplit::kReplicated);
  EXPECT_EQ(plan.split("m.experts.3.up.weight", tp), TensorParallelSplit::kReplicated);
  EXPECT_TRUE(plan.is_expert("m.experts.3.up.weight"));
  EXPECT_FALSE(plan.is_expert("m.shared_experts.up.weight"));
  EXPECT_TRUE(plan.partial_gradient("l.q_norm.weight", tp));
  EXPECT_FALSE(plan.partial_gradient("l.input_layernorm.weight", tp));
  EXPECT_FALSE(plan.partial_gradient("l.q_norm.weight", none));
  tp.sequence = true;
  tp.experts_split = true;
  EXPECT_TRUE(plan.partial_gradient("l.input_layernorm.weight", tp));
  EXPECT_EQ(plan.split("m.experts.3.up.weight", tp), TensorParallelSplit::kRows);
  EXPECT_EQ(plan.split("m.experts.3.down.weight", tp), TensorParallelSplit::kColumns);
  EXPECT_EQ(plan.boundary("a"), TensorParallelBoundary::kRegion);
  EXPECT_EQ(plan.boundary("a.b"), TensorParallelBoundary::kInput);  // '*' spans dots
  EXPECT_EQ(plan.boundary(""), TensorParallelBoundary::kInput);
  plan.boundaries.clear();
  EXPECT_FALSE(plan.boundary("a").has_value());
}

// A Qwen3-MoE-like model with a dense first layer, a shared expert, q/k norms and an untied
// output layer: every kind of parameter the plan names.
mfsdp::LlamaConfig moe_config() {
  mfsdp::LlamaConfig c = mfsdp::testing::tiny_llama_config();
  c.qk_norm = true;
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.ffn_hidden_size = 16;
  c.moe.shared_expert_intermediate_size = 24;
  c.moe.shared_expert_gate = true;
  c.moe.moe_layers = {false, true};
  return c;
}

// Megatron's layout by the parameter's leaf names: (dim it is split along, -1 whole).
int megatron_split_dim(const std::string& name, bool experts_split) {
  auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  const bool expert = has(".experts.");
  if (expert && !experts_split) return -1;
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return 0;  // vocabulary rows
  if (has("q_proj") || has("k_proj") || has("v_proj") || has("gate_proj") || has("up_proj")) return 0;  // column-parallel
  if (has("o_proj") || has("down_proj")) return 1;  // row-parallel
  return -1;  // norms, router, shared-expert gate
}

TEST(ParallelPlan, LlamaPlanCutsMegatronsSlicesOfTheOneRankModel) {
  for (const bool experts_split : {false, true}) {
    SCOPED_TRACE(experts_split ? "expert tensor parallel" : "experts whole");
    mfsdp::LlamaOptions whole_options;
    whole_options.init_seed = 7;
    mfsdp::LlamaForCausalLM whole(moe_config(), whole_options);
    std::map<std::string, at::Tensor> full;
    for (const auto& item : whole->named_parameters()) full[item.key()] = item.value();

    mfsdp::LlamaOptions options;
    options.init_seed = 7;
    options.tensor_parallel = mfsdp::make_simulated_communicator(1, 2);
    options.sequence_parallel = true;
    if (experts_split) options.expert_tensor_parallel = options.tensor_parallel;
    mfsdp::LlamaForCausalLM tp(moe_config(), options);
    int split = 0;
    for (const auto& item : tp->named_parameters()) {
      const std::string& name = item.key();
      ASSERT_TRUE(full.count(name)) << name;
      const int dim = megatron_split_dim(name, experts_split);
      at::Tensor expected = full[name];
      if (dim >= 0) {
        expected = expected.narrow(dim, expected.size(dim) / 2, expected.size(dim) / 2);  // rank 1 of 2
        ++split;
      }
      EXPECT_TRUE(item.value().equal(expected)) << name << ": " << item.value().sizes() << " vs " << expected.sizes();
      EXPECT_EQ(tp->tensor_parallel_split(name) == TensorParallelSplit::kReplicated, dim < 0) << name;
      EXPECT_EQ(tp->expert_parameter(name), name.find(".experts.") != std::string::npos) << name;
      // Under sequence parallelism every replicated weight reading this rank's positions.
      const bool partial = name.find("norm.weight") != std::string::npos ||
                           name.find(".gate.weight") != std::string::npos ||
                           name.find("shared_expert_gate.weight") != std::string::npos;
      EXPECT_EQ(tp->tensor_parallel_partial_grad(name), partial) << name;
    }
    // embed, lm_head, 2 x (q, k, v, o), dense gate/up/down, shared gate/up/down, experts' 4 x 3.
    EXPECT_EQ(split, 2 + 8 + 3 + 3 + (experts_split ? 12 : 0));
  }
}

// Multi-head latent attention (DeepSeek-V3) under TP 2, against Megatron's MLA layout written out
// here: the query's and the latent's up-projections column-parallel (each rank its heads), o_proj
// row-parallel, the down-projections and their norms whole with partial gradients.
TEST(ParallelPlan, LlamaPlanSplitsLatentAttentionByHeads) {
  mfsdp::LlamaConfig c = mfsdp::testing::tiny_llama_config();
  c.num_key_value_heads = 4;  // unused by MLA
  mfsdp::MlaConfig mla;
  mla.hidden_size = c.hidden_size;
  mla.num_heads = c.num_attention_heads;
  mla.q_lora_rank = 8;
  mla.kv_lora_rank = 6;
  mla.qk_nope_head_dim = 4;
  mla.qk_rope_head_dim = 2;
  mla.v_head_dim = 3;
  mla.attention_bias = true;
  mla.rope_theta = c.rope_theta;
  c.mla = mla;
  mfsdp::LlamaOptions whole_options;
  whole_options.init_seed = 5;
  mfsdp::LlamaForCausalLM whole(c, whole_options);
  std::map<std::string, at::Tensor> full;
  for (const auto& item : whole->named_parameters()) full[item.key()] = item.value();
  mfsdp::LlamaOptions options = whole_options;
  options.tensor_parallel = mfsdp::make_simulated_communicator(0, 2);
  mfsdp::LlamaForCausalLM tp(c, options);
  const std::map<std::string, int> attention_dim = {{"q_a_proj.weight", -1},      {"q_a_proj.bias", -1},
                                                    {"q_a_layernorm.weight", -1}, {"q_b_proj.weight", 0},
                                                    {"kv_a_proj_with_mqa.weight", -1}, {"kv_a_proj_with_mqa.bias", -1},
                                                    {"kv_a_layernorm.weight", -1}, {"kv_b_proj.weight", 0},
                                                    {"o_proj.weight", 1},          {"o_proj.bias", -1}};
  int seen = 0;
  for (const auto& item : tp->named_parameters()) {
    const std::string& name = item.key();
    const std::string prefix = "model.layers.0.self_attn.";
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string leaf = name.substr(prefix.size());
    ASSERT_TRUE(attention_dim.count(leaf)) << name;
    const int dim = attention_dim.at(leaf);
    at::Tensor expected = full.at(name);
    if (dim >= 0) expected = expected.narrow(dim, 0, expected.size(dim) / 2);  // rank 0 of 2
    EXPECT_TRUE(item.value().equal(expected)) << name << ": " << item.value().sizes() << " vs " << expected.sizes();
    // Only this rank's heads read the latents; o_proj's bias is added after the region.
    EXPECT_EQ(tp->tensor_parallel_partial_grad(name), dim < 0 && leaf != "o_proj.bias") << name;
    ++seen;
  }
  EXPECT_EQ(seen, 10);
  // Every head count is half the model's: q_b [2 x (4 + 2), 8], kv_b [2 x (4 + 3), 6].
  EXPECT_EQ(tp->model->layer(1).mla_attn->q_b_proj->weight.size(0), 12);
  EXPECT_EQ(tp->model->layer(1).mla_attn->kv_b_proj->weight.size(0), 14);
}

// Expert parallelism: each MoE block, built with every expert, keeps its rank's, under their
// global names and with the one-rank model's values; the dense layer is untouched.
TEST(ParallelPlan, LlamaPlanKeepsEachRanksExperts) {
  mfsdp::LlamaOptions whole_options;
  whole_options.init_seed = 9;
  mfsdp::LlamaForCausalLM whole(moe_config(), whole_options);
  std::map<std::string, at::Tensor> full;
  for (const auto& item : whole->named_parameters()) full[item.key()] = item.value();
  mfsdp::LlamaOptions options = whole_options;
  options.expert_parallel = mfsdp::make_simulated_communicator(1, 2);
  mfsdp::LlamaForCausalLM ep(moe_config(), options);
  std::map<std::string, int> experts;
  for (const auto& item : ep->named_parameters()) {
    ASSERT_TRUE(full.count(item.key())) << item.key();
    EXPECT_TRUE(item.value().equal(full[item.key()])) << item.key();
    if (item.key().find(".experts.") != std::string::npos)
      ++experts[item.key().substr(0, item.key().find('.', item.key().find(".experts.") + 9))];
  }
  const std::map<std::string, int> want = {{"model.layers.1.mlp.experts.2", 3}, {"model.layers.1.mlp.experts.3", 3}};
  EXPECT_EQ(experts, want);
  EXPECT_EQ(ep->model->layer(1).moe->experts->first(), 2);
  EXPECT_EQ(ep->model->layer(1).moe->experts->count(), 2);
  EXPECT_EQ(ep->named_parameters().size(), full.size() - 6);

  mfsdp::LlamaOptions three = whole_options;
  three.expert_parallel = mfsdp::make_simulated_communicator(0, 3);
  EXPECT_NE(error_of([&] { mfsdp::LlamaForCausalLM m(moe_config(), three); })
                .find("3 expert-parallel ranks do not divide 4 experts"),
            std::string::npos);
}

TEST(ParallelPlan, ApplyNamesWhatItCannotCut) {
  const auto tp2 = mfsdp::make_simulated_communicator(0, 2);
  mfsdp::LlamaConfig odd = moe_config();
  odd.moe.shared_expert_intermediate_size = 25;
  mfsdp::LlamaOptions options;
  options.tensor_parallel = tp2;
  options.sequence_parallel = true;
  EXPECT_NE(error_of([&] { mfsdp::LlamaForCausalLM m(odd, options); }).find("shared_expert_intermediate_size (25)"),
            std::string::npos);

  // A module the plan gives a boundary must have one; a parameter it cuts must not have values yet.
  torch::nn::Module root;
  auto child = root.register_module("child", std::make_shared<torch::nn::Module>());
  child->register_parameter("weight", at::zeros({4, 4}));
  ParallelPlan plan;
  plan.boundaries = {{"child", TensorParallelBoundary::kRegion}};
  const TensorParallelism tp{tp2, false, false};
  EXPECT_NE(error_of([&] { mfsdp::apply_tensor_parallel(root, plan, tp); })
                .find("the plan gives module 'child' (torch::nn::Module) a boundary, and it has none"),
            std::string::npos);
  plan.boundaries.clear();
  plan.tensor_parallel = {{"child.weight", TensorParallelSplit::kRows}};
  EXPECT_NE(error_of([&] { mfsdp::apply_tensor_parallel(root, plan, tp); }).find("'child.weight' already has its values"),
            std::string::npos);

  // Context and expert parallelism reach only modules that can take them.
  plan.context_parallel = {"child"};
  EXPECT_NE(error_of([&] { mfsdp::apply_context_parallel(root, plan, {tp2}); })
                .find("the plan makes module 'child' (torch::nn::Module) context-parallel, and it cannot be"),
            std::string::npos);
  plan.expert_parallel = {"child"};
  mfsdp::ExpertParallelism groups;
  groups.expert = tp2;
  EXPECT_NE(error_of([&] { mfsdp::apply_expert_parallel(root, plan, groups); })
                .find("the plan makes module 'child' (torch::nn::Module) expert-parallel, and it is not an MoE block"),
            std::string::npos);
}

}  // namespace
