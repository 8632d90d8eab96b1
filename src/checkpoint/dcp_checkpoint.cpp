// The fsdp_dtensor format on PyTorch DCP: src/checkpoint/dcp_checkpoint.h.
#include "checkpoint/dcp_checkpoint.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <set>
#include <stdexcept>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/interop_util.h"
#include "checkpoint/megatron_gpt_names.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/safetensors.h"

namespace fs = std::filesystem;

namespace mfsdp::checkpoint {
namespace {

using interop::starts_with;

const std::string kModel = "model.";
const std::string kMegatronModel = "model.module.";
const std::string kOptimizerState = "optimizer.state.";
const std::string kMegatronOptimizerState = "optimizer.state.module.module.module.";
const std::string kMegatronGroupMeta = "optimizer.param_to_group_meta.module.module.module.";
const std::string kRngPrefix = "rng_state.rank";
const std::string kMegatronRng = "rng_state.(0, 0).";
const std::string kMetadataEntry = "mfsdp_metadata";

// The generator label of our name and Megatron's, both ways.
const std::pair<const char*, const char*> kGenerators[] = {{"cpu", "torch_rng_state"}, {"cuda", "cuda_rng_state"}};

// "optimizer.state.<fqn>.<key>" -> {fqn, key}; state keys have no dots.
std::pair<std::string, std::string> split_state_key(const std::string& rest) {
  const size_t dot = rest.rfind('.');
  if (dot == std::string::npos) return {rest, ""};
  return {rest.substr(0, dot), rest.substr(dot + 1)};
}

}  // namespace

std::string to_dcp_key(const std::string& canonical) {
  if (starts_with(canonical, kOptimizerState)) return kMegatronOptimizerState + canonical.substr(kOptimizerState.size());
  if (starts_with(canonical, kModel)) return kMegatronModel + canonical.substr(kModel.size());
  if (starts_with(canonical, kRngPrefix)) {  // rng_state.rank<r>.<generator>
    const std::string rest = canonical.substr(kRngPrefix.size());
    const size_t dot = rest.find('.');
    for (const auto& [ours, theirs] : kGenerators)
      if (dot != std::string::npos && rest.substr(dot + 1) == ours) return kMegatronRng + rest.substr(0, dot) + "." + theirs;
  }
  return canonical;
}

std::string from_dcp_key(const std::string& key) {
  if (starts_with(key, kMegatronOptimizerState)) return kOptimizerState + key.substr(kMegatronOptimizerState.size());
  if (starts_with(key, kMegatronModel)) return kModel + key.substr(kMegatronModel.size());
  if (starts_with(key, kMegatronRng)) {
    const std::string rest = key.substr(kMegatronRng.size());
    const size_t dot = rest.find('.');
    for (const auto& [ours, theirs] : kGenerators)
      if (dot != std::string::npos && rest.substr(dot + 1) == theirs) return kRngPrefix + rest.substr(0, dot) + "." + ours;
  }
  return key;
}

std::vector<std::string> dcp_path(const std::string& key) {
  if (starts_with(key, kMegatronOptimizerState)) {
    auto [fqn, state] = split_state_key(key.substr(kOptimizerState.size()));
    return {"optimizer", "state", fqn, state};
  }
  if (starts_with(key, kMegatronGroupMeta)) {
    auto [fqn, field] = split_state_key(key.substr(std::string("optimizer.param_to_group_meta.").size()));
    return {"optimizer", "param_to_group_meta", fqn, field};
  }
  if (starts_with(key, kMegatronModel)) return {"model", key.substr(kModel.size())};
  if (starts_with(key, kMegatronRng)) {
    const std::string rest = key.substr(kMegatronRng.size());
    const size_t dot = rest.find('.');
    return {"rng_state", "(0, 0)", rest.substr(0, dot), rest.substr(dot + 1)};
  }
  return {key};
}

std::vector<dcp::Box> slice_range_boxes(const std::vector<int64_t>& slice_shape, const std::vector<int64_t>& origin,
                                        int64_t begin, int64_t end) {
  std::vector<dcp::Box> boxes = dcp::flat_range_boxes(slice_shape, begin, end);
  for (dcp::Box& b : boxes)
    for (size_t d = 0; d < origin.size() && d < b.offsets.size(); ++d) b.offsets[d] += origin[d];
  return boxes;
}

namespace {

// The runs of `box` in the row-major flattening of a tensor of `shape`: (first element, length)
// in order, each as long as the box allows (whole trailing dimensions merge into one run).
std::vector<std::pair<int64_t, int64_t>> box_runs(const std::vector<int64_t>& shape, const dcp::Box& box) {
  const size_t rank = shape.size();
  if (rank == 0) return {{0, 1}};
  size_t inner = rank - 1;  // dims [inner, rank) form one contiguous run
  int64_t run = box.sizes[inner];
  while (inner > 0 && box.sizes[inner] == shape[inner]) run *= box.sizes[--inner];
  std::vector<int64_t> stride(rank, 1);
  for (size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * shape[d];
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t s : box.sizes)
    if (s == 0) return runs;
  std::vector<int64_t> index(inner, 0);  // position in the outer dims [0, inner)
  for (;;) {
    int64_t start = 0;
    for (size_t d = 0; d < rank; ++d) start += (box.offsets[d] + (d < inner ? index[d] : 0)) * stride[d];
    runs.emplace_back(start, run);
    size_t d = inner;
    while (d > 0 && ++index[d - 1] == box.sizes[d - 1]) index[--d] = 0;
    if (d == 0) return runs;
  }
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> slice_range_runs(const std::vector<int64_t>& shape,
                                                          const std::vector<int64_t>& slice_shape,
                                                          const std::vector<int64_t>& origin, int64_t begin, int64_t end) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const dcp::Box& box : slice_range_boxes(slice_shape, origin, begin, end))
    for (const auto& run : box_runs(shape, box)) runs.push_back(run);
  return runs;
}

nlohmann::json write_dcp_rank_file(const std::string& dir, int rank, const std::vector<TensorPiece>& pieces,
                                   const nlohmann::json& metadata) {
  dcp::FileWriter file(dir, dcp::rank_file_name(rank));
  nlohmann::json tensors = nlohmann::json::array(), bytes = nlohmann::json::array();
  for (const TensorPiece& piece : pieces) {
    TensorPiece read;  // a piece read only now, dropped after it is written
    if (!piece.data.defined()) {
      read = piece;
      read.data = piece.read();
    }
    const TensorPiece& p = piece.data.defined() ? piece : read;
    nlohmann::json chunks = nlohmann::json::array();
    int64_t flat = p.offset;
    const bool sliced = !p.slice_shape.empty();
    for (const dcp::Box& box : sliced ? slice_range_boxes(p.slice_shape, p.origin, p.offset, p.offset + p.data.numel())
                                      : dcp::flat_range_boxes(p.shape, p.offset, p.offset + p.data.numel())) {
      const dcp::Location l = file.write_tensor(p.data.narrow(0, flat - p.offset, box.numel()).view(box.sizes));
      flat += box.numel();
      chunks.push_back({{"offsets", box.offsets}, {"sizes", box.sizes}, {"offset", l.offset}, {"length", l.length},
                        {"crc32c", *l.crc32c}});
    }
    tensors.push_back({{"key", to_dcp_key(p.tensor)},
                       {"dtype", safetensors_dtype_name(p.data.scalar_type())},
                       {"shape", p.shape},
                       {"chunks", chunks}});
  }
  if (rank == 0) {
    auto add = [&](const std::string& key, const nlohmann::json& value) {
      const dcp::Location l = file.write_object(value);
      bytes.push_back({{"key", key}, {"offset", l.offset}, {"length", l.length}, {"crc32c", *l.crc32c}});
    };
    add(kMetadataEntry, metadata);
    add("iteration", metadata.at("iteration"));
    add("checkpoint_version", 3.0);  // Megatron's checkpoint_version
    const nlohmann::json& o = metadata.at("optimizer");
    if (o.is_object()) {  // Megatron keeps Adam's step in the parameter group
      std::set<std::string> params;
      for (const TensorPiece& p : pieces)
        if (starts_with(p.tensor, kOptimizerState)) params.insert(split_state_key(p.tensor.substr(kOptimizerState.size())).first);
      for (const std::string& fqn : params) add(kMegatronGroupMeta + fqn + ".step", o.at("step"));
    }
  }
  file.close();
  return {{"file", dcp::rank_file_name(rank)}, {"tensors", tensors}, {"bytes", bytes}};
}

void write_dcp_metadata(const std::string& dir, const std::vector<nlohmann::json>& reports) {
  dcp::Metadata m;
  for (const nlohmann::json& report : reports) {
    const std::string file = report.at("file").get<std::string>();
    for (const auto& t : report.at("tensors")) {
      const std::string key = t.at("key").get<std::string>();
      const at::ScalarType dtype = safetensors_dtype_from_name(t.at("dtype").get<std::string>());
      const auto shape = t.at("shape").get<std::vector<int64_t>>();
      auto [it, fresh] = m.tensors.try_emplace(key);
      dcp::TensorEntry& e = it->second;
      if (fresh) {
        e.dtype = dtype;
        e.shape = shape;
      } else if (e.dtype != dtype || e.shape != shape) {
        throw std::logic_error("checkpoint save: ranks disagree on dtype/shape of '" + key + "'");
      }
      for (const auto& c : t.at("chunks"))
        e.chunks.push_back({{c.at("offsets").get<std::vector<int64_t>>(), c.at("sizes").get<std::vector<int64_t>>()},
                            {file, c.at("offset").get<uint64_t>(), c.at("length").get<uint64_t>(),
                             c.at("crc32c").get<uint32_t>()}});
    }
    for (const auto& b : report.at("bytes"))
      m.bytes[b.at("key").get<std::string>()] = {file, b.at("offset").get<uint64_t>(), b.at("length").get<uint64_t>(),
                                                 b.at("crc32c").get<uint32_t>()};
  }
  for (const auto& [key, e] : m.tensors) {
    int64_t numel = 1, chunked = 0;
    for (int64_t s : e.shape) numel *= s;
    for (const auto& c : e.chunks) chunked += c.box.numel();
    if (chunked != numel)
      throw std::logic_error("checkpoint save: the chunks of '" + key + "' hold " + std::to_string(chunked) + " of its " +
                             std::to_string(numel) + " elements");
  }
  for (const auto& [key, e] : m.tensors) m.paths[key] = dcp_path(key);
  for (const auto& [key, l] : m.bytes) m.paths[key] = dcp_path(key);
  const std::string encoded = dcp::encode_metadata(m);
  write_file_atomically((fs::path(dir) / dcp::kMetadataFile).string(), encoded);
  write_file_atomically((fs::path(dir) / dcp::kChecksumsFile).string(), dcp::encode_checksums(m, encoded));
}

namespace {

// metadata.json's fields for a checkpoint mfsdp did not write: the iteration Megatron and
// PyTorch users store, and the optimizer that the state entries imply.
nlohmann::json made_up_metadata(const dcp::Reader& r, const std::map<std::string, RowSource>& sources) {
  const dcp::Metadata& m = r.metadata();
  nlohmann::json meta = {{"format", "torch.distributed.checkpoint"}, {"version", 1},
                         {"iteration", 0}, {"consumed_samples", 0}, {"world_size", -1},
                         {"args", nlohmann::json::object()}, {"model_config", nlohmann::json::object()},
                         {"scheduler", nlohmann::json::object()}, {"optimizer", nullptr},
                         {"iteration_recorded", m.bytes.count("iteration") != 0}};
  if (m.bytes.count("iteration")) {
    const nlohmann::json it = r.read_object("iteration");
    if (!it.is_number_integer() || it.get<int64_t>() < 0)
      throw std::invalid_argument("checkpoint '" + r.dir() + "': 'iteration' is not a non-negative int");
    meta["iteration"] = it;
  }
  std::set<std::string> states;
  for (const auto& [name, src] : sources)
    if (starts_with(name, kOptimizerState)) states.insert(split_state_key(name.substr(kOptimizerState.size())).second);
  std::optional<int64_t> step;
  auto agree = [&](int64_t s, const std::string& where) {
    if (step && *step != s)
      throw std::invalid_argument("checkpoint '" + r.dir() + "': optimizer steps differ (" + std::to_string(*step) +
                                  " and " + std::to_string(s) + " at '" + where + "')");
    step = s;
  };
  for (const auto& [key, l] : m.bytes)
    if (starts_with(key, "optimizer.param_to_group_meta.") && split_state_key(key).second == "step") {
      const nlohmann::json s = r.read_object(key);
      if (!s.is_number()) throw std::invalid_argument("checkpoint '" + r.dir() + "': '" + key + "' is not a number");
      agree(static_cast<int64_t>(s.get<double>()), key);
    }
  for (const auto& [name, src] : sources)  // PyTorch's optimizers keep a 0-d step per parameter
    if (starts_with(name, kOptimizerState) && split_state_key(name).second == "step" &&
        m.tensors.at(src.key).shape.empty())
      agree(static_cast<int64_t>(r.read(src.key).item<double>()), src.key);
  if (states.count("exp_avg") && states.count("exp_avg_sq"))
    meta["optimizer"] = {{"name", "AdamW"}, {"step", step.value_or(0)}, {"state", {"exp_avg", "exp_avg_sq"}}};
  else if (states.count("momentum_buffer"))
    meta["optimizer"] = {{"name", "SGD"}, {"step", step.value_or(0)}, {"state", {"momentum_buffer"}}};
  return meta;
}


// The model a checkpoint with Megatron names holds, for splitting its fused tensors: its
// model_config, else what Megatron's pickled args describe; none when neither describes a model
// of a registered family (a fused linear_qkv then keeps its name).
std::optional<ModelConfig> megatron_model(const dcp::Reader& r, const nlohmann::json& model_config) {
  try {
    if (model_config.is_object() && !model_config.empty()) return model_config_from_hf(model_config);
    if (!r.metadata().bytes.count("args")) return std::nullopt;
    return model_config_from_megatron(r.read_object("args", ObjectPolicy::kDescribeObjects));
  } catch (const std::invalid_argument&) {
    return std::nullopt;  // args we cannot read as data, or no family's model
  }
}

}  // namespace

RowSource whole_tensor(const std::string& key, const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  if (shape.empty() || shape[0] == 0) return {key, numel, {{0, 1}}};
  return {key, numel / shape[0], {{0, shape[0]}}};
}

void read_rows(const dcp::Reader& reader, const RowSource& source, int64_t offset, const at::Tensor& dst) {
  if (source.runs.size() == 1 && source.runs[0].first == 0) return reader.read_range(source.key, offset, dst);
  const int64_t end = offset + dst.numel();
  int64_t at = 0;  // flat position of the current run in the mapped tensor
  for (const auto& [first, rows] : source.runs) {
    const int64_t run_begin = at, run_end = at + rows * source.row_numel;
    at = run_end;
    const int64_t lo = std::max(offset, run_begin), hi = std::min(end, run_end);
    if (hi <= lo) continue;
    reader.read_range(source.key, first * source.row_numel + (lo - run_begin), dst.narrow(0, lo - offset, hi - lo));
  }
}

dcp::Reader open_dcp_folder(const std::string& path) {
  const std::string dir = resolve_checkpoint_dir(path);
  if (!dcp::is_dcp_directory(dir))
    throw std::invalid_argument("'" + dir + "' is not a PyTorch Distributed Checkpoint (no .metadata); an mfsdp-format "
                                "checkpoint converts with `mfsdp-ckpt convert`");
  return dcp::Reader(dir);
}

OpenedDcp open_dcp_checkpoint(const std::string& dir) {
  OpenedDcp out;
  auto reader = std::make_shared<dcp::Reader>(dir);
  const dcp::Metadata& m = reader->metadata();
  std::map<std::string, MappedTensor> tensors;
  for (const auto& [key, e] : m.tensors) {
    const std::string name = from_dcp_key(key);
    auto [it, fresh] = tensors.try_emplace(name, MappedTensor{e.shape, e.dtype, whole_tensor(key, e.shape)});
    if (!fresh)
      throw std::invalid_argument("checkpoint '" + dir + "': entries '" + it->second.source.key + "' and '" + key +
                                  "' are the same tensor '" + name + "'");
  }
  if (m.bytes.count(kMetadataEntry)) {
    out.metadata = reader->read_object(kMetadataEntry);
    if (!out.metadata.is_object())
      throw std::invalid_argument("checkpoint '" + dir + "': '" + kMetadataEntry + "' is not a dict");
  }
  if (has_megatron_gpt_names(tensors)) {
    const std::optional<ModelConfig> model =
        megatron_model(*reader, out.metadata.value("model_config", nlohmann::json::object()));
    // Without a model described, the first family registered (src/models/model_registry.cpp).
    const ModelSpec& spec = model ? *model->spec : *model_specs().front();
    tensors = megatron_gpt_to_model(tensors, spec, model ? &*model : nullptr);
  }
  for (const auto& [name, t] : tensors) out.sources[name] = t.source;
  if (!m.bytes.count(kMetadataEntry)) out.metadata = made_up_metadata(*reader, out.sources);
  nlohmann::json described = nlohmann::json::object();
  std::set<std::string> files;
  for (const auto& [name, t] : tensors) {
    const dcp::TensorEntry& e = m.tensors.at(t.source.key);
    nlohmann::json chunks = nlohmann::json::array();
    for (const auto& c : e.chunks) {
      chunks.push_back({{"file", c.location.file}, {"offsets", c.box.offsets}, {"sizes", c.box.sizes},
                        {"bytes", {c.location.offset, c.location.offset + c.location.length}}});
      files.insert(c.location.file);
    }
    described[name] = {{"key", t.source.key}, {"dtype", safetensors_dtype_name(t.dtype)}, {"shape", t.shape},
                       {"chunks", chunks}};
    if (t.shape != e.shape) described[name]["rows"] = t.source.runs;  // a part of the stored tensor
  }
  out.metadata["tensors"] = described;
  out.metadata["files"] = files;
  out.reader = std::move(reader);
  return out;
}

}  // namespace mfsdp::checkpoint
