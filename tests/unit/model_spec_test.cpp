// The model-family registry and the Llama family's ModelSpec (include/mfsdp/models/model_spec.h).
// Expected values are worked by hand from Megatron-LM's rules (arguments.py for the default MLP
// width, its fused linear_qkv layout, training.py's num_floating_point_operations) and from
// transformers' config.json field names; the model built through the spec is checked against a
// plain eager LlamaForCausalLM.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "checkpoint/megatron_gpt_names.h"
#include "harness/expect_error.h"
#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/models/model_spec.h"

namespace {

using json = nlohmann::json;

// Megatron's argparse names of a small GPT as Llama builds it.
json megatron_args() {
  return {{"num_layers", 2},          {"hidden_size", 64},         {"num_attention_heads", 4},
          {"group_query_attention", true}, {"num_query_groups", 2},  {"padded_vocab_size", 128},
          {"swiglu", true},           {"normalization", "RMSNorm"}, {"position_embedding_type", "rope"},
          {"add_bias_linear", false}, {"seq_length", 16},          {"max_position_embeddings", 32},
          {"norm_epsilon", 1e-6},     {"rotary_base", 500000.0},   {"init_method_std", 0.01},
          {"untie_embeddings_and_output_weights", true}};
}

std::string error_of(const std::function<void()>& f) { return mfsdp::testing::error_of(f); }

}  // namespace

TEST(ModelSpec, TheRegistryFindsTheFamilyByNameModelTypeAndMegatronArgs) {
  const mfsdp::ModelSpec& llama = mfsdp::model_spec("llama");
  EXPECT_EQ(llama.name(), "llama");
  for (const char* type : {"llama", "mistral", "qwen2"})
    EXPECT_EQ(&mfsdp::model_spec_for_hf({{"model_type", type}}), &llama) << type;
  EXPECT_EQ(&mfsdp::model_spec_for_megatron(megatron_args()), &llama);

  EXPECT_NE(error_of([] { mfsdp::model_spec("gpt-neox"); }).find("no model family 'gpt-neox' (known: llama"),
            std::string::npos);
  EXPECT_EQ(error_of([] { mfsdp::model_spec_for_hf({{"model_type", "gpt_neox"}}); }),
            "HF config.json field 'model_type': 'gpt_neox' is not supported (llama, mistral, qwen2, qwen3, "
            "qwen3_moe, mixtral, qwen2_moe, deepseek_v3)");
  EXPECT_EQ(error_of([] { mfsdp::model_spec_for_hf({{"vocab_size", 3}}); }),
            "HF config.json field 'model_type': missing");
}

