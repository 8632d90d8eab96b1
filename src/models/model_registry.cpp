// The registry of model families (include/mfsdp/models/model_spec.h). A family registers by one
// line in kFamilies; the list is explicit because self-registering statics in a static library
// are dropped by the linker when nothing else references their object file.
#include <stdexcept>

#include "mfsdp/models/model_spec.h"
#include "models/llama/llama_spec.h"

namespace mfsdp {

const std::vector<const ModelSpec*>& model_specs() {
  static const std::vector<const ModelSpec*> kFamilies = {
      &llama_spec(),      // Llama, Mistral (no sliding window), Qwen2
      &qwen3_spec(),      // Qwen3, Qwen3-MoE
      &mixtral_spec(),    // Mixtral
      &qwen2_moe_spec(),  // Qwen2-MoE
      &deepseek_v3_spec(),  // DeepSeek-V3
  };
  return kFamilies;
}

const ModelSpec& model_spec(const std::string& name) {
  std::string known;
  for (const ModelSpec* spec : model_specs()) {
    if (spec->name() == name) return *spec;
    known += (known.empty() ? "" : ", ") + spec->name();
  }
  throw std::invalid_argument("no model family '" + name + "' (known: " + known + ")");
}

const ModelSpec& model_spec_for_hf(const nlohmann::json& hf) {
  if (!hf.is_object()) throw std::invalid_argument("HF config.json: not a JSON object");
  auto it = hf.find("model_type");
  if (it == hf.end() || it->is_null()) throw std::invalid_argument("HF config.json field 'model_type': missing");
  if (!it->is_string())
    throw std::invalid_argument("HF config.json field 'model_type': expected a string, found " + it->dump());
  const std::string type = it->get<std::string>();
  std::string known;
  for (const ModelSpec* spec : model_specs())
    for (const std::string& t : spec->hf_model_types()) {
      if (t == type) return *spec;
      known += (known.empty() ? "" : ", ") + t;
    }
  throw std::invalid_argument("HF config.json field 'model_type': '" + type + "' is not supported (" + known + ")");
}

const ModelSpec& model_spec_for_megatron(const nlohmann::json& args) {
  return *model_config_from_megatron(args).spec;
}

ModelConfig model_config_from_hf(const nlohmann::json& hf) { return model_spec_for_hf(hf).config_from_hf(hf); }

ModelConfig model_config_from_megatron(const nlohmann::json& args) {
  std::string first_error;
  for (const ModelSpec* spec : model_specs()) {
    try {
      return spec->config_from_megatron(args);
    } catch (const std::invalid_argument& e) {
      if (first_error.empty()) first_error = e.what();
    }
  }
  throw std::invalid_argument(first_error);
}

}  // namespace mfsdp
