// DeepSeek-V3's config.json (model_type "deepseek_v3") read into a LlamaConfig with multi-head
// latent attention, YaRN and DeepSeek's MoE, written back, and refused field by field where mfsdp
// does not build it. The logits against transformers are tests/reference/hf_reference_test.cpp's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "harness/expect_error.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/models/model_spec.h"

namespace {

using json = nlohmann::json;
using mfsdp::testing::error_of;

// What transformers 5's save_pretrained writes for a small DeepseekV3Config (the reference
// test's model), trimmed of token ids.
json deepseek_config() {
  return json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": false,
    "attention_dropout": 0.0, "dtype": "float32", "first_k_dense_replace": 1, "head_dim": 8,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.25, "intermediate_size": 176,
    "kv_lora_rank": 16, "max_position_embeddings": 128, "moe_intermediate_size": 24, "n_group": 4,
    "n_routed_experts": 8, "n_shared_experts": 2, "norm_topk_prob": true, "num_attention_heads": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 4, "num_nextn_predict_layers": 0,
    "pretraining_tp": 1, "q_lora_rank": 32, "qk_head_dim": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-05, "rope_interleave": true,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 32, "rope_theta": 10000.0, "rope_type": "yarn"},
    "routed_scaling_factor": 2.5, "tie_word_embeddings": false, "topk_group": 2, "use_cache": true,
    "v_head_dim": 16, "vocab_size": 300})");
}

