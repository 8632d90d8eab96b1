// load_model: a model for inference from a checkpoint or a Hugging Face folder
// (include/mfsdp/checkpoint/load_model.h). It lives in the checkpoint layer because it reads
// checkpoints; the models layer below it only builds and runs models.
#include "mfsdp/checkpoint/load_model.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "checkpoint/interop_util.h"
#include "mfsdp/checkpoint/hf_interop.h"
#include "mfsdp/checkpoint/tensor_source.h"

namespace mfsdp {
namespace {

using interop::ends_with;
using interop::kModelPrefix;  // a checkpoint's model tensors, and TensorSource's HF names
using interop::starts_with;

// model_config_from_hf with `where` (the file, or the checkpoint and field) in front of its error.
ModelConfig config_from_hf(const nlohmann::json& j, const std::string& where) {
  try {
    return model_config_from_hf(j);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + ": " + e.what());
  }
}

// The model `cfg` describes holding the tensors `shapes` lists (by HF name), read one by one from
// `source` ("model.<HF name>") and cast to fp32, after check_model_tensors: any missing,
// unexpected or misshapen tensor is an error before anything is read.
std::shared_ptr<CausalLM> build_model(const ModelConfig& cfg, const std::map<std::string, std::vector<int64_t>>& shapes,
                                      const TensorSource& source, const std::string& where) {
  check_model_tensors(shapes, cfg, where);
  ModelBuildOptions options;
  options.init_seed = 0;  // every value is overwritten below: leave the default generator alone
  std::shared_ptr<CausalLM> model = cfg.spec->build(cfg, options);
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model_tensors(*model)) {
    const at::Tensor t = source.read(kModelPrefix + name);
    if (!at::isFloatingType(t.scalar_type()))
      throw std::invalid_argument(where + ": tensor '" + name + "' is " + c10::toString(t.scalar_type()) +
                                  ", not a floating-point tensor");
    p.copy_(t);
  }
  return model;
}

}  // namespace

LoadedModel load_model(const std::string& path, const std::string& model_config_file) {
  namespace fs = std::filesystem;
  if (!is_checkpoint(path) && !is_hf_folder(path))
    throw std::invalid_argument(
        "'" + path + "' " + (fs::exists(path) ? "is neither" : "does not exist; a model is either") +
        " a checkpoint (a save folder with latest_checkpointed_iteration.txt, or one iteration folder with .metadata "
        "or metadata.json, from --save of mfsdp-pretrain, -sft or -grpo, mfsdp-ckpt import-hf or PyTorch's "
        "dcp.save) nor a Hugging Face model folder "
        "(config.json with model.safetensors or model.safetensors.index.json, from --export-hf or mfsdp-ckpt "
        "export-hf)");
  const TensorSource source(path);
  const std::string where = source.description();
  if (!source.is_checkpoint() && !model_config_file.empty())
    throw std::invalid_argument(where + " has its own config.json; --model-config is only for checkpoints that "
                                "record no model_config");
  const nlohmann::json model_config =
      source.is_checkpoint() ? checkpoint_model_config(*source.checkpoint(), model_config_file) : source.model_config();
  ModelConfig c = config_from_hf(model_config, where + (source.is_checkpoint() ? ": model_config" : ": config.json"));

  // The model's tensors by HF name: a checkpoint stores them as "model.<HF name>", and
  // TensorSource names an HF folder's tensors the same way (tensor_source.h).
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const std::string& name : source.names())
    if (starts_with(name, kModelPrefix)) shapes[name.substr(kModelPrefix.size())] = source.shape(name);
  if (!source.is_checkpoint()) {
    // What import_hf accepts from transformers' folders, so `--model HF` and `--model
    // $(mfsdp-ckpt import-hf HF)` load the same model.
    std::vector<std::string> names;
    for (const auto& kv : shapes) names.push_back(kv.first);
    c = c.spec->with_hf_tensors(c, names, where);  // tensors a family may leave out (Qwen2's biases)
    for (auto it = shapes.begin(); it != shapes.end();)
      it = ends_with(it->first, "rotary_emb.inv_freq") ? shapes.erase(it) : std::next(it);
    if (c.hf.value("tie_word_embeddings", false) && shapes.count("lm_head.weight") && shapes.count("model.embed_tokens.weight")) {
      const at::Tensor head = source.read(kModelPrefix + "lm_head.weight");
      const at::Tensor embed = source.read(kModelPrefix + "model.embed_tokens.weight");
      if (head.scalar_type() != embed.scalar_type() || head.sizes() != embed.sizes() || !at::equal(head, embed))
        throw std::invalid_argument(where + ": config.json has tie_word_embeddings true, but 'lm_head.weight' "
                                    "differs from 'model.embed_tokens.weight'");
      shapes.erase("lm_head.weight");
    }
  }
  LoadedModel loaded;
  loaded.model = build_model(c, shapes, source, where);
  loaded.config = c;
  if (const CheckpointReader* reader = source.checkpoint()) {
    const nlohmann::json& meta = reader->metadata();
    if (meta.contains("args") && meta["args"].is_object() && meta["args"].contains("--tokenizer-type") &&
        meta["args"]["--tokenizer-type"].is_string())
      loaded.tokenizer_type = meta["args"]["--tokenizer-type"].get<std::string>();
  }
  return loaded;
}

}  // namespace mfsdp
