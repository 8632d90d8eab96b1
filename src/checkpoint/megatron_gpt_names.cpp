// Megatron-Core GPT names as a model family's names: src/checkpoint/megatron_gpt_names.h.
#include "checkpoint/megatron_gpt_names.h"

#include "checkpoint/interop_util.h"

#include <stdexcept>

namespace mfsdp::checkpoint {
namespace {

using interop::starts_with;

// Rows [first, first + count) of `t`'s row space.
MappedTensor rows_of(const MappedTensor& t, int64_t first, int64_t count, std::vector<int64_t> shape) {
  MappedTensor out{std::move(shape), t.dtype, {t.source.key, t.source.row_numel, {}}};
  int64_t at = 0;  // first row of the current run in t's row space
  for (const auto& [src, n] : t.source.runs) {
    const int64_t lo = std::max(first, at), hi = std::min(first + count, at + n);
    if (hi > lo) out.source.runs.emplace_back(src + (lo - at), hi - lo);
    at += n;
  }
  return out;
}

// Several row ranges of `t`, concatenated.
MappedTensor gather_rows(const MappedTensor& t, const std::vector<std::pair<int64_t, int64_t>>& ranges,
                         std::vector<int64_t> shape) {
  MappedTensor out{std::move(shape), t.dtype, {t.source.key, t.source.row_numel, {}}};
  for (const auto& [first, count] : ranges) {
    MappedTensor part = rows_of(t, first, count, {});
    out.source.runs.insert(out.source.runs.end(), part.source.runs.begin(), part.source.runs.end());
  }
  return out;
}

// The parameter `piece` names, made of rows of `t`.
MappedTensor take_rows(const MappedTensor& t, const MegatronRows& piece) {
  if (piece.ranges.empty()) return t;
  std::vector<int64_t> shape = t.shape;
  shape.at(0) = piece.rows;
  return gather_rows(t, piece.ranges, std::move(shape));
}

// "model.<fqn>" -> {fqn, ""}; "optimizer.state.<fqn>.<key>" -> {fqn, key}; else {"", ""}.
std::pair<std::string, std::string> parameter_of(const std::string& name) {
  if (starts_with(name, "optimizer.state.")) {
    const std::string rest = name.substr(16);
    const size_t dot = rest.rfind('.');
    if (dot != std::string::npos) return {rest.substr(0, dot), rest.substr(dot + 1)};
  } else if (starts_with(name, "model.")) {
    return {name.substr(6), ""};
  }
  return {"", ""};
}

}  // namespace

bool has_megatron_gpt_names(const std::map<std::string, MappedTensor>& tensors) {
  for (const auto& [name, t] : tensors) {
    const std::string fqn = parameter_of(name).first;
    if (starts_with(fqn, "decoder.layers.") || fqn == "embedding.word_embeddings.weight") return true;
  }
  return false;
}

std::map<std::string, MappedTensor> megatron_gpt_to_model(const std::map<std::string, MappedTensor>& tensors,
                                                          const ModelSpec& spec, const ModelConfig* config) {
  std::map<std::string, MappedTensor> out;
  for (const auto& [name, t] : tensors) {
    const auto [fqn, state] = parameter_of(name);
    std::vector<std::pair<std::string, MappedTensor>> mapped;
    if (!fqn.empty()) {
      // A 0-d entry (an optimizer's per-parameter step) follows its parameter's renaming when
      // that is a whole rename; a split has no rows of it to take, so it keeps its name.
      const int64_t rows = t.shape.empty() ? 0 : t.shape[0];
      for (const MegatronRows& piece : spec.from_megatron_name(fqn, rows, config, "checkpoint tensor '" + name + "'")) {
        if (t.shape.empty() && !piece.ranges.empty()) {
          mapped.clear();
          break;
        }
        mapped.emplace_back(state.empty() ? "model." + piece.name : "optimizer.state." + piece.name + "." + state,
                            take_rows(t, piece));
      }
    }
    if (mapped.empty()) mapped.emplace_back(name, t);  // not one of the family's parameters: as it is
    for (auto& [n, m] : mapped)
      if (!out.emplace(n, std::move(m)).second)
        throw std::invalid_argument("checkpoint: two tensors become '" + n + "' (Megatron GPT names)");
  }
  return out;
}

}  // namespace mfsdp::checkpoint
