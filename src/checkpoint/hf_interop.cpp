// Hugging Face import and export (include/mfsdp/checkpoint/hf_interop.h): the checkpoint's model as a folder
// transformers loads, and a transformers folder of a registered model family as a checkpoint.
// Both check the tensors against the model the config describes (check_model_tensors) before
// writing anything, so a folder that would not load is refused here rather than at the first
// training step.
#include "mfsdp/checkpoint/hf_interop.h"
#include "mfsdp/checkpoint/tensor_source.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <optional>
#include <set>
#include <stdexcept>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/interop_util.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/checkpoint/safetensors.h"

namespace fs = std::filesystem;

namespace mfsdp {
namespace {

using json = nlohmann::json;
using interop::ends_with;
using interop::kConfigFile;
using interop::kModelPrefix;
using interop::read_json_file;
using interop::shape_str;
using interop::starts_with;

std::string quoted_list(const std::vector<std::string>& names, size_t limit = 8) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > limit) out += " and " + std::to_string(names.size() - limit) + " more";
  return out;
}

// The dtypes an export writes and an import accepts for weights (what transformers'
// configs name as torch_dtype).
bool is_output_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

}  // namespace

void check_model_tensors(const std::map<std::string, std::vector<int64_t>>& shapes, const ModelConfig& config,
                         const std::string& where) {
  std::vector<std::string> missing, unexpected, wrong;
  std::set<std::string> expected_names;
  for (const auto& [name, shape] : model_tensor_shapes(config)) {
    expected_names.insert(name);
    auto it = shapes.find(name);
    if (it == shapes.end())
      missing.push_back(name);
    else if (it->second != shape)
      wrong.push_back("'" + name + "' has shape " + shape_str(it->second) + ", the config expects " + shape_str(shape));
  }
  for (const auto& [name, shape] : shapes)
    if (!expected_names.count(name)) unexpected.push_back(name);
  if (missing.empty() && unexpected.empty() && wrong.empty()) return;
  std::string msg = where + ": the tensors do not match the model config (" + config.spec->describe(config) + "):";
  if (!missing.empty()) msg += " missing tensor(s) " + quoted_list(missing) + ";";
  if (!unexpected.empty()) msg += " unexpected tensor(s) " + quoted_list(unexpected) + ";";
  for (size_t i = 0; i < wrong.size() && i < 8; ++i) msg += " tensor " + wrong[i] + ";";
  if (wrong.size() > 8) msg += " and " + std::to_string(wrong.size() - 8) + " more misshapen tensors;";
  msg.pop_back();
  throw std::invalid_argument(msg);
}

at::ScalarType export_hf(const std::string& ckpt, const std::string& out_dir,
                         std::optional<at::ScalarType> requested, uint64_t max_shard_bytes,
                         const std::string& model_config_file) {
  if (requested && !is_output_float(*requested))
    throw std::invalid_argument(std::string("export_hf: the dtype must be float32, bfloat16 or float16, not ") +
                                c10::toString(*requested));
  CheckpointReader reader(ckpt);
  const std::string where = "checkpoint '" + reader.dir() + "'";
  ModelConfig cfg;
  try {
    cfg = model_config_from_hf(checkpoint_model_config(reader, model_config_file));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + ": model_config: " + e.what());
  }
  if (const std::string refusal = cfg.spec->hf_export_refusal(cfg); !refusal.empty())
    throw std::invalid_argument(where + ": " + refusal);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const std::string& name : reader.tensor_names())
    if (starts_with(name, kModelPrefix)) shapes[name.substr(kModelPrefix.size())] = reader.shape(name);
  check_model_tensors(shapes, cfg, where);
  for (const auto& [name, shape] : shapes)
    if (!at::isFloatingType(reader.dtype(kModelPrefix + name)))
      throw std::invalid_argument(where + ": tensor '" + kModelPrefix + name + "' is " +
                                  safetensors_dtype_name(reader.dtype(kModelPrefix + name)) +
                                  ", not a floating-point tensor");
  // Without a requested dtype, the checkpoint's: an export then holds exactly the checkpoint's
  // values (an fp32 checkpoint imported from an fp32 folder exports that folder's bytes). The
  // embedding decides when the model's tensors disagree, as it does for import_hf's torch_dtype.
  const std::string embedding = kModelPrefix + "model.embed_tokens.weight";
  const at::ScalarType dtype = requested ? *requested : reader.dtype(embedding);
  if (!is_output_float(dtype))
    throw std::invalid_argument(where + ": tensor '" + embedding + "' is " + safetensors_dtype_name(dtype) +
                                "; give an export dtype (mfsdp-ckpt export-hf --dtype fp32, bf16 or fp16)");
  const json config = cfg.spec->hf_config(cfg, dtype);

  std::vector<std::pair<std::string, at::Tensor>> tensors;  // module order: shards fill layer by layer
  for (const auto& [name, shape] : model_tensor_shapes(cfg))
    tensors.emplace_back(name, reader.read(kModelPrefix + name).to(dtype));
  fs::create_directories(out_dir);
  write_safetensors_sharded(out_dir, tensors, max_shard_bytes);
  checkpoint::write_file_atomically((fs::path(out_dir) / kConfigFile).string(), config.dump(2) + "\n");
  return dtype;
}

void import_hf(const std::string& hf_dir, const std::string& out_ckpt) {
  const std::string where = "HF folder '" + hf_dir + "'";
  if (!fs::is_directory(hf_dir)) throw std::invalid_argument(where + " does not exist or is not a folder");
  // Checked before a weight is read (config, tensor names and shapes, a tied head, float types),
  // then written a tensor at a time: the import holds one tensor, never the model.
  const TensorSource source(hf_dir);
  const HfModel described = describe_hf_model(source);
  const at::ScalarType dtype = source.dtype(kModelPrefix + "model.embed_tokens.weight");
  if (!is_output_float(dtype))
    throw std::invalid_argument(where + ": tensor 'model.embed_tokens.weight' is " + safetensors_dtype_name(dtype) +
                                "; weights must be float32, bfloat16 or float16");
  CheckpointInfo info;
  info.iteration = 0;
  info.consumed_samples = 0;
  info.model_config = described.config.spec->hf_config(described.config, dtype);
  info.args = {{"imported_from", hf_dir}};
  write_checkpoint(out_ckpt, described.shapes, [&](const std::string& name) {
    at::Tensor t = at::empty(described.shapes.at(name), at::TensorOptions().dtype(source.dtype(kModelPrefix + name)));
    source.read_range(kModelPrefix + name, 0, t.view({-1}));
    return t;
  }, info);
}

}  // namespace mfsdp
