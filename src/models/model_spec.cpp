// ModelConfig's common fields and the shapes of a family's parameters
// (include/mfsdp/models/model_spec.h).
#include "mfsdp/models/model_spec.h"

#include <stdexcept>

namespace mfsdp {
namespace {

int64_t field(const nlohmann::json& hf, const char* name) {
  auto it = hf.find(name);
  if (it == hf.end() || !it->is_number_integer())
    throw std::logic_error(std::string("ModelConfig: no integer '") + name + "' (not written by a ModelSpec)");
  return it->get<int64_t>();
}

}  // namespace

int64_t ModelConfig::vocab_size() const { return field(hf, "vocab_size"); }
int64_t ModelConfig::num_layers() const { return field(hf, "num_hidden_layers"); }
int64_t ModelConfig::hidden_size() const { return field(hf, "hidden_size"); }
int64_t ModelConfig::max_position_embeddings() const { return field(hf, "max_position_embeddings"); }

int64_t megatron_default_ffn_hidden_size(int64_t hidden_size, bool swiglu) {
  if (!swiglu) return 4 * hidden_size;
  // The same double operations as Python's int((4 * h * 2 / 3) / 64) * 64.
  return static_cast<int64_t>(static_cast<double>(4 * hidden_size * 2) / 3.0 / 64.0) * 64;
}

std::vector<std::pair<std::string, at::Tensor>> model_tensors(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : model.named_buffers(/*recurse=*/true)) out.emplace_back(b.key(), b.value());
  return out;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> model_tensor_shapes(const ModelConfig& config) {
  ModelBuildOptions options;
  options.deferred_init = true;  // full shapes, no storage
  options.init_seed = 0;         // leave the default generator alone
  std::shared_ptr<CausalLM> model = config.spec->build(config, options);
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& [name, t] : model_tensors(*model)) out.emplace_back(name, t.sizes().vec());
  return out;
}

}  // namespace mfsdp