TEST(ModelSpec, MegatronArgsGiveTheModelMegatronBuilds) {
  json args = megatron_args();
  args.erase("untie_embeddings_and_output_weights");  // Megatron's default: tied
  const mfsdp::ModelConfig config = mfsdp::model_config_from_megatron(args);
  const json& hf = config.hf;
  EXPECT_EQ(hf["architectures"], json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(hf["num_hidden_layers"], 2);
  EXPECT_EQ(hf["hidden_size"], 64);
  EXPECT_EQ(hf["intermediate_size"], 128);  // int(4 x 64 x 2/3 / 64) x 64
  EXPECT_EQ(hf["num_attention_heads"], 4);
  EXPECT_EQ(hf["num_key_value_heads"], 2);
  EXPECT_EQ(hf["vocab_size"], 128);
  EXPECT_EQ(hf["max_position_embeddings"], 32);
  EXPECT_EQ(hf["rope_theta"], 500000.0);
  EXPECT_EQ(hf["rms_norm_eps"], 1e-6);
  EXPECT_EQ(hf["initializer_range"], 0.01);
  EXPECT_EQ(hf["tie_word_embeddings"], true);
  EXPECT_EQ(hf["hidden_act"], "silu");
  EXPECT_EQ(config.vocab_size(), 128);
  EXPECT_EQ(config.num_layers(), 2);
  // RoPE positions cover --seq-length when --max-position-embeddings is smaller.
  args["seq_length"] = 64;
  EXPECT_EQ(mfsdp::model_config_from_megatron(args).max_position_embeddings(), 64);
  args["seq_length"] = 16;

  // Without --swiglu: Megatron's GeLU MLP, 4 x hidden; without GQA every head has its own K/V.
  args["swiglu"] = false;
  args["group_query_attention"] = false;
  args["add_qkv_bias"] = true;  // Qwen2's q/k/v biases
  const json gelu = mfsdp::model_config_from_megatron(args).hf;
  EXPECT_EQ(gelu["intermediate_size"], 256);
  EXPECT_EQ(gelu["hidden_act"], "gelu");
  EXPECT_EQ(gelu["gated_mlp"], false);
  EXPECT_EQ(gelu["num_key_value_heads"], 4);
  EXPECT_EQ(gelu["model_type"], "qwen2");
}

TEST(ModelSpec, MegatronArgsOfAnotherModelAreRefusedNamingTheArgument) {
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"normalization", "LayerNorm"}}, "Megatron argument 'normalization': the Llama family has RMSNorm"},
      {{{"position_embedding_type", "learned_absolute"}}, "Megatron argument 'position_embedding_type'"},
      {{{"add_bias_linear", true}}, "Megatron argument 'add_bias_linear'"},
      {{{"num_experts", 4}, {"moe_router_topk", 5}},
       "Megatron argument 'moe_router_topk': expected 1 .. num_experts (4), found 5"},
      {{{"num_experts", 4}, {"moe_router_score_function", "relu"}},
       "Megatron argument 'moe_router_score_function': expected softmax or sigmoid, found relu"},
      {{{"num_experts", 4}, {"moe_layer_freq", json::array({1, 0, 1})}},
       "Megatron argument 'moe_layer_freq': has 3 entries for 2 layers"},
      {{{"num_experts", 4}, {"swiglu", false}}, "Megatron argument 'swiglu': the experts are SwiGLU MLPs"},
      {{{"num_layers", nullptr}}, "Megatron argument 'num_layers': missing"},
      {{{"num_layers", 0}}, "Megatron argument 'num_layers': expected a positive integer, found 0"},
      {{{"max_position_embeddings", nullptr}, {"seq_length", nullptr}},
       "Megatron argument 'max_position_embeddings': missing, and so is seq_length"},
      {{{"num_attention_heads", 5}},
       "Megatron argument 'num_attention_heads': expected a divisor of hidden_size 64, found 5"},
      {{{"num_query_groups", 3}},
       "Megatron argument 'num_query_groups': expected a divisor of num_attention_heads 4, found 3"},
  };
  for (const auto& [change, want] : cases) {
    json args = megatron_args();
    args.update(change);
    const std::string got = error_of([&] { mfsdp::model_config_from_megatron(args); });
    EXPECT_NE(got.find(want), std::string::npos) << change.dump() << ": " << got;
  }
}

