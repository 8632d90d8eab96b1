// CheckpointReader: metadata.json validation and element-range reads across shard files.
#include <ATen/ATen.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/dcp_checkpoint.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/base/crc32c.h"
#include "mfsdp/base/json_parse.h"

namespace fs = std::filesystem;

namespace mfsdp {
namespace {

// checkpoint_metadata_parse_count's counter.
std::atomic<int64_t> metadata_parses{0};

[[noreturn]] void bad(const std::string& file, const std::string& what) {
  throw std::invalid_argument("checkpoint file '" + file + "': " + what);
}

nlohmann::json read_json(const std::string& file) {
  std::ifstream in(file);
  if (!in) bad(file, "cannot be read");
  try {
    return parse_json(in);
  } catch (const nlohmann::json::exception& e) {
    bad(file, std::string("is not valid JSON: ") + e.what());
  }
}

// Checks one tensor's entry: dtype, shape, and chunks that tile its elements in order.
void check_tensor_entry(const std::string& file, const std::string& name, const nlohmann::json& t,
                        size_t num_files) {
  auto fail = [&](const std::string& what) { bad(file, "tensor '" + name + "': " + what); };
  if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("chunks"))
    fail("needs dtype, shape and chunks");
  if (!t["dtype"].is_string()) fail("dtype is not a string");
  at::ScalarType dtype;
  try {
    dtype = safetensors_dtype_from_name(t["dtype"].get<std::string>());
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  if (!t["shape"].is_array()) fail("shape is not an array");
  int64_t numel = 1;
  for (const auto& s : t["shape"]) {
    if (!s.is_number_integer() || s.get<int64_t>() < 0) fail("shape has a negative or non-integer size");
    numel *= s.get<int64_t>();
  }
  if (!t["chunks"].is_array()) fail("chunks is not an array");
  const uint64_t item = c10::elementSize(dtype);
  int64_t next = 0;
  for (const auto& c : t["chunks"]) {
    const bool ok = c.is_object() && c.contains("file") && c["file"].is_number_unsigned() &&
                    c.contains("key") && c["key"].is_string() && c.contains("offset") &&
                    c["offset"].is_number_integer() && c.contains("numel") && c["numel"].is_number_integer() &&
                    c.contains("bytes") && c["bytes"].is_array() && c["bytes"].size() == 2 &&
                    c["bytes"][0].is_number_unsigned() && c["bytes"][1].is_number_unsigned();
    if (!ok) fail("a chunk needs file, key, offset, numel and bytes [begin, end]");
    if (c.contains("crc32c") && !(c["crc32c"].is_number_unsigned() && c["crc32c"].get<uint64_t>() <= 0xffffffffu))
      fail("a chunk's crc32c is not a 32-bit unsigned number");
    if (c["file"].get<size_t>() >= num_files)
      fail("a chunk names file " + std::to_string(c["file"].get<size_t>()) + " of " + std::to_string(num_files));
    const int64_t offset = c["offset"].get<int64_t>(), n = c["numel"].get<int64_t>();
    if (offset != next || n <= 0)
      fail("chunks do not tile the tensor (chunk at element " + std::to_string(offset) + " of " +
           std::to_string(n) + " elements, expected one at " + std::to_string(next) + ")");
    if (c["bytes"][1].get<uint64_t>() - c["bytes"][0].get<uint64_t>() != static_cast<uint64_t>(n) * item ||
        c["bytes"][1].get<uint64_t>() < c["bytes"][0].get<uint64_t>())
      fail("chunk at element " + std::to_string(offset) + " has a byte range that does not match its size");
    next += n;
  }
  if (next != numel)
    fail("chunks cover " + std::to_string(next) + " of its " + std::to_string(numel) + " elements");
}

}  // namespace

CheckpointFormat checkpoint_format_from_name(const std::string& name) {
  if (name == "fsdp_dtensor") return CheckpointFormat::kFsdpDtensor;
  if (name == "mfsdp") return CheckpointFormat::kMfsdp;
  throw std::invalid_argument("unknown checkpoint format '" + name + "' (fsdp_dtensor or mfsdp)");
}

int64_t checkpoint_metadata_parse_count() { return metadata_parses.load(); }

CheckpointReader::CheckpointReader(const std::string& path) : dir_(resolve_checkpoint_dir(path)) {
  ++metadata_parses;
  if (dcp::is_dcp_directory(dir_)) {
    auto opened = std::make_shared<checkpoint::OpenedDcp>(checkpoint::open_dcp_checkpoint(dir_));
    metadata_ = std::move(opened->metadata);
    dcp_ = std::move(opened);
    const std::string file = dir_ + "/" + dcp::kMetadataFile;
    for (const char* key : {"iteration", "consumed_samples"})
      if (!metadata_.contains(key) || !metadata_[key].is_number_integer() || metadata_[key].get<int64_t>() < 0)
        bad(file, std::string("needs a non-negative integer \"") + key + "\"");
    if (metadata_.value("version", 1) > kCheckpointFormatVersion)
      bad(file, "was written in format version " + metadata_["version"].dump() + ", newer than this build reads (" +
                    std::to_string(kCheckpointFormatVersion) + "); update mfsdp");
    return;
  }
  const std::string file = dir_ + "/" + checkpoint::kMetadataFile;
  metadata_ = read_json(file);
  if (!metadata_.is_object() || metadata_.value("format", "") != kCheckpointFormatName)
    bad(file, std::string("is not an mfsdp checkpoint (\"format\" should be \"") + kCheckpointFormatName + "\")");
  if (!metadata_.contains("version") || !metadata_["version"].is_number_integer())
    bad(file, "has no integer \"version\"");
  const int64_t version = metadata_["version"].get<int64_t>();
  if (version > kCheckpointFormatVersion)
    bad(file, "was written in format version " + std::to_string(version) + ", newer than this build reads (" +
                  std::to_string(kCheckpointFormatVersion) + "); update mfsdp");
  if (version < 1) bad(file, "has an invalid format version " + std::to_string(version));
  for (const char* key : {"iteration", "consumed_samples"})
    if (!metadata_.contains(key) || !metadata_[key].is_number_integer() || metadata_[key].get<int64_t>() < 0)
      bad(file, std::string("needs a non-negative integer \"") + key + "\"");
  if (!metadata_.contains("files") || !metadata_["files"].is_array()) bad(file, "has no \"files\" array");
  for (const auto& f : metadata_["files"]) {
    if (!f.is_string() || f.get<std::string>().empty() || f.get<std::string>().find('/') != std::string::npos)
      bad(file, "\"files\" must hold plain file names");
    files_.push_back(f.get<std::string>());
  }
  if (!metadata_.contains("tensors") || !metadata_["tensors"].is_object()) bad(file, "has no \"tensors\" object");
  for (const auto& [name, t] : metadata_["tensors"].items()) check_tensor_entry(file, name, t, files_.size());
}

std::vector<std::string> CheckpointReader::tensor_names() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : metadata_["tensors"].items()) out.push_back(name);
  return out;  // nlohmann::json objects iterate in sorted key order
}

