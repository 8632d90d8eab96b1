// Hugging Face config.json <-> LlamaConfig: see include/mfsdp/models/llama_hf_config.h.
#include "mfsdp/models/llama_hf_config.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

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
  if (cfg.moe.num_experts > 0) write_moe(j, cfg, model_type);
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
  m.expert_bias = optional_bool(c, "moe_router_enable_expert_bias", false);
  if (m.expert_bias && m.score != MoeConfig::Score::kSigmoid)
    bad("moe_router_enable_expert_bias", "true needs moe_router_score_function \"sigmoid\" (aux-loss-free "
        "balancing scores experts with a sigmoid, as in Megatron-LM)");
  m.topk_scaling_factor = optional_double(c, "moe_router_topk_scaling_factor", 1.0);
  if (m.topk_scaling_factor <= 0)
    bad("moe_router_topk_scaling_factor", "expected a positive number, found " +
                                              find(c, "moe_router_topk_scaling_factor")->dump());
}

}  // namespace

LlamaConfig llama_config_from_hf(const json& c) {
  if (!c.is_object()) throw std::invalid_argument("HF config.json: not a JSON object");
  const json* mt = find(c, "model_type");
  if (mt == nullptr) bad("model_type", "missing");
  if (!mt->is_string()) bad("model_type", "expected a string, found " + mt->dump());
  const std::string model_type = mt->get<std::string>();
  static const std::vector<std::string> kTypes = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"};
  if (std::find(kTypes.begin(), kTypes.end(), model_type) == kTypes.end())
    bad("model_type", "'" + model_type + "' is not supported (llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral)");
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
  if (const json* rs = find(c, "rope_scaling")) bad("rope_scaling", "RoPE scaling is not supported, found " + rs->dump());
  // transformers 5 writes the RoPE settings as {"rope_parameters": {"rope_theta": ..,
  // "rope_type": "default"}} instead of a top-level rope_theta.
  if (const json* rp = find(c, "rope_parameters")) {
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
  } else if (optional_bool(c, "attention_bias", false)) {
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
  if (find(c, "head_dim") != nullptr) {
    const int64_t hd = required_int(c, "head_dim");
    check_bound("head_dim", hd, int64_t{1} << 17);
    if (cfg.hidden_size % cfg.num_attention_heads != 0 || hd != cfg.hidden_size / cfg.num_attention_heads)
      cfg.explicit_head_dim = hd;  // Qwen3's heads need not divide hidden_size
  }
  if (model_type == "qwen3_moe" || model_type == "qwen2_moe" || model_type == "mixtral") read_moe(c, model_type, cfg);
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
  for (const auto& n : tensor_names)
    if (n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0) out.push_back(n);
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
