#include "mfsdp/generate.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "mfsdp/batched_generate.h"
#include "mfsdp/hf_interop.h"
#include "mfsdp/hf_llama.h"

namespace mfsdp {
namespace {

const std::string kModelPrefix = "model.";  // a checkpoint's model tensors (hf_interop.h)
const std::string kFormatKey = "__format__";  // model.pt's marker entry, not a tensor

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// llama_config_from_hf with `where` (the file, or the checkpoint and field) in front of its error.
LlamaConfig config_from_hf(const nlohmann::json& j, const std::string& where) {
  try {
    return llama_config_from_hf(j);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + ": " + e.what());
  }
}

// LlamaForCausalLM(cfg) holding the tensors `shapes` lists (by HF name), read one by one with
// `read` and cast to fp32, after check_llama_tensors: any missing, unexpected or misshapen
// tensor is an error before anything is read.
LlamaForCausalLM build_model(const LlamaConfig& cfg, const std::map<std::string, std::vector<int64_t>>& shapes,
                             const std::function<at::Tensor(const std::string&)>& read, const std::string& where) {
  check_llama_tensors(shapes, cfg, where);
  LlamaOptions options;
  options.init_seed = 0;  // every value is overwritten below: leave the default generator alone
  LlamaForCausalLM model(cfg, options);
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    const at::Tensor t = read(p.key());
    if (!at::isFloatingType(t.scalar_type()))
      throw std::invalid_argument(where + ": tensor '" + p.key() + "' is " + c10::toString(t.scalar_type()) +
                                  ", not a floating-point tensor");
    p.value().copy_(t);
  }
  return model;
}

}  // namespace

std::vector<int64_t> generate(LlamaForCausalLMImpl& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& o) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt is empty");
  if (!(o.temperature > 0)) throw std::invalid_argument("generate: temperature must be > 0");
  if (!(o.top_p > 0 && o.top_p <= 1)) throw std::invalid_argument("generate: top_p must be in (0, 1]");
  if (o.top_k < 0) throw std::invalid_argument("generate: top_k must be >= 0");
  if (o.max_new_tokens < 0) throw std::invalid_argument("generate: max_new_tokens must be >= 0");
  const int64_t limit = model.config().max_position_embeddings;
  if (static_cast<int64_t>(prompt.size()) >= limit)
    throw std::invalid_argument("generate: the prompt has " + std::to_string(prompt.size()) +
                                " tokens; the model takes at most " + std::to_string(limit));
  // A batch of one (batched_generate.h): the same KV-cache decoding and CPU sampling with a
  // generator seeded o.seed, so one prompt continues exactly as it does inside a rollout batch.
  SamplingOptions s;
  s.max_new_tokens = o.max_new_tokens;
  s.greedy = o.greedy;
  s.temperature = o.temperature;
  s.top_k = o.top_k;
  s.top_p = o.top_p;
  if (o.stop_id >= 0) s.stop_ids = {o.stop_id};
  return generate_batch(model, {prompt}, {o.seed}, s).tokens.front();
}

void save_final_model(const std::string& dir, const LlamaConfig& c, const std::string& tokenizer_type,
                      const std::map<std::string, at::Tensor>& state) {
  namespace fs = std::filesystem;
  // The HF mapping (hf_llama.h) so that load_final_model, checkpoints and HF folders share one
  // config reader; "tokenizer_type" is ours (transformers ignores unknown fields).
  auto embed = state.find("model.embed_tokens.weight");
  const at::ScalarType dtype = embed != state.end() && (embed->second.scalar_type() == at::kBFloat16 ||
                                                        embed->second.scalar_type() == at::kHalf)
                                   ? embed->second.scalar_type()
                                   : at::kFloat;
  nlohmann::json j = llama_hf_config(c, dtype);
  j["tokenizer_type"] = tokenizer_type;
  fs::create_directories(dir);
  std::ofstream(fs::path(dir) / "config.json") << j.dump(2) << "\n";
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : state) dict.insert(name, t.contiguous());
  dict.insert(kFormatKey, torch::tensor({1}));  // keeps the dict >= 2 entries (libtorch_probe Q8)
  std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream out(fs::path(dir) / "model.pt", std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + (fs::path(dir) / "model.pt").string());
}

