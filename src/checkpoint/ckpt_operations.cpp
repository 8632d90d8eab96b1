// mfsdp-ckpt's inspect, print-tensor, compare and convert (include/mfsdp/checkpoint/ckpt_operations.h). The
// readers go through TensorSource a block at a time, so they work on models larger than memory;
// convert builds the whole state dict because its transforms (swiglu splits, renames that must
// not collide) need every name at once.
#include "mfsdp/checkpoint/ckpt_operations.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <iterator>
#include <limits>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>

#include "checkpoint/interop_util.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/checkpoint/torch_save.h"

namespace fs = std::filesystem;

namespace mfsdp {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;
using interop::ends_with;
using interop::kConfigFile;
using interop::kIndexFile;
using interop::kModelPrefix;
using interop::kSingleFile;
using interop::read_json_file;
using interop::replace_all;
using interop::shape_str;
using interop::starts_with;

// Elements read at a time by compare and print-tensor (32 MiB of fp64 per side).
constexpr int64_t kBlockElements = int64_t{1} << 22;

// For "a.b.linear_fc1.weight": true, with the name before and after the fc1 component.
bool split_fc1_name(const std::string& name, std::string& head, std::string& tail) {
  static const std::string kWeight = ".weight";
  if (!ends_with(name, kWeight)) return false;
  const std::string stem = name.substr(0, name.size() - kWeight.size());
  const size_t dot = stem.rfind('.');
  const std::string component = dot == std::string::npos ? stem : stem.substr(dot + 1);
  if (component != "fc1" && component != "linear_fc1") return false;
  head = dot == std::string::npos ? "" : stem.substr(0, dot + 1);
  tail = kWeight;
  return true;
}

struct BlockDifference {
  double max_abs_diff = 0;  // NaN where one side is NaN and the other not
  bool close = true;        // every element within atol + rtol * |y|
};

// Two 1-D blocks compared in fp64 (integers exactly, in int64).
BlockDifference compare_block(const at::Tensor& x, const at::Tensor& y, const CompareOptions& o) {
  BlockDifference d;
  if (x.numel() == 0) return d;
  if (at::isIntegralType(x.scalar_type(), true) && at::isIntegralType(y.scalar_type(), true)) {
    const at::Tensor diff = (x.to(at::kLong) - y.to(at::kLong)).abs();
    d.max_abs_diff = static_cast<double>(diff.max().item<int64_t>());
    d.close = diff.to(at::kDouble).le(y.to(at::kLong).abs().to(at::kDouble).mul(o.rtol).add(o.atol)).all().item<bool>();
    return d;
  }
  const at::Tensor a = x.to(at::kDouble), b = y.to(at::kDouble);
  const at::Tensor same = at::eq(a, b).logical_or(at::isnan(a).logical_and(at::isnan(b)));
  const at::Tensor diff = (a - b).abs().masked_fill(same, 0.0);
  if (at::isnan(diff).any().item<bool>()) {
    d.max_abs_diff = std::numeric_limits<double>::quiet_NaN();
    d.close = false;
    return d;
  }
  d.max_abs_diff = diff.max().item<double>();
  d.close = diff.le(b.abs().mul(o.rtol).add(o.atol)).all().item<bool>();
  return d;
}

bool is_dcp(const TensorSource& s) {
  return s.checkpoint() != nullptr && s.checkpoint()->format() == CheckpointFormat::kFsdpDtensor;
}

// The keys of a DCP checkpoint's non-tensor entries.
std::set<std::string> object_keys(const TensorSource& s) {
  std::set<std::string> keys;
  const dcp::Reader reader(s.checkpoint()->dir());
  for (const auto& entry : reader.metadata().bytes) keys.insert(entry.first);
  return keys;
}

std::string format_number(double v, int precision) {
  std::ostringstream os;
  os << std::setprecision(precision) << v;
  return os.str();
}

}  // namespace

ojson inspect_checkpoint(const CheckpointReader& reader, bool chunks) {
  const json& meta = reader.metadata();
  ojson out;
  out["path"] = reader.dir();
  for (const char* key : {"format", "version", "iteration", "consumed_samples", "world_size", "args", "model_config",
                          "scheduler", "optimizer", "files"})
    if (meta.contains(key)) out[key] = ojson::parse(meta[key].dump());
  for (const auto& [key, value] : meta.items())  // fields a newer writer may add
    if (key != "tensors" && !out.contains(key)) out[key] = ojson::parse(value.dump());
  ojson tensors = ojson::object();
  int64_t model_parameters = 0;
  uint64_t bytes = 0;
  for (const std::string& name : reader.tensor_names()) {
    const json& entry = meta["tensors"][name];
    ojson t;
    t["dtype"] = entry["dtype"];
    t["shape"] = ojson::parse(entry["shape"].dump());
    if (chunks)
      t["chunks"] = ojson::parse(entry["chunks"].dump());
    else
      t["chunks"] = entry["chunks"].size();
    int64_t numel = 1;
    for (int64_t s : reader.shape(name)) numel *= s;
    bytes += static_cast<uint64_t>(numel) * c10::elementSize(reader.dtype(name));
    if (starts_with(name, kModelPrefix)) model_parameters += numel;
    tensors[name] = std::move(t);
  }
  out["summary"] = {{"tensors", tensors.size()}, {"model_parameters", model_parameters}, {"total_bytes", bytes}};
  out["tensors"] = std::move(tensors);
  return out;
}

