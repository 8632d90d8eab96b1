// Where tensors come from when a tool reads a model it did not train: a sharded checkpoint or a
// Hugging Face folder, behind one read-only interface, so mfsdp-ckpt (compare, print-tensor) and
// mfsdp-generate (load_model.h) take either without caring which.
//
//   mfsdp::TensorSource src("hf_folder");                          // or a checkpoint
//   at::Tensor w = src.read("model.model.norm.weight");            // HF "model.norm.weight"
//
// Names: a checkpoint's tensors keep their names ("model.<fqn>", "optimizer.state....",
// "rng_state...."; include/mfsdp/checkpoint/checkpoint.h). An HF folder's tensor "<name>" is read as
// "model.<name>", the name the same parameter has in a checkpoint (the fqns of every family's
// CausalLM are transformers' names, include/mfsdp/models/causal_lm.h), so a checkpoint and its
// export compare tensor by tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/safetensors.h"

namespace mfsdp {

// True when `path` is a folder with config.json and model.safetensors or
// model.safetensors.index.json (a Hugging Face model folder).
bool is_hf_folder(const std::string& path);
// is_checkpoint(path): include/mfsdp/checkpoint/checkpoint.h.

// The model a checkpoint holds (Hugging Face config.json names): the model_config it records, or,
// for one that records none (a PyTorch dcp.save folder), the config.json `model_config_file`.
// std::invalid_argument naming the checkpoint when it has neither, or both (the file is only for
// checkpoints that record no model, so it can never silently disagree with one that does).
nlohmann::json checkpoint_model_config(const CheckpointReader& reader, const std::string& model_config_file);

// Read-only, whole-tensor or element-range access to the tensors of a checkpoint (every tensor:
// model, optimizer state, RNG) or of an HF folder (names "model.<HF name>", see above). Only
// headers are read when opening, so a large model is read piece by piece; an HF folder's index
// and shard headers are validated as read_safetensors_folder does (every tensor the index maps
// is in its file, every file's tensors are in the index). Errors are std::invalid_argument
// naming the folder or file and, where one is at fault, the tensor.
class TensorSource {
 public:
  // A checkpoint or an HF folder (is_checkpoint / is_hf_folder); anything else throws.
  explicit TensorSource(const std::string& path);

  bool is_checkpoint() const { return reader_ != nullptr; }
  // "checkpoint '<iter dir>'" or "Hugging Face folder '<dir>'".
  std::string description() const;
  const std::vector<std::string>& names() const { return names_; }  // sorted
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  int64_t numel(const std::string& name) const;
  at::Tensor read(const std::string& name) const;
  // Elements [offset, offset + count) of the flattened tensor, as a 1-D CPU tensor.
  at::Tensor read_elements(const std::string& name, int64_t offset, int64_t count) const;
  // Elements [offset, offset + dst.numel()) of the flattened tensor into the 1-D `dst`, converted
  // to dst's dtype and device piece by piece (SafetensorsFile::read_elements_into,
  // CheckpointReader::read_range): how a rank reads its shard without a copy of the range.
  void read_range(const std::string& name, int64_t offset, const at::Tensor& dst) const;
  // The checkpoint's model_config, or the HF folder's config.json (an empty object if none).
  nlohmann::json model_config() const;
  const CheckpointReader* checkpoint() const { return reader_.get(); }

 private:
  // An HF folder's index and safetensors headers (the constructor names a tensor missing from
  // them first when they fail to open).
  void open_hf_files(const std::string& path);

  std::string path_;
  std::unique_ptr<CheckpointReader> reader_;
  std::vector<SafetensorsFile> files_;                        // HF folder: its safetensors files
  std::map<std::string, std::pair<size_t, std::string>> hf_;  // "model.<n>" -> (file, "<n>")
  std::vector<std::string> names_;
};

}  // namespace mfsdp
