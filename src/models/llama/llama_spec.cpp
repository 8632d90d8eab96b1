// The Llama family's ModelSpec (src/models/llama/llama_spec.h): Megatron's arguments and
// Hugging Face configs to LlamaConfig, Megatron-Core's parameter names to the model's, the FLOP
// formula. The model itself: llama.cpp; config.json: llama_hf_config.cpp.
#include "models/llama/llama_spec.h"

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
      {"rms_norm_eps", "norm_epsilon"},            {"init_std", "init_method_std"}};
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
std::vector<MegatronRows> llama_rows(const std::string& fqn, int64_t rows,
                                     std::optional<std::pair<int64_t, int64_t>> heads, bool gated,
                                     const std::string& where) {
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
  };
  if (auto it = kWhole.find(fqn); it != kWhole.end()) return {{it->second, {}, rows}};
  static const std::regex layer(R"(decoder\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(fqn, m, layer)) return {};
  const std::string prefix = "model.layers." + m[1].str() + ".", rest = m[2].str();
  if (auto it = kLayerWhole.find(rest); it != kLayerWhole.end()) return {{prefix + it->second, {}, rows}};
  if (rest == "mlp.linear_fc1.weight") {
    if (!gated) return {{prefix + "mlp.up_proj.weight", {}, rows}};
    if (rows % 2) throw std::invalid_argument(where + " has an odd number of rows for [gate; up]");
    return {{prefix + "mlp.gate_proj.weight", {{0, rows / 2}}, rows / 2},
            {prefix + "mlp.up_proj.weight", {{rows / 2, rows / 2}}, rows / 2}};
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

class LlamaSpec final : public ModelSpec {
 public:
  std::string name() const override { return "llama"; }
  std::vector<std::string> hf_model_types() const override { return {"llama", "mistral", "qwen2"}; }

  ModelConfig config_from_megatron(const json& args) const override {
    if (!args.is_object()) throw std::invalid_argument("Megatron arguments: not a JSON object");
    // Megatron-LM's GPT as this family builds it: RMSNorm, RoPE, no linear biases.
    if (text(args, "normalization", "") != "RMSNorm")
      bad_arg("normalization", "the Llama family has RMSNorm, found " + text(args, "normalization", "none"));
    if (text(args, "position_embedding_type", "rope") != "rope")
      bad_arg("position_embedding_type", "the Llama family has RoPE, found " + text(args, "position_embedding_type", ""));
    if (flag(args, "add_bias_linear")) bad_arg("add_bias_linear", "the Llama family has no linear biases");
    if (flag(args, "qk_layernorm")) bad_arg("qk_layernorm", "the Llama family has no query/key norms");
    if (number(args, "num_experts", 0) > 0) bad_arg("num_experts", "the Llama family has no mixture of experts");
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
    if (number(args, "kv_channels", 0) > 0 && static_cast<int64_t>(number(args, "kv_channels", 0)) != c.head_dim())
      bad_arg("kv_channels", "differs from hidden_size / num_attention_heads (" + std::to_string(c.head_dim()) + ")");
    return llama_model_config(c);
  }

  ModelConfig config_from_hf(const json& hf) const override { return llama_model_config(llama_config_from_hf(hf)); }

  json hf_config(const ModelConfig& config, at::ScalarType torch_dtype) const override {
    return llama_hf_config(llama_config_of(config), torch_dtype);
  }

  std::string hf_export_refusal(const ModelConfig& config) const override {
    if (llama_config_of(config).swiglu) return "";
    return "the model has Megatron's GeLU MLP (trained without --swiglu), which no Hugging Face Llama or Qwen2 has "
           "(their MLP is SwiGLU); it has no Hugging Face folder";
  }

  ModelConfig with_hf_tensors(const ModelConfig& config, const std::vector<std::string>& tensor_names,
                              const std::string& where) const override {
    LlamaConfig c = llama_config_of(config);
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
    if (config != nullptr) {
      const LlamaConfig c = llama_config_of(*config);
      heads = std::make_pair(c.num_attention_heads, c.num_key_value_heads);
      gated = c.swiglu;
    }
    return llama_rows(fqn, rows, heads, gated, where);
  }

  double flops_per_iteration(const ModelConfig& config, int64_t batch, int64_t seq_length) const override {
    // megatron/training/training.py num_floating_point_operations: 3 (fwd + 2 bwd) x 2 (mul-add)
    // x 2 (two GEMMs per block side) = 12.
    const LlamaConfig c = llama_config_of(config);
    const double expansion = 12.0;
    const double gated = c.swiglu ? 1.5 : 1.0;
    const double h = static_cast<double>(c.hidden_size), s = static_cast<double>(seq_length);
    const double layers = static_cast<double>(c.num_layers);
    const double attention = 1.0 + static_cast<double>(c.num_key_value_heads) / c.num_attention_heads + s / h;
    const double mlp = static_cast<double>(c.intermediate_size) / h * gated;
    const double logits = static_cast<double>(c.vocab_size) / (2.0 * layers * h);
    return expansion * batch * s * layers * h * h * (attention + mlp + logits);
  }

  std::string describe(const ModelConfig& config) const override {
    const LlamaConfig c = llama_config_of(config);
    return std::to_string(c.num_layers) + " layers, hidden " + std::to_string(c.hidden_size) + ", vocab " +
           std::to_string(c.vocab_size) + (c.tie_word_embeddings ? ", tied embeddings" : "");
  }
};

}  // namespace

const ModelSpec& llama_spec() {
  static const LlamaSpec spec;
  return spec;
}

ModelConfig llama_model_config(const LlamaConfig& cfg) { return {&llama_spec(), llama_hf_config(cfg, at::kFloat)}; }

LlamaConfig llama_config_of(const ModelConfig& config) {
  if (config.spec != &llama_spec())
    throw std::logic_error("llama_config_of: a config of family '" +
                           (config.spec ? config.spec->name() : std::string("(none)")) + "'");
  return llama_config_from_hf(config.hf);
}

}  // namespace mfsdp
