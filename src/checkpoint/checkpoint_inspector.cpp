// checkpoint_inspector.py's read-only commands and modify-state-dict on DCP checkpoints
// (include/mfsdp/checkpoint/checkpoint_inspector.h); convert-torch-dist-to-fsdp-dtensor is in
// src/checkpoint/torch_dist_conversion.cpp.
#include "mfsdp/checkpoint/checkpoint_inspector.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/base/json_parse.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>
#include <stdexcept>

#include "checkpoint/dcp_checkpoint.h"
#include "checkpoint/interop_util.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/checkpoint/state_dict_ops.h"

namespace fs = std::filesystem;

namespace mfsdp {
namespace {

using interop::replace_all;

void header(std::ostream& out, const std::string& title) {
  std::string upper = title;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  out << "\n" << std::string(50, '=') << "\n=== " << upper << " ===\n" << std::string(50, '=') << "\n\n";
}

std::string shape_tuple(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

std::string torch_size(const std::vector<int64_t>& shape) {
  std::string s = "torch.Size([";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "])";
}

dcp::Reader open(const std::string& path) { return checkpoint::open_dcp_folder(path); }

// common.pt of a torch_dist checkpoint, described (objects never constructed).
nlohmann::json read_common(const std::string& dir) {
  const std::string path = dir + "/common.pt";
  return read_torch_save_value(path, 0, fs::file_size(path), "common state '" + path + "'",
                               ObjectPolicy::kDescribeObjects);
}

// A tensor as nested JSON lists.
nlohmann::json tensor_json(const at::Tensor& t) {
  if (t.dim() == 0) return t.scalar_type() == at::kBool ? nlohmann::json(t.item<bool>())
                           : at::isFloatingType(t.scalar_type()) ? nlohmann::json(t.item<double>())
                                                                 : nlohmann::json(t.item<int64_t>());
  nlohmann::json out = nlohmann::json::array();
  for (int64_t i = 0; i < t.size(0); ++i) out.push_back(tensor_json(t[i]));
  return out;
}

}  // namespace

void inspect_dcp_checkpoint(const std::string& path, bool show_param_to_group_meta, std::ostream& out) {
  const dcp::Reader r = open(path);
  const std::string dir = r.dir();
  if (fs::exists(dir + "/metadata.json")) {
    header(out, "checkpoint metadata");
    out << interop::read_json_file(dir + "/metadata.json", "checkpoint metadata").dump(2) << "\n";
  } else {
    // Megatron's tool looks for metadata.json only; a DCP checkpoint keeps its metadata inside
    // .metadata (mfsdp's "mfsdp_metadata" entry), or has none (what its entries imply is shown).
    header(out, "checkpoint metadata");
    try {
      nlohmann::json meta = CheckpointReader(dir).metadata();
      meta.erase("tensors");
      meta.erase("files");
      out << (r.metadata().bytes.count("mfsdp_metadata")
                  ? "(the mfsdp_metadata entry of .metadata)\n"
                  : "(no mfsdp_metadata entry: not written by mfsdp; what its entries imply)\n")
          << meta.dump(2) << "\n";
    } catch (const std::exception& e) {
      out << "(not readable as a model checkpoint: " << e.what() << ")\n";
    }
  }
  if (fs::exists(dir + "/common.pt")) {
    const nlohmann::json common = read_common(dir);
    header(out, "common state (" + std::to_string(common.size()) + " items)");
    for (const auto& [k, v] : common.items()) out << "  \u2022 " << k << ": " << v.dump() << "\n";
  }
  const dcp::Metadata& m = r.metadata();
  std::map<std::string, std::string> lines;  // sorted by key
  double elements = 0;
  int ignored = 0;
  for (const auto& [key, e] : m.tensors) {
    double n = 1;
    for (int64_t s : e.shape) n *= static_cast<double>(s);
    elements += n;
    lines[key] = "[" + dcp::torch_dtype_name(e.dtype) + ", shape=" + shape_tuple(e.shape) + "]";
  }
  for (const auto& [key, l] : m.bytes) {
    if (!show_param_to_group_meta && key.rfind("optimizer.param_to_group_meta.", 0) == 0) {
      ++ignored;
      continue;
    }
    lines[key] = "[BYTES]";
  }
  header(out, "sharded tensors metadata");
  // Megatron prints billions only ("0.00B" for any small model); the unit follows the size here.
  std::ostringstream total;
  const std::pair<double, const char*> units[] = {{1e9, "B"}, {1e6, "M"}, {1e3, "K"}};
  const auto unit = std::find_if(std::begin(units), std::end(units), [&](const auto& u) { return elements >= u.first; });
  if (unit == std::end(units))
    total << static_cast<int64_t>(elements);
  else
    total << std::fixed << std::setprecision(2) << elements / unit->first << unit->second;
  out << "Total Tensors: " << m.tensors.size() << " | Total Elements: " << total.str() << " ("
      << static_cast<int64_t>(elements) << ")\n\n";
  for (const auto& [key, what] : lines) out << "  \u25ba " << key << " " << what << "\n";
  if (!show_param_to_group_meta) out << "Ignored parameter-to-group metadata: " << ignored << "\n";
}

void print_dcp_tensor(const std::string& path, const std::string& key, std::ostream& out) {
  const dcp::Reader r = open(path);
  header(out, "tensor metadata");
  if (r.contains_tensor(key)) {
    const dcp::TensorEntry& e = r.tensor(key);
    out << "Key: " << key << "\nShape: " << torch_size(e.shape) << "\nDtype: " << dcp::torch_dtype_name(e.dtype) << "\n";
    out << r.read(key) << "\n";
  } else if (r.metadata().bytes.count(key)) {
    out << "Key: " << key << " (Bytes Storage)\n" << r.read_object(key, ObjectPolicy::kDescribeObjects).dump(2) << "\n";
  } else {
    out << "Key '" << key << "' not found in checkpoint metadata.\n";
    throw std::invalid_argument("checkpoint '" + r.dir() + "' has no entry '" + key + "'");
  }
}

std::string print_dcp_in_json(const std::string& path, std::ostream& out) {
  const dcp::Reader r = open(path);
  const dcp::Metadata& m = r.metadata();
  nlohmann::json all = nlohmann::json::object();
  auto put = [&](const std::string& key, nlohmann::json value) {
    std::vector<std::string> p = m.paths.count(key) ? m.paths.at(key) : std::vector<std::string>{key};
    nlohmann::json* at = &all;
    for (size_t i = 0; i + 1 < p.size(); ++i) at = &(*at)[replace_all(p[i], "module.module", "model.module")];
    (*at)[replace_all(p.back(), "module.module", "model.module")] = std::move(value);
  };
  for (const auto& [key, e] : m.tensors) put(key, tensor_json(r.read(key)));
  for (const auto& [key, l] : m.bytes) put(key, r.read_object(key, ObjectPolicy::kDescribeObjects));
  out << "torch dcp content: " << all.dump() << "\n";
  const std::string file = r.dir() + "/param_to_param_group_map.json";
  std::ofstream(file) << all.dump(2) << "\n";
  out << "Saved converted param_to_param_group_map to: " << file << "\n";
  return file;
}

void write_param_to_param_group_map(const std::string& dir, const std::map<std::string, int>& group_of_fqn) {
  const std::string tmp = dir + ".tmp";
  remove_tree(tmp);
  dcp::DirectoryWriter w(tmp);
  for (const auto& [fqn, group] : group_of_fqn) w.object("module.module." + fqn, group);
  w.finish();
  remove_tree(dir);
  fs::rename(tmp, dir);
}

void modify_dcp_state_dict(const std::string& in, const std::string& out_dir, const std::vector<std::string>& ops,
                           std::ostream& out) {
  const dcp::Reader r = open(in);
  StateDictOps state_ops;
  for (const std::string& op : ops) state_ops.add(op);
  if (fs::exists(out_dir)) throw std::invalid_argument("'" + out_dir + "' exists; choose a new output folder");
  const std::string tmp = out_dir + ".tmp";
  remove_tree(tmp);
  dcp::DirectoryWriter w(tmp);
  const dcp::Metadata& m = r.metadata();
  std::set<std::string> keys;
  for (const auto& kv : m.tensors) keys.insert(kv.first);
  for (const auto& kv : m.bytes) keys.insert(kv.first);
  for (const std::string& key : keys) {
    if (state_ops.removes(key)) {
      out << "Removing key '" << key << "'\n";
      continue;
    }
    std::vector<std::string> path = m.paths.count(key) ? m.paths.at(key) : std::vector<std::string>{};
    bool applied = false;
    const std::string name = state_ops.renamed(key, &applied);
    if (applied) {
      out << "Renaming key '" << key << "' to '" << name << "'\n";
      path = {name};
    }
    if (r.contains_tensor(key)) w.tensor(name, r.read(key), path);
    else w.bytes(name, r.read_bytes(key), path);
  }
  w.finish();
  for (const char* f : {"metadata.json", "common.pt"})
    if (fs::exists(r.dir() + "/" + f)) fs::copy_file(r.dir() + "/" + f, tmp + "/" + f);
  fs::rename(tmp, out_dir);
  out << "State dict items modified and saved to " << out_dir << ".\n";
}

}  // namespace mfsdp
