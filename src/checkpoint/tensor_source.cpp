// TensorSource (include/mfsdp/checkpoint/tensor_source.h): a checkpoint or a Hugging Face folder behind one
// read-only interface. Opening reads headers only; tensors are read when asked for, whole or as
// an element range, so compare and print-tensor never hold a whole model.
#include "mfsdp/checkpoint/tensor_source.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/interop_util.h"
#include "mfsdp/base/json_parse.h"
#include "mfsdp/models/model_spec.h"

namespace fs = std::filesystem;

namespace mfsdp {
namespace {

using json = nlohmann::json;
using interop::kConfigFile;
using interop::kIndexFile;
using interop::kModelPrefix;
using interop::kSingleFile;
using interop::read_json_file;

// The metadata file of a PyTorch Distributed Checkpoint folder (torch.distributed.checkpoint's
// FileSystemWriter names it so).
constexpr const char* kDcpMetadataFile = ".metadata";

// A plain file name inside a folder (no path components): an index must not point outside it.
bool plain_file_name(const std::string& f) {
  return !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos && f.find('\\') == std::string::npos;
}

// The tensor names a safetensors file's header lists, read without checking the byte layout
// (SafetensorsFile::open does); empty when the header cannot be read.
std::vector<std::string> header_names(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char len[8];
  if (!in.read(reinterpret_cast<char*>(len), 8)) return {};
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];  // little-endian, whatever the host
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec || n > size - 8 || n > 100u * 1000u * 1000u) return {};  // the format's 100 MB header limit
  std::string header(n, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(n))) return {};
  const json h = try_parse_json(header);
  std::vector<std::string> names;
  if (!h.is_object()) return names;
  for (const auto& [name, entry] : h.items())
    if (name != "__metadata__") names.push_back(name);
  return names;
}

// A folder's safetensors files failed to open (`e`). A header that lost a tensor's entry leaves
// that tensor's bytes behind, which open() can only report as a gap beside some other tensor; the
// tensors the model of config.json has and no header lists are the cause, so they are named
// first. `e` as it is when config.json is no model mfsdp builds or nothing is missing.
[[noreturn]] void rethrow_naming_missing(const fs::path& dir, const std::string& where, const std::invalid_argument& e) {
  std::vector<std::string> files = {kSingleFile};
  if (fs::exists(dir / kIndexFile)) {
    files.clear();
    try {
      const json index = read_json_file((dir / kIndexFile).string(), "safetensors index");
      std::set<std::string> unique;
      for (const auto& [name, file] : index.at("weight_map").items())
        if (file.is_string() && plain_file_name(file.get<std::string>())) unique.insert(file.get<std::string>());
      files.assign(unique.begin(), unique.end());
    } catch (const std::exception&) {
      throw e;
    }
  }
  std::vector<std::string> names;
  for (const std::string& f : files)
    for (std::string& n : header_names((dir / f).string())) names.push_back(std::move(n));
  std::vector<std::string> missing;
  try {
    ModelConfig config = model_config_from_hf(read_json_file((dir / kConfigFile).string(), "HF config"));
    config = config.spec->with_hf_tensors(config, names, where);
    const std::set<std::string> present(names.begin(), names.end());
    for (const auto& [name, shape] : model_tensor_shapes(config))
      if (!present.count(name)) missing.push_back(name);
  } catch (const std::exception&) {
    throw e;
  }
  if (missing.empty()) throw e;
  std::string list;
  for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", '" : "'") + missing[i] + "'";
  if (missing.size() > 8) list += " and " + std::to_string(missing.size() - 8) + " more";
  throw std::invalid_argument(where + ": missing tensor(s) " + list + ", which the model of config.json has and no " +
                              "safetensors header lists; opening the files then fails: " + e.what());
}

}  // namespace

bool is_hf_folder(const std::string& path) {
  const fs::path p(path);
  return fs::is_directory(p) && fs::is_regular_file(p / kConfigFile) &&
         (fs::is_regular_file(p / kSingleFile) || fs::is_regular_file(p / kIndexFile));
}

TensorSource::TensorSource(const std::string& path) : path_(path) {
  if (mfsdp::is_checkpoint(path)) {
    reader_ = std::make_unique<CheckpointReader>(path);
    names_ = reader_->tensor_names();
    return;
  }
  if (!is_hf_folder(path))
    throw std::invalid_argument("'" + path + "' is neither a checkpoint (a save folder with " + checkpoint::kLatestFile +
                                ", or an iteration folder with " + kDcpMetadataFile + " or " +
                                checkpoint::kMetadataFile + ") nor a Hugging Face folder (config.json with " +
                                kSingleFile + " or " + kIndexFile + ")");
  const fs::path dir(path);
  try {
    open_hf_files(path);
  } catch (const std::invalid_argument& e) {
    rethrow_naming_missing(dir, description(), e);
  }
}

