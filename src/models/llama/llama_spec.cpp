// The decoder's ModelSpecs (src/models/llama/llama_spec.h): Llama/Qwen2, Qwen3 (dense and MoE),
// Mixtral and Qwen2-MoE are one model (llama.h, moe.h) with different Hugging Face families.
// Megatron's arguments and Hugging Face configs to LlamaConfig, Megatron-Core's parameter names
// to the model's, the FLOP formula. The model itself: llama.cpp; config.json: llama_hf_config.cpp.
#include "models/llama/llama_spec.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <regex>
#include <stdexcept>


namespace mfsdp {
namespace {

using json = nlohmann::json;

[[noreturn]] void bad_arg(const std::string& name, const std::string& what) {
  throw std::invalid_argument("Megatron argument '" + name + "': " + what);
}

// A number argument, or `fallback` when absent or null.
double number(const json& args, const char* name, double fallback) {
  auto it = args.find(name);
  if (it == args.end() || it->is_null()) return fallback;
  if (!it->is_number()) bad_arg(name, "expected a number, found " + it->dump());
  return it->get<double>();
}

int64_t positive_int(const json& args, const char* name) {
  auto it = args.find(name);
  if (it == args.end() || it->is_null()) bad_arg(name, "missing");
  const double v = number(args, name, 0);
  if (v <= 0 || v != std::floor(v) || v > 9.0e15) bad_arg(name, "expected a positive integer, found " + it->dump());
  return static_cast<int64_t>(v);
}

// The Megatron argument behind each LlamaConfig field, for LlamaConfig::validate's errors.
const std::map<std::string, std::string>& argument_of_field() {
  static const std::map<std::string, std::string> names = {
      {"vocab_size", "padded_vocab_size"},         {"hidden_size", "hidden_size"},
      {"intermediate_size", "ffn_hidden_size"},    {"num_layers", "num_layers"},
      {"num_attention_heads", "num_attention_heads"}, {"num_key_value_heads", "num_query_groups"},
      {"max_position_embeddings", "max_position_embeddings"}, {"rope_theta", "rotary_base"},
      {"rms_norm_eps", "norm_epsilon"},            {"init_std", "init_method_std"},
      {"MoeConfig.top_k", "moe_router_topk"},      {"MoeConfig.ffn_hidden_size", "moe_ffn_hidden_size"},
      {"MoeConfig.moe_layers", "moe_layer_freq"}, {"MoeConfig.n_group", "moe_router_num_groups"},
      {"MoeConfig.topk_group", "moe_router_group_topk"}, {"mla.q_lora_rank", "q_lora_rank"},
      {"mla.kv_lora_rank", "kv_lora_rank"},        {"mla.qk_nope_head_dim", "qk_head_dim"},
      {"mla.qk_rope_head_dim", "qk_pos_emb_head_dim"}, {"mla.v_head_dim", "v_head_dim"}};
  return names;
}

bool flag(const json& args, const char* name) {
  auto it = args.find(name);
  if (it == args.end() || it->is_null()) return false;
  if (!it->is_boolean()) bad_arg(name, "expected true or false, found " + it->dump());
  return it->get<bool>();
}

std::string text(const json& args, const char* name, const std::string& fallback) {
  auto it = args.find(name);
  if (it == args.end() || it->is_null()) return fallback;
  if (!it->is_string()) bad_arg(name, "expected a string, found " + it->dump());
  return it->get<std::string>();
}

// The model's parameters made from rows of one Megatron-Core GPT tensor `fqn` (Transformer
// Engine layer spec, as Megatron-FSDP's fsdp_dtensor and converted torch_dist checkpoints name
// them). `heads` (query heads, key/value groups) splits the fused linear_qkv; `gated` says
// whether linear_fc1 is [gate; up] (SwiGLU) or up alone (GeLU).
// [gate; up] rows of a SwiGLU linear_fc1 as `gate` and `up`.
std::vector<MegatronRows> gate_up(const std::string& gate, const std::string& up, int64_t rows, const std::string& where) {
  if (rows % 2) throw std::invalid_argument(where + " has an odd number of rows for [gate; up]");
  return {{gate, {{0, rows / 2}}, rows / 2}, {up, {{rows / 2, rows / 2}}, rows / 2}};
}

// An MoE layer's tensors (Megatron-Core's MoELayer: router (and its expert_bias, with
// --moe-router-enable-expert-bias), TEGroupedMLP's "weight{j}" or
// SequentialMLP's "local_experts.{j}", shared_experts) as the family names them; `c` says
// whether the block is "mlp" or Mixtral's "block_sparse_moe" with w1/w3/w2. A SwiGLU linear_fc1
// comes whole ([gate; up]) or as Megatron-FSDP's halves "<name>_w" (gate) and "<name>_v" (up).
std::vector<MegatronRows> moe_rows(const std::string& prefix, const std::string& rest, int64_t rows,
                                   const LlamaConfig& c, const std::string& where) {
  const std::string block = prefix + (c.moe.mixtral_names ? "block_sparse_moe." : "mlp.");
  const char* g = c.moe.mixtral_names ? "w1" : "gate_proj";
  const char* u = c.moe.mixtral_names ? "w3" : "up_proj";
  const char* d = c.moe.mixtral_names ? "w2" : "down_proj";
  const std::string shared = c.moe.shared_experts_name ? "shared_experts." : "shared_expert.";
  // A whole fc1 as gate and up, or the half `half` ("_w", "_v") names.
  auto fc1 = [&](const std::string& gate, const std::string& up, const std::string& half) -> std::vector<MegatronRows> {
    if (half.empty()) return gate_up(gate, up, rows, where);
    return {{half == "_w" ? gate : up, {}, rows}};
  };
  if (rest == "pre_mlp_layernorm.weight") return {{prefix + "post_attention_layernorm.weight", {}, rows}};
  if (rest == "mlp.router.weight") return {{block + "gate.weight", {}, rows}};
  if (rest == "mlp.router.expert_bias" && c.moe.expert_bias) return {{block + "gate.e_score_correction_bias", {}, rows}};
  for (const char* half : {"", "_w", "_v"})
    if (rest == std::string("mlp.shared_experts.linear_fc1.weight") + half)
      return fc1(block + shared + "gate_proj.weight", block + shared + "up_proj.weight", half);
  if (rest == "mlp.shared_experts.linear_fc2.weight") return {{block + shared + "down_proj.weight", {}, rows}};
  if (rest == "mlp.shared_experts.gate_weight") return {{block + "shared_expert_gate.weight", {}, rows}};
  static const std::regex grouped(R"(mlp\.experts\.linear_fc([12])\.weight(\d+)(_[wv])?)");
  static const std::regex sequential(R"(mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight(_[wv])?)");
  std::smatch m;
  std::string fc, expert;
  if (std::regex_match(rest, m, grouped)) {
    fc = m[1].str();
    expert = m[2].str();
  } else if (std::regex_match(rest, m, sequential)) {
    expert = m[1].str();
    fc = m[2].str();
  } else {
    return {};
  }
  const std::string half = m[3].str();
  if (expert.size() > 9 || std::stoll(expert) >= c.moe.num_experts)
    throw std::invalid_argument(where + " is expert " + expert + " of a model with " + std::to_string(c.moe.num_experts));
  const std::string e = block + "experts." + expert + ".";
  if (fc == "2") return half.empty() ? std::vector<MegatronRows>{{e + d + ".weight", {}, rows}} : std::vector<MegatronRows>{};
  return fc1(e + g + ".weight", e + u + ".weight", half);
}

std::vector<MegatronRows> llama_rows(const std::string& fqn, int64_t rows,
                                     std::optional<std::pair<int64_t, int64_t>> heads, bool gated,
                                     const LlamaConfig* config, const std::string& where) {
  static const std::map<std::string, std::string> kWhole = {
      {"embedding.word_embeddings.weight", "model.embed_tokens.weight"},
      {"decoder.final_layernorm.weight", "model.norm.weight"},
      {"output_layer.weight", "lm_head.weight"},
  };
  static const std::map<std::string, std::string> kLayerWhole = {
      {"self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"},
      {"self_attention.linear_proj.weight", "self_attn.o_proj.weight"},
      {"mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"},
      {"mlp.linear_fc1.weight_w", "mlp.gate_proj.weight"},
      {"mlp.linear_fc1.weight_v", "mlp.up_proj.weight"},
      {"mlp.linear_fc2.weight", "mlp.down_proj.weight"},
      {"self_attention.q_layernorm.weight", "self_attn.q_norm.weight"},
      {"self_attention.k_layernorm.weight", "self_attn.k_norm.weight"},
  };
  if (auto it = kWhole.find(fqn); it != kWhole.end()) return {{it->second, {}, rows}};
  static const std::regex layer(R"(decoder\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(fqn, m, layer)) return {};
  const std::string prefix = "model.layers." + m[1].str() + ".", rest = m[2].str();
  // A layer past the model's keeps a name the model does not have (reported as unexpected).
  const bool in_model = config != nullptr && m[1].str().size() < 10 && std::stoll(m[1].str()) < config->num_layers;
  if (in_model && config->moe.is_moe_layer(std::stoll(m[1].str()))) {
    if (auto moe = moe_rows(prefix, rest, rows, *config, where); !moe.empty()) return moe;
  }
  if (auto it = kLayerWhole.find(rest); it != kLayerWhole.end()) return {{prefix + it->second, {}, rows}};
  if (rest == "mlp.linear_fc1.weight") {
    if (!gated) return {{prefix + "mlp.up_proj.weight", {}, rows}};
    return gate_up(prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight", rows, where);
  }
  for (const char* kind : {"weight", "bias"}) {
    if (rest != std::string("self_attention.linear_qkv.") + kind) continue;
    if (!heads) return {};  // cannot split without the head counts: keeps its name
    const auto [q_heads, kv_heads] = *heads;
    if (q_heads <= 0 || kv_heads <= 0 || q_heads % kv_heads || rows % (q_heads + 2 * kv_heads))
      throw std::invalid_argument(where + " has " + std::to_string(rows) + " rows, which do not split into " +
                                  std::to_string(q_heads) + " query heads and " + std::to_string(kv_heads) +
                                  " key/value groups");
    // For each query group g the fused rows are [g's q heads; g's k head; g's v head].
    if (config != nullptr && rows != (q_heads + 2 * kv_heads) * config->head_dim())
      throw std::invalid_argument(where + " has " + std::to_string(rows) + " rows, not (" + std::to_string(q_heads) +
                                  " + 2 x " + std::to_string(kv_heads) + ") heads of " +
                                  std::to_string(config->head_dim()));
    const int64_t d = rows / (q_heads + 2 * kv_heads), per_group = q_heads / kv_heads, stride = (per_group + 2) * d;
    MegatronRows q{prefix + "self_attn.q_proj." + kind, {}, q_heads * d};
    MegatronRows k{prefix + "self_attn.k_proj." + kind, {}, kv_heads * d};
    MegatronRows v{prefix + "self_attn.v_proj." + kind, {}, kv_heads * d};
    for (int64_t g = 0; g < kv_heads; ++g) {
      q.ranges.emplace_back(g * stride, per_group * d);
      k.ranges.emplace_back(g * stride + per_group * d, d);
      v.ranges.emplace_back(g * stride + (per_group + 1) * d, d);
    }
    return {q, k, v};
  }
  return {};
}

// Megatron's --moe-layer-freq: every N-th layer from layer 0 (an integer), or one 0/1 per layer.
std::vector<bool> moe_layer_pattern(const json& args, int64_t layers) {
  auto it = args.find("moe_layer_freq");
  if (it == args.end() || it->is_null()) return {};
  std::vector<bool> pattern;
  if (it->is_number_integer()) {
    const int64_t freq = it->get<int64_t>();
    if (freq <= 0) bad_arg("moe_layer_freq", "expected a positive integer or a list of 0/1, found " + it->dump());
    for (int64_t i = 0; i < layers; ++i) pattern.push_back(i % freq == 0);
  } else if (it->is_array()) {
    for (const json& v : *it) {
      if (!v.is_number_integer() || (v.get<int64_t>() != 0 && v.get<int64_t>() != 1))
        bad_arg("moe_layer_freq", "expected a list of 0 and 1, found " + it->dump());
      pattern.push_back(v.get<int64_t>() == 1);
    }
    if (static_cast<int64_t>(pattern.size()) != layers)
      bad_arg("moe_layer_freq", "has " + std::to_string(pattern.size()) + " entries for " + std::to_string(layers) +
                                    " layers");
  } else {
    bad_arg("moe_layer_freq", "expected a positive integer or a list of 0/1, found " + it->dump());
  }
  if (std::all_of(pattern.begin(), pattern.end(), [](bool m) { return m; })) pattern.clear();
  return pattern;
}

// Megatron-LM's GPT as this family builds it (RMSNorm, RoPE, no linear biases), dense or MoE.
LlamaConfig decoder_config_from_megatron(const json& args) {
  if (!args.is_object()) throw std::invalid_argument("Megatron arguments: not a JSON object");
  if (text(args, "normalization", "") != "RMSNorm")
    bad_arg("normalization", "the Llama family has RMSNorm, found " + text(args, "normalization", "none"));
  if (text(args, "position_embedding_type", "rope") != "rope")
    bad_arg("position_embedding_type", "the Llama family has RoPE, found " + text(args, "position_embedding_type", ""));
  if (flag(args, "add_bias_linear")) bad_arg("add_bias_linear", "the Llama family has no linear biases");
  LlamaConfig c;
  c.num_layers = positive_int(args, "num_layers");
  c.hidden_size = positive_int(args, "hidden_size");
  c.num_attention_heads = positive_int(args, "num_attention_heads");
  c.vocab_size = positive_int(args, "padded_vocab_size");
  c.swiglu = flag(args, "swiglu");
  c.intermediate_size = number(args, "ffn_hidden_size", 0) > 0 ? positive_int(args, "ffn_hidden_size")
                                                                : megatron_default_ffn_hidden_size(c.hidden_size, c.swiglu);
  c.num_key_value_heads = flag(args, "group_query_attention") && number(args, "num_query_groups", 0) > 0
                              ? positive_int(args, "num_query_groups")
                              : c.num_attention_heads;
  // Megatron builds RoPE models for --seq-length when --max-position-embeddings is smaller.
  const double positions = std::max(number(args, "max_position_embeddings", -1), number(args, "seq_length", -1));
  if (positions <= 0) bad_arg("max_position_embeddings", "missing, and so is seq_length");
  c.max_position_embeddings = static_cast<int64_t>(positions);
  if (number(args, "norm_epsilon", -1) >= 0) c.rms_norm_eps = number(args, "norm_epsilon", -1);
  if (number(args, "rotary_base", -1) > 0) c.rope_theta = number(args, "rotary_base", -1);
  if (number(args, "init_method_std", -1) >= 0) c.init_std = number(args, "init_method_std", -1);
  c.tie_word_embeddings = !flag(args, "untie_embeddings_and_output_weights");
  c.attention_bias = flag(args, "add_qkv_bias");  // Qwen2's q/k/v biases
  c.qk_norm = flag(args, "qk_layernorm");          // Qwen3's per-head q/k RMSNorm
  // --kv-channels: the heads' width, when it is not hidden_size / num_attention_heads.
  if (number(args, "kv_channels", 0) > 0) {
    const int64_t kv = positive_int(args, "kv_channels");
    if (c.hidden_size % c.num_attention_heads != 0 || kv != c.hidden_size / c.num_attention_heads) c.explicit_head_dim = kv;
  }
  if (number(args, "num_experts", 0) > 0) {
    MoeConfig& m = c.moe;
    m.num_experts = positive_int(args, "num_experts");
    m.top_k = number(args, "moe_router_topk", 0) != 0 ? positive_int(args, "moe_router_topk") : 2;
    // Megatron: --moe-ffn-hidden-size defaults to --ffn-hidden-size.
    m.ffn_hidden_size = number(args, "moe_ffn_hidden_size", 0) > 0 ? positive_int(args, "moe_ffn_hidden_size") : c.intermediate_size;
    if (number(args, "moe_shared_expert_intermediate_size", 0) > 0)
      m.shared_expert_intermediate_size = positive_int(args, "moe_shared_expert_intermediate_size");
    m.shared_expert_gate = flag(args, "moe_shared_expert_gate");
    if (m.shared_expert_gate && m.shared_expert_intermediate_size == 0)
      bad_arg("moe_shared_expert_gate", "needs a shared expert (moe_shared_expert_intermediate_size)");
    const std::string score = text(args, "moe_router_score_function", "softmax");
    if (score != "softmax" && score != "sigmoid")
      bad_arg("moe_router_score_function", "expected softmax or sigmoid, found " + score);
    m.score = score == "sigmoid" ? MoeConfig::Score::kSigmoid : MoeConfig::Score::kSoftmax;
    // Megatron's sigmoid router renormalises whatever --moe-router-pre-softmax says.
    m.norm_topk_prob = m.score == MoeConfig::Score::kSigmoid || !flag(args, "moe_router_pre_softmax");
    const double scaling = number(args, "moe_router_topk_scaling_factor", 1.0);
    if (!(scaling > 0)) bad_arg("moe_router_topk_scaling_factor", "expected a positive number");
    m.topk_scaling_factor = scaling;
    m.expert_bias = flag(args, "moe_router_enable_expert_bias");
    if (m.expert_bias && !(m.score == MoeConfig::Score::kSigmoid))
      bad_arg("moe_router_enable_expert_bias", "needs moe_router_score_function sigmoid, as in Megatron-LM");
    m.moe_layers = moe_layer_pattern(args, c.num_layers);
    if (number(args, "moe_router_num_groups", 0) > 0) {
      m.n_group = positive_int(args, "moe_router_num_groups");
      m.topk_group = positive_int(args, "moe_router_group_topk");
    }
    // Which Hugging Face family it is: q/k norms, Qwen3-MoE; a shared expert, Qwen2-MoE; else Mixtral.
    m.mixtral_names = !c.qk_norm && m.shared_expert_intermediate_size == 0;
    if (!c.swiglu) bad_arg("swiglu", "the experts are SwiGLU MLPs: MoE models need --swiglu");
  }
  if (flag(args, "multi_latent_attention")) {
    // Megatron's MLATransformerConfig: YaRN (its default rope_type) over max_position_embeddings,
    // which a factor of 1 leaves plain RoPE; the RoPE part interleaved, as DeepSeek's weights.
    MlaConfig a;
    a.hidden_size = c.hidden_size;
    a.num_heads = c.num_attention_heads;
    a.q_lora_rank = number(args, "q_lora_rank", 0) > 0 ? positive_int(args, "q_lora_rank") : 0;
    a.kv_lora_rank = positive_int(args, "kv_lora_rank");
    a.qk_nope_head_dim = static_cast<int64_t>(number(args, "qk_head_dim", 0));
    a.qk_rope_head_dim = positive_int(args, "qk_pos_emb_head_dim");
    a.v_head_dim = positive_int(args, "v_head_dim");
    a.rope_theta = c.rope_theta;
    const double factor = number(args, "rotary_scaling_factor", 1.0);
    if (factor != 1.0) {
      YarnRopeScaling y;
      y.factor = factor;
      y.original_max_position_embeddings = c.max_position_embeddings;
      y.mscale = number(args, "mscale", 1.0);
      y.mscale_all_dim = number(args, "mscale_all_dim", 0.0);
      a.yarn = y;
    }
    c.mla = a;
    if (c.qk_norm) bad_arg("qk_layernorm", "multi-head latent attention has its own latent norms, not --qk-layernorm");
    if (c.attention_bias) bad_arg("add_qkv_bias", "multi-head latent attention has no q/k/v biases");
    if (c.moe.num_experts > 0) {
      // Built as DeepSeek-V3's MoE, which is what a Hugging Face folder of it can hold.
      if (c.moe.score != MoeConfig::Score::kSigmoid)
        bad_arg("moe_router_score_function", "multi-head latent attention models are DeepSeek-V3's: sigmoid");
      if (c.moe.shared_expert_gate) bad_arg("moe_shared_expert_gate", "DeepSeek-V3's shared experts are ungated");
      c.moe.shared_experts_name = true;
      c.moe.mixtral_names = false;
    }
  }
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    // "LlamaConfig.<field>: ..." names the field; the caller wrote the Megatron argument.
    const std::string what = e.what(), prefix = "LlamaConfig.";
    const size_t colon = what.find(':');
    if (what.rfind(prefix, 0) == 0 && colon != std::string::npos) {
      const auto it = argument_of_field().find(what.substr(prefix.size(), colon - prefix.size()));
      if (it != argument_of_field().end()) bad_arg(it->second, what.substr(colon + 2));
    }
    throw std::invalid_argument("Megatron arguments: " + what);
  }
  return c;
}

// One spec per Hugging Face family of the decoder (llama.h): they differ in the config.json
// types they read and the models Megatron's arguments make of them (hf_model_type).
class DecoderSpec final : public ModelSpec {
 public:
  DecoderSpec(std::string name, std::vector<std::string> types, std::string describe_family)
      : name_(std::move(name)), types_(std::move(types)), family_(std::move(describe_family)) {}
  std::string name() const override { return name_; }
  std::vector<std::string> hf_model_types() const override { return types_; }

  ModelConfig config_from_megatron(const json& args) const override {
    const LlamaConfig c = decoder_config_from_megatron(args);
    const ModelConfig config = llama_model_config(c);
    if (config.spec != this) {
      if (c.moe.num_experts > 0 && name_ != "qwen3")
        bad_arg("num_experts", "the " + family_ + " family has no mixture of experts of this kind (a " +
                                   hf_model_type(c) + " model)");
      if (c.qk_norm) bad_arg("qk_layernorm", "the " + family_ + " family has no query/key norms");
      bad_arg("qk_layernorm", "the " + family_ + " family has query/key norms; the arguments make a " + hf_model_type(c) +
                                  " model");
    }
    return config;
  }

  ModelConfig config_from_hf(const json& hf) const override { return llama_model_config(llama_config_from_hf(hf)); }

  json hf_config(const ModelConfig& config, at::ScalarType torch_dtype) const override {
    return llama_hf_config(llama_config_of(config), torch_dtype);
  }

  std::string hf_export_refusal(const ModelConfig& config) const override { return hf_refusal(llama_config_of(config)); }

  ModelConfig with_hf_tensors(const ModelConfig& config, const std::vector<std::string>& tensor_names,
                              const std::string& where) const override {
    LlamaConfig c = llama_config_of(config);
    refuse_hf_mtp_tensors(c, tensor_names, where);  // DeepSeek-V3's multi-token prediction layers
    reconcile_hf_biases(c, tensor_names, where);  // Qwen2's q/k/v biases: all or none
    return llama_model_config(c);
  }

  std::shared_ptr<CausalLM> build(const ModelConfig& config, const ModelBuildOptions& options) const override {
    return LlamaForCausalLM(llama_config_of(config), options).ptr();
  }

  std::vector<MegatronRows> from_megatron_name(const std::string& fqn, int64_t rows, const ModelConfig* config,
                                               const std::string& where) const override {
    std::optional<std::pair<int64_t, int64_t>> heads;
    bool gated = true;  // without a config, linear_fc1 is taken as SwiGLU's [gate; up]
    std::optional<LlamaConfig> c;
    if (config != nullptr) {
      c = llama_config_of(*config);
      heads = std::make_pair(c->num_attention_heads, c->num_key_value_heads);
      gated = c->swiglu;
    }
    return llama_rows(fqn, rows, heads, gated, c ? &*c : nullptr, where);
  }

  double flops_per_iteration(const ModelConfig& config, int64_t batch, int64_t seq_length) const override {
    // megatron/training/training.py num_floating_point_operations: 3 (fwd + 2 bwd) x 2 (mul-add)
    // x 2 (two GEMMs per block side) = 12. MoE layers count the experts a token is routed to
    // (top-k) and the shared expert: the active parameters.
    const LlamaConfig c = llama_config_of(config);
    const double expansion = 12.0;
    const double gated = c.swiglu ? 1.5 : 1.0;
    const double h = static_cast<double>(c.hidden_size), s = static_cast<double>(seq_length);
    const double layers = static_cast<double>(c.num_layers);
    const double query_ratio = static_cast<double>(c.head_dim() * c.num_attention_heads) / h;
    const double attention =
        query_ratio * (1.0 + static_cast<double>(c.num_key_value_heads) / c.num_attention_heads + s / h);
    double moe_layers = 0;
    for (int64_t i = 0; i < c.num_layers; ++i) moe_layers += c.moe.is_moe_layer(i) ? 1 : 0;
    const double dense_width = static_cast<double>(c.intermediate_size) * (layers - moe_layers) / layers;
    const double moe_width = static_cast<double>(c.moe.ffn_hidden_size * c.moe.top_k + c.moe.shared_expert_intermediate_size) *
                             moe_layers / layers;
    const double mlp = (dense_width + moe_width) / h * gated;
    const double logits = static_cast<double>(c.vocab_size) / (2.0 * layers * h);
    return expansion * batch * s * layers * h * h * (attention + mlp + logits);
  }

  ParallelSplits parallel_splits(const ModelConfig& config) const override {
    const LlamaConfig c = llama_config_of(config);
    ParallelSplits s;
    s.tensor_parallel = c.tensor_parallel_splits();
    s.experts = c.moe.num_experts;
    if (c.moe.num_experts > 0) s.expert_tensor_parallel = {{"moe_intermediate_size", c.moe.ffn_hidden_size}};
    return s;
  }

  std::string describe(const ModelConfig& config) const override {
    const LlamaConfig c = llama_config_of(config);
    std::string moe;
    if (c.moe.num_experts > 0)
      moe = ", " + std::to_string(c.moe.num_experts) + " experts (top " + std::to_string(c.moe.top_k) + ")";
    return hf_model_type(c) + ", " + std::to_string(c.num_layers) + " layers, hidden " + std::to_string(c.hidden_size) +
           ", vocab " + std::to_string(c.vocab_size) + moe + (c.tie_word_embeddings ? ", tied embeddings" : "");
  }

 private:
  std::string name_;
  std::vector<std::string> types_;
  std::string family_;
};

}  // namespace

const ModelSpec& llama_spec() {
  static const DecoderSpec spec("llama", {"llama", "mistral", "qwen2"}, "Llama");
  return spec;
}
const ModelSpec& qwen3_spec() {
  static const DecoderSpec spec("qwen3", {"qwen3", "qwen3_moe"}, "Qwen3");
  return spec;
}
const ModelSpec& mixtral_spec() {
  static const DecoderSpec spec("mixtral", {"mixtral"}, "Mixtral");
  return spec;
}
const ModelSpec& qwen2_moe_spec() {
  static const DecoderSpec spec("qwen2_moe", {"qwen2_moe"}, "Qwen2-MoE");
  return spec;
}
const ModelSpec& deepseek_v3_spec() {
  static const DecoderSpec spec("deepseek_v3", {"deepseek_v3"}, "DeepSeek-V3");
  return spec;
}

ModelConfig llama_model_config(const LlamaConfig& cfg) {
  const std::string type = hf_model_type(cfg);
  const ModelSpec* spec = &llama_spec();
  if (type == "qwen3" || type == "qwen3_moe") spec = &qwen3_spec();
  if (type == "mixtral") spec = &mixtral_spec();
  if (type == "qwen2_moe") spec = &qwen2_moe_spec();
  if (type == "deepseek_v3") spec = &deepseek_v3_spec();
  return {spec, llama_hf_config(cfg, at::kFloat)};
}

LlamaConfig llama_config_of(const ModelConfig& config) {
  if (config.spec != &llama_spec() && config.spec != &qwen3_spec() && config.spec != &mixtral_spec() &&
      config.spec != &qwen2_moe_spec() && config.spec != &deepseek_v3_spec())
    throw std::logic_error("llama_config_of: a config of family '" +
                           (config.spec ? config.spec->name() : std::string("(none)")) + "'");
  return llama_config_from_hf(config.hf);
}

}  // namespace mfsdp