bool CheckpointReader::contains(const std::string& name) const { return metadata_["tensors"].contains(name); }

const nlohmann::json& CheckpointReader::entry(const std::string& name) const {
  if (!contains(name))
    throw std::invalid_argument("checkpoint '" + dir_ + "': no tensor '" + name + "'");
  return metadata_["tensors"][name];
}

std::vector<int64_t> CheckpointReader::shape(const std::string& name) const {
  return entry(name)["shape"].get<std::vector<int64_t>>();
}

at::ScalarType CheckpointReader::dtype(const std::string& name) const {
  return safetensors_dtype_from_name(entry(name)["dtype"].get<std::string>());
}

const SafetensorsFile& CheckpointReader::file(int index) const {
  auto it = open_files_.find(index);
  if (it != open_files_.end()) return it->second;
  const std::string path = dir_ + "/" + files_.at(static_cast<size_t>(index));
  if (!fs::exists(path)) bad(path, "is missing (listed in " + std::string(checkpoint::kMetadataFile) + ")");
  SafetensorsFile f(path);  // validates the header itself
  // Every chunk metadata.json places in this file must be there, as described.
  for (const auto& [name, t] : metadata_["tensors"].items()) {
    const at::ScalarType dtype = safetensors_dtype_from_name(t["dtype"].get<std::string>());
    for (const auto& c : t["chunks"]) {
      if (c["file"].get<int>() != index) continue;
      const std::string key = c["key"].get<std::string>();
      if (!f.contains(key)) bad(path, "tensor '" + name + "': chunk '" + key + "' is missing");
      const int64_t n = c["numel"].get<int64_t>();
      if (f.dtype(key) != dtype || f.shape(key) != std::vector<int64_t>{n})
        bad(path, "tensor '" + name + "': chunk '" + key + "' has another dtype or size than " +
                      checkpoint::kMetadataFile + " says");
      const auto range = f.file_byte_range(key);
      if (range.first != c["bytes"][0].get<uint64_t>() || range.second != c["bytes"][1].get<uint64_t>())
        bad(path, "tensor '" + name + "': chunk '" + key + "' is at other bytes than " +
                      checkpoint::kMetadataFile + " says");
    }
  }
  return open_files_.emplace(index, std::move(f)).first->second;
}

