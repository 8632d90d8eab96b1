// Hugging Face config.json <-> LlamaConfig: see include/mfsdp/models/llama_hf_config.h.
#include "mfsdp/models/llama_hf_config.h"

#include <algorithm>
#include <optional>
#include <cmath>
#include <stdexcept>
#include <string>

#include "mfsdp/models/rope_scaling.h"

namespace mfsdp {
namespace {

using json = nlohmann::json;

[[noreturn]] void bad(const std::string& field, const std::string& what) {
  throw std::invalid_argument("HF config.json field '" + field + "': " + what);
}

const json* find(const json& c, const char* field) {
  auto it = c.find(field);
  if (it == c.end() || it->is_null()) return nullptr;
  return &*it;
}

int64_t get_int(const json& c, const char* field, const int64_t* fallback) {
  const json* v = find(c, field);
  if (v == nullptr) {
    if (fallback == nullptr) bad(field, "missing");
    return *fallback;
  }
  if (!v->is_number_integer()) bad(field, "expected an integer, found " + v->dump());
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    bad(field, "too large: " + v->dump());
  const int64_t x = v->get<int64_t>();
  if (x <= 0) bad(field, "expected a positive integer, found " + v->dump());
  return x;
}

int64_t required_int(const json& c, const char* field) { return get_int(c, field, nullptr); }
// An integer that may be 0 (DeepSeek-V3's first_k_dense_replace, n_shared_experts).
int64_t required_count(const json& c, const char* field) {
  const json* v = find(c, field);
  if (v == nullptr) bad(field, "missing");
  if (!v->is_number_integer() || v->get<int64_t>() < 0) bad(field, "expected an integer >= 0, found " + v->dump());
  return v->get<int64_t>();
}
int64_t optional_int(const json& c, const char* field, int64_t fallback) { return get_int(c, field, &fallback); }

// The sizes a config.json may give, bounded before anything is built from them: a file is input,
// and 2^31 layers or an FFN of 2^63 would otherwise end in an allocator failure naming no file.
// The bounds are the trainer's own (docs/pretrain.md, "Errors"), far past any released model.
void check_bound(const char* field, int64_t value, int64_t most) {
  if (value > most)
    bad(field, std::to_string(value) + " is more than mfsdp builds (at most " + std::to_string(most) + ")");
}

double optional_double(const json& c, const char* field, double fallback) {
  const json* v = find(c, field);
  if (v == nullptr) return fallback;
  if (!v->is_number()) bad(field, "expected a number, found " + v->dump());
  const double x = v->get<double>();
  if (!std::isfinite(x)) bad(field, "not finite");
  return x;
}

bool optional_bool(const json& c, const char* field, bool fallback) {
  const json* v = find(c, field);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) bad(field, "expected true or false, found " + v->dump());
  return v->get<bool>();
}

}  // namespace

std::string hf_model_type(const LlamaConfig& cfg) {
  if (cfg.mla) return "deepseek_v3";
  if (cfg.moe.num_experts > 0) {
    if (cfg.qk_norm) return "qwen3_moe";
    return cfg.moe.mixtral_names ? "mixtral" : "qwen2_moe";
  }
  if (cfg.qk_norm) return "qwen3";
  return cfg.attention_bias ? "qwen2" : "llama";
}