LoadedModel load_final_model(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path config_path = fs::path(dir) / "config.json", model_path = fs::path(dir) / "model.pt";
  std::ifstream cin(config_path);
  if (!cin) throw std::invalid_argument("cannot read " + config_path.string());
  nlohmann::json j;
  try {
    cin >> j;
  } catch (const std::exception& e) {
    throw std::invalid_argument(config_path.string() + ": " + e.what());
  }
  // Folders written before save_final_model used llama_hf_config have no model_type; every
  // final-model folder holds a Llama.
  if (j.is_object() && !j.contains("model_type")) j["model_type"] = "llama";
  LoadedModel loaded;
  const LlamaConfig c = config_from_hf(j, config_path.string());
  if (j.contains("tokenizer_type") && j["tokenizer_type"].is_string())
    loaded.tokenizer_type = j["tokenizer_type"].get<std::string>();

  std::ifstream in(model_path, std::ios::binary);
  if (!in) throw std::invalid_argument("cannot read " + model_path.string());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw std::invalid_argument(model_path.string() + ": not a torch pickle file: " + e.what());
  }
  if (!value.isGenericDict())
    throw std::invalid_argument(model_path.string() + ": expected a dict of tensors by name, found " +
                                value.tagKind());
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString())
      throw std::invalid_argument(model_path.string() + ": a key is " + item.key().tagKind() + ", not a name");
    const std::string name = item.key().toStringRef();
    if (name == kFormatKey) continue;
    if (!item.value().isTensor())
      throw std::invalid_argument(model_path.string() + ": entry '" + name + "' is " + item.value().tagKind() +
                                  ", not a tensor");
    tensors[name] = item.value().toTensor();
  }
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, t] : tensors) shapes[name] = t.sizes().vec();
  loaded.model = build_model(c, shapes, [&](const std::string& name) { return tensors.at(name); },
                             model_path.string());
  return loaded;
}

LoadedModel load_model(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path dir(path);
  if (fs::is_regular_file(dir / "config.json") && fs::is_regular_file(dir / "model.pt"))
    return load_final_model(path);
  if (!is_checkpoint(path) && !is_hf_folder(path))
    throw std::invalid_argument(
        "'" + path + "' " + (fs::exists(dir) ? "is none of" : "does not exist; a model is one of") +
        ": a final model (config.json and model.pt, from mfsdp-pretrain --save-final-model), a "
        "checkpoint (a folder with latest_checkpointed_iteration.txt, or an iter_NNNNNNN folder with "
        "metadata.json, from mfsdp-pretrain --save or mfsdp-ckpt import-hf), a Hugging Face Llama folder "
        "(config.json with model.safetensors or model.safetensors.index.json)");
  const TensorSource source(path);
  const std::string where = source.description();
  const nlohmann::json model_config = source.model_config();
  if (source.is_checkpoint() && model_config.empty())
    throw std::invalid_argument(where + " has no model_config in its metadata.json; generation needs the model's "
                                "configuration");
  LlamaConfig c = config_from_hf(model_config, where + (source.is_checkpoint() ? ": model_config" : ": config.json"));

  // The model's tensors by HF name: a checkpoint stores them as "model.<HF name>", and
  // TensorSource names an HF folder's tensors the same way (hf_interop.h).
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const std::string& name : source.names())
    if (starts_with(name, kModelPrefix)) shapes[name.substr(kModelPrefix.size())] = source.shape(name);
  if (!source.is_checkpoint()) {
    // What import_hf accepts from transformers' folders, so `--model HF` and `--model
    // $(mfsdp-ckpt import-hf HF)` load the same model.
    std::vector<std::string> names;
    for (const auto& kv : shapes) names.push_back(kv.first);
    reconcile_hf_biases(c, names, where);  // Qwen2's q/k/v biases: all or none
    for (auto it = shapes.begin(); it != shapes.end();)
      it = ends_with(it->first, "rotary_emb.inv_freq") ? shapes.erase(it) : std::next(it);
    if (c.tie_word_embeddings && shapes.count("lm_head.weight") && shapes.count("model.embed_tokens.weight")) {
      const at::Tensor head = source.read(kModelPrefix + "lm_head.weight");
      const at::Tensor embed = source.read(kModelPrefix + "model.embed_tokens.weight");
      if (head.scalar_type() != embed.scalar_type() || head.sizes() != embed.sizes() || !at::equal(head, embed))
        throw std::invalid_argument(where + ": config.json has tie_word_embeddings true, but 'lm_head.weight' "
                                    "differs from 'model.embed_tokens.weight'");
      shapes.erase("lm_head.weight");
    }
  }
  LoadedModel loaded;
  loaded.model = build_model(c, shapes, [&](const std::string& name) { return source.read(kModelPrefix + name); },
                             where);
  if (const CheckpointReader* reader = source.checkpoint()) {
    const nlohmann::json& meta = reader->metadata();
    if (meta.contains("args") && meta["args"].is_object() && meta["args"].contains("--tokenizer-type") &&
        meta["args"]["--tokenizer-type"].is_string())
      loaded.tokenizer_type = meta["args"]["--tokenizer-type"].get<std::string>();
  }
  return loaded;
}

}  // namespace mfsdp
