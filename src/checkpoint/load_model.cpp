// load_model: a model for inference from a checkpoint or a Hugging Face folder
// (include/mfsdp/checkpoint/load_model.h). It lives in the checkpoint layer because it reads
// checkpoints; the models layer below it only builds and runs models.
#include "mfsdp/checkpoint/load_model.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "checkpoint/dcp_checkpoint.h"
#include "checkpoint/interop_util.h"
#include "checkpoint/rank_strings.h"
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
    const at::ScalarType stored = source.dtype(kModelPrefix + name);
    if (!at::isFloatingType(stored))
      throw std::invalid_argument(where + ": tensor '" + name + "' is " + c10::toString(stored) +
                                  ", not a floating-point tensor");
    source.read_range(kModelPrefix + name, 0, p.view({-1}));  // converted piece by piece, no second copy
  }
  return model;
}

// Elements compared at a time when checking a tied head against the embedding.
constexpr int64_t kCompareChunk = int64_t{1} << 22;

// Whether two tensors of `source` hold the same values, read a piece at a time.
bool equal_tensors(const TensorSource& source, const std::string& a, const std::string& b) {
  if (source.dtype(a) != source.dtype(b) || source.shape(a) != source.shape(b)) return false;
  const int64_t numel = source.numel(a);
  for (int64_t at = 0; at < numel; at += kCompareChunk) {
    const int64_t n = std::min(kCompareChunk, numel - at);
    if (!at::equal(source.read_elements(a, at, n), source.read_elements(b, at, n))) return false;
  }
  return true;
}

}  // namespace

HfModel describe_hf_model(const TensorSource& source) {
  if (source.is_checkpoint()) throw std::logic_error("describe_hf_model: " + source.description() + " is a checkpoint");
  HfModel m;
  m.where = source.description();
  m.config = config_from_hf(source.model_config(), m.where + ": config.json");
  for (const std::string& name : source.names())
    if (starts_with(name, kModelPrefix)) m.shapes[name.substr(kModelPrefix.size())] = source.shape(name);
  std::vector<std::string> names;
  for (const auto& kv : m.shapes) names.push_back(kv.first);
  m.config = m.config.spec->with_hf_tensors(m.config, names, m.where);  // tensors a family may leave out
  for (auto it = m.shapes.begin(); it != m.shapes.end();)
    it = ends_with(it->first, "rotary_emb.inv_freq") ? m.shapes.erase(it) : std::next(it);
  if (m.config.hf.value("tie_word_embeddings", false) && m.shapes.count("lm_head.weight") &&
      m.shapes.count("model.embed_tokens.weight")) {
    if (!equal_tensors(source, kModelPrefix + "lm_head.weight", kModelPrefix + "model.embed_tokens.weight"))
      throw std::invalid_argument(m.where + ": config.json has tie_word_embeddings true, but 'lm_head.weight' "
                                  "differs from 'model.embed_tokens.weight'");
    m.shapes.erase("lm_head.weight");
  }
  check_model_tensors(m.shapes, m.config, m.where);
  for (const auto& [name, shape] : m.shapes)
    if (!at::isFloatingType(source.dtype(kModelPrefix + name)))
      throw std::invalid_argument(m.where + ": tensor '" + name + "' is " +
                                  c10::toString(source.dtype(kModelPrefix + name)) + ", not a floating-point tensor");
  return m;
}

int64_t load_hf_shards(const std::string& hf_dir, FsdpHandle& model, Communicator& world, const TensorSlices& slices) {
  torch::NoGradGuard no_grad;
  int64_t bytes = 0;
  std::string error;
  try {
    const TensorSource source(hf_dir);
    if (source.is_checkpoint()) throw std::invalid_argument("'" + hf_dir + "' is a checkpoint, not a Hugging Face folder");
    const HfModel described = describe_hf_model(source);
    // Slices of parameters, then the module buffers (held whole by every rank).
    std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, std::pair<int64_t, at::Tensor>>>> reads;
    for (const LocalShard& s : model.local_shards()) reads.push_back({s.name, {s.global_shape, {s.offset, s.local}}});
    for (const auto& [name, b] : model.buffers()) reads.push_back({name, {b.sizes().vec(), {0, b.view({-1})}}});
    auto slice_of = [&](const std::string& name) {
      const auto it = slices.find(name);
      return it == slices.end() ? nullptr : &it->second;
    };
    for (const auto& [name, what] : reads) {
      const auto it = described.shapes.find(name);
      if (it == described.shapes.end())
        throw std::invalid_argument(described.where + " has no tensor '" + name + "', which the model holds");
      const TensorSlice* slice = slice_of(name);
      const std::vector<int64_t>& expected = slice ? slice->whole_shape : what.first;
      if (it->second != expected)
        throw std::invalid_argument(described.where + ": tensor '" + name + "' has shape " +
                                    c10::str(at::IntArrayRef(it->second)) + ", the model expects " +
                                    c10::str(at::IntArrayRef(expected)) +
                                    (slice ? " (its tensor-parallel slices put together)" : ""));
    }
    for (const auto& [name, what] : reads) {
      const at::Tensor& dst = what.second.second;
      if (dst.numel() == 0) continue;
      const int64_t offset = what.second.first;
      if (const TensorSlice* slice = slice_of(name)) {  // the runs of the whole tensor the slice covers
        int64_t at = 0;
        for (const auto& [start, length] :
             checkpoint::slice_range_runs(slice->whole_shape, what.first, slice->origin, offset, offset + dst.numel())) {
          source.read_range(kModelPrefix + name, start, dst.narrow(0, at, length));
          at += length;
        }
      } else {
        source.read_range(kModelPrefix + name, offset, dst);
      }
      bytes += dst.numel() * static_cast<int64_t>(c10::elementSize(source.dtype(kModelPrefix + name)));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::vector<std::string> errors = checkpoint::all_gather_strings(world, error);
  if (!error.empty()) throw std::invalid_argument(error);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty())
      throw std::invalid_argument("loading '" + hf_dir + "' failed on rank " + std::to_string(r) + ": " + errors[r]);
  model.refresh_model_weights();  // main weights -> model weights; starts no all-gather
  return bytes;
}

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
  if (source.is_checkpoint()) {
    for (const std::string& name : source.names())
      if (starts_with(name, kModelPrefix)) shapes[name.substr(kModelPrefix.size())] = source.shape(name);
  } else {
    // What import_hf accepts from transformers' folders, so `--model HF` and `--model
    // $(mfsdp-ckpt import-hf HF)` load the same model.
    HfModel described = describe_hf_model(source);
    c = described.config;
    shapes = std::move(described.shapes);
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