std::string describe_tensor(const TensorSource& source, const std::string& name, int64_t max_elements) {
  std::string resolved = name;
  if (!source.contains(name) && source.contains(kModelPrefix + name)) resolved = kModelPrefix + name;
  if (!source.contains(resolved))
    throw std::invalid_argument("no tensor '" + name + "' in " + source.description() +
                                (source.is_checkpoint() ? " (mfsdp-ckpt inspect lists the names)"
                                                        : " (give the HF name, or model.<HF name>)"));
  const std::vector<int64_t> shape = source.shape(resolved);
  const at::ScalarType dtype = source.dtype(resolved);
  const int64_t numel = source.numel(resolved);
  const bool integral = at::isIntegralType(dtype, /*includeBool=*/true);
  const int precision = dtype == at::kDouble ? 17 : 9;
  std::ostringstream os;
  os << "tensor  " << resolved << "\n"
     << "dtype   " << safetensors_dtype_name(dtype) << "\n"
     << "shape   " << shape_str(shape) << " (" << numel << " elements)\n";

  if (numel == 0) {
    os << "stats   (empty)\n";
    return os.str();
  }
  double lo = std::numeric_limits<double>::infinity(), hi = -lo, sum = 0;
  for (int64_t off = 0; off < numel; off += kBlockElements) {
    const at::Tensor block = source.read_elements(resolved, off, std::min(kBlockElements, numel - off)).to(at::kDouble);
    const double block_min = block.min().item<double>(), block_max = block.max().item<double>();
    if (std::isnan(block_min) || std::isnan(lo)) {
      lo = hi = std::numeric_limits<double>::quiet_NaN();  // as torch: NaN wins
    } else {
      lo = std::min(lo, block_min);
      hi = std::max(hi, block_max);
    }
    sum += block.sum().item<double>();
  }
  os << "min     " << format_number(lo, precision) << "\n"
     << "max     " << format_number(hi, precision) << "\n"
     << "mean    " << format_number(sum / static_cast<double>(numel), precision) << "\n";

  const int64_t shown = std::min(numel, std::max<int64_t>(max_elements, 0));
  if (shown < numel)
    os << "values  (the first " << shown << " of " << numel
       << " elements, row-major; --max-elements N shows more)\n";
  else
    os << "values\n";
  if (shown == 0) return os.str();
  const at::Tensor values = source.read_elements(resolved, 0, shown).to(integral ? at::kLong : at::kDouble).contiguous();
  const int64_t* ints = integral ? values.data_ptr<int64_t>() : nullptr;
  const double* reals = integral ? nullptr : values.data_ptr<double>();
  // One line per row of the last dimension, prefixed with the row's index ("[1, 0, :]").
  const int64_t row = shape.empty() ? 1 : std::max<int64_t>(shape.back(), 1);
  for (int64_t start = 0; start < shown; start += row) {
    os << "  ";
    if (shape.size() > 1) {
      std::vector<int64_t> index(shape.size() - 1);
      int64_t r = start / row;
      for (size_t d = index.size(); d-- > 0;) {
        index[d] = r % shape[d];
        r /= shape[d];
      }
      os << "[";
      for (int64_t i : index) os << i << ", ";
      os << ":]  ";
    }
    const int64_t end = std::min(shown, start + row);
    for (int64_t i = start; i < end; ++i) {
      if (i > start) os << " ";
      if (integral)
        os << ints[i];
      else
        os << format_number(reals[i], precision);
    }
    os << (end < std::min(numel, start + row) ? " ..." : "") << "\n";
  }
  return os.str();
}