TEST(DeepseekV3Config, TheHfConfigGivesMlaYarnAndDeepseekMoe) {
  const mfsdp::LlamaConfig c = mfsdp::llama_config_from_hf(deepseek_config());
  ASSERT_TRUE(c.mla.has_value());
  EXPECT_EQ(c.mla->q_lora_rank, 32);
  EXPECT_EQ(c.mla->kv_lora_rank, 16);
  EXPECT_EQ(c.mla->qk_nope_head_dim, 16);
  EXPECT_EQ(c.mla->qk_rope_head_dim, 8);
  EXPECT_EQ(c.mla->v_head_dim, 16);
  EXPECT_TRUE(c.mla->rope_interleave);
  ASSERT_TRUE(c.mla->yarn.has_value());
  EXPECT_EQ(c.mla->yarn->factor, 4.0);
  EXPECT_EQ(c.mla->yarn->original_max_position_embeddings, 32);
  EXPECT_EQ(c.mla->yarn->mscale_all_dim, 1.0);
  EXPECT_EQ(c.moe.num_experts, 8);
  EXPECT_EQ(c.moe.top_k, 2);
  EXPECT_EQ(c.moe.ffn_hidden_size, 24);
  EXPECT_EQ(c.moe.shared_expert_intermediate_size, 48);  // n_shared_experts x moe_intermediate_size
  EXPECT_TRUE(c.moe.shared_experts_name);
  EXPECT_FALSE(c.moe.shared_expert_gate);
  EXPECT_EQ(c.moe.score, mfsdp::MoeConfig::Score::kSigmoid);
  EXPECT_TRUE(c.moe.expert_bias);
  EXPECT_EQ(c.moe.n_group, 4);
  EXPECT_EQ(c.moe.topk_group, 2);
  EXPECT_EQ(c.moe.topk_scaling_factor, 2.5);
  EXPECT_EQ(c.moe.moe_layers, (std::vector<bool>{false, true, true, true}));  // first_k_dense_replace 1
  EXPECT_EQ(mfsdp::hf_model_type(c), "deepseek_v3");
  EXPECT_EQ(mfsdp::hf_refusal(c), "");

  // Written and read back: the same model, and the spec's ModelConfig is stable.
  const json written = mfsdp::llama_hf_config(c, at::kFloat);
  EXPECT_EQ(written["architectures"], json::array({"DeepseekV3ForCausalLM"}));
  EXPECT_EQ(written["n_shared_experts"], 2);
  EXPECT_EQ(written["first_k_dense_replace"], 1);
  EXPECT_EQ(written["rope_parameters"]["rope_type"], "yarn");
  const mfsdp::ModelConfig config = mfsdp::model_config_from_hf(deepseek_config());
  EXPECT_EQ(config.spec->name(), "deepseek_v3");
  EXPECT_EQ(mfsdp::model_config_from_hf(config.hf).hf, config.hf);

  json plain = deepseek_config();
  plain["q_lora_rank"] = nullptr;
  plain["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  const mfsdp::LlamaConfig p = mfsdp::llama_config_from_hf(plain);
  EXPECT_EQ(p.mla->q_lora_rank, 0);
  EXPECT_FALSE(p.mla->yarn.has_value());
  EXPECT_EQ(p.mla->rope_theta, 500000.0);
  EXPECT_EQ(mfsdp::llama_config_from_hf(mfsdp::llama_hf_config(p, at::kFloat)).mla->q_lora_rank, 0);

  // The released config.json's spelling: rope_scaling with "type", rope_theta at the top.
  json released = deepseek_config();
  released.erase("rope_parameters");
  released["rope_theta"] = 10000.0;
  released["rope_scaling"] = {{"type", "yarn"}, {"factor", 40}, {"original_max_position_embeddings", 4096},
                              {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  released["scoring_func"] = "sigmoid";
  released["topk_method"] = "noaux_tc";
  released["moe_layer_freq"] = 1;
  released["num_nextn_predict_layers"] = 1;
  EXPECT_EQ(mfsdp::llama_config_from_hf(released).mla->yarn->factor, 40.0);
}

TEST(DeepseekV3Config, WhatIsNotBuiltIsRefusedNamingTheField) {
  struct Case {
    json patch;
    std::string expected;
  } cases[] = {
      {{{"quantization_config", {{"quant_method", "fp8"}}}}, "field 'quantization_config': quantized weights"},
      {{{"scoring_func", "softmax"}}, "field 'scoring_func'"},
      {{{"topk_method", "greedy"}}, "field 'topk_method'"},
      {{{"moe_layer_freq", 2}}, "field 'moe_layer_freq'"},
      {{{"attention_bias", true}}, "field 'attention_bias'"},
      {{{"rope_parameters", {{"rope_type", "linear"}, {"factor", 2.0}}}}, "field 'rope_parameters.rope_type'"},
      {{{"rope_parameters", {{"rope_type", "yarn"}, {"factor", 4.0}}}}, "field 'original_max_position_embeddings': missing"},
      {{{"n_group", 3}}, "field 'n_group': 3 does not divide n_routed_experts 8"},
      {{{"topk_group", 5}}, "field 'topk_group'"},
      {{{"num_experts_per_tok", 9}}, "field 'num_experts_per_tok'"},
      {{{"kv_lora_rank", 0}}, "field 'kv_lora_rank'"},
      {{{"qk_rope_head_dim", 7}}, "field 'qk_rope_head_dim'"},
      {{{"first_k_dense_replace", -1}}, "field 'first_k_dense_replace'"},
      {{{"architectures", {"LlamaForCausalLM"}}}, "field 'architectures'"},
  };
  for (const Case& c : cases) {
    json bad = deepseek_config();
    for (const auto& [key, value] : c.patch.items()) bad[key] = value;
    const std::string error = error_of([&] { mfsdp::llama_config_from_hf(bad); });
    EXPECT_NE(error.find(c.expected), std::string::npos) << c.patch.dump() << ": " << error;
  }
  // MTP layers' tensors (past num_hidden_layers) are named, not loaded.
  const mfsdp::LlamaConfig cfg = mfsdp::llama_config_from_hf(deepseek_config());
  const std::string error = error_of([&] {
    mfsdp::refuse_hf_mtp_tensors(cfg, {"model.layers.3.mlp.gate.weight", "model.layers.4.eh_proj.weight"}, "folder");
  });
  EXPECT_NE(error.find("folder has tensors of layers past num_hidden_layers 4"), std::string::npos) << error;
  EXPECT_NE(error.find("'model.layers.4.eh_proj.weight'"), std::string::npos) << error;
  EXPECT_EQ(error.find("layers.3"), std::string::npos) << error;
}

// The decoder with MLA: transformers' names, MlaAttention under "self_attn", DeepSeek's MoE
// names; generating with the KV cache gives the logits of the whole sequence at once.
TEST(DeepseekV3Config, TheModelHasTransformersNamesAndItsCacheAgrees) {
  const mfsdp::LlamaConfig cfg = mfsdp::llama_config_from_hf(deepseek_config());
  torch::manual_seed(5);
  mfsdp::LlamaForCausalLM model(cfg);
  std::vector<std::string> names;
  for (const auto& p : model->named_parameters()) names.push_back(p.key());
  for (const auto& b : model->named_buffers()) names.push_back(b.key());
  for (const char* want :
       {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias", "lm_head.weight"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  std::vector<int64_t> shape;
  for (const auto& [name, s] : mfsdp::model_tensor_shapes(mfsdp::llama_model_config(cfg)))
    if (name == "model.layers.1.mlp.shared_experts.down_proj.weight") shape = s;
  EXPECT_EQ(shape, (std::vector<int64_t>{64, 48}));

  torch::NoGradGuard no_grad;
  const at::Tensor ids = torch::randint(0, 300, {2, 40});  // past original_max_position_embeddings 32
  const at::Tensor whole = model->forward(ids);
  mfsdp::KVCache cache(cfg.num_layers);
  const at::Tensor first = model->forward(ids.narrow(1, 0, 25), &cache);
  const at::Tensor rest = model->forward(ids.narrow(1, 25, 15), &cache);
  EXPECT_TRUE(torch::allclose(at::cat({first, rest}, 1), whole, 1e-5, 1e-5));
}

// Megatron's MLA and group-routing arguments (as mfsdp-pretrain records them) build the same
// architecture: the deepseek_v3 family, YaRN over max_position_embeddings, DeepSeek's MoE names.
TEST(DeepseekV3Config, MegatronMlaArgumentsGiveTheDeepseekFamily) {
  json args = {{"num_layers", 3},          {"hidden_size", 64},          {"num_attention_heads", 4},
               {"padded_vocab_size", 128}, {"swiglu", true},             {"normalization", "RMSNorm"},
               {"position_embedding_type", "rope"}, {"add_bias_linear", false}, {"seq_length", 64},
               {"max_position_embeddings", 64}, {"multi_latent_attention", true}, {"q_lora_rank", nullptr},
               {"kv_lora_rank", 16},      {"qk_head_dim", 16},          {"qk_pos_emb_head_dim", 8},
               {"v_head_dim", 16},        {"rotary_scaling_factor", 4.0}, {"mscale", 1.0},
               {"mscale_all_dim", 1.0},   {"num_experts", 4},           {"moe_router_topk", 2},
               {"moe_ffn_hidden_size", 32}, {"moe_shared_expert_intermediate_size", 64},
               {"moe_router_score_function", "sigmoid"}, {"moe_router_enable_expert_bias", true},
               {"moe_router_num_groups", 2}, {"moe_router_group_topk", 1}, {"moe_layer_freq", {0, 1, 1}}};
  const mfsdp::ModelConfig config = mfsdp::model_config_from_megatron(args);
  EXPECT_EQ(config.spec->name(), "deepseek_v3");
  EXPECT_EQ(config.spec->hf_export_refusal(config), "");
  EXPECT_EQ(mfsdp::model_config_from_hf(config.hf).hf, config.hf);
  const mfsdp::LlamaConfig c = mfsdp::llama_config_of(config);
  ASSERT_TRUE(c.mla.has_value());
  EXPECT_EQ(c.mla->q_lora_rank, 0);
  EXPECT_EQ(c.mla->qk_nope_head_dim, 16);
  ASSERT_TRUE(c.mla->yarn.has_value());
  EXPECT_EQ(c.mla->yarn->original_max_position_embeddings, 64);
  EXPECT_EQ(c.moe.n_group, 2);
  EXPECT_EQ(c.moe.topk_group, 1);
  EXPECT_TRUE(c.moe.shared_experts_name);
  EXPECT_EQ(c.moe.shared_expert_intermediate_size, 64);
  EXPECT_EQ(config.hf["first_k_dense_replace"], 1);
  EXPECT_EQ(config.hf["n_shared_experts"], 2);
  // Tensor parallelism splits MLA's heads, not its (unused) key/value heads.
  const auto tp_splits = config.spec->parallel_splits(config).tensor_parallel;
  EXPECT_TRUE(std::any_of(tp_splits.begin(), tp_splits.end(), [](const auto& f) { return f.first == "num_attention_heads"; }));
  EXPECT_FALSE(std::any_of(tp_splits.begin(), tp_splits.end(), [](const auto& f) { return f.first == "num_key_value_heads"; }));

  // Without experts, a dense model of MLA layers (the arguments leave the router at its softmax
  // default, which a dense model never uses).
  json dense = args;
  for (const char* key : {"num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                          "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                          "moe_router_group_topk", "moe_layer_freq"})
    dense.erase(key);
  dense["ffn_hidden_size"] = 128;
  const mfsdp::ModelConfig dense_config = mfsdp::model_config_from_megatron(dense);
  EXPECT_EQ(dense_config.spec->name(), "deepseek_v3");
  EXPECT_EQ(mfsdp::llama_config_of(dense_config).moe.num_experts, 0);
  EXPECT_EQ(mfsdp::model_config_from_hf(dense_config.hf).hf, dense_config.hf);

  json softmax = args;
  softmax["moe_router_score_function"] = "softmax";
  softmax["moe_router_enable_expert_bias"] = false;
  EXPECT_NE(error_of([&] { mfsdp::model_config_from_megatron(softmax); }).find("moe_router_score_function"),
            std::string::npos);
  json groups = args;
  groups["moe_router_num_groups"] = 3;
  EXPECT_NE(error_of([&] { mfsdp::model_config_from_megatron(groups); }).find("moe_router_num_groups"),
            std::string::npos);
}

}  // namespace
