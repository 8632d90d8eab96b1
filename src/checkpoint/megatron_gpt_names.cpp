// Megatron-Core GPT names as Llama names: src/checkpoint/megatron_gpt_names.h.
#include "checkpoint/megatron_gpt_names.h"

#include "checkpoint/interop_util.h"

#include <regex>
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

std::vector<int64_t> with_rows(std::vector<int64_t> shape, int64_t rows) {
  shape.at(0) = rows;
  return shape;
}

// The Llama tensors of one GPT parameter `fqn` (empty when it is not a GPT name).
std::vector<std::pair<std::string, MappedTensor>> llama_tensors(
    const std::string& fqn, const MappedTensor& t, std::optional<std::pair<int64_t, int64_t>> head_counts,
    const std::string& name) {
  static const std::map<std::string, std::string> kWhole = {
      {"embedding.word_embeddings.weight", "model.embed_tokens.weight"},
      {"decoder.final_layernorm.weight", "model.norm.weight"},
      {"output_layer.weight", "lm_head.weight"},
  };
  static const std::map<std::string, std::string> kLayerWhole = {
      {"self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"},
      {"self_attention.linear_proj.weight", "self_attn.o_proj.weight"},
      {"mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"},
      {"mlp.linear_fc1.weight_w", "mlp.gate_proj.weight"},
      {"mlp.linear_fc1.weight_v", "mlp.up_proj.weight"},
      {"mlp.linear_fc2.weight", "mlp.down_proj.weight"},
  };
  if (auto it = kWhole.find(fqn); it != kWhole.end()) return {{it->second, t}};
  static const std::regex layer(R"(decoder\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(fqn, m, layer)) return {};
  const std::string prefix = "model.layers." + m[1].str() + ".", rest = m[2].str();
  if (auto it = kLayerWhole.find(rest); it != kLayerWhole.end()) return {{prefix + it->second, t}};
  if (t.shape.empty()) return {};
  const int64_t rows = t.shape[0];
  if (rest == "mlp.linear_fc1.weight") {
    if (rows % 2) throw std::invalid_argument("checkpoint tensor '" + name + "' has an odd number of rows for [gate; up]");
    return {{prefix + "mlp.gate_proj.weight", rows_of(t, 0, rows / 2, with_rows(t.shape, rows / 2))},
            {prefix + "mlp.up_proj.weight", rows_of(t, rows / 2, rows / 2, with_rows(t.shape, rows / 2))}};
  }
  for (const char* kind : {"weight", "bias"}) {
    if (rest != std::string("self_attention.linear_qkv.") + kind) continue;
    if (!head_counts) return {};  // cannot split without the head counts: keeps its name
    const auto [heads, kv_heads] = *head_counts;
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || rows % (heads + 2 * kv_heads))
      throw std::invalid_argument("checkpoint tensor '" + name + "' has " + std::to_string(rows) +
                                  " rows, which do not split into " + std::to_string(heads) + " query heads and " +
                                  std::to_string(kv_heads) + " key/value groups");
    const int64_t d = rows / (heads + 2 * kv_heads), per_group = heads / kv_heads, stride = (per_group + 2) * d;
    std::vector<std::pair<int64_t, int64_t>> q, k, v;
    for (int64_t g = 0; g < kv_heads; ++g) {
      q.emplace_back(g * stride, per_group * d);
      k.emplace_back(g * stride + per_group * d, d);
      v.emplace_back(g * stride + (per_group + 1) * d, d);
    }
    const std::string suffix = std::string(".") + kind;
    return {{prefix + "self_attn.q_proj" + suffix, gather_rows(t, q, with_rows(t.shape, heads * d))},
            {prefix + "self_attn.k_proj" + suffix, gather_rows(t, k, with_rows(t.shape, kv_heads * d))},
            {prefix + "self_attn.v_proj" + suffix, gather_rows(t, v, with_rows(t.shape, kv_heads * d))}};
  }
  return {};
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

std::map<std::string, MappedTensor> megatron_gpt_to_llama(const std::map<std::string, MappedTensor>& tensors,
                                                          std::optional<std::pair<int64_t, int64_t>> heads) {
  std::map<std::string, MappedTensor> out;
  for (const auto& [name, t] : tensors) {
    const auto [fqn, state] = parameter_of(name);
    auto mapped = fqn.empty() ? decltype(llama_tensors(fqn, t, heads, name)){} : llama_tensors(fqn, t, heads, name);
    if (mapped.empty()) mapped.emplace_back(name, t);  // not a GPT parameter: as it is
    else
      for (auto& [llama, m] : mapped) llama = state.empty() ? "model." + llama : "optimizer.state." + llama + "." + state;
    for (auto& [n, m] : mapped)
      if (!out.emplace(n, std::move(m)).second)
        throw std::invalid_argument("checkpoint: two tensors become '" + n + "' (Megatron GPT names)");
  }
  return out;
}

}  // namespace mfsdp::checkpoint