ComparisonReport compare_tensors(const TensorSource& a, const TensorSource& b, const CompareOptions& options) {
  if (!(options.atol >= 0) || !(options.rtol >= 0))
    throw std::invalid_argument("compare: atol and rtol must be >= 0, got atol " + format_number(options.atol, 6) +
                                ", rtol " + format_number(options.rtol, 6));
  ComparisonReport report;
  report.options = options;
  std::set<std::string> names;
  for (const auto* s : {&a, &b})
    for (const std::string& n : s->names())
      if (!options.model_only || starts_with(n, kModelPrefix)) names.insert(n);
  // Other entries only between two DCP checkpoints: an HF folder or the earlier format has none.
  if (!options.model_only && is_dcp(a) && is_dcp(b)) {
    const std::set<std::string> in_a = object_keys(a), in_b = object_keys(b);
    std::set_difference(in_a.begin(), in_a.end(), in_b.begin(), in_b.end(), std::back_inserter(report.objects_only_in_a));
    std::set_difference(in_b.begin(), in_b.end(), in_a.begin(), in_a.end(), std::back_inserter(report.objects_only_in_b));
    if (!report.objects_only_in_a.empty() || !report.objects_only_in_b.empty()) report.same = false;
  }
  using Status = TensorComparison::Status;
  for (const std::string& name : names) {
    TensorComparison row;
    row.name = name;
    const bool in_a = a.contains(name), in_b = b.contains(name);
    if (in_a) row.shape_a = a.shape(name), row.dtype_a = a.dtype(name);
    if (in_b) row.shape_b = b.shape(name), row.dtype_b = b.dtype(name);
    if (!in_a || !in_b) {
      row.status = in_a ? Status::kOnlyInA : Status::kOnlyInB;
    } else if (row.shape_a != row.shape_b) {
      row.status = Status::kShapeMismatch;
    } else {
      const int64_t numel = a.numel(name);
      bool close = true;
      for (int64_t off = 0; off < numel; off += kBlockElements) {
        const int64_t n = std::min(kBlockElements, numel - off);
        const BlockDifference d = compare_block(a.read_elements(name, off, n).to(options.device),
                                                b.read_elements(name, off, n).to(options.device), options);
        close = close && d.close;
        if (std::isnan(d.max_abs_diff)) {
          row.max_abs_diff = d.max_abs_diff;
          break;
        }
        row.max_abs_diff = std::max(row.max_abs_diff, d.max_abs_diff);
      }
      row.status = close ? Status::kEqual : Status::kDifferent;
    }
    if (row.status != Status::kEqual) report.same = false;
    report.rows.push_back(std::move(row));
  }
  return report;
}

std::string ComparisonReport::table() const {
  using Status = TensorComparison::Status;
  size_t width = 6;
  for (const auto& r : rows) width = std::max(width, r.name.size());
  std::ostringstream os;
  os << std::left << std::setw(10) << "status" << std::setw(14) << "max|a-b|" << "tensor\n";
  int64_t counts[5] = {0, 0, 0, 0, 0};
  for (const auto& r : rows) {
    ++counts[static_cast<int>(r.status)];
    const char* status = "ok";
    std::string detail;
    switch (r.status) {
      case Status::kEqual: break;
      case Status::kDifferent: status = "DIFFERENT"; break;
      case Status::kShapeMismatch:
        status = "SHAPE";
        detail = "  shape " + shape_str(r.shape_a) + " vs " + shape_str(r.shape_b);
        break;
      case Status::kOnlyInA: status = "ONLY-A"; break;
      case Status::kOnlyInB: status = "ONLY-B"; break;
    }
    const bool both = r.status != Status::kOnlyInA && r.status != Status::kOnlyInB;
    if (both && r.dtype_a != r.dtype_b)
      detail += "  dtype " + safetensors_dtype_name(r.dtype_a) + " vs " + safetensors_dtype_name(r.dtype_b);
    const std::string diff =
        r.status == Status::kEqual || r.status == Status::kDifferent ? format_number(r.max_abs_diff, 6) : "-";
    os << std::left << std::setw(10) << status << std::setw(14) << diff << r.name << detail << "\n";
  }
  using Lone = std::pair<const char*, const std::vector<std::string>*>;
  for (const auto& [side, keys] : {Lone{"A", &objects_only_in_a}, Lone{"B", &objects_only_in_b}})
    for (const std::string& key : *keys) os << std::left << std::setw(10) << (std::string("ONLY-") + side) << std::setw(14) << "-" << key << "  (object)\n";
  os << rows.size() << " tensors: " << counts[0] << " equal, " << counts[1] << " different, " << counts[2]
     << " with other shapes, " << counts[3] << " only in A, " << counts[4] << " only in B";
  if (!objects_only_in_a.empty() || !objects_only_in_b.empty())
    os << "; objects: " << objects_only_in_a.size() << " only in A, " << objects_only_in_b.size() << " only in B";
  os << " (allclose: rtol " << format_number(options.rtol, 6) << ", atol " << format_number(options.atol, 6)
     << "): " << (same ? "SAME" : "DIFFERENT") << "\n";
  return os.str();
}

// ---- convert -----------------------------------------------------------------------------------

