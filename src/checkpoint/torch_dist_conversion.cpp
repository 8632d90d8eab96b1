// Megatron torch_dist -> fsdp_dtensor (include/mfsdp/checkpoint/checkpoint_inspector.h), following
// Megatron-LM's tools/checkpoint/checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor.
#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <stdexcept>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/dcp_checkpoint.h"
#include "checkpoint/interop_util.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/checkpoint_inspector.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/base/json_parse.h"
#include "mfsdp/models/model_spec.h"

namespace fs = std::filesystem;

namespace mfsdp {
namespace {

using interop::replace_all;
using interop::starts_with;

// Dicts and lists flattened with "." (as the script flattens common.pt).
void flatten(const nlohmann::json& v, const std::string& name, std::map<std::string, nlohmann::json>& out) {
  if ((v.is_object() || v.is_array()) && !v.empty()) {
    size_t i = 0;
    for (auto it = v.begin(); it != v.end(); ++it, ++i) {
      const std::string k = v.is_object() ? it.key() : std::to_string(i);
      flatten(*it, name.empty() ? k : name + "." + k, out);
    }
  } else {
    out[name] = v;
  }
}

// The model_config (config.json) of the model Megatron's args describe, or {} when no model
// family builds it (a LayerNorm, biased or non-RoPE GPT, say).
nlohmann::json model_config_of_args(const nlohmann::json& args, std::ostream& out) {
  try {
    const ModelConfig config = model_config_from_megatron(args);
    return config.spec->hf_config(config, at::kFloat);
  } catch (const std::invalid_argument& e) {
    out << "Note: Megatron's args do not describe a model mfsdp builds (" << e.what()
        << "); the checkpoint has no model_config, so only its tensors are usable by mfsdp.\n";
    return nlohmann::json::object();
  }
}

// Megatron's optimizer param groups in common.pt: {"param_groups"}, one optimizer's
// {"optimizer": {"param_groups"}}, or a ChainedOptimizer's {"0": {...}, "1": {...}} (a mixture of
// experts: the dense optimizer, then the expert one), concatenated in that order, which is how
// --dump-param-to-param-group-map numbers them. null when there are none.
nlohmann::json param_groups_of(const nlohmann::json& common) {
  if (!common.contains("optimizer") || !common["optimizer"].is_object()) return nullptr;
  const nlohmann::json& o = common["optimizer"];
  auto groups_of = [](const nlohmann::json& one) -> nlohmann::json {
    if (one.contains("param_groups")) return one["param_groups"];
    if (one.contains("optimizer") && one["optimizer"].is_object() && one["optimizer"].contains("param_groups"))
      return one["optimizer"]["param_groups"];
    return nullptr;
  };
  if (nlohmann::json groups = groups_of(o); !groups.is_null()) return groups;
  std::map<int64_t, nlohmann::json> chained;  // keys "0", "1", ...: by number, not as text
  for (const auto& [k, v] : o.items()) {
    if (k.empty() || k.size() > 9 || k.find_first_not_of("0123456789") != std::string::npos || !v.is_object()) return nullptr;
    const nlohmann::json groups = groups_of(v);
    if (!groups.is_array()) return nullptr;
    chained[std::stoll(k)] = groups;
  }
  nlohmann::json all = nlohmann::json::array();
  for (const auto& [i, groups] : chained)
    for (const nlohmann::json& g : groups) all.push_back(g);
  return chained.empty() ? nullptr : all;
}

// Megatron stacks a layer's experts on one axis, "<block>.experts.experts.<linear>.<weight|bias>"
// (its TEGroupedMLP and SequentialMLP write the same tensors); Megatron-FSDP keeps one tensor per
// expert, named as the model that saved it names its parameters: TEGroupedMLP's
// "<block>.experts.<linear>.weight<j>" (--moe-grouped-gemm) or SequentialMLP's
// "<block>.experts.local_experts.<j>.<linear>.weight", j the global expert index. `key` is the
// output name of one layer's tensor `t` [experts, ...] (optimizer state keeps its ".<state>"
// suffix); `where` names the checkpoint tensor for errors; `num_experts` < 0 when args do not say.
std::vector<std::pair<std::string, at::Tensor>> split_experts(const std::string& key, const at::Tensor& t,
                                                              int64_t num_experts, bool grouped,
                                                              const std::string& where) {
  static const std::regex expert(R"((.*\.experts)\.experts\.(\w+)\.(weight|bias)((?:\.\w+)?))");
  std::smatch m;
  if (!std::regex_match(key, m, expert))
    throw std::invalid_argument(where + " is not an expert weight or bias ('<block>.experts.experts.<linear>.weight')");
  if (t.dim() < 2) throw std::invalid_argument(where + " is " + std::to_string(t.dim()) + "-d: no expert axis");
  if (num_experts >= 0 && t.size(0) != num_experts)
    throw std::invalid_argument(where + " holds " + std::to_string(t.size(0)) + " experts per layer, but common.pt's " +
                                "args have num_experts " + std::to_string(num_experts));
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int64_t j = 0; j < t.size(0); ++j) {
    const std::string index = std::to_string(j);
    out.emplace_back(grouped ? m[1].str() + "." + m[2].str() + "." + m[3].str() + index + m[4].str()
                             : m[1].str() + ".local_experts." + index + "." + m[2].str() + "." + m[3].str() + m[4].str(),
                     t[j]);
  }
  return out;
}

// An argparse.Namespace with `fields` (plain values; described objects are left out), so that
// Megatron reads "args" back as it wrote it.
std::string namespace_pickle(const nlohmann::json& fields) {
  nlohmann::json plain = nlohmann::json::object();
  for (const auto& [k, v] : fields.items())
    if (!(v.is_string() && v.get<std::string>().rfind("<", 0) == 0)) plain[k] = v;
  return torch_save_namespace(plain);
}

}  // namespace