void TensorSource::open_hf_files(const std::string& path) {
  const fs::path dir(path);
  std::map<std::string, std::string> weight_map;  // HF name -> file
  const std::string index_path = (dir / kIndexFile).string();
  if (fs::exists(index_path)) {
    const json index = read_json_file(index_path, "safetensors index");
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      throw std::invalid_argument("safetensors index '" + index_path + "' has no \"weight_map\" object");
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string() || !plain_file_name(file.get<std::string>()))
        throw std::invalid_argument("safetensors index '" + index_path + "': tensor '" + name +
                                    "' maps to " + file.dump() + ", not a plain file name in the folder");
      weight_map[name] = file.get<std::string>();
    }
  } else {
    files_.emplace_back((dir / kSingleFile).string());
    for (const std::string& n : files_[0].names()) weight_map[n] = kSingleFile;
  }
  std::map<std::string, size_t> file_index;
  if (!files_.empty()) file_index[kSingleFile] = 0;
  for (const auto& [name, file] : weight_map) {
    auto it = file_index.find(file);
    if (it == file_index.end()) {
      const std::string file_path = (dir / file).string();
      if (!fs::exists(file_path))
        throw std::invalid_argument("safetensors index '" + index_path + "' names '" + file + "', which is missing");
      files_.emplace_back(file_path);
      it = file_index.emplace(file, files_.size() - 1).first;
    }
    if (!files_[it->second].contains(name))
      throw std::invalid_argument("safetensors file '" + files_[it->second].path() + "' has no tensor '" + name +
                                  "' (the index maps it there)");
    hf_[kModelPrefix + name] = {it->second, name};
  }
  for (const auto& [file, i] : file_index)
    for (const std::string& n : files_[i].names())
      if (!weight_map.count(n) || weight_map.at(n) != file)
        throw std::invalid_argument("safetensors file '" + files_[i].path() + "' holds tensor '" + n + "', which " +
                                    (weight_map.count(n) ? "the index maps to '" + weight_map.at(n) + "'"
                                                         : std::string("the index does not list")));
  for (const auto& kv : hf_) names_.push_back(kv.first);
}

std::string TensorSource::description() const {
  return reader_ ? "checkpoint '" + reader_->dir() + "'" : "Hugging Face folder '" + path_ + "'";
}

bool TensorSource::contains(const std::string& name) const {
  return reader_ ? reader_->contains(name) : hf_.count(name) != 0;
}

namespace {
[[noreturn]] void no_tensor(const TensorSource& s, const std::string& name) {
  throw std::invalid_argument("no tensor '" + name + "' in " + s.description());
}
}  // namespace

std::vector<int64_t> TensorSource::shape(const std::string& name) const {
  if (!contains(name)) no_tensor(*this, name);
  if (reader_) return reader_->shape(name);
  const auto& [file, n] = hf_.at(name);
  return files_[file].shape(n);
}

at::ScalarType TensorSource::dtype(const std::string& name) const {
  if (!contains(name)) no_tensor(*this, name);
  if (reader_) return reader_->dtype(name);
  const auto& [file, n] = hf_.at(name);
  return files_[file].dtype(n);
}

int64_t TensorSource::numel(const std::string& name) const {
  int64_t n = 1;
  for (int64_t s : shape(name)) n *= s;
  return n;
}

at::Tensor TensorSource::read(const std::string& name) const {
  if (!contains(name)) no_tensor(*this, name);
  if (reader_) return reader_->read(name);
  const auto& [file, n] = hf_.at(name);
  return files_[file].load(n);
}

at::Tensor TensorSource::read_elements(const std::string& name, int64_t offset, int64_t count) const {
  if (!contains(name)) no_tensor(*this, name);
  if (reader_) {
    at::Tensor out = at::empty({count}, at::TensorOptions().dtype(reader_->dtype(name)));
    if (count > 0) reader_->read_range(name, offset, out);
    return out;
  }
  const auto& [file, n] = hf_.at(name);
  return files_[file].load_elements(n, offset, count);
}

void TensorSource::read_range(const std::string& name, int64_t offset, const at::Tensor& dst) const {
  if (!contains(name)) no_tensor(*this, name);
  if (reader_) {
    if (dst.numel() > 0) reader_->read_range(name, offset, dst);
    return;
  }
  const auto& [file, n] = hf_.at(name);
  files_[file].read_elements_into(n, offset, dst);
}

json TensorSource::model_config() const {
  if (reader_) return reader_->metadata().value("model_config", json::object());
  return read_json_file((fs::path(path_) / kConfigFile).string(), "HF config");
}

json checkpoint_model_config(const CheckpointReader& reader, const std::string& model_config_file) {
  const std::string where = "checkpoint '" + reader.dir() + "'";
  const json recorded = reader.metadata().value("model_config", json::object());
  const bool has = recorded.is_object() && !recorded.empty();
  if (has && !model_config_file.empty())
    throw std::invalid_argument(where + " records its own model_config; --model-config " + model_config_file +
                                " is only for checkpoints that record none (such as PyTorch's dcp.save folders)");
  if (has) return recorded;
  if (model_config_file.empty())
    throw std::invalid_argument(where + " records no model_config (a checkpoint PyTorch or Megatron wrote); give the "
                                "model as a Hugging Face config.json with --model-config FILE");
  const json config = read_json_file(model_config_file, "--model-config");
  if (!config.is_object()) throw std::invalid_argument("--model-config " + model_config_file + ": not a JSON object");
  return config;
}

}  // namespace mfsdp