// Megatron's MoE arguments pick the Hugging Face family whose model they make.
TEST(ModelSpec, MegatronMoeArgsGiveTheFamilyAndItsConfig) {
  json args = megatron_args();
  args.update({{"num_experts", 4}, {"moe_router_topk", 2}, {"moe_ffn_hidden_size", 24}, {"moe_layer_freq", 2}});
  // Without q/k norms or a shared expert: Mixtral's layout. --moe-layer-freq 2 makes layers 0, 2,
  // ... MoE layers (i % 2 == 0, Megatron's rule), so layer 1 of 2 is dense.
  const mfsdp::ModelConfig mixtral = mfsdp::model_config_from_megatron(args);
  EXPECT_EQ(mixtral.spec, &mfsdp::model_spec("mixtral"));
  EXPECT_EQ(mixtral.hf["model_type"], "mixtral");
  EXPECT_EQ(mixtral.hf["num_local_experts"], 4);
  EXPECT_EQ(mixtral.hf["num_experts_per_tok"], 2);
  EXPECT_EQ(mixtral.hf["intermediate_size"], 24);               // Mixtral's experts' width
  EXPECT_EQ(mixtral.hf["moe_dense_intermediate_size"], 128);    // the dense layer's (Megatron's default)
  EXPECT_EQ(mixtral.hf["mlp_only_layers"], json::array({1}));
  EXPECT_NE(mixtral.spec->hf_export_refusal(mixtral).find("every Mixtral layer is an MoE layer"), std::string::npos);
  EXPECT_EQ(mfsdp::model_config_from_hf(mixtral.hf).hf, mixtral.hf);  // the checkpoint's model_config round trips
  const auto shapes = mfsdp::model_tensor_shapes(mixtral);
  auto shape_of = [&](const std::string& name) {
    for (const auto& [n, s] : shapes)
      if (n == name) return s;
    return std::vector<int64_t>{};
  };
  EXPECT_EQ(shape_of("model.layers.0.block_sparse_moe.gate.weight"), (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(shape_of("model.layers.0.block_sparse_moe.experts.3.w1.weight"), (std::vector<int64_t>{24, 64}));
  EXPECT_EQ(shape_of("model.layers.0.block_sparse_moe.experts.3.w2.weight"), (std::vector<int64_t>{64, 24}));
  EXPECT_EQ(shape_of("model.layers.1.mlp.gate_proj.weight"), (std::vector<int64_t>{128, 64}));

  // --qk-layernorm: Qwen3-MoE; --kv-channels 24 (not 64 / 4): its head_dim.
  args.update({{"qk_layernorm", true}, {"kv_channels", 24}, {"moe_layer_freq", 1}, {"moe_router_pre_softmax", true}});
  const mfsdp::ModelConfig qwen3 = mfsdp::model_config_from_megatron(args);
  EXPECT_EQ(qwen3.spec, &mfsdp::model_spec("qwen3"));
  EXPECT_EQ(qwen3.hf["model_type"], "qwen3_moe");
  EXPECT_EQ(qwen3.hf["head_dim"], 24);
  EXPECT_EQ(qwen3.hf["moe_intermediate_size"], 24);
  EXPECT_EQ(qwen3.hf["norm_topk_prob"], false);  // --moe-router-pre-softmax: top-k of the full softmax
  EXPECT_EQ(qwen3.hf["mlp_only_layers"], json::array());
  EXPECT_EQ(qwen3.spec->hf_export_refusal(qwen3), "");
  const auto qshapes = mfsdp::model_tensor_shapes(qwen3);
  bool has_q_norm = false;
  for (const auto& [n, s] : qshapes) has_q_norm |= n == "model.layers.0.self_attn.q_norm.weight" && s == std::vector<int64_t>{24};
  EXPECT_TRUE(has_q_norm);

  // A shared expert without q/k norms: Qwen2-MoE, whose shared expert is gated; ungated it has no
  // Hugging Face folder.
  args.update({{"qk_layernorm", false}, {"moe_shared_expert_intermediate_size", 32}});
  const mfsdp::ModelConfig qwen2 = mfsdp::model_config_from_megatron(args);
  EXPECT_EQ(qwen2.hf["model_type"], "qwen2_moe");
  EXPECT_EQ(qwen2.hf["shared_expert_intermediate_size"], 32);
  EXPECT_NE(qwen2.spec->hf_export_refusal(qwen2).find("gates its shared expert"), std::string::npos);
  args["moe_shared_expert_gate"] = true;
  const mfsdp::ModelConfig gated = mfsdp::model_config_from_megatron(args);
  EXPECT_EQ(gated.spec->hf_export_refusal(gated), "");

  // Every field survives the checkpoint's model_config: a gated shared expert beside q/k norms
  // (no Hugging Face family has it), q/k/v biases on a dense Qwen3.
  json odd = megatron_args();
  odd.update({{"num_experts", 4}, {"qk_layernorm", true}, {"moe_shared_expert_intermediate_size", 32},
              {"moe_shared_expert_gate", true}});
  const mfsdp::ModelConfig gated_qwen3 = mfsdp::model_config_from_megatron(odd);
  EXPECT_EQ(mfsdp::model_config_from_hf(gated_qwen3.hf).hf, gated_qwen3.hf);
  bool has_gate = false;
  for (const auto& [n, s] : mfsdp::model_tensor_shapes(gated_qwen3))
    has_gate |= n == "model.layers.0.mlp.shared_expert_gate.weight";
  EXPECT_TRUE(has_gate);
  json biased = megatron_args();
  biased.update({{"qk_layernorm", true}, {"add_qkv_bias", true}});
  const mfsdp::ModelConfig qwen3_bias = mfsdp::model_config_from_megatron(biased);
  EXPECT_EQ(mfsdp::model_config_from_hf(qwen3_bias.hf).hf, qwen3_bias.hf);
  EXPECT_NE(qwen3_bias.spec->hf_export_refusal(qwen3_bias).find("q/k/v biases"), std::string::npos);

  // Megatron's FLOPs count the experts a token reaches: top-k x moe_ffn + shared, per MoE layer.
  // 12 B s L h^2 [(1 + g/a + s/h) q + (k f_moe + f_shared) 1.5 / h + V / (2 L h)], q = 4 x 24 / 64.
  const double b = 3, s = 16, L = 2, h = 64;
  const double q = 4.0 * 24 / 64;
  const double want = 12 * b * s * L * h * h * ((1 + 2.0 / 4 + s / h) * q + (2 * 24 + 32) * 1.5 / h + 128 / (2 * L * h));
  EXPECT_NEAR(gated.spec->flops_per_iteration(gated, 3, 16), want, want * 1e-12);
}

// Megatron-Core's MoE tensors (router, TEGroupedMLP's weight{j}, SequentialMLP's local_experts,
// shared experts, the pre-MLP norm) become the family's parameters.
TEST(ModelSpec, MegatronMoeNamesBecomeTheExperts) {
  json args = megatron_args();
  args.update({{"num_experts", 4}, {"moe_ffn_hidden_size", 24}, {"moe_shared_expert_intermediate_size", 32},
               {"moe_shared_expert_gate", true}});
  const mfsdp::ModelConfig c = mfsdp::model_config_from_megatron(args);
  const mfsdp::ModelSpec& spec = *c.spec;
  auto names = [&](const std::string& fqn, int64_t rows) {
    std::vector<std::string> out;
    for (const auto& r : spec.from_megatron_name(fqn, rows, &c, "test")) out.push_back(r.name);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(names("decoder.layers.1.mlp.router.weight", 4), V{"model.layers.1.mlp.gate.weight"});
  EXPECT_EQ(names("decoder.layers.1.mlp.experts.linear_fc1.weight3", 48),
            (V{"model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"}));
  EXPECT_EQ(names("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight", 64),
            V{"model.layers.0.mlp.experts.2.down_proj.weight"});
  EXPECT_EQ(names("decoder.layers.0.mlp.shared_experts.gate_weight", 1), V{"model.layers.0.mlp.shared_expert_gate.weight"});
  EXPECT_EQ(names("decoder.layers.0.pre_mlp_layernorm.weight", 64), V{"model.layers.0.post_attention_layernorm.weight"});
  const auto up = spec.from_megatron_name("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", 64, &c, "test");
  ASSERT_EQ(up.size(), 2u);
  EXPECT_EQ(up[1].name, "model.layers.0.mlp.shared_expert.up_proj.weight");
  EXPECT_EQ(up[1].ranges, (std::vector<std::pair<int64_t, int64_t>>{{32, 32}}));
  EXPECT_NE(error_of([&] { spec.from_megatron_name("decoder.layers.0.mlp.experts.linear_fc2.weight4", 64, &c, "entry x"); })
                .find("entry x is expert 4 of a model with 4"),
            std::string::npos);
  // The aux-loss-free bias has a name only in a model that has one.
  EXPECT_TRUE(names("decoder.layers.1.mlp.router.expert_bias", 4).empty());
  args.update({{"moe_router_score_function", "sigmoid"}, {"moe_router_enable_expert_bias", true}});
  const mfsdp::ModelConfig biased = mfsdp::model_config_from_megatron(args);
  const auto bias = biased.spec->from_megatron_name("decoder.layers.1.mlp.router.expert_bias", 4, &biased, "test");
  ASSERT_EQ(bias.size(), 1u);
  EXPECT_EQ(bias[0].name, "model.layers.1.mlp.gate.e_score_correction_bias");
  // and the config.json of the model keeps it.
  const mfsdp::ModelConfig again = mfsdp::model_config_from_hf(biased.spec->hf_config(biased, at::kFloat));
  EXPECT_TRUE(mfsdp::llama_config_of(again).moe.expert_bias);
}

TEST(ModelSpec, TheHfConfigRoundTripsThroughTheSpec) {
  const mfsdp::ModelConfig config = mfsdp::model_config_from_megatron(megatron_args());
  const json bf16 = config.spec->hf_config(config, at::kBFloat16);
  EXPECT_EQ(bf16["torch_dtype"], "bfloat16");
  const mfsdp::ModelConfig back = mfsdp::model_config_from_hf(bf16);
  EXPECT_EQ(back.spec, config.spec);
  EXPECT_EQ(back.hf, config.hf);  // the spec writes every field, torch_dtype float32
  EXPECT_EQ(config.spec->hf_export_refusal(config), "");

  json args = megatron_args();
  args["swiglu"] = false;
  const mfsdp::ModelConfig gelu = mfsdp::model_config_from_megatron(args);
  EXPECT_NE(gelu.spec->hf_export_refusal(gelu).find("Megatron's GeLU MLP"), std::string::npos);
}

// A config.json is input: sizes past what mfsdp builds, classes it does not build, dtypes that are
// not floating point and values RoPE or the norms cannot use are refused before any model is
// built, naming the config.json key (never LlamaConfig's fields).
TEST(ModelSpec, HfConfigValuesAreBoundedAndNamedByTheirKey) {
  const mfsdp::ModelConfig config = mfsdp::model_config_from_megatron(megatron_args());
  const json good = config.spec->hf_config(config, at::kFloat);
  struct Case {
    json patch;
    std::string expected;
  } cases[] = {
      {{{"num_hidden_layers", int64_t{1} << 31}}, "field 'num_hidden_layers': 2147483648 is more than mfsdp builds (at most 1024)"},
      {{{"intermediate_size", INT64_MAX}}, "field 'intermediate_size': 9223372036854775807 is more than mfsdp builds"},
      {{{"vocab_size", INT64_MAX}}, "field 'vocab_size': 9223372036854775807 is more than mfsdp builds"},
      {{{"hidden_size", int64_t{1} << 40}}, "field 'hidden_size'"},
      {{{"max_position_embeddings", int64_t{1} << 40}}, "field 'max_position_embeddings'"},
      {{{"architectures", {"GPT2LMHeadModel"}}}, "field 'architectures': \"GPT2LMHeadModel\" is not a model mfsdp builds: model_type \"llama\" is LlamaForCausalLM"},
      {{{"torch_dtype", "int8"}}, "field 'torch_dtype': \"int8\" is not a floating-point dtype"},
      {{{"dtype", "uint8"}}, "field 'dtype': \"uint8\" is not a floating-point dtype"},
      {{{"rope_theta", -1}}, "field 'rope_theta': must be > 0"},
      {{{"rms_norm_eps", -1}}, "field 'rms_norm_eps': must be >= 0"},
      {{{"num_key_value_heads", 3}}, "field 'num_key_value_heads': 3 does not divide num_attention_heads 4"},
      {{{"num_attention_heads", 6}, {"num_key_value_heads", 6}}, "field 'num_attention_heads': expected a divisor of hidden_size 64"},
  };
  for (const Case& c : cases) {
    json bad = good;
    bad.erase("head_dim");
    for (const auto& [key, value] : c.patch.items()) bad[key] = value;
    const std::string error = error_of([&] { mfsdp::model_config_from_hf(bad); });
    EXPECT_NE(error.find(c.expected), std::string::npos) << c.patch.dump() << ": " << error;
    EXPECT_EQ(error.find("LlamaConfig"), std::string::npos) << error;
  }
  json mistral = good;
  mistral["model_type"] = "mistral";
  mistral["architectures"] = {"MistralForCausalLM"};
  EXPECT_EQ(error_of([&] { mfsdp::model_config_from_hf(mistral); }), "<no exception>");
}

// Megatron fuses q, k and v per query group: [g's query heads; g's key head; g's value head].
// With 4 heads in 2 groups and head_dim d = 16: rows 0..2d are group 0's queries, 2d..3d its key,
// 3d..4d its value, then group 1 from 4d.
TEST(ModelSpec, MegatronNamesSplitAsMegatronFusesThem) {
  const mfsdp::ModelConfig config = mfsdp::model_config_from_megatron(megatron_args());
  const mfsdp::ModelSpec& spec = *config.spec;
  const int64_t d = 16;
  auto qkv = spec.from_megatron_name("decoder.layers.1.self_attention.linear_qkv.weight", 8 * d, &config, "t");
  ASSERT_EQ(qkv.size(), 3u);
  EXPECT_EQ(qkv[0].name, "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(qkv[0].ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 2 * d}, {4 * d, 2 * d}}));
  EXPECT_EQ(qkv[0].rows, 4 * d);
  EXPECT_EQ(qkv[1].name, "model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(qkv[1].ranges, (std::vector<std::pair<int64_t, int64_t>>{{2 * d, d}, {6 * d, d}}));
  EXPECT_EQ(qkv[2].name, "model.layers.1.self_attn.v_proj.weight");
  EXPECT_EQ(qkv[2].ranges, (std::vector<std::pair<int64_t, int64_t>>{{3 * d, d}, {7 * d, d}}));
  EXPECT_NE(error_of([&] { spec.from_megatron_name("decoder.layers.0.self_attention.linear_qkv.weight", 8 * d + 1,
                                                   &config, "tensor 'x'"); })
                .find("tensor 'x' has 129 rows, which do not split into 4 query heads and 2 key/value groups"),
            std::string::npos);
  auto bias = spec.from_megatron_name("decoder.layers.0.self_attention.linear_qkv.bias", 8 * d, &config, "t");
  ASSERT_EQ(bias.size(), 3u);
  EXPECT_EQ(bias[1].name, "model.layers.0.self_attn.k_proj.bias");
  EXPECT_EQ(bias[1].ranges, qkv[1].ranges);
  // Without a config the fused tensor keeps its name.
  EXPECT_TRUE(spec.from_megatron_name("decoder.layers.0.self_attention.linear_qkv.weight", 8 * d, nullptr, "t").empty());

  // SwiGLU's linear_fc1 is [gate; up]; the GeLU MLP's is up alone.
  auto fc1 = spec.from_megatron_name("decoder.layers.0.mlp.linear_fc1.weight", 256, &config, "t");
  ASSERT_EQ(fc1.size(), 2u);
  EXPECT_EQ(fc1[0].name, "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(fc1[0].ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 128}}));
  EXPECT_EQ(fc1[1].name, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(fc1[1].ranges, (std::vector<std::pair<int64_t, int64_t>>{{128, 128}}));
  json args = megatron_args();
  args["swiglu"] = false;
  const mfsdp::ModelConfig gelu = mfsdp::model_config_from_megatron(args);
  auto up = spec.from_megatron_name("decoder.layers.0.mlp.linear_fc1.weight", 256, &gelu, "t");
  ASSERT_EQ(up.size(), 1u);
  EXPECT_EQ(up[0].name, "model.layers.0.mlp.up_proj.weight");
  EXPECT_TRUE(up[0].ranges.empty());

  EXPECT_EQ(spec.from_megatron_name("embedding.word_embeddings.weight", 128, &config, "t")[0].name,
            "model.embed_tokens.weight");
  EXPECT_EQ(spec.from_megatron_name("output_layer.weight", 128, &config, "t")[0].name, "lm_head.weight");
  EXPECT_TRUE(spec.from_megatron_name("decoder.layers.0.unknown.weight", 4, &config, "t").empty());
}

// A checkpoint with Megatron names read through the family's table (src/checkpoint/
// megatron_gpt_names.cpp): weights and optimizer states follow their parameter; a 0-d step follows
// a whole rename and keeps its name where the parameter splits; other entries stay.
TEST(ModelSpec, MegatronCheckpointEntriesFollowTheirParameters) {
  using mfsdp::checkpoint::MappedTensor;
  auto stored = [](const std::string& key, std::vector<int64_t> shape) {
    return MappedTensor{shape, at::kFloat, mfsdp::checkpoint::whole_tensor(key, shape)};
  };
  const std::map<std::string, MappedTensor> in = {
      {"model.embedding.word_embeddings.weight", stored("a", {128, 64})},
      {"optimizer.state.embedding.word_embeddings.weight.step", stored("b", {})},
      {"optimizer.state.decoder.layers.0.mlp.linear_fc1.weight.exp_avg", stored("c", {256, 64})},
      {"optimizer.state.decoder.layers.0.mlp.linear_fc1.weight.step", stored("d", {})},
      {"rng_state.rank0.cpu", stored("e", {5})}};
  const mfsdp::ModelConfig config = mfsdp::model_config_from_megatron(megatron_args());
  const auto out = mfsdp::checkpoint::megatron_gpt_to_model(in, *config.spec, &config);
  std::vector<std::string> names;
  for (const auto& [name, t] : out) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"model.model.embed_tokens.weight",
                                             "optimizer.state.decoder.layers.0.mlp.linear_fc1.weight.step",
                                             "optimizer.state.model.embed_tokens.weight.step",
                                             "optimizer.state.model.layers.0.mlp.gate_proj.weight.exp_avg",
                                             "optimizer.state.model.layers.0.mlp.up_proj.weight.exp_avg",
                                             "rng_state.rank0.cpu"}));
  const MappedTensor& up = out.at("optimizer.state.model.layers.0.mlp.up_proj.weight.exp_avg");
  EXPECT_EQ(up.shape, (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(up.source.key, "c");
  EXPECT_EQ(up.source.runs, (std::vector<std::pair<int64_t, int64_t>>{{128, 128}}));  // the second half
}

// training.py: 12 x batch x seq x layers x h^2 x (1 + groups/heads + seq/h + ffn/h x 1.5 (SwiGLU)
// + vocab / (2 x layers x h)) = 12 x 16 x 2 x 4096 x (1 + 0.5 + 0.25 + 3 + 0.5) = 8,257,536.
TEST(ModelSpec, FlopsAreMegatronsFormula) {
  const mfsdp::ModelConfig config = mfsdp::model_config_from_megatron(megatron_args());
  EXPECT_DOUBLE_EQ(config.spec->flops_per_iteration(config, 1, 16), 8257536.0);
  EXPECT_DOUBLE_EQ(config.spec->flops_per_iteration(config, 3, 16), 3 * 8257536.0);
}

// Built through the spec with deferred parameters and sharded by shard_model, the model computes
// what a plain eager LlamaForCausalLM of the same seed computes.
TEST(ModelSpec, AModelBuiltAndShardedThroughTheSpecIsThePlainModel) {
  const mfsdp::ModelConfig config = mfsdp::model_config_from_megatron(megatron_args());
  mfsdp::ModelBuildOptions deferred;
  deferred.deferred_init = true;
  deferred.init_seed = 11;
  std::shared_ptr<mfsdp::CausalLM> model = config.spec->build(config, deferred);
  EXPECT_TRUE(model->has_deferred());
  EXPECT_EQ(model->num_layers(), 2);
  EXPECT_EQ(model->vocab_size(), 128);
  EXPECT_EQ(model->max_positions(), 32);
  mfsdp::FullyShardOptions o;
  o.comm = mfsdp::make_simulated_communicator(0, 1);
  o.strategy = mfsdp::ShardingStrategy::kOptimGradsParams;
  mfsdp::shard_model(*model, o);
  EXPECT_FALSE(model->has_deferred());

  mfsdp::LlamaOptions eager;
  eager.init_seed = 11;
  mfsdp::LlamaForCausalLM plain(mfsdp::llama_config_of(config), eager);
  const at::Tensor ids = torch::arange(12, torch::kLong).remainder(128).view({2, 6});
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(model->call(ids), plain->forward(ids)));

  // Transformers' names and shapes: 4 heads of 16, 2 key/value groups, SwiGLU width 128, untied.
  const auto shapes = mfsdp::model_tensor_shapes(config);
  ASSERT_EQ(shapes.size(), 2u + 2 * 9 + 1);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> first = {
      {"model.embed_tokens.weight", {128, 64}},
      {"model.layers.0.self_attn.q_proj.weight", {64, 64}},
      {"model.layers.0.self_attn.k_proj.weight", {32, 64}},
      {"model.layers.0.self_attn.v_proj.weight", {32, 64}},
      {"model.layers.0.self_attn.o_proj.weight", {64, 64}},
      {"model.layers.0.mlp.gate_proj.weight", {128, 64}},
      {"model.layers.0.mlp.up_proj.weight", {128, 64}},
      {"model.layers.0.mlp.down_proj.weight", {64, 128}}};
  for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(shapes[i], first[i]) << i;
  EXPECT_EQ(shapes.back(), (std::pair<std::string, std::vector<int64_t>>{"lm_head.weight", {128, 64}}));
}