void convert_torch_dist_to_fsdp_dtensor(const std::string& in, const std::string& out_dir,
                                        const TorchDistConversion& options, std::ostream& out) {
  const dcp::Reader r = checkpoint::open_dcp_folder(in);
  const std::string dir = r.dir();
  const dcp::Metadata& m = r.metadata();
  nlohmann::json common = nlohmann::json::object();
  if (fs::exists(dir + "/common.pt"))
    common = read_torch_save_value(dir + "/common.pt", 0, fs::file_size(dir + "/common.pt"),
                                   "common state '" + dir + "/common.pt'", ObjectPolicy::kDescribeObjects);
  const nlohmann::json args = common.value("args", nlohmann::json::object());
  const nlohmann::json groups = param_groups_of(common);
  // Mixtures of experts: how many experts a layer has, and how the saving model named them.
  const int64_t num_experts = args.contains("num_experts") && args["num_experts"].is_number_integer()
                                  ? args["num_experts"].get<int64_t>() : -1;
  const bool grouped_experts = !args.contains("moe_grouped_gemm") || args["moe_grouped_gemm"] != false;
  nlohmann::json group_map = nlohmann::json::object();
  if (!options.param_to_param_group_map_json.empty()) {
    std::ifstream f(options.param_to_param_group_map_json);
    if (!f) throw std::invalid_argument("cannot read --param-to-param-group-map-json '" +
                                        options.param_to_param_group_map_json + "'");
    try {
      group_map = parse_json(f);
    } catch (const nlohmann::json::exception& e) {
      throw std::invalid_argument("'" + options.param_to_param_group_map_json + "' is not JSON: " + e.what());
    }
  }
  if (fs::exists(out_dir)) throw std::invalid_argument("'" + out_dir + "' exists; choose a new output folder");

  bool has_fp32 = false;
  for (const auto& [key, e] : m.tensors) has_fp32 |= starts_with(key, "optimizer.state.fp32_param.");
  auto swiglu_here = [&](const std::string& key) {
    if (options.swiglu_modules.empty()) return options.swiglu;
    for (const std::string& mod : options.swiglu_modules)
      if (key.find("." + mod + ".") != std::string::npos || starts_with(key, mod + ".")) return true;
    return false;
  };
  auto path_of = [&](const std::string& key) {
    return options.model_prefix == "model.module" && options.optimizer_prefix == "optimizer.state.module.module.module"
               ? checkpoint::dcp_path(key) : std::vector<std::string>{key};
  };

  // SwiGLU fc1 keys (a dense MLP's, an expert's, the shared expert's), and where "_w" / "_v" go
  // in them (after weight/bias and an expert index: "weight3_w.exp_avg").
  static const std::regex fc1(R"(\.mlp\.(shared_experts\.|experts\.local_experts\.\d+\.)?linear_fc1\.(weight|bias)(\.|$))"
                              R"(|\.mlp\.experts\.linear_fc1\.(weight|bias)\d+(\.|$))");
  static const std::regex suffix(R"(((?:weight|bias)\d*)(.*))");
  const std::string tmp = out_dir + ".tmp";
  remove_tree(tmp);
  dcp::DirectoryWriter w(tmp);
  std::set<std::string> model_keys, states;
  size_t index = 0;
  for (const auto& [key, e] : m.tensors) {
    out << "[Convert] [" << ++index << "/" << m.tensors.size() << "] Key: " << key << "\n";
    if (key.find("._extra_state") != std::string::npos) continue;
    const std::string where = "checkpoint '" + dir + "': '" + key + "'";
    const bool experts = key.find(".experts.experts.") != std::string::npos;
    if (!experts && key.find(".experts.") != std::string::npos)
      throw std::invalid_argument(where + " is an expert tensor outside Megatron's torch_dist layout, where a layer's "
                                  "experts are one tensor '<block>.experts.experts.<linear>.weight' with the expert "
                                  "axis before the weight's own (singleton_local_shards false)");
    std::string out_key;
    if (starts_with(key, "optimizer.state.")) {
      const std::string rest = key.substr(16);
      const size_t dot = rest.find('.');
      if (dot == std::string::npos) throw std::invalid_argument("checkpoint '" + dir + "': cannot parse '" + key + "'");
      const std::string state = rest.substr(0, dot), base = rest.substr(dot + 1);
      if (state == "fp32_param") out_key = options.model_prefix + "." + base;  // the fp32 main weights
      else out_key = options.optimizer_prefix + "." + base + "." + state, states.insert(state);
    } else {
      if (has_fp32 && m.tensors.count("optimizer.state.fp32_param." + key)) continue;  // its fp32 copy is used
      out_key = options.model_prefix + "." + key;
    }
    const at::Tensor value = r.read(key);
    std::vector<std::pair<std::string, at::Tensor>> layers, pieces;
    static const std::regex numbered_layer(R"(layers\.\d+\.)");
    if (out_key.find(".layers.") != std::string::npos && !std::regex_search(out_key, numbered_layer)) {
      if (value.dim() == 0) throw std::invalid_argument("checkpoint '" + dir + "': stacked '" + key + "' is 0-d");
      for (int64_t i = 0; i < value.size(0); ++i)
        layers.emplace_back(replace_all(out_key, ".layers.", ".layers." + std::to_string(i) + "."), value[i]);
    } else {
      layers.emplace_back(out_key, value);
    }
    for (auto& [k, t] : layers) {
      if (!experts) pieces.emplace_back(k, t);
      else for (auto& e : split_experts(k, t, num_experts, grouped_experts, where)) pieces.push_back(std::move(e));
    }
    for (auto& [k, t] : pieces) {
      const bool model = starts_with(k, options.model_prefix + ".");
      if (std::regex_search(k, fc1) && swiglu_here(k)) {
        if (t.size(0) % 2) throw std::invalid_argument("'" + key + "': odd fc1 rows cannot split into gate and up");
        const auto halves = t.chunk(2, 0);
        for (int h = 0; h < 2; ++h) {
          const std::string split = std::regex_replace(k, suffix, h == 0 ? "$1_w$2" : "$1_v$2",
                                                       std::regex_constants::format_first_only);
          w.tensor(split, halves[h].contiguous(), path_of(split));
          if (model) model_keys.insert(k);  // the map names the unsplit parameter
        }
      } else {
        w.tensor(k, t.contiguous(), path_of(k));
        if (model) model_keys.insert(k);
      }
    }
  }

  // Non-tensor entries: RNG and rerun state mean nothing to another run; the rest stays.
  std::set<std::string> written;
  for (const auto& [key, l] : m.bytes) {
    if (starts_with(key, "rng_state") || starts_with(key, "rerun_state_machine")) continue;
    w.bytes(key, r.read_bytes(key));
    written.insert(key);
  }
  std::map<std::string, nlohmann::json> flat;
  for (const auto& [k, v] : common.items())
    if (k != "args") flatten(v, k, flat);
  if (common.contains("args")) {
    w.bytes("args", namespace_pickle(args));
    written.insert("args");
  }
  for (auto& [k, v] : flat) {
    std::string key = k;
    if (starts_with(key, "optimizer.optimizer.param_groups.")) key = key.substr(10);
    if (starts_with(key, "rerun_state_machine") || starts_with(key, "content_metadata")) continue;
    if (!written.insert(key).second) throw std::invalid_argument("common.pt entry '" + key + "' clashes with another");
    w.object(key, v);
  }
  if (!written.count("checkpoint_version")) w.object("checkpoint_version", 3.0);

  // Megatron-FSDP keeps each parameter's optimizer group (lr, weight decay, betas, step...).
  if (!group_map.empty() && groups.is_array()) {
    for (const std::string& k : model_keys) {
      if (k.find(".expert_bias") != std::string::npos) continue;
      if (!group_map.contains(k) || !group_map[k].is_number_integer())
        throw std::invalid_argument("'" + options.param_to_param_group_map_json + "' has no group for '" + k + "'");
      const int64_t g = group_map[k].get<int64_t>();
      if (g < 0 || g >= static_cast<int64_t>(groups.size()))
        throw std::invalid_argument("group " + std::to_string(g) + " of '" + k + "' is not in common.pt's " +
                                    std::to_string(groups.size()) + " param groups");
      const std::string fqn = k.substr(options.model_prefix.size() + 1);
      auto split_names = [&](const std::string& f) {
        std::vector<std::string> names;
        if (std::regex_search(k, fc1) && swiglu_here(k))
          for (const char* s : {"$1_w$2", "$1_v$2"})
            names.push_back(std::regex_replace(f, suffix, s, std::regex_constants::format_first_only));
        else
          names.push_back(f);
        return names;
      };
      for (const std::string& name : split_names(fqn))
        for (const auto& [field, value] : groups[static_cast<size_t>(g)].items())
          if (field != "params")
            w.object("optimizer.param_to_group_meta.module.module.module." + name + "." + field, value,
                     {"optimizer", "param_to_group_meta", "module.module.module." + name, field});
    }
  }

  // What mfsdp needs to train from it.
  const int64_t iteration = common.value("iteration", 0);
  nlohmann::json optimizer = nullptr;
  if (states.count("exp_avg") && states.count("exp_avg_sq")) {
    int64_t step = iteration;
    if (groups.is_array() && !groups.empty() && groups[0].contains("step") && groups[0]["step"].is_number())
      step = static_cast<int64_t>(groups[0]["step"].get<double>());
    optimizer = {{"name", "AdamW"}, {"step", step}, {"state", {"exp_avg", "exp_avg_sq"}}};
  }
  w.object("mfsdp_metadata", {{"format", kCheckpointFormatName},
                              {"version", kCheckpointFormatVersion},
                              {"iteration", iteration},
                              {"consumed_samples", args.value("consumed_train_samples", 0)},
                              {"world_size", -1},
                              {"args", {{"converted_from", dir}}},
                              {"model_config", model_config_of_args(args, out)},
                              {"scheduler", nlohmann::json::object()},
                              {"optimizer", optimizer}});
  w.finish();

  static const std::regex iter_name(R"(iter_(\d+))");
  std::smatch match;
  const std::string base = fs::path(out_dir).filename().string();
  const std::string parent = fs::path(out_dir).parent_path().string();
  if (std::regex_match(base, match, iter_name) &&
      fs::path(checkpoint_iteration_dir(parent, std::stoll(match[1].str()))).filename() == base) {
    checkpoint::commit_checkpoint(parent.empty() ? "." : parent, tmp, out_dir, std::stoll(match[1].str()));
  } else {
    fs::rename(tmp, out_dir);
  }
  out << "Converted checkpoint saved to " << out_dir << ".\n";
}

}  // namespace mfsdp