std::map<std::string, at::Tensor> apply_state_transform(std::map<std::string, at::Tensor> tensors,
                                                        const StateTransform& transform) {
  for (auto it = tensors.begin(); it != tensors.end();)
    it = transform.ops.removes(it->first) ? tensors.erase(it) : std::next(it);
  auto renamed = [&](const std::string& name) { return transform.ops.renamed(name); };
  std::map<std::string, std::pair<std::string, at::Tensor>> out;  // final name -> (source, tensor)
  auto put = [&](const std::string& name, const std::string& source, const at::Tensor& t) {
    auto [it, inserted] = out.emplace(name, std::make_pair(source, t));
    if (!inserted)
      throw std::invalid_argument("tensors '" + it->second.first + "' and '" + source + "' would both be named '" +
                                  name + "'");
  };
  for (const auto& [name, t] : tensors) {
    std::string head, tail;
    if (transform.swiglu && split_fc1_name(name, head, tail)) {
      if (t.dim() == 0 || t.size(0) % 2 != 0)
        throw std::invalid_argument("--swiglu: tensor '" + name + "' has shape " + shape_str(t.sizes().vec()) +
                                    "; a fused gate/up weight needs an even first dimension");
      const int64_t half = t.size(0) / 2;
      put(renamed(head + "gate_proj" + tail), name, t.narrow(0, 0, half).contiguous());
      put(renamed(head + "up_proj" + tail), name, t.narrow(0, half, half).contiguous());
    } else {
      put(renamed(name), name, t);
    }
  }
  std::map<std::string, at::Tensor> result;
  for (auto& [name, st] : out) {
    if (name.empty()) throw std::invalid_argument("a rename leaves tensor '" + st.first + "' with an empty name");
    result.emplace(name, std::move(st.second));
  }
  return result;
}

std::vector<std::string> convert_to_checkpoint(const std::string& in, const std::string& out,
                                               const StateTransform& transform, int64_t iteration) {
  if (iteration < 0) throw std::invalid_argument("convert: the iteration must not be negative");
  std::map<std::string, at::Tensor> tensors;
  json model_config = json::object();
  if (is_checkpoint(in)) {
    CheckpointReader reader(in);
    for (const std::string& name : reader.tensor_names())
      if (starts_with(name, kModelPrefix)) tensors[name.substr(kModelPrefix.size())] = reader.read(name);
    model_config = reader.metadata().value("model_config", json::object());
  } else if (is_hf_folder(in)) {
    tensors = read_safetensors_folder(in);
    model_config = read_json_file((fs::path(in) / kConfigFile).string(), "HF config");
  } else if (fs::is_regular_file(in)) {
    tensors = read_torch_save(in);
  } else {
    throw std::invalid_argument("convert: '" + in + "' is not a checkpoint, a Hugging Face folder (config.json with " +
                                kSingleFile + " or " + kIndexFile + ") or a torch.save file");
  }
  if (tensors.empty()) throw std::invalid_argument("convert: '" + in + "' holds no model tensors");
  tensors = apply_state_transform(std::move(tensors), transform);
  if (tensors.empty()) throw std::invalid_argument("convert: no tensor of '" + in + "' is left after the removes");

  CheckpointInfo info;
  info.iteration = iteration;
  info.model_config = model_config;
  info.args = {{"converted_from", in}, {"swiglu", transform.swiglu}, {"ops", transform.ops.texts()}};
  write_checkpoint(out, tensors, info);
  std::vector<std::string> names;
  for (const auto& kv : tensors) names.push_back(kv.first);
  return names;
}

uint64_t parse_byte_size(const std::string& text) {
  auto bad = [&]() -> uint64_t {
    throw std::invalid_argument("'" + text + "' is not a size (examples: 500MB, 2GB, 64KiB, 1000000)");
  };
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const std::string number = text.substr(0, i);
  std::string unit;
  for (size_t j = i; j < text.size(); ++j)
    if (!std::isspace(static_cast<unsigned char>(text[j]))) unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[j])));
  if (number.empty() || std::count(number.begin(), number.end(), '.') > 1 || number == ".") return bad();
  static const std::map<std::string, double> kUnits = {
      {"", 1},         {"b", 1},        {"k", 1e3},          {"kb", 1e3},          {"m", 1e6},
      {"mb", 1e6},     {"g", 1e9},      {"gb", 1e9},         {"t", 1e12},          {"tb", 1e12},
      {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  auto unit_it = kUnits.find(unit);
  if (unit_it == kUnits.end()) return bad();
  const double value = std::stod(number) * unit_it->second;
  if (!(value >= 1) || value >= 1.8e19) return bad();
  return static_cast<uint64_t>(value);
}

}  // namespace mfsdp
