// PyTorch Distributed Checkpoint directories: include/mfsdp/checkpoint/dcp.h.
#include "mfsdp/checkpoint/dcp.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include "checkpoint/formats/pickle.h"
#include "checkpoint/formats/zip_archive.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/torch_save.h"
#include "mfsdp/base/crc32c.h"
#include "mfsdp/base/json_parse.h"

namespace fs = std::filesystem;

namespace mfsdp::dcp {
namespace {

using pickle::Value;

const char* const kMetadataModule = "torch.distributed.checkpoint.metadata";
const char* const kFilesystemModule = "torch.distributed.checkpoint.filesystem";

// torch's dtype names, as the metadata pickles them ("torch.float32").
const std::pair<const char*, at::ScalarType> kDtypes[] = {
    {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16},
    {"int64", at::kLong},    {"int32", at::kInt},      {"int16", at::kShort},  {"int8", at::kChar},
    {"uint8", at::kByte},    {"bool", at::kBool},
};

const std::set<std::string>& allowed_globals() {
  static const std::set<std::string> allowed = [] {
    std::set<std::string> a;
    for (const char* cls : {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"})
      a.insert(std::string(kMetadataModule) + "." + cls);
    a.insert(std::string(kFilesystemModule) + "._StorageInfo");
    // Values only: never called here. PosixPath is StorageMeta.checkpoint_id's type.
    for (const char* g : {"torch.Size", "torch.serialization._get_layout", "torch.strided", "collections.OrderedDict",
                          "pathlib.PosixPath"})
      a.insert(g);
    for (const auto& [name, dtype] : kDtypes) a.insert(std::string("torch.") + name);
    return a;
  }();
  return allowed;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

std::string box_str(const std::vector<int64_t>& v) { return c10::str(at::IntArrayRef(v)); }

// Interprets the unpickled tree, failing with the file named.
class MetadataParser {
 public:
  explicit MetadataParser(std::string where) : where_(std::move(where)) {}

  Metadata parse(const Value& root) {
    const auto fields = object_state(root, "Metadata");
    Metadata out;
    const Value* sdm = field(fields, "state_dict_metadata", "Metadata");
    for (const auto& [k, v] : dict(*sdm, "state_dict_metadata")) {
      const std::string name = string(*k, "a state_dict_metadata key");
      if (is_object(*v, kMetadataModule, "BytesStorageMetadata")) {
        out.bytes[name];
      } else {
        out.tensors[name] = tensor_entry(*v, name);
      }
    }
    if (const Value* pd = optional_field(fields, "planner_data"); pd != nullptr && pd->kind != Value::kNone) {
      for (const auto& [k, v] : dict(*pd, "planner_data")) {
        std::vector<std::string>& path = out.paths[string(*k, "a planner_data key")];
        if (v->kind != Value::kTuple && v->kind != Value::kList) fail("planner_data of " + quote(k->s) + " is not a tuple");
        for (const Value* p : v->items)
          path.push_back(p->kind == Value::kInt ? std::to_string(p->i) : string(*p, "a planner_data path element"));
      }
    }
    const Value* sd = field(fields, "storage_data", "Metadata");
    std::map<std::pair<std::string, std::vector<int64_t>>, Location> tensor_storage;
    for (const auto& [k, v] : dict(*sd, "storage_data")) {
      const auto index = object_state(*k, "MetadataIndex");
      const std::string fqn = string(*field(index, "fqn", "MetadataIndex"), "MetadataIndex.fqn");
      const Value* offset = optional_field(index, "offset");
      const Location location = storage_info(*v, fqn);
      if (offset == nullptr || offset->kind == Value::kNone) {
        auto it = out.bytes.find(fqn);
        if (it == out.bytes.end()) fail("storage_data has bytes of " + quote(fqn) + ", which state_dict_metadata does not list as bytes");
        it->second = location;
      } else {
        tensor_storage[{fqn, torch_size(*offset, "MetadataIndex.offset of " + quote(fqn))}] = location;
      }
    }
    for (auto& [name, entry] : out.tensors)
      for (TensorChunk& c : entry.chunks) {
        auto it = tensor_storage.find({name, c.box.offsets});
        if (it == tensor_storage.end())
          fail("tensor " + quote(name) + ": the chunk at offsets " + box_str(c.box.offsets) + " has no storage_data entry");
        c.location = it->second;
      }
    for (const auto& [name, location] : out.bytes)
      if (location.file.empty()) fail("bytes entry " + quote(name) + " has no storage_data entry");
    return out;
  }

 private:
  using Fields = std::map<std::string, const Value*>;

  [[noreturn]] void fail(const std::string& what) const { throw std::invalid_argument(where_ + ": " + what); }

  static bool is_object(const Value& v, const std::string& module, const std::string& cls) {
    return v.kind == Value::kCall && v.callee->s == module + "." + cls;
  }

  // A dataclass instance: NEWOBJ(cls, ()) then BUILD with a dict of its fields.
  Fields object_state(const Value& v, const std::string& cls, const char* module = kMetadataModule) const {
    if (!is_object(v, module, cls))
      fail("expected a " + cls + ", found " +
           (v.kind == Value::kCall ? "a call of " + quote(v.callee->s) : std::string("a ") + pickle::kind_name(v.kind)));
    Fields out;
    if (v.state == nullptr) return out;
    for (const auto& [k, val] : dict(*v.state, cls + "'s state")) out[string(*k, cls + " field name")] = val;
    return out;
  }

  const Value* field(const Fields& f, const std::string& name, const std::string& cls) const {
    auto it = f.find(name);
    if (it == f.end()) fail(cls + " has no field " + quote(name));
    return it->second;
  }
  static const Value* optional_field(const Fields& f, const std::string& name) {
    auto it = f.find(name);
    return it == f.end() ? nullptr : it->second;
  }

  const std::vector<std::pair<const Value*, const Value*>>& dict(const Value& v, const std::string& what) const {
    if (v.kind != Value::kDict) fail(what + " is a " + pickle::kind_name(v.kind) + ", not a dict");
    return v.dict;
  }
  std::string string(const Value& v, const std::string& what) const {
    if (v.kind != Value::kStr) fail(what + " is a " + std::string(pickle::kind_name(v.kind)) + ", not a str");
    return v.s;
  }
  int64_t non_negative(const Value& v, const std::string& what) const {
    if (v.kind != Value::kInt || v.huge || v.i < 0) fail(what + " is not a non-negative int");
    return v.i;
  }

  // torch.Size((d0, d1, ...)): REDUCE of torch.Size with one tuple of ints.
  std::vector<int64_t> torch_size(const Value& v, const std::string& what) const {
    if (v.kind != Value::kCall || v.callee->s != "torch.Size" || v.items.size() != 1 || v.items[0]->kind != Value::kTuple)
      fail(what + " is not a torch.Size");
    std::vector<int64_t> out;
    for (const Value* d : v.items[0]->items) out.push_back(non_negative(*d, what));
    return out;
  }

  at::ScalarType dtype(const Value& v, const std::string& name) const {
    if (v.kind == Value::kGlobal)
      for (const auto& [n, t] : kDtypes)
        if (v.s == std::string("torch.") + n) return t;
    fail("tensor " + quote(name) + " has a dtype this reader does not support" +
         (v.kind == Value::kGlobal ? " (" + v.s + ")" : ""));
  }

  // TensorProperties' state is a tuple: (dtype, layout, requires_grad, memory_format, pin_memory
  // [, strides]).
  at::ScalarType properties_dtype(const Value& v, const std::string& name) const {
    if (!is_object(v, kMetadataModule, "TensorProperties")) fail("tensor " + quote(name) + " has no TensorProperties");
    const Value* st = v.state;
    if (st == nullptr) fail("tensor " + quote(name) + ": TensorProperties without state");
    if (st->kind == Value::kTuple) {
      if (st->items.size() < 5) fail("tensor " + quote(name) + ": TensorProperties has a short state");
      return dtype(*st->items[0], name);
    }
    for (const auto& [k, val] : dict(*st, "TensorProperties' state"))  // older torch: a dict of fields
      if (k->kind == Value::kStr && k->s == "dtype") return dtype(*val, name);
    fail("tensor " + quote(name) + ": TensorProperties has no dtype");
  }

  TensorEntry tensor_entry(const Value& v, const std::string& name) const {
    const auto f = object_state(v, "TensorStorageMetadata");
    TensorEntry e;
    e.dtype = properties_dtype(*field(f, "properties", "TensorStorageMetadata"), name);
    e.shape = torch_size(*field(f, "size", "TensorStorageMetadata"), "the size of tensor " + quote(name));
    const Value* chunks = field(f, "chunks", "TensorStorageMetadata");
    if (chunks->kind != Value::kList) fail("tensor " + quote(name) + ": chunks is not a list");
    for (const Value* c : chunks->items) {
      const auto cf = object_state(*c, "ChunkStorageMetadata");
      TensorChunk chunk;
      chunk.box.offsets = torch_size(*field(cf, "offsets", "ChunkStorageMetadata"), "a chunk offset of " + quote(name));
      chunk.box.sizes = torch_size(*field(cf, "sizes", "ChunkStorageMetadata"), "a chunk size of " + quote(name));
      if (chunk.box.offsets.size() != e.shape.size() || chunk.box.sizes.size() != e.shape.size())
        fail("tensor " + quote(name) + " of size " + box_str(e.shape) + " has a chunk of another rank");
      for (size_t d = 0; d < e.shape.size(); ++d)
        if (chunk.box.offsets[d] > e.shape[d] || chunk.box.sizes[d] > e.shape[d] - chunk.box.offsets[d])
          fail("tensor " + quote(name) + " of size " + box_str(e.shape) + " has a chunk at offsets " +
               box_str(chunk.box.offsets) + " of size " + box_str(chunk.box.sizes) + " that lies outside it");
      e.chunks.push_back(std::move(chunk));
    }
    return e;
  }

  Location storage_info(const Value& v, const std::string& fqn) const {
    const auto f = object_state(v, "_StorageInfo", kFilesystemModule);
    Location l;
    l.file = string(*field(f, "relative_path", "_StorageInfo"), "relative_path of " + quote(fqn));
    if (l.file.empty() || l.file.find('/') != std::string::npos || l.file == "." || l.file == "..")
      fail("the storage of " + quote(fqn) + " is in " + quote(l.file) + ", not a plain file name in the directory");
    l.offset = static_cast<uint64_t>(non_negative(*field(f, "offset", "_StorageInfo"), "offset of " + quote(fqn)));
    l.length = static_cast<uint64_t>(non_negative(*field(f, "length", "_StorageInfo"), "length of " + quote(fqn)));
    if (const Value* t = optional_field(f, "transform_descriptors");
        t != nullptr && t->kind != Value::kNone && !t->items.empty())
      fail("the storage of " + quote(fqn) + " has transforms (compression or an extension), which this reader does not support");
    return l;
  }

  std::string where_;
};

// ---- encoding ----------------------------------------------------------------------------------

void new_object(pickle::Writer& w, const char* module, const char* cls) {
  w.global(module, cls);
  w.mark();
  w.tuple();
  w.new_obj();
}

void torch_size(pickle::Writer& w, const std::vector<int64_t>& v) {
  w.global("torch", "Size");
  w.mark();
  w.tuple_of(v);
  w.tuple();
  w.reduce();
}

const char* dtype_name(at::ScalarType t) {
  for (const auto& [name, dtype] : kDtypes)
    if (dtype == t) return name;
  throw std::invalid_argument(std::string("DCP: dtype ") + c10::toString(t) + " is not supported");
}

void tensor_storage_metadata(pickle::Writer& w, const TensorEntry& e) {
  new_object(w, kMetadataModule, "TensorStorageMetadata");
  w.empty_dict();
  w.mark();
  w.str("properties");
  new_object(w, kMetadataModule, "TensorProperties");
  // The 5-tuple state every torch since 2.0 reads (2.15 also writes strides as a sixth).
  w.mark();
  w.global("torch", dtype_name(e.dtype));
  w.global("torch.serialization", "_get_layout");
  w.mark();
  w.str("torch.strided");
  w.tuple();
  w.reduce();
  w.boolean(false);  // requires_grad
  w.global(kMetadataModule, "_MEM_FORMAT_ENCODING");
  w.mark();
  w.integer(0);  // TORCH_CONTIGUOUS_FORMAT
  w.tuple();
  w.reduce();
  w.boolean(false);  // pin_memory
  w.tuple();
  w.build();
  w.str("size");
  torch_size(w, e.shape);
  w.str("chunks");
  w.empty_list();
  w.mark();
  for (const TensorChunk& c : e.chunks) {
    new_object(w, kMetadataModule, "ChunkStorageMetadata");
    w.empty_dict();
    w.mark();
    w.str("offsets");
    torch_size(w, c.box.offsets);
    w.str("sizes");
    torch_size(w, c.box.sizes);
    w.set_items();
    w.build();
  }
  w.append_items();
  w.set_items();
  w.build();
}

void storage_entry(pickle::Writer& w, const std::string& fqn, const std::vector<int64_t>* offsets,
                   std::optional<int64_t> index, const Location& l) {
  new_object(w, kMetadataModule, "MetadataIndex");
  w.empty_dict();
  w.mark();
  w.str("fqn");
  w.str(fqn);
  w.str("offset");
  if (offsets) torch_size(w, *offsets); else w.none();
  w.str("index");
  if (index) w.integer(*index); else w.none();
  w.set_items();
  w.build();
  new_object(w, kFilesystemModule, "_StorageInfo");
  w.empty_dict();
  w.mark();
  w.str("relative_path");
  w.str(l.file);
  w.str("offset");
  w.integer(static_cast<int64_t>(l.offset));
  w.str("length");
  w.integer(static_cast<int64_t>(l.length));
  w.set_items();
  w.build();
}

}  // namespace

std::string rank_file_name(int rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  std::vector<Box> out;
  if (begin >= end) return out;
  if (shape.empty()) return {Box{}};
  std::vector<int64_t> inner_shape(shape.begin() + 1, shape.end());
  int64_t inner = 1;
  for (int64_t s : inner_shape) inner *= s;
  // Boxes of the sub-tensor `row`, placed at that row.
  auto in_row = [&](int64_t row, int64_t b, int64_t e) {
    for (Box sub : flat_range_boxes(inner_shape, b, e)) {
      sub.offsets.insert(sub.offsets.begin(), row);
      sub.sizes.insert(sub.sizes.begin(), 1);
      out.push_back(std::move(sub));
    }
  };
  int64_t first = begin / inner;
  const int64_t last = end / inner;  // rows [first, last) may be whole
  if (first == (end - 1) / inner && (begin % inner != 0 || end % inner != 0)) {
    in_row(first, begin - first * inner, end - first * inner);  // within one row
    return out;
  }
  if (begin % inner != 0) in_row(first++, begin % inner, inner);
  if (last > first) {
    Box whole;
    whole.offsets.assign(shape.size(), 0);
    whole.offsets[0] = first;
    whole.sizes = shape;
    whole.sizes[0] = last - first;
    out.push_back(std::move(whole));
  }
  if (end % inner != 0) in_row(last, 0, end % inner);
  return out;
}

Metadata parse_metadata(const std::string& pickled, const std::string& where) {
  const auto tree = pickle::unpickle(pickled, allowed_globals(), where);
  return MetadataParser(where).parse(tree->root());
}

std::string encode_metadata(const Metadata& m) {
  pickle::Writer w;
  new_object(w, kMetadataModule, "Metadata");
  w.empty_dict();
  w.mark();
  w.str("state_dict_metadata");
  w.empty_dict();
  w.mark();
  for (const auto& [name, e] : m.tensors) {
    w.str(name);
    tensor_storage_metadata(w, e);
  }
  for (const auto& [name, l] : m.bytes) {
    w.str(name);
    new_object(w, kMetadataModule, "BytesStorageMetadata");
  }
  w.set_items();
  w.str("planner_data");
  w.empty_dict();
  w.mark();
  for (const auto& [name, path] : m.paths) {
    w.str(name);
    w.mark();
    for (const std::string& p : path) w.str(p);
    w.tuple();
  }
  w.set_items();
  w.str("storage_data");
  w.empty_dict();
  w.mark();
  for (const auto& [name, e] : m.tensors)
    for (size_t i = 0; i < e.chunks.size(); ++i)
      storage_entry(w, name, &e.chunks[i].box.offsets, static_cast<int64_t>(i), e.chunks[i].location);
  for (const auto& [name, l] : m.bytes) storage_entry(w, name, nullptr, std::nullopt, l);
  w.set_items();
  w.str("storage_meta");
  w.none();
  w.str("version");
  w.str("1.0.0");
  w.set_items();
  w.build();
  return w.finish();
}

namespace {
constexpr const char* kChecksumsFormat = "mfsdp.dcp_checksums";

nlohmann::json checksum_record(const Location& l) {
  if (!l.crc32c) throw std::logic_error("dcp::encode_checksums: the entry at '" + l.file + "' has no crc32c");
  return {{"file", l.file}, {"offset", l.offset}, {"length", l.length}, {"crc32c", *l.crc32c}};
}
}  // namespace

std::string encode_checksums(const Metadata& m, const std::string& metadata_bytes) {
  nlohmann::json tensors = nlohmann::json::object(), bytes = nlohmann::json::object();
  for (const auto& [name, e] : m.tensors) {
    nlohmann::json& chunks = tensors[name] = nlohmann::json::array();
    for (const TensorChunk& c : e.chunks) {
      nlohmann::json r = checksum_record(c.location);
      r["offsets"] = c.box.offsets;
      chunks.push_back(std::move(r));
    }
  }
  for (const auto& [name, l] : m.bytes) bytes[name] = checksum_record(l);
  const nlohmann::json out = {
      {"format", kChecksumsFormat}, {"version", 1}, {"algorithm", "crc32c"},
      {"metadata", {{"length", metadata_bytes.size()}, {"crc32c", crc32c(metadata_bytes.data(), metadata_bytes.size())}}},
      {"tensors", tensors}, {"bytes", bytes}};
  return out.dump() + "\n";
}

std::string torch_dtype_name(at::ScalarType dtype) { return std::string("torch.") + dtype_name(dtype); }

bool is_dcp_directory(const std::string& dir) { return fs::is_regular_file(fs::path(dir) / kMetadataFile); }

// ---- Reader --------------------------------------------------------------------------------------

namespace {

// Chunks move between the file and memory in blocks of this size, each checksummed right after
// pread filled it or right before write copies it (while it is in cache), and written or read
// where the tensor's storage lies: no copy in between (bench/ckpt_throughput.sh).
constexpr uint64_t kIoBlock = 1u << 20;

std::invalid_argument checksum_mismatch(const std::string& what, uint32_t expected, uint32_t found,
                                        const std::string& dir) {
  return std::invalid_argument(what + ": the bytes do not match their checksum (CRC-32C " + crc32c_hex(expected) +
                               " in '" + (fs::path(dir) / kChecksumsFile).string() + "', " + crc32c_hex(found) +
                               " read): the file was changed or damaged after the save");
}

// Reader::verify's check: throws unless the bytes of `l` match its crc32c (if it has one and the
// file holds them).
void verify_location(const std::string& dir, const Location& l, const std::string& what) {
  if (!l.crc32c) return;
  const std::string path = (fs::path(dir) / l.file).string();
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec || l.offset > size || l.length > size - l.offset) return;  // the reader names what is missing
  const uint32_t found = crc32c_of_file_range(path, l.offset, l.length);
  if (found != *l.crc32c) throw checksum_mismatch(what, *l.crc32c, found, dir);
}

class ReadOnlyFile {
 public:
  ReadOnlyFile(const std::string& path, const std::string& what) : what_(what) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw std::invalid_argument(what + ": cannot open: " + std::strerror(errno));
  }
  ~ReadOnlyFile() { ::close(fd_); }
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;

  // Bytes [at, at + n) into dst; their CRC-32C extends *crc when crc is not null.
  void read(uint64_t at, void* dst, uint64_t n, uint32_t* crc) const {
    auto* p = static_cast<char*>(dst);
    for (uint64_t done = 0; done < n;) {
      const uint64_t want = std::min<uint64_t>(n - done, kIoBlock);
      const ssize_t r = ::pread(fd_, p + done, want, static_cast<off_t>(at + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        throw std::invalid_argument(what_ + ": reading failed: " + (r == 0 ? "unexpected end of file" : std::strerror(errno)));
      if (crc) *crc = crc32c_extend(*crc, p + done, static_cast<size_t>(r));
      done += static_cast<uint64_t>(r);
    }
  }

 private:
  std::string what_;
  int fd_ = -1;
};

// The layout of the archive at `l`; a damaged archive is named as such (its checksum) first.
TorchSaveTensorLayout chunk_layout(const std::string& dir, const Location& l, const std::string& what) {
  try {
    return read_torch_save_tensor_layout((fs::path(dir) / l.file).string(), l.offset, l.length, what);
  } catch (const std::invalid_argument&) {
    verify_location(dir, l, what);
    throw;
  }
}

// The storage bytes of the archive at `l` (laid out as `layout`) into dst, checking the whole
// archive against its CRC-32C, if it has one, in the same pass.
void read_chunk_storage(const std::string& dir, const Location& l, const TorchSaveTensorLayout& layout, void* dst,
                        const std::string& what) {
  const ReadOnlyFile file((fs::path(dir) / l.file).string(), what);
  if (!l.crc32c) {
    file.read(l.offset + layout.data_at, dst, layout.data_bytes, nullptr);
    return;
  }
  uint32_t crc = 0;
  std::string around(static_cast<size_t>(std::max(layout.data_at, l.length - layout.data_at - layout.data_bytes)), '\0');
  file.read(l.offset, around.data(), layout.data_at, &crc);
  file.read(l.offset + layout.data_at, dst, layout.data_bytes, &crc);
  const uint64_t tail_at = layout.data_at + layout.data_bytes;
  file.read(l.offset + tail_at, around.data(), l.length - tail_at, &crc);
  if (crc != *l.crc32c) throw checksum_mismatch(what, *l.crc32c, crc, dir);
}

std::string chunk_what(const std::string& dir, const std::string& name, const TensorChunk& chunk) {
  const Location& l = chunk.location;
  return "checkpoint file '" + (fs::path(dir) / l.file).string() + "', bytes [" + std::to_string(l.offset) + ", " +
         std::to_string(l.offset + l.length) + ") (tensor '" + name + "', chunk at offsets " +
         box_str(chunk.box.offsets) + ")";
}

// The archive holds what the metadata says (after its checksum, which names damage first).
void check_chunk_layout(const std::string& dir, const TensorEntry& e, const TensorChunk& chunk,
                        const TorchSaveTensorLayout& layout, const std::string& what) {
  if (layout.sizes == chunk.box.sizes && layout.dtype == e.dtype) return;
  verify_location(dir, chunk.location, what);
  throw std::invalid_argument(what + ": holds a " + std::string(c10::toString(layout.dtype)) + " tensor of size " +
                              box_str(layout.sizes) + ", the metadata says " + c10::toString(e.dtype) + " of size " +
                              box_str(chunk.box.sizes));
}

// Whether the chunk's storage is exactly its tensor's elements in order, so that it can be read
// straight into a contiguous tensor of its size.
bool dense_layout(const TorchSaveTensorLayout& layout) {
  int64_t numel = 1;
  for (size_t d = layout.sizes.size(); d-- > 0;) {
    if (layout.sizes[d] != 1 && layout.strides[d] != numel) return false;
    numel *= layout.sizes[d];
  }
  return layout.storage_offset == 0 &&
         layout.data_bytes == static_cast<uint64_t>(numel) * c10::elementSize(layout.dtype);
}

// Reader::read_chunk into `dst` (contiguous, on the CPU, of the chunk's size and the entry's
// dtype), without a buffer in between when the archive stores the chunk densely.
void read_chunk_into(const Reader& r, const std::string& name, const TensorChunk& chunk, const at::Tensor& dst) {
  const TensorEntry& e = r.tensor(name);
  const std::string what = chunk_what(r.dir(), name, chunk);
  const TorchSaveTensorLayout layout = chunk_layout(r.dir(), chunk.location, what);
  check_chunk_layout(r.dir(), e, chunk, layout, what);
  if (dense_layout(layout)) return read_chunk_storage(r.dir(), chunk.location, layout, dst.data_ptr(), what);
  dst.copy_(r.read_chunk(name, chunk));
}

bool readable_in_place(const at::Tensor& dst, at::ScalarType dtype) {
  return dst.device().is_cpu() && dst.scalar_type() == dtype && dst.is_contiguous() && dst.layout() == at::kStrided &&
         !dst.is_conj() && !dst.is_neg();
}

}  // namespace

Reader::Reader(const std::string& dir) : dir_(dir) {
  const std::string file = (fs::path(dir) / kMetadataFile).string();
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::invalid_argument("checkpoint file '" + file + "' cannot be read");
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string bytes = buf.str();
  if (fs::exists(fs::path(dir) / kChecksumsFile)) {
    has_checksums_ = true;
    attach_checksums(bytes);  // first: a changed .metadata is named as such, not parsed
  } else {
    metadata_ = parse_metadata(bytes, "checkpoint file '" + file + "'");
  }
}

void Reader::attach_checksums(const std::string& metadata_bytes) {
  const std::string path = (fs::path(dir_) / kChecksumsFile).string();
  const std::string meta_path = (fs::path(dir_) / kMetadataFile).string();
  std::ifstream in(path, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  if (!in) throw std::invalid_argument("checkpoint file '" + path + "' cannot be read");
  auto bad = [&](const std::string& what) -> std::invalid_argument {
    return std::invalid_argument("checkpoint file '" + path + "' " + what);
  };
  nlohmann::json j;
  try {
    j = parse_json(buf.str());
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("is not valid JSON (") + e.what() + ")");
  }
  try {
    if (!j.is_object() || j.value("format", "") != kChecksumsFormat || j.value("algorithm", "") != "crc32c")
      throw bad("is not an mfsdp checksums file (format '" + std::string(kChecksumsFormat) + "', algorithm crc32c)");
    if (j.at("version").get<int>() != 1)
      throw bad("has version " + j.at("version").dump() + "; this build reads version 1 (update mfsdp)");
    const uint64_t length = j.at("metadata").at("length").get<uint64_t>();
    const uint32_t expected = j.at("metadata").at("crc32c").get<uint32_t>();
    const uint32_t found = crc32c(metadata_bytes.data(), metadata_bytes.size());
    if (length != metadata_bytes.size() || expected != found)
      throw std::invalid_argument("checkpoint file '" + meta_path + "' does not match its checksum in '" + path + "' (" +
                                  std::to_string(length) + " bytes with CRC-32C " + crc32c_hex(expected) +
                                  " saved; " + std::to_string(metadata_bytes.size()) + " bytes with " +
                                  crc32c_hex(found) + " now): it was changed or damaged after the save");
    metadata_ = parse_metadata(metadata_bytes, "checkpoint file '" + meta_path + "'");
    // Each entry's record must describe the location .metadata gives it; then it lends its CRC.
    auto attach = [&](Location& l, const nlohmann::json& r, const std::string& entry) {
      if (r.at("file").get<std::string>() != l.file || r.at("offset").get<uint64_t>() != l.offset ||
          r.at("length").get<uint64_t>() != l.length)
        throw bad("places " + entry + " elsewhere than '" + meta_path + "' does");
      l.crc32c = r.at("crc32c").get<uint32_t>();
    };
    const nlohmann::json& tensors = j.at("tensors");
    const nlohmann::json& bytes = j.at("bytes");
    if (tensors.size() != metadata_.tensors.size() || bytes.size() != metadata_.bytes.size())
      throw bad("lists other entries than '" + meta_path + "'");
    for (auto& [name, e] : metadata_.tensors) {
      const nlohmann::json& records = tensors.at(name);
      if (records.size() != e.chunks.size())
        throw bad("lists " + std::to_string(records.size()) + " chunks of tensor '" + name + "', '" + meta_path + "' " +
                  std::to_string(e.chunks.size()));
      for (size_t i = 0; i < e.chunks.size(); ++i) {
        const std::string entry = "the chunk of tensor '" + name + "' at offsets " + box_str(e.chunks[i].box.offsets);
        if (records[i].at("offsets").get<std::vector<int64_t>>() != e.chunks[i].box.offsets)
          throw bad("does not list " + entry + " where '" + meta_path + "' does");
        attach(e.chunks[i].location, records[i], entry);
      }
    }
    for (auto& [name, l] : metadata_.bytes) attach(l, bytes.at(name), "bytes entry '" + name + "'");
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("is malformed (") + e.what() + ")");
  }
}

std::pair<int64_t, uint64_t> Reader::verify_checksums() const {
  if (!has_checksums_)
    throw std::invalid_argument("checkpoint '" + dir_ + "' has no " + kChecksumsFile +
                                " (written by torch, Megatron-FSDP or an older mfsdp): its bytes cannot be verified");
  int64_t entries = 0;
  uint64_t bytes = 0;
  auto check = [&](const Location& l, const std::string& entry) {
    const std::string path = (fs::path(dir_) / l.file).string();
    const std::string what = "checkpoint file '" + path + "', bytes [" + std::to_string(l.offset) + ", " +
                             std::to_string(l.offset + l.length) + ") (" + entry + ")";
    std::error_code ec;
    const uint64_t size = fs::file_size(path, ec);
    if (ec) throw std::invalid_argument(what + ": the file cannot be read (" + ec.message() + ")");
    if (l.offset > size || l.length > size - l.offset)
      throw std::invalid_argument(what + ": beyond the end of the " + std::to_string(size) + "-byte file (truncated?)");
    verify(l, what);
    ++entries;
    bytes += l.length;
  };
  for (const auto& [name, e] : metadata_.tensors)
    for (const TensorChunk& c : e.chunks) check(c.location, "tensor '" + name + "', chunk at offsets " + box_str(c.box.offsets));
  for (const auto& [name, l] : metadata_.bytes) check(l, "bytes entry '" + name + "'");
  return {entries, bytes};
}

void Reader::verify(const Location& l, const std::string& what) const { verify_location(dir_, l, what); }

const TensorEntry& Reader::tensor(const std::string& name) const {
  auto it = metadata_.tensors.find(name);
  if (it == metadata_.tensors.end()) throw std::invalid_argument("checkpoint '" + dir_ + "': no tensor '" + name + "'");
  return it->second;
}

at::Tensor Reader::read_chunk(const std::string& name, const TensorChunk& chunk) const {
  const TensorEntry& e = tensor(name);
  const std::string what = chunk_what(dir_, name, chunk);
  const TorchSaveTensorLayout layout = chunk_layout(dir_, chunk.location, what);
  check_chunk_layout(dir_, e, chunk, layout, what);
  at::Tensor storage =
      at::empty({static_cast<int64_t>(layout.data_bytes / c10::elementSize(layout.dtype))}, at::TensorOptions().dtype(layout.dtype));
  read_chunk_storage(dir_, chunk.location, layout, storage.data_ptr(), what);
  return storage.as_strided(layout.sizes, layout.strides, layout.storage_offset);
}

void Reader::read_range(const std::string& name, int64_t offset, const at::Tensor& dst) const {
  const TensorEntry& e = tensor(name);
  int64_t numel = 1;
  for (int64_t s : e.shape) numel *= s;
  const int64_t count = dst.numel();
  if (dst.dim() != 1 || offset < 0 || offset > numel || count > numel - offset)
    throw std::invalid_argument("checkpoint '" + dir_ + "', tensor '" + name + "': cannot read elements [" +
                                std::to_string(offset) + ", " + std::to_string(offset + count) + ") of " +
                                std::to_string(numel));
  std::map<size_t, at::Tensor> loaded;  // chunks read for this call, by index
  int64_t flat = offset;
  for (const Box& want : flat_range_boxes(e.shape, offset, offset + count)) {
    read_box_into(name, want, dst.narrow(0, flat - offset, want.numel()).view(want.sizes), loaded);
    flat += want.numel();
  }
}

void Reader::read_boxes(const std::string& name, const std::vector<Box>& boxes, const std::vector<at::Tensor>& dsts) const {
  const TensorEntry& e = tensor(name);
  if (boxes.size() != dsts.size()) throw std::logic_error("Reader::read_boxes: boxes and destinations differ in number");
  std::map<size_t, at::Tensor> loaded;
  for (size_t i = 0; i < boxes.size(); ++i) {
    const Box& want = boxes[i];
    bool inside = want.offsets.size() == e.shape.size() && want.sizes.size() == e.shape.size();
    for (size_t d = 0; inside && d < e.shape.size(); ++d)
      inside = want.offsets[d] >= 0 && want.sizes[d] >= 0 && want.offsets[d] <= e.shape[d] - want.sizes[d];
    if (!inside || dsts[i].sizes().vec() != want.sizes)
      throw std::invalid_argument("checkpoint '" + dir_ + "', tensor '" + name + "' of size " + box_str(e.shape) +
                                  ": cannot read the box at offsets " + box_str(want.offsets) + " of size " +
                                  box_str(want.sizes) + " into a tensor of size " + box_str(dsts[i].sizes().vec()));
    read_box_into(name, want, dsts[i], loaded);
  }
}

void Reader::read_box_into(const std::string& name, const Box& want, const at::Tensor& dview,
                           std::map<size_t, at::Tensor>& loaded) const {
  const TensorEntry& e = tensor(name);
  at::NoGradGuard no_grad;
  int64_t covered = 0;
  for (size_t i = 0; i < e.chunks.size(); ++i) {
    const Box& have = e.chunks[i].box;
    at::Tensor src, part = dview;
    bool empty = false;
    std::vector<std::pair<int64_t, int64_t>> src_ranges;  // per dimension: start, length
    for (size_t d = 0; d < want.sizes.size() && !empty; ++d) {
      const int64_t lo = std::max(want.offsets[d], have.offsets[d]);
      const int64_t hi = std::min(want.offsets[d] + want.sizes[d], have.offsets[d] + have.sizes[d]);
      if (hi <= lo) empty = true;
      else {
        src_ranges.emplace_back(lo - have.offsets[d], hi - lo);
        part = part.narrow(static_cast<int64_t>(d), lo - want.offsets[d], hi - lo);
      }
    }
    if (empty || have.numel() == 0) continue;
    bool whole_chunk = true;  // then read it where it goes, once (mfsdp's loads: every chunk)
    for (size_t d = 0; d < src_ranges.size(); ++d)
      whole_chunk = whole_chunk && src_ranges[d].first == 0 && src_ranges[d].second == have.sizes[d];
    if (whole_chunk && !loaded.count(i) && readable_in_place(part, e.dtype)) {
      read_chunk_into(*this, name, e.chunks[i], part);
      covered += part.numel();
      continue;
    }
    auto it = loaded.find(i);
    if (it == loaded.end()) it = loaded.emplace(i, read_chunk(name, e.chunks[i])).first;
    src = it->second;
    for (size_t d = 0; d < src_ranges.size(); ++d)
      src = src.narrow(static_cast<int64_t>(d), src_ranges[d].first, src_ranges[d].second);
    part.copy_(src);
    covered += part.numel();
  }
  if (covered != want.numel())
    throw std::invalid_argument("checkpoint '" + dir_ + "', tensor '" + name + "': the chunks " +
                                (covered < want.numel() ? "do not cover" : "overlap in") + " the box at offsets " +
                                box_str(want.offsets) + " of size " + box_str(want.sizes));
}

at::Tensor Reader::read(const std::string& name) const {
  const TensorEntry& e = tensor(name);
  at::Tensor out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  read_range(name, 0, out.view({-1}));
  return out;
}

std::string Reader::read_bytes(const std::string& name) const {
  auto it = metadata_.bytes.find(name);
  if (it == metadata_.bytes.end()) throw std::invalid_argument("checkpoint '" + dir_ + "': no bytes entry '" + name + "'");
  const Location& l = it->second;
  const std::string path = (fs::path(dir_) / l.file).string();
  verify(l, "checkpoint file '" + path + "', bytes [" + std::to_string(l.offset) + ", " +
                std::to_string(l.offset + l.length) + ") (bytes entry '" + name + "')");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("checkpoint file '" + path + "' cannot be read (bytes entry '" + name + "')");
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  if (l.offset > size || l.length > size - l.offset)
    throw std::invalid_argument("checkpoint file '" + path + "' is " + std::to_string(size) + " bytes; bytes entry '" +
                                name + "' lies at [" + std::to_string(l.offset) + ", " +
                                std::to_string(l.offset + l.length) + ") (truncated?)");
  std::string out(l.length, '\0');
  in.seekg(static_cast<std::streamoff>(l.offset));
  in.read(out.data(), static_cast<std::streamsize>(l.length));
  return out;
}

nlohmann::json Reader::read_object(const std::string& name, ObjectPolicy policy) const {
  auto it = metadata_.bytes.find(name);
  if (it == metadata_.bytes.end()) throw std::invalid_argument("checkpoint '" + dir_ + "': no bytes entry '" + name + "'");
  const Location& l = it->second;
  const std::string path = (fs::path(dir_) / l.file).string();
  const std::string where = "checkpoint file '" + path + "', bytes [" + std::to_string(l.offset) + ", " +
                            std::to_string(l.offset + l.length) + ") (entry '" + name + "')";
  verify(l, where);
  return read_torch_save_value(path, l.offset, l.length, where, policy);
}

// ---- FileWriter ------------------------------------------------------------------------------------

FileWriter::FileWriter(const std::string& dir, const std::string& file_name)
    : path_((fs::path(dir) / file_name).string()), name_(file_name) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error("cannot create '" + path_ + "': " + std::strerror(errno));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Location FileWriter::write_bytes(const std::string& bytes) {
  if (fd_ < 0) throw std::logic_error("FileWriter: '" + path_ + "' is closed");
  checkpoint_file_system().append_to_shard(fd_, path_, bytes.data(), bytes.size());
  Location l{name_, size_, bytes.size(), crc32c(bytes.data(), bytes.size())};
  size_ += bytes.size();
  return l;
}

// torch.save's archive around the tensor's storage, which goes to the file from where it lies in
// one pass: each 1 MiB block is read from memory once, for the zip CRC-32, and is still in the
// cache for the CRC-32C and for write's copy (a separate zip CRC pass over the whole storage
// first cost ~15% of a save). The head, which holds the zip CRC, is written with a placeholder
// and rewritten in place once the CRC is known (same length); the chunk's CRC-32C is put together
// from its three parts' (crc32c_combine).
Location FileWriter::write_tensor(const at::Tensor& chunk) {
  if (fd_ < 0) throw std::logic_error("FileWriter: '" + path_ + "' is closed");
  const TorchSaveParts placeholder = torch_save_tensor_parts(chunk, 0);
  CheckpointFileSystem& files = checkpoint_file_system();
  const char* data = static_cast<const char*>(placeholder.data.data_ptr());
  const uint64_t n = placeholder.data.nbytes();
  files.append_to_shard(fd_, path_, placeholder.head.data(), placeholder.head.size());
  uint32_t zip_crc = 0, data_crc = 0;
  for (uint64_t done = 0; done < n; done += kIoBlock) {
    const size_t block = static_cast<size_t>(std::min<uint64_t>(kIoBlock, n - done));
    zip_crc = zip::crc32(zip_crc, data + done, block);
    data_crc = crc32c_extend(data_crc, data + done, block);
    files.append_to_shard(fd_, path_, data + done, block);
  }
  const TorchSaveParts parts = torch_save_tensor_parts(placeholder.data, zip_crc);
  if (parts.head.size() != placeholder.head.size())
    throw std::logic_error("FileWriter: the zip header of a chunk of '" + path_ + "' changed size with its CRC");
  // Not through the file-system seam, which appends only: these bytes were appended above.
  for (size_t done = 0; done < parts.head.size();) {
    const ssize_t w = ::pwrite(fd_, parts.head.data() + done, parts.head.size() - done, static_cast<off_t>(size_ + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw std::runtime_error("writing '" + path_ + "' failed: " + std::strerror(errno));
    done += static_cast<size_t>(w);
  }
  files.append_to_shard(fd_, path_, parts.tail.data(), parts.tail.size());
  const uint32_t crc = crc32c_combine(crc32c_combine(crc32c(parts.head.data(), parts.head.size()), data_crc, n),
                                      crc32c(parts.tail.data(), parts.tail.size()), parts.tail.size());
  const uint64_t length = parts.head.size() + n + parts.tail.size();
  Location l{name_, size_, length, crc};
  size_ += length;
  // Starts writing the chunk to the disk now, while the next ones are encoded, so that close()'s
  // fsync waits for the last ones only (a hint: errors show in fsync).
  if (length >= kIoBlock) ::sync_file_range(fd_, static_cast<off_t>(l.offset), static_cast<off_t>(length), SYNC_FILE_RANGE_WRITE);
  return l;
}

Location FileWriter::write_object(const nlohmann::json& value) { return write_bytes(torch_save_value(value)); }

void FileWriter::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0 || ::close(fd) != 0)
    throw std::runtime_error("writing '" + path_ + "' failed: " + std::strerror(errno));
}

// ---- DirectoryWriter -------------------------------------------------------------------------------

namespace {
std::string created(const std::string& dir) {
  fs::create_directories(dir);
  return dir;
}
}  // namespace

DirectoryWriter::DirectoryWriter(const std::string& dir) : dir_(dir), file_(created(dir), rank_file_name(0)) {}

void DirectoryWriter::add_path(const std::string& key, std::vector<std::string> path) {
  if (metadata_.paths.count(key)) throw std::invalid_argument("checkpoint '" + dir_ + "': entry '" + key + "' written twice");
  metadata_.paths[key] = path.empty() ? std::vector<std::string>{key} : std::move(path);
}

void DirectoryWriter::tensor(const std::string& key, const at::Tensor& value, std::vector<std::string> path) {
  add_path(key, std::move(path));
  TensorEntry& e = metadata_.tensors[key];
  e.dtype = value.scalar_type();
  e.shape = value.sizes().vec();
  Box whole{std::vector<int64_t>(e.shape.size(), 0), e.shape};
  e.chunks.push_back({whole, file_.write_tensor(value)});
}

void DirectoryWriter::bytes(const std::string& key, const std::string& torch_saved, std::vector<std::string> path) {
  add_path(key, std::move(path));
  metadata_.bytes[key] = file_.write_bytes(torch_saved);
}

void DirectoryWriter::object(const std::string& key, const nlohmann::json& value, std::vector<std::string> path) {
  bytes(key, torch_save_value(value), std::move(path));
}

void DirectoryWriter::finish() {
  file_.close();
  const std::string meta = encode_metadata(metadata_);
  for (const auto& [name, bytes] : {std::pair<const char*, std::string>{kMetadataFile, meta},
                                    {kChecksumsFile, encode_checksums(metadata_, meta)}}) {
    std::ofstream out(fs::path(dir_) / name, std::ios::binary | std::ios::trunc);
    out << bytes;
    out.flush();
    if (!out) throw std::runtime_error("writing '" + (fs::path(dir_) / name).string() + "' failed");
  }
}

}  // namespace mfsdp::dcp