void CheckpointReader::verify_chunk(const std::string& name, const nlohmann::json& chunk) const {
  const std::string key = chunk["key"].get<std::string>();
  if (!chunk.contains("crc32c") || verified_chunks_.count(key)) return;
  const std::string path = file(chunk["file"].get<int>()).path();  // opened: the byte range lies in the file
  const uint64_t begin = chunk["bytes"][0].get<uint64_t>(), end = chunk["bytes"][1].get<uint64_t>();
  const uint32_t saved = chunk["crc32c"].get<uint32_t>(), found = crc32c_of_file_range(path, begin, end - begin);
  if (found != saved)
    bad(path, "bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ") (tensor '" + name + "', chunk '" +
                  key + "') do not match their checksum (CRC-32C " + crc32c_hex(saved) + " in " +
                  checkpoint::kMetadataFile + ", " + crc32c_hex(found) + " read): the file was changed or damaged " +
                  "after the save");
  verified_chunks_.insert(key);
}

std::pair<int64_t, uint64_t> CheckpointReader::verify_checksums() const {
  if (dcp_) return dcp_->reader->verify_checksums();
  int64_t entries = 0;
  uint64_t bytes = 0;
  for (const auto& [name, t] : metadata_["tensors"].items())
    for (const auto& c : t["chunks"]) {
      if (!c.contains("crc32c"))
        bad(dir_ + "/" + checkpoint::kMetadataFile, "has no checksum for tensor '" + name + "' (written by an older "
                                                    "mfsdp): its bytes cannot be verified");
      verify_chunk(name, c);
      ++entries;
      bytes += c["bytes"][1].get<uint64_t>() - c["bytes"][0].get<uint64_t>();
    }
  return {entries, bytes};
}

void CheckpointReader::read_range(const std::string& name, int64_t offset, const at::Tensor& dst) const {
  const nlohmann::json& t = entry(name);
  if (dcp_) return checkpoint::read_rows(*dcp_->reader, dcp_->sources.at(name), offset, dst);
  int64_t numel = 1;
  for (const auto& s : t["shape"]) numel *= s.get<int64_t>();
  const int64_t count = dst.numel();
  if (dst.dim() != 1 || offset < 0 || offset + count > numel)
    throw std::invalid_argument("checkpoint '" + dir_ + "', tensor '" + name + "': cannot read elements [" +
                                std::to_string(offset) + ", " + std::to_string(offset + count) + ") of " +
                                std::to_string(numel));
  at::NoGradGuard no_grad;
  for (const auto& c : t["chunks"]) {
    const int64_t begin = c["offset"].get<int64_t>(), end = begin + c["numel"].get<int64_t>();
    const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + count);
    if (hi <= lo) continue;
    verify_chunk(name, c);
    at::Tensor part = file(c["file"].get<int>()).load_elements(c["key"].get<std::string>(), lo - begin, hi - lo);
    dst.narrow(0, lo - offset, hi - lo).copy_(part);
  }
}

void CheckpointReader::read_slice_range(const std::string& name, const std::vector<int64_t>& slice_shape,
                                        const std::vector<int64_t>& origin, int64_t offset, const at::Tensor& dst) const {
  const std::vector<int64_t> whole = shape(name);
  bool inside = slice_shape.size() == whole.size() && origin.size() == whole.size();
  int64_t numel = 1;
  for (size_t d = 0; inside && d < whole.size(); ++d) {
    inside = origin[d] >= 0 && slice_shape[d] >= 0 && origin[d] <= whole[d] - slice_shape[d];
    numel *= slice_shape[d];
  }
  const int64_t count = dst.numel();
  if (!inside || dst.dim() != 1 || offset < 0 || offset > numel || count > numel - offset)
    throw std::invalid_argument("checkpoint '" + dir_ + "', tensor '" + name + "' of shape " +
                                c10::str(at::IntArrayRef(whole)) + ": cannot read elements [" + std::to_string(offset) +
                                ", " + std::to_string(offset + count) + ") of its slice " +
                                c10::str(at::IntArrayRef(slice_shape)) + " at " + c10::str(at::IntArrayRef(origin)));
  const std::vector<dcp::Box> boxes = checkpoint::slice_range_boxes(slice_shape, origin, offset, offset + count);
  std::vector<at::Tensor> views;
  int64_t flat = 0;
  for (const dcp::Box& b : boxes) {
    views.push_back(dst.narrow(0, flat, b.numel()).view(b.sizes));
    flat += b.numel();
  }
  if (dcp_) {
    const checkpoint::RowSource& source = dcp_->sources.at(name);
    if (source.runs.size() == 1 && source.runs[0].first == 0 && dcp_->reader->tensor(source.key).shape == whole)
      return dcp_->reader->read_boxes(source.key, boxes, views);
  }
  // A tensor made of rows of another (Megatron's fused tensors) or stored as element ranges
  // (the mfsdp format): each box's contiguous runs.
  int64_t at = 0;
  for (const auto& [start, length] : checkpoint::slice_range_runs(whole, slice_shape, origin, offset, offset + count)) {
    read_range(name, start, dst.narrow(0, at, length));
    at += length;
  }
}

at::Tensor CheckpointReader::read(const std::string& name) const {
  at::Tensor out = at::empty(shape(name), at::TensorOptions().dtype(dtype(name)));
  read_range(name, 0, out.view({-1}));
  return out;
}

}  // namespace mfsdp
