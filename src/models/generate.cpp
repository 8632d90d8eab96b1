// Generation (KV-cache decoding through batched_generate) and load_model: see
// include/mfsdp/generate.h.
#include "mfsdp/generate.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "checkpoint/interop_util.h"
#include "mfsdp/batched_generate.h"
#include "mfsdp/hf_interop.h"
#include "mfsdp/hf_llama.h"
#include "mfsdp/tensor_source.h"

namespace mfsdp {
namespace {

using interop::ends_with;
using interop::kModelPrefix;  // a checkpoint's model tensors, and TensorSource's HF names
using interop::starts_with;

// llama_config_from_hf with `where` (the file, or the checkpoint and field) in front of its error.
LlamaConfig config_from_hf(const nlohmann::json& j, const std::string& where) {
  try {
    return llama_config_from_hf(j);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + ": " + e.what());
  }
}

// LlamaForCausalLM(cfg) holding the tensors `shapes` lists (by HF name), read one by one from
// `source` ("model.<HF name>") and cast to fp32, after check_llama_tensors: any missing,
// unexpected or misshapen tensor is an error before anything is read.
LlamaForCausalLM build_model(const LlamaConfig& cfg, const std::map<std::string, std::vector<int64_t>>& shapes,
                             const TensorSource& source, const std::string& where) {
  check_llama_tensors(shapes, cfg, where);
  LlamaOptions options;
  options.init_seed = 0;  // every value is overwritten below: leave the default generator alone
  LlamaForCausalLM model(cfg, options);
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    const at::Tensor t = source.read(kModelPrefix + p.key());
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

LoadedModel load_model(const std::string& path, const std::string& model_config_file) {
  namespace fs = std::filesystem;
  if (!is_checkpoint(path) && !is_hf_folder(path))
    throw std::invalid_argument(
        "'" + path + "' " + (fs::exists(path) ? "is neither" : "does not exist; a model is either") +
        " a checkpoint (a save folder with latest_checkpointed_iteration.txt, or one iteration folder with .metadata "
        "or metadata.json, from --save of mfsdp-pretrain, -sft or -grpo, mfsdp-ckpt import-hf or PyTorch's "
        "dcp.save) nor a Hugging Face Llama folder "
        "(config.json with model.safetensors or model.safetensors.index.json, from --export-hf or mfsdp-ckpt "
        "export-hf)");
  const TensorSource source(path);
  const std::string where = source.description();
  if (!source.is_checkpoint() && !model_config_file.empty())
    throw std::invalid_argument(where + " has its own config.json; --model-config is only for checkpoints that "
                                "record no model_config");
  const nlohmann::json model_config =
      source.is_checkpoint() ? checkpoint_model_config(*source.checkpoint(), model_config_file) : source.model_config();
  LlamaConfig c = config_from_hf(model_config, where + (source.is_checkpoint() ? ": model_config" : ": config.json"));

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
  loaded.model = build_model(c, shapes, source, where);
  if (const CheckpointReader* reader = source.checkpoint()) {
    const nlohmann::json& meta = reader->metadata();
    if (meta.contains("args") && meta["args"].is_object() && meta["args"].contains("--tokenizer-type") &&
        meta["args"]["--tokenizer-type"].is_string())
      loaded.tokenizer_type = meta["args"]["--tokenizer-type"].get<std::string>();
  }
  return loaded;
}

}  // namespace mfsdp
