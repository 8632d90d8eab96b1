// Internal to the library: what the Hugging Face import/export (hf_interop.cpp), TensorSource
// (tensor_source.cpp), mfsdp-ckpt's operations (ckpt_operations.cpp, checkpoint_inspector.cpp,
// torch_dist_conversion.cpp), the DCP key mapping (dcp_checkpoint.cpp, megatron_gpt_names.cpp)
// and mfsdp-generate's loader (src/models/generate.cpp) share, defined once so that they cannot drift apart: the names a
// checkpoint and an HF folder use, and small string helpers (C++17's std::string has no
// starts_with / ends_with).
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "mfsdp/base/json_parse.h"

namespace mfsdp::interop {

// A checkpoint stores the model's parameters as "model.<fqn>" (include/mfsdp/checkpoint/checkpoint.h), and
// the fqns of every family's CausalLM are transformers' names, so HF tensor "<name>" is checkpoint tensor
// "model.<name>"; TensorSource names an HF folder's tensors the same way.
inline const std::string kModelPrefix = "model.";

// A Hugging Face model folder: config.json plus one model.safetensors, or an index naming shards.
constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

inline bool starts_with(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}
inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// `s` with every `from` replaced by `to` (unchanged for an empty `from`).
inline std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

// "[16, 32]", as torch prints sizes; error messages name shapes this way.
inline std::string shape_str(const std::vector<int64_t>& s) { return c10::str(c10::IntArrayRef(s)); }

// The JSON in `path`; std::invalid_argument naming `what` and the file when it cannot be read or
// parsed, or nests deeper than kMaxJsonDepth (config.json, a safetensors index).
inline nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(what + " '" + path + "' cannot be read");
  try {
    return parse_json(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(what + " '" + path + "' is not valid JSON: " + e.what());
  }
}

}  // namespace mfsdp::interop