namespace {

const char* architecture(const std::string& model_type) {
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  if (model_type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  if (model_type == "qwen2_moe") return "Qwen2MoeForCausalLM";
  if (model_type == "mixtral") return "MixtralForCausalLM";
  if (model_type == "deepseek_v3") return "DeepseekV3ForCausalLM";
  return "LlamaForCausalLM";
}

// The MoE fields of config.json: transformers' for the family, plus mfsdp's own (prefixed
// "moe_", Megatron's names) for what no Hugging Face family of that type has.
void write_moe(json& j, const LlamaConfig& cfg, const std::string& model_type) {
  const MoeConfig& m = cfg.moe;
  j[model_type == "mixtral" ? "num_local_experts" : "num_experts"] = m.num_experts;
  j["num_experts_per_tok"] = m.top_k;
  if (model_type == "mixtral") {
    j["intermediate_size"] = m.ffn_hidden_size;  // every Mixtral layer is an MoE layer
    j["router_jitter_noise"] = 0.0;
    if (!m.norm_topk_prob) j["norm_topk_prob"] = false;
    if (m.shared_expert_intermediate_size > 0) j["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size;
  } else {
    j["moe_intermediate_size"] = m.ffn_hidden_size;
    j["norm_topk_prob"] = m.norm_topk_prob;
    j["decoder_sparse_step"] = 1;
    json dense = json::array();
    for (int64_t i = 0; i < cfg.num_layers; ++i)
      if (!m.is_moe_layer(i)) dense.push_back(i);
    j["mlp_only_layers"] = dense;
    if (model_type == "qwen2_moe" || m.shared_expert_intermediate_size > 0)
      j["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size;
  }
  if (m.shared_expert_intermediate_size > 0) j["moe_shared_expert_gate"] = m.shared_expert_gate;
  if (model_type == "mixtral" && !m.moe_layers.empty()) {
    j["moe_dense_intermediate_size"] = cfg.intermediate_size;  // mfsdp's own: Mixtral has no dense layers
    json dense = json::array();
    for (int64_t i = 0; i < cfg.num_layers; ++i)
      if (!m.is_moe_layer(i)) dense.push_back(i);
    j["mlp_only_layers"] = dense;
  }
  if (m.score == MoeConfig::Score::kSigmoid) j["moe_router_score_function"] = "sigmoid";
  if (m.expert_bias) j["moe_router_enable_expert_bias"] = true;  // mfsdp's own, with sigmoid scores
  if (m.topk_scaling_factor != 1.0) j["moe_router_topk_scaling_factor"] = m.topk_scaling_factor;
  j["router_aux_loss_coef"] = 0.001;  // transformers' default; mfsdp trains with --moe-aux-loss-coeff
  j["output_router_logits"] = false;
}

// transformers' DeepseekV3Config fields of a model with multi-head latent attention (cfg.mla),
// plus mfsdp's own where the model is not one DeepSeek-V3 spells (hf_refusal says so for a
// folder; a checkpoint's model_config keeps it exact).
void write_deepseek_v3(json& j, const LlamaConfig& cfg) {
  const MlaConfig& a = *cfg.mla;
  j["q_lora_rank"] = a.q_lora_rank > 0 ? json(a.q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = a.kv_lora_rank;
  j["qk_nope_head_dim"] = a.qk_nope_head_dim;
  j["qk_rope_head_dim"] = a.qk_rope_head_dim;
  j["v_head_dim"] = a.v_head_dim;
  j["head_dim"] = a.qk_rope_head_dim;  // what transformers derives (the RoPE width)
  j["rope_interleave"] = a.rope_interleave;
  json rope = {{"rope_type", "default"}, {"rope_theta", cfg.rope_theta}};
  if (a.yarn) {
    const YarnRopeScaling& y = *a.yarn;
    rope = {{"rope_type", "yarn"},
            {"rope_theta", cfg.rope_theta},
            {"factor", y.factor},
            {"original_max_position_embeddings", y.original_max_position_embeddings},
            {"beta_fast", y.beta_fast},
            {"beta_slow", y.beta_slow},
            {"truncate", y.truncate}};
    if (y.mscale != 0) rope["mscale"] = y.mscale;
    if (y.mscale_all_dim != 0) rope["mscale_all_dim"] = y.mscale_all_dim;
  }
  j["rope_parameters"] = rope;
  j.erase("rope_scaling");
  const MoeConfig& m = cfg.moe;
  int64_t dense = 0;  // DeepSeek-V3's dense layers are the first ones
  while (dense < cfg.num_layers && !m.is_moe_layer(dense)) ++dense;
  j["first_k_dense_replace"] = m.num_experts > 0 ? dense : cfg.num_layers;
  bool prefix = true;
  for (int64_t i = dense; i < cfg.num_layers; ++i) prefix = prefix && m.is_moe_layer(i);
  if (m.num_experts > 0 && !prefix) {
    json only = json::array();
    for (int64_t i = 0; i < cfg.num_layers; ++i)
      if (!m.is_moe_layer(i)) only.push_back(i);
    j["mlp_only_layers"] = only;  // mfsdp's own: dense layers after MoE layers
  }
  // A dense model (no experts) is written with one nominal expert that no layer builds.
  j["n_routed_experts"] = m.num_experts > 0 ? m.num_experts : 1;
  j["num_experts_per_tok"] = m.num_experts > 0 ? m.top_k : 1;
  j["moe_intermediate_size"] = m.num_experts > 0 ? m.ffn_hidden_size : cfg.intermediate_size;
  const int64_t shared = m.num_experts > 0 ? m.shared_expert_intermediate_size : 0;
  if (shared % j["moe_intermediate_size"].get<int64_t>() == 0) {
    j["n_shared_experts"] = shared / j["moe_intermediate_size"].get<int64_t>();
  } else {
    j["n_shared_experts"] = 1;
    j["shared_expert_intermediate_size"] = shared;  // mfsdp's own: not a multiple of the expert width
  }
  j["n_group"] = m.num_experts > 0 ? m.n_group : 1;
  j["topk_group"] = m.num_experts > 0 ? m.topk_group : 1;
  j["routed_scaling_factor"] = m.topk_scaling_factor;
  j["norm_topk_prob"] = m.norm_topk_prob;
  j["topk_method"] = "noaux_tc";
  // DeepSeek-V3 scores only by sigmoid; a dense model's nominal expert is scored alike.
  j["scoring_func"] = m.num_experts == 0 || m.score == MoeConfig::Score::kSigmoid ? "sigmoid" : "softmax";
  if (m.num_experts > 0 && !m.expert_bias) j["moe_router_enable_expert_bias"] = false;  // mfsdp's own
  j["num_nextn_predict_layers"] = 0;
  j["pretraining_tp"] = 1;
  j["attention_bias"] = a.attention_bias;
}

}  // namespace

json llama_hf_config(const LlamaConfig& cfg, at::ScalarType torch_dtype) {
  cfg.validate();
  std::string dtype;
  switch (torch_dtype) {
    case at::kFloat: dtype = "float32"; break;
    case at::kBFloat16: dtype = "bfloat16"; break;
    case at::kHalf: dtype = "float16"; break;
    default:
      throw std::invalid_argument(std::string("llama_hf_config: torch_dtype must be float32, bfloat16 or float16, not ") +
                                  c10::toString(torch_dtype));
  }
  // q/k/v biases make a dense model Qwen2: transformers' LlamaForCausalLM with attention_bias
  // would also give o_proj a bias, Qwen2ForCausalLM has exactly these.
  const std::string model_type = hf_model_type(cfg);
  const bool qwen2 = model_type == "qwen2";
  json j;
  j["architectures"] = json::array({architecture(model_type)});
  j["model_type"] = model_type;
  j["vocab_size"] = cfg.vocab_size;
  j["hidden_size"] = cfg.hidden_size;
  j["intermediate_size"] = cfg.intermediate_size;
  j["num_hidden_layers"] = cfg.num_layers;
  j["num_attention_heads"] = cfg.num_attention_heads;
  j["num_key_value_heads"] = cfg.num_key_value_heads;
  j["head_dim"] = cfg.head_dim();
  j["max_position_embeddings"] = cfg.max_position_embeddings;
  j["rope_theta"] = cfg.rope_theta;
  j["rope_scaling"] = nullptr;
  j["rms_norm_eps"] = cfg.rms_norm_eps;
  j["initializer_range"] = cfg.init_std;
  j["tie_word_embeddings"] = cfg.tie_word_embeddings;
  j["hidden_act"] = cfg.swiglu ? "silu" : "gelu";
  if (!cfg.swiglu) j["gated_mlp"] = false;  // mfsdp's own field: no Hugging Face Llama has this MLP
  // Qwen2Config has no attention_bias field (its q/k/v biases are fixed); written anyway so that
  // a config compares field by field with another (transformers keeps unknown fields).
  j["attention_bias"] = cfg.attention_bias;
  if (model_type == "qwen2_moe") j["qkv_bias"] = cfg.attention_bias;
  if (model_type == "mixtral" && cfg.attention_bias) j["moe_qkv_bias"] = true;  // no Mixtral has them
  if ((model_type == "qwen3_moe" || model_type == "qwen3") && cfg.attention_bias) j["moe_qkv_bias"] = true;
  j["attention_dropout"] = 0.0;
  if (qwen2 || model_type == "qwen3" || model_type == "qwen3_moe" || model_type == "qwen2_moe") {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = cfg.num_layers;
  } else if (model_type == "mixtral") {
    j["sliding_window"] = nullptr;
  } else {
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  if (model_type == "deepseek_v3") {
    j.erase("mlp_bias");
    write_deepseek_v3(j, cfg);
  } else if (cfg.moe.num_experts > 0) {
    write_moe(j, cfg, model_type);
  }
  j["use_cache"] = true;
  j["torch_dtype"] = dtype;
  return j;
}

std::string hf_refusal(const LlamaConfig& cfg) {
  if (!cfg.swiglu)
    return "the model has Megatron's GeLU MLP (trained without --swiglu), which no Hugging Face Llama or Qwen2 has "
           "(their MLP is SwiGLU); it has no Hugging Face folder";
  const MoeConfig& m = cfg.moe;
  const std::string type = hf_model_type(cfg);
  if (type == "qwen3" && cfg.attention_bias)
    return "the model has q/k/v biases (--add-qkv-bias) and q/k norms, which no Hugging Face Qwen3 has (its "
           "attention_bias would also bias o_proj)";
  if (type == "deepseek_v3") {
    if (cfg.attention_bias) return "DeepSeek-V3 has no q/k/v biases (--add-qkv-bias)";
    if (cfg.mla->attention_bias) return "mfsdp does not write DeepSeek-V3's attention biases (attention_bias)";
    if (m.num_experts == 0) return "";
    if (m.score != MoeConfig::Score::kSigmoid)
      return "DeepSeek-V3 scores experts with a sigmoid (--moe-router-score-function sigmoid); the model's router "
             "uses a softmax";
    if (!m.expert_bias) return "DeepSeek-V3's router has an expert bias (e_score_correction_bias); the model's has none";
    if (m.shared_expert_gate) return "DeepSeek-V3's shared experts are ungated (--moe-shared-expert-gate)";
    if (m.shared_expert_intermediate_size % m.ffn_hidden_size != 0)
      return "DeepSeek-V3's shared experts are n_shared_experts x moe_intermediate_size wide; the model's shared "
             "expert width " + std::to_string(m.shared_expert_intermediate_size) + " is not a multiple of " +
             std::to_string(m.ffn_hidden_size);
    int64_t dense = 0;
    while (dense < cfg.num_layers && !m.is_moe_layer(dense)) ++dense;
    for (int64_t i = dense; i < cfg.num_layers; ++i)
      if (!m.is_moe_layer(i))
        return "DeepSeek-V3's dense layers are its first ones (first_k_dense_replace); the model's layer " +
               std::to_string(i) + " is dense after an MoE layer";
    return "";
  }
  if (m.num_experts == 0) return "";
  if (m.score == MoeConfig::Score::kSigmoid)
    return "the router scores experts with a sigmoid (--moe-router-score-function sigmoid), which no Hugging Face " +
           type + " model does; it has no Hugging Face folder";
  if (m.topk_scaling_factor != 1.0)
    return "the router scales its top-k weights (--moe-router-topk-scaling-factor), which no Hugging Face " + type +
           " model does; it has no Hugging Face folder";
  if (type == "mixtral") {
    if (cfg.attention_bias) return "Mixtral has no q/k/v biases (--add-qkv-bias); the model has no Hugging Face folder";
    if (!m.norm_topk_prob) return "Mixtral renormalises its top-k weights (not --moe-router-pre-softmax)";
    if (!m.moe_layers.empty() && std::count(m.moe_layers.begin(), m.moe_layers.end(), false) > 0)
      return "every Mixtral layer is an MoE layer (--moe-layer-freq 1); the model has dense layers";
    if (m.shared_expert_intermediate_size > 0) return "Mixtral has no shared expert (--moe-shared-expert-intermediate-size)";
  } else if (type == "qwen3_moe") {
    if (cfg.attention_bias) return "Qwen3-MoE has no q/k/v biases (--add-qkv-bias)";
    if (m.shared_expert_intermediate_size > 0)
      return "Qwen3-MoE has no shared expert (--moe-shared-expert-intermediate-size); the model has no Hugging Face folder";
  } else if (type == "qwen2_moe" && !m.shared_expert_gate) {
    return "Qwen2-MoE gates its shared expert (--moe-shared-expert-gate); the model's is ungated, which no Hugging Face "
           "model has";
  }
  return "";
}

namespace {

// Layer indices from a list field (mlp_only_layers), each in [0, layers).
std::vector<int64_t> layer_list(const json& c, const char* field, int64_t layers) {
  std::vector<int64_t> out;
  const json* v = find(c, field);
  if (v == nullptr) return out;
  if (!v->is_array()) bad(field, "expected a list of layer indices, found " + v->dump());
  for (const json& i : *v) {
    if (!i.is_number_integer() || i.get<int64_t>() < 0 || i.get<int64_t>() >= layers)
      bad(field, "expected layer indices in [0, " + std::to_string(layers) + "), found " + i.dump());
    out.push_back(i.get<int64_t>());
  }
  return out;
}

// transformers' Qwen3MoeConfig / Qwen2MoeConfig / MixtralConfig fields, and mfsdp's own "moe_".
void read_moe(const json& c, const std::string& model_type, LlamaConfig& cfg) {
  MoeConfig& m = cfg.moe;
  const bool mixtral = model_type == "mixtral";
  m.mixtral_names = mixtral;
  // transformers maps num_experts and num_local_experts to one another (attribute_map).
  const char* experts_key = find(c, "num_experts") != nullptr ? "num_experts" : "num_local_experts";
  m.num_experts = required_int(c, experts_key);
  m.top_k = required_int(c, "num_experts_per_tok");
  if (m.top_k > m.num_experts)
    bad("num_experts_per_tok", "expected 1 .. " + std::string(experts_key) + " (" + std::to_string(m.num_experts) +
                                   "), found " + std::to_string(m.top_k));
  if (mixtral) {
    m.ffn_hidden_size = cfg.intermediate_size;
    if (find(c, "moe_dense_intermediate_size") != nullptr) cfg.intermediate_size = required_int(c, "moe_dense_intermediate_size");
    m.norm_topk_prob = optional_bool(c, "norm_topk_prob", true);  // MixtralTopKRouter always renormalises
    if (optional_double(c, "router_jitter_noise", 0.0) != 0.0)
      bad("router_jitter_noise", "router jitter is not supported, found " + find(c, "router_jitter_noise")->dump());
  } else {
    m.ffn_hidden_size = required_int(c, "moe_intermediate_size");
    m.norm_topk_prob = optional_bool(c, "norm_topk_prob", false);  // transformers' default for both Qwen MoEs
  }
  if (model_type == "qwen2_moe") {
    m.shared_expert_intermediate_size = required_int(c, "shared_expert_intermediate_size");
    m.shared_expert_gate = true;
  } else if (find(c, "shared_expert_intermediate_size") != nullptr) {
    m.shared_expert_intermediate_size = required_int(c, "shared_expert_intermediate_size");
  }
  if (m.shared_expert_intermediate_size > 0) m.shared_expert_gate = optional_bool(c, "moe_shared_expert_gate", m.shared_expert_gate);
  check_bound(experts_key, m.num_experts, 4096);
  check_bound(mixtral ? "intermediate_size" : "moe_intermediate_size", m.ffn_hidden_size, int64_t{1} << 20);
  check_bound("shared_expert_intermediate_size", m.shared_expert_intermediate_size, int64_t{1} << 20);
  const int64_t step = mixtral ? 1 : optional_int(c, "decoder_sparse_step", 1);
  const std::vector<int64_t> dense = layer_list(c, "mlp_only_layers", cfg.num_layers);
  m.moe_layers.assign(cfg.num_layers, true);
  for (int64_t i = 0; i < cfg.num_layers; ++i)
    m.moe_layers[i] = (i + 1) % step == 0 && std::find(dense.begin(), dense.end(), i) == dense.end();
  // No MoE layer left is said of the key that left none: the step alone, else the dense list.
  if (std::none_of(m.moe_layers.begin(), m.moe_layers.end(), [](bool x) { return x; })) {
    const std::string layers = " of the " + std::to_string(cfg.num_layers) + " layers (num_hidden_layers)";
    if (step > cfg.num_layers) bad("decoder_sparse_step", std::to_string(step) + " leaves no MoE layer" + layers);
    bad("mlp_only_layers", find(c, "mlp_only_layers")->dump() + " leaves no MoE layer" + layers +
                               (mixtral ? "" : " with decoder_sparse_step " + std::to_string(step)));
  }
  if (std::all_of(m.moe_layers.begin(), m.moe_layers.end(), [](bool x) { return x; })) m.moe_layers.clear();
  if (const json* score = find(c, "moe_router_score_function")) {
    if (!score->is_string() || (score->get<std::string>() != "softmax" && score->get<std::string>() != "sigmoid"))
      bad("moe_router_score_function", "expected \"softmax\" or \"sigmoid\", found " + score->dump());
    m.score = score->get<std::string>() == "sigmoid" ? MoeConfig::Score::kSigmoid : MoeConfig::Score::kSoftmax;
  }
  // mfsdp's sigmoid router (Megatron's) renormalised its top-k whatever norm_topk_prob said
  // before DeepSeek-V3's norm_topk_prob was honoured; these families' files keep that meaning.
  if (m.score == MoeConfig::Score::kSigmoid) m.norm_topk_prob = true;
  m.expert_bias = optional_bool(c, "moe_router_enable_expert_bias", false);
  if (m.expert_bias && m.score != MoeConfig::Score::kSigmoid)
    bad("moe_router_enable_expert_bias", "true needs moe_router_score_function \"sigmoid\" (aux-loss-free "
        "balancing scores experts with a sigmoid, as in Megatron-LM)");
  m.topk_scaling_factor = optional_double(c, "moe_router_topk_scaling_factor", 1.0);
  if (m.topk_scaling_factor <= 0)
    bad("moe_router_topk_scaling_factor", "expected a positive number, found " +
                                              find(c, "moe_router_topk_scaling_factor")->dump());
}

// DeepSeek-V3's RoPE: rope_parameters (transformers 5) or rope_scaling with rope_theta (the
// released config.json), of type "default" or "yarn".
std::optional<YarnRopeScaling> read_deepseek_rope(const json& c, double& theta) {
  const char* key = find(c, "rope_parameters") != nullptr ? "rope_parameters" : "rope_scaling";
  const json* rp = find(c, key);
  if (rp == nullptr) return std::nullopt;
  if (!rp->is_object()) bad(key, "expected an object, found " + rp->dump());
  const std::string field = std::string(key) + ".";
  const json* type = find(*rp, "rope_type") != nullptr ? find(*rp, "rope_type") : find(*rp, "type");
  const std::string kind = type != nullptr && type->is_string() ? type->get<std::string>() : "";
  if (type != nullptr && kind != "default" && kind != "yarn")
    bad(field + "rope_type", "only \"default\" and \"yarn\" RoPE are supported, found " + type->dump());
  if (find(*rp, "rope_theta") != nullptr) theta = optional_double(*rp, "rope_theta", theta);
  if (kind != "yarn") return std::nullopt;
  YarnRopeScaling y;
  y.factor = optional_double(*rp, "factor", 0);
  if (!(y.factor > 0)) bad(field + "factor", "expected a positive number, found " + (find(*rp, "factor") ? find(*rp, "factor")->dump() : "none"));
  y.original_max_position_embeddings = required_int(*rp, "original_max_position_embeddings");
  y.beta_fast = optional_double(*rp, "beta_fast", 32);
  y.beta_slow = optional_double(*rp, "beta_slow", 1);
  y.mscale = optional_double(*rp, "mscale", 0);
  y.mscale_all_dim = optional_double(*rp, "mscale_all_dim", 0);
  y.truncate = optional_bool(*rp, "truncate", true);
  try {
    y.validate();
  } catch (const std::invalid_argument& e) {
    bad(key, e.what());
  }
  // An explicit attention_factor replaces the one of the mscales; only that one is built.
  if (const json* af = find(*rp, "attention_factor")) {
    if (!af->is_number() || std::abs(af->get<double>() - yarn_attention_factor(y)) > 1e-12)
      bad(field + "attention_factor", af->dump() + " is not the factor of the mscales (" +
                                          std::to_string(yarn_attention_factor(y)) + "), which is the only one supported");
  }
  if (const json* pf = find(*rp, "partial_rotary_factor"))
    if (!pf->is_number() || pf->get<double>() != 1.0) bad(field + "partial_rotary_factor", "only 1 is supported, found " + pf->dump());
  return y;
}

// transformers' DeepseekV3Config: multi-head latent attention, then the MoE fields (sigmoid
// router with e_score_correction_bias, group-limited, the first first_k_dense_replace layers
// dense, n_shared_experts ungated shared experts).
void read_deepseek_v3(const json& c, LlamaConfig& cfg) {
  if (const json* q = find(c, "quantization_config"))
    bad("quantization_config", "quantized weights are not supported (mfsdp holds fp32 weights), found " + q->dump());
  for (const char* key : {"num_nextn_predict_layers", "num_mtp_layers"})
    if (const json* v = find(c, key))
      if (!v->is_number_integer() || v->get<int64_t>() < 0) bad(key, "expected an integer >= 0, found " + v->dump());
  MlaConfig a;
  a.hidden_size = cfg.hidden_size;
  a.num_heads = cfg.num_attention_heads;
  a.q_lora_rank = find(c, "q_lora_rank") != nullptr ? required_int(c, "q_lora_rank") : 0;
  a.kv_lora_rank = required_int(c, "kv_lora_rank");
  a.qk_nope_head_dim = required_count(c, "qk_nope_head_dim");
  a.qk_rope_head_dim = required_int(c, "qk_rope_head_dim");
  a.v_head_dim = required_int(c, "v_head_dim");
  for (const char* f : {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"})
    if (find(c, f) != nullptr) check_bound(f, find(c, f)->get<int64_t>(), int64_t{1} << 17);
  if (a.qk_rope_head_dim % 2 != 0)
    bad("qk_rope_head_dim", "expected an even value (RoPE rotates pairs), found " + std::to_string(a.qk_rope_head_dim));
  if (optional_bool(c, "attention_bias", false))
    bad("attention_bias", "true (biases on MLA's q_a_proj, kv_a_proj_with_mqa and o_proj) is not supported");
  a.rope_interleave = optional_bool(c, "rope_interleave", true);
  a.yarn = read_deepseek_rope(c, cfg.rope_theta);
  if (cfg.rope_theta <= 0) bad("rope_theta", "must be > 0, found " + std::to_string(cfg.rope_theta));
  a.rope_theta = cfg.rope_theta;
  cfg.mla = a;

  if (const json* f = find(c, "scoring_func"))
    if (!f->is_string() || f->get<std::string>() != "sigmoid")
      bad("scoring_func", "DeepSeek-V3 scores experts with \"sigmoid\", the only one supported; found " + f->dump());
  if (const json* t = find(c, "topk_method"))
    if (!t->is_string() || t->get<std::string>() != "noaux_tc")
      bad("topk_method", "only \"noaux_tc\" (DeepSeek-V3's group-limited top-k with e_score_correction_bias) is "
                         "supported, found " + t->dump());
  if (const json* f = find(c, "moe_layer_freq"))
    if (!f->is_number_integer() || f->get<int64_t>() != 1)
      bad("moe_layer_freq", "only 1 (every layer after first_k_dense_replace is an MoE layer) is supported, found " +
                                f->dump());
  const int64_t dense = required_count(c, "first_k_dense_replace");
  if (dense >= cfg.num_layers) return;  // no MoE layer: the dense model
  MoeConfig& m = cfg.moe;
  m.num_experts = required_int(c, "n_routed_experts");
  check_bound("n_routed_experts", m.num_experts, 4096);
  m.top_k = required_int(c, "num_experts_per_tok");
  if (m.top_k > m.num_experts)
    bad("num_experts_per_tok", "expected 1 .. n_routed_experts (" + std::to_string(m.num_experts) + "), found " +
                                   std::to_string(m.top_k));
  m.ffn_hidden_size = required_int(c, "moe_intermediate_size");
  check_bound("moe_intermediate_size", m.ffn_hidden_size, int64_t{1} << 20);
  m.shared_expert_intermediate_size = find(c, "shared_expert_intermediate_size") != nullptr
                                          ? required_int(c, "shared_expert_intermediate_size")
                                          : required_count(c, "n_shared_experts") * m.ffn_hidden_size;
  check_bound("n_shared_experts", m.shared_expert_intermediate_size, int64_t{1} << 20);
  m.shared_experts_name = true;
  m.score = MoeConfig::Score::kSigmoid;
  m.expert_bias = optional_bool(c, "moe_router_enable_expert_bias", true);
  m.norm_topk_prob = optional_bool(c, "norm_topk_prob", true);
  m.topk_scaling_factor = optional_double(c, "routed_scaling_factor", 2.5);
  if (!(m.topk_scaling_factor > 0))
    bad("routed_scaling_factor", "expected a positive number, found " + find(c, "routed_scaling_factor")->dump());
  m.n_group = required_int(c, "n_group");
  m.topk_group = required_int(c, "topk_group");
  if (m.num_experts % m.n_group != 0)
    bad("n_group", std::to_string(m.n_group) + " does not divide n_routed_experts " + std::to_string(m.num_experts));
  if (m.topk_group > m.n_group)
    bad("topk_group", "expected 1 .. n_group (" + std::to_string(m.n_group) + "), found " + std::to_string(m.topk_group));
  if (m.top_k > m.topk_group * (m.num_experts / m.n_group))
    bad("num_experts_per_tok", std::to_string(m.top_k) + " is more than the experts of topk_group groups (" +
                                   std::to_string(m.topk_group * (m.num_experts / m.n_group)) + ")");
  m.moe_layers.assign(cfg.num_layers, true);
  for (int64_t i = 0; i < dense; ++i) m.moe_layers[i] = false;
  for (int64_t i : layer_list(c, "mlp_only_layers", cfg.num_layers)) m.moe_layers[i] = false;
  if (std::all_of(m.moe_layers.begin(), m.moe_layers.end(), [](bool x) { return x; })) m.moe_layers.clear();
}

}  // namespace

LlamaConfig llama_config_from_hf(const json& c) {
  if (!c.is_object()) throw std::invalid_argument("HF config.json: not a JSON object");
  const json* mt = find(c, "model_type");
  if (mt == nullptr) bad("model_type", "missing");
  if (!mt->is_string()) bad("model_type", "expected a string, found " + mt->dump());
  const std::string model_type = mt->get<std::string>();
  static const std::vector<std::string> kTypes = {"llama",     "mistral",   "qwen2",   "qwen3",
                                                  "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"};
  if (std::find(kTypes.begin(), kTypes.end(), model_type) == kTypes.end())
    bad("model_type", "'" + model_type + "' is not supported (llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, "
                      "deepseek_v3)");
  const bool deepseek = model_type == "deepseek_v3";
  const bool qwen3 = model_type == "qwen3" || model_type == "qwen3_moe";

  // The class transformers would build must be the one this model_type is (GPT-2's weights under a
  // llama model_type would otherwise load as a Llama).
  if (const json* arch = find(c, "architectures")) {
    if (!arch->is_array()) bad("architectures", "expected a list, found " + arch->dump());
    for (const json& a : *arch) {
      const std::string want = architecture(model_type);
      const bool ok = a.is_string() && (a.get<std::string>() == want ||
                                        (model_type == "mistral" && a.get<std::string>() == "MistralForCausalLM"));
      if (!ok)
        bad("architectures", a.dump() + " is not a model mfsdp builds: model_type \"" + model_type + "\" is " +
                                 (model_type == "mistral" ? std::string("MistralForCausalLM") : want));
    }
  }
  // The weights are held in fp32 whatever the files hold; a dtype that is not floating point is
  // not a model mfsdp can train (a quantized export).
  for (const char* key : {"torch_dtype", "dtype"})
    if (const json* dt = find(c, key)) {
      static const std::vector<std::string> kFloat = {"float32", "bfloat16", "float16"};
      if (!dt->is_string() || std::find(kFloat.begin(), kFloat.end(), dt->get<std::string>()) == kFloat.end())
        bad(key, dt->dump() + " is not a floating-point dtype (float32, bfloat16 or float16; mfsdp holds the "
                 "weights in float32)");
    }

  LlamaConfig cfg;
  cfg.vocab_size = required_int(c, "vocab_size");
  check_bound("vocab_size", cfg.vocab_size, int64_t{1} << 24);
  cfg.hidden_size = required_int(c, "hidden_size");
  check_bound("hidden_size", cfg.hidden_size, int64_t{1} << 17);
  cfg.intermediate_size = required_int(c, "intermediate_size");
  check_bound("intermediate_size", cfg.intermediate_size, int64_t{1} << 20);
  cfg.num_layers = required_int(c, "num_hidden_layers");
  check_bound("num_hidden_layers", cfg.num_layers, 1024);
  cfg.num_attention_heads = required_int(c, "num_attention_heads");
  check_bound("num_attention_heads", cfg.num_attention_heads, cfg.hidden_size);
  cfg.num_key_value_heads = optional_int(c, "num_key_value_heads", cfg.num_attention_heads);
  if (cfg.num_attention_heads % cfg.num_key_value_heads != 0)
    bad("num_key_value_heads", std::to_string(cfg.num_key_value_heads) + " does not divide num_attention_heads " +
                                   std::to_string(cfg.num_attention_heads));
  cfg.max_position_embeddings = required_int(c, "max_position_embeddings");
  check_bound("max_position_embeddings", cfg.max_position_embeddings, int64_t{1} << 22);
  cfg.rope_theta = optional_double(c, "rope_theta", 10000.0);
  if (cfg.rope_theta <= 0) bad("rope_theta", "must be > 0, found " + std::to_string(cfg.rope_theta));
  cfg.rms_norm_eps = optional_double(c, "rms_norm_eps", 1e-6);
  if (cfg.rms_norm_eps < 0) bad("rms_norm_eps", "must be >= 0, found " + std::to_string(cfg.rms_norm_eps));
  cfg.init_std = optional_double(c, "initializer_range", 0.02);
  if (cfg.init_std < 0) bad("initializer_range", "must be >= 0, found " + std::to_string(cfg.init_std));
  cfg.tie_word_embeddings = optional_bool(c, "tie_word_embeddings", false);

  // gated_mlp false: a checkpoint's model_config of Megatron's GeLU MLP (a model trained without
  // --swiglu); never in a Hugging Face folder.
  cfg.swiglu = optional_bool(c, "gated_mlp", true);
  const std::string act_expected = cfg.swiglu ? "silu" : "gelu";
  if (const json* act = find(c, "hidden_act")) {
    if (!act->is_string() || act->get<std::string>() != act_expected)
      bad("hidden_act", "only \"" + act_expected + "\" is supported" + (cfg.swiglu ? "" : " with gated_mlp false") +
                            ", found " + act->dump());
  }
  if (const json* rs = find(c, "rope_scaling"); rs != nullptr && !deepseek)
    bad("rope_scaling", "RoPE scaling is not supported, found " + rs->dump());
  // transformers 5 writes the RoPE settings as {"rope_parameters": {"rope_theta": ..,
  // "rope_type": "default"}} instead of a top-level rope_theta.
  if (const json* rp = find(c, "rope_parameters"); rp != nullptr && !deepseek) {
    if (!rp->is_object()) bad("rope_parameters", "expected an object, found " + rp->dump());
    if (const json* type = find(*rp, "rope_type")) {
      if (!type->is_string() || type->get<std::string>() != "default")
        bad("rope_parameters.rope_type", "only \"default\" RoPE is supported, found " + type->dump());
    }
    if (find(*rp, "rope_theta") != nullptr) cfg.rope_theta = optional_double(*rp, "rope_theta", cfg.rope_theta);
  }
  cfg.qk_norm = qwen3;
  if (model_type == "qwen2") {
    // Qwen2Attention always has q/k/v biases (and none on o_proj), whatever the file says.
    cfg.attention_bias = true;
  } else if (model_type == "qwen2_moe") {
    cfg.attention_bias = optional_bool(c, "qkv_bias", true);  // q/k/v only, as Qwen2
  } else if (optional_bool(c, "moe_qkv_bias", false)) {
    cfg.attention_bias = true;  // mfsdp's own: a Megatron MoE model trained with --add-qkv-bias
  } else if (!deepseek && optional_bool(c, "attention_bias", false)) {
    bad("attention_bias", "true on a " + model_type + " model also puts a bias on o_proj, which is not supported "
        "(q/k/v biases alone are: model_type \"qwen2\")");
  }
  if (optional_bool(c, "mlp_bias", false)) bad("mlp_bias", "MLP biases are not supported");
  if (model_type == "mistral" || model_type == "mixtral") {
    if (const json* sw = find(c, "sliding_window"))
      bad("sliding_window", "sliding-window attention is not supported, found " + sw->dump());
  }
  if (model_type != "llama" && model_type != "mistral" && model_type != "mixtral" &&
      optional_bool(c, "use_sliding_window", false))
    bad("use_sliding_window", "sliding-window attention is not supported (sliding_window is ignored only when "
        "use_sliding_window is false)");
  // transformers 5 spells the attention kind per layer; only full attention is supported.
  if (const json* lt = find(c, "layer_types")) {
    if (!lt->is_array()) bad("layer_types", "expected a list, found " + lt->dump());
    for (const json& t : *lt)
      if (!t.is_string() || t.get<std::string>() != "full_attention")
        bad("layer_types", "only \"full_attention\" layers are supported, found " + t.dump());
  }
  if (find(c, "head_dim") != nullptr && !deepseek) {  // DeepSeek-V3's is the RoPE width (qk_rope_head_dim)
    const int64_t hd = required_int(c, "head_dim");
    check_bound("head_dim", hd, int64_t{1} << 17);
    if (cfg.hidden_size % cfg.num_attention_heads != 0 || hd != cfg.hidden_size / cfg.num_attention_heads)
      cfg.explicit_head_dim = hd;  // Qwen3's heads need not divide hidden_size
  }
  if (model_type == "qwen3_moe" || model_type == "qwen2_moe" || model_type == "mixtral") read_moe(c, model_type, cfg);
  if (deepseek) read_deepseek_v3(c, cfg);
  try {
    cfg.validate();
  } catch (const std::invalid_argument& e) {
    // What is left for validate() to find is said in config.json's words: its field names are
    // LlamaConfig's (num_layers is num_hidden_layers, init_std initializer_range). The MoE
    // fields' checks are read_moe's, in the file's keys, so none reaches here.
    std::string what = e.what();
    for (const std::string prefix : {"LlamaConfig.", "MoeConfig."})
      for (size_t at; (at = what.find(prefix)) != std::string::npos;) what.erase(at, prefix.size());
    static const std::vector<std::pair<std::string, std::string>> kNames = {
        {"num_layers", "num_hidden_layers"}, {"init_std", "initializer_range"}, {"explicit_head_dim", "head_dim"}};
    for (const auto& [ours, theirs] : kNames)
      if (what.rfind(ours + ":", 0) == 0) what.replace(0, ours.size(), theirs);
    const auto colon = what.find(':');
    throw std::invalid_argument("HF config.json field '" + what.substr(0, colon) + "'" +
                                (colon == std::string::npos ? "" : what.substr(colon)));
  }
  return cfg;
}

std::vector<std::string> hf_bias_tensors(const std::vector<std::string>& tensor_names) {
  std::vector<std::string> out;
  const std::string suffix = "bias";
  const std::string router = "e_score_correction_bias";  // DeepSeek-V3's routing bias, a buffer
  for (const auto& n : tensor_names)
    if (n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        !(n.size() >= router.size() && n.compare(n.size() - router.size(), router.size(), router) == 0))
      out.push_back(n);
  return out;
}

namespace {
std::string quoted(const std::vector<std::string>& names, size_t most = 8) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > most) out += " and " + std::to_string(names.size() - most) + " more";
  return out;
}
}  // namespace

void refuse_hf_mtp_tensors(const LlamaConfig& cfg, const std::vector<std::string>& tensor_names, const std::string& where) {
  std::vector<std::string> mtp;
  const std::string prefix = "model.layers.";
  for (const std::string& n : tensor_names) {
    if (n.compare(0, prefix.size(), prefix) != 0) continue;
    const size_t dot = n.find('.', prefix.size());
    const std::string index = n.substr(prefix.size(), dot == std::string::npos ? std::string::npos : dot - prefix.size());
    if (!index.empty() && index.find_first_not_of("0123456789") == std::string::npos && index.size() < 10 &&
        std::stoll(index) >= cfg.num_layers)
      mtp.push_back(n);
  }
  if (!mtp.empty())
    throw std::invalid_argument(where + " has tensors of layers past num_hidden_layers " + std::to_string(cfg.num_layers) +
                                " (DeepSeek-V3's multi-token prediction layers, num_nextn_predict_layers), which mfsdp "
                                "does not build: " + quoted(mtp));
}

void reconcile_hf_biases(LlamaConfig& cfg, const std::vector<std::string>& tensor_names, const std::string& where) {
  const std::vector<std::string> present = hf_bias_tensors(tensor_names);
  if (!cfg.attention_bias) {
    if (!present.empty())
      throw std::invalid_argument(where + " has bias tensors, which its config.json does not provide for (only "
                                  "Qwen2's q/k/v biases are supported, with model_type \"qwen2\"): " + quoted(present, 16));
    return;
  }
  if (present.empty()) {
    cfg.attention_bias = false;  // zero biases: the model without them
    return;
  }
  std::vector<std::string> missing;
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
      const std::string name = "model.layers." + std::to_string(l) + ".self_attn." + proj + ".bias";
      if (std::find(present.begin(), present.end(), name) == present.end()) missing.push_back(name);
    }
  if (!missing.empty())
    throw std::invalid_argument(where + " has only some of Qwen2's q/k/v bias tensors: present " + quoted(present) +
                                "; missing " + quoted(missing));
}

}  // namespace mfsdp
