// The safetensors format: see include/mfsdp/checkpoint/safetensors.h and docs/safetensors.md.
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/base/json_parse.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <stdexcept>
#include <system_error>

namespace mfsdp {
namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;
using json = nlohmann::json;

// The safetensors library refuses headers above 100 MB; so do we (a corrupt length must not
// make us allocate gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100u * 1000u * 1000u;

bool host_is_little_endian() {
  const uint16_t one = 1;
  unsigned char b;
  std::memcpy(&b, &one, 1);
  return b == 1;
}

void require_little_endian() {
  if (!host_is_little_endian())
    throw std::runtime_error("safetensors: only little-endian hosts are supported");
}

struct DtypeInfo {
  const char* name;
  at::ScalarType type;
  int rank;  // the safetensors library's Dtype order; higher is written first
};

const DtypeInfo kDtypes[] = {
    {"BOOL", at::kBool, 0},    {"U8", at::kByte, 1},   {"I8", at::kChar, 2},
    {"I16", at::kShort, 3},    {"F16", at::kHalf, 5},  {"BF16", at::kBFloat16, 6},
    {"I32", at::kInt, 7},      {"F32", at::kFloat, 9}, {"F64", at::kDouble, 10},
    {"I64", at::kLong, 11},
};

const DtypeInfo& dtype_info(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d;
  throw std::invalid_argument(std::string("safetensors: unsupported dtype ") + c10::toString(t));
}

uint64_t read_le_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void write_le_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>((v >> (8 * i)) & 0xff);
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

[[noreturn]] void bad_file(const std::string& path, const std::string& what) {
  throw std::invalid_argument("safetensors file " + quote(path) + ": " + what);
}

[[noreturn]] void bad_tensor(const std::string& path, const std::string& name, const std::string& what) {
  throw std::invalid_argument("safetensors file " + quote(path) + ", tensor " + quote(name) + ": " + what);
}

// a * b, or false on uint64 overflow.
bool mul_checked(uint64_t a, uint64_t b, uint64_t& out) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return false;
  out = a * b;
  return true;
}

uint64_t file_size_of(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    throw std::invalid_argument("safetensors file " + quote(path) + ": cannot stat: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw std::invalid_argument("safetensors file " + quote(path) + ": not a regular file");
  return static_cast<uint64_t>(st.st_size);
}

// Reads exactly `n` bytes at `offset` into `dst`.
void read_exact(const std::string& path, uint64_t offset, void* dst, uint64_t n) {
  if (n == 0) return;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) bad_file(path, std::string("cannot open: ") + std::strerror(errno));
  auto* p = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < n) {
    size_t chunk = static_cast<size_t>(std::min<uint64_t>(n - done, 1u << 30));
    ssize_t r = ::pread(fd, p + done, chunk, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int err = errno;
      ::close(fd);
      bad_file(path, r == 0 ? "unexpected end of file (truncated?)" : std::string("read failed: ") + std::strerror(err));
    }
    done += static_cast<uint64_t>(r);
  }
  ::close(fd);
}

void write_all(int fd, const std::string& path, const void* src, uint64_t n) {
  const auto* p = static_cast<const char*>(src);
  uint64_t done = 0;
  while (done < n) {
    size_t chunk = static_cast<size_t>(std::min<uint64_t>(n - done, 1u << 30));
    ssize_t w = ::write(fd, p + done, chunk);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw std::runtime_error("safetensors: write to " + quote(path) + " failed: " + std::strerror(errno));
    done += static_cast<uint64_t>(w);
  }
}

std::string shard_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i, n);
  return buf;
}

const char* kIndexName = "model.safetensors.index.json";
const char* kSingleName = "model.safetensors";

}  // namespace

std::string safetensors_dtype_name(at::ScalarType dtype) { return dtype_info(dtype).name; }

at::ScalarType safetensors_dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  throw std::invalid_argument("safetensors: unknown dtype " + quote(name));
}

// ---- writer ----------------------------------------------------------------------------------

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  require_little_endian();
  struct Item {
    std::string name;
    at::Tensor t;  // contiguous CPU
    const DtypeInfo* info;
    uint64_t nbytes;
  };
  std::vector<Item> items;
  items.reserve(tensors.size());
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) throw std::invalid_argument("write_safetensors " + quote(path) + ": empty tensor name");
    if (name == "__metadata__")
      throw std::invalid_argument("write_safetensors " + quote(path) + ": '__metadata__' is reserved, not a tensor name");
    if (!seen.insert(name).second)
      throw std::invalid_argument("write_safetensors " + quote(path) + ": duplicated tensor " + quote(name));
    if (!t.defined()) throw std::invalid_argument("write_safetensors " + quote(path) + ": tensor " + quote(name) + " is undefined");
    const DtypeInfo* info;
    try {
      info = &dtype_info(t.scalar_type());
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("write_safetensors " + quote(path) + ": tensor " + quote(name) + ": " + e.what());
    }
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    items.push_back({name, c, info, static_cast<uint64_t>(c.numel()) * static_cast<uint64_t>(c.element_size())});
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.info->rank != b.info->rank) return a.info->rank > b.info->rank;
    return a.name < b.name;
  });

  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json m = ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  uint64_t offset = 0;
  for (const auto& it : items) {
    ordered_json e = ordered_json::object();
    e["dtype"] = it.info->name;
    ordered_json shape = ordered_json::array();
    for (int64_t s : it.t.sizes()) shape.push_back(s);
    e["shape"] = std::move(shape);
    e["data_offsets"] = ordered_json::array({offset, offset + it.nbytes});
    header[it.name] = std::move(e);
    offset += it.nbytes;
  }
  std::string text = header.dump();  // compact, UTF-8 (names are passed through as UTF-8)
  text.append((8 - text.size() % 8) % 8, ' ');

  unsigned char len[8];
  write_le_u64(len, text.size());

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("safetensors: cannot create " + quote(tmp) + ": " + std::strerror(errno));
  try {
    write_all(fd, tmp, len, 8);
    write_all(fd, tmp, text.data(), text.size());
    for (const auto& it : items) write_all(fd, tmp, it.t.data_ptr(), it.nbytes);
    if (::fsync(fd) != 0) throw std::runtime_error("safetensors: fsync of " + quote(tmp) + " failed: " + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw std::runtime_error("safetensors: close of " + quote(tmp) + " failed");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw std::runtime_error("safetensors: rename " + quote(tmp) + " -> " + quote(path) + " failed: " + std::strerror(err));
  }
}

// ---- reader ----------------------------------------------------------------------------------

void SafetensorsFile::open(const std::string& path) {
  require_little_endian();
  path_.clear();
  entries_.clear();
  metadata_.clear();

  const uint64_t size = file_size_of(path);
  if (size < 8) bad_file(path, "truncated: " + std::to_string(size) + " bytes, fewer than the 8-byte header length");
  unsigned char len_bytes[8];
  read_exact(path, 0, len_bytes, 8);
  const uint64_t n = read_le_u64(len_bytes);
  if (n > size - 8)
    bad_file(path, "header length " + std::to_string(n) + " exceeds the file size " + std::to_string(size) + " (truncated?)");
  if (n > kMaxHeaderBytes) bad_file(path, "header length " + std::to_string(n) + " above the 100 MB limit");
  if (n < 2) bad_file(path, "header of " + std::to_string(n) + " bytes cannot hold a JSON object");
  std::string text(static_cast<size_t>(n), '\0');
  read_exact(path, 8, text.data(), n);
  if (text[0] != '{') bad_file(path, "header does not start with '{'");

  // Parse, rejecting duplicated top-level keys (nlohmann would keep the last one silently).
  std::set<std::string> keys;
  std::string duplicate;
  json header;
  try {
    header = parse_json(text, [&](int depth, const std::string& key) {
      if (depth == 1 && !keys.insert(key).second && duplicate.empty()) duplicate = key;
    });
  } catch (const json::exception& e) {
    bad_file(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!duplicate.empty()) bad_tensor(path, duplicate, "listed twice in the header");
  if (!header.is_object()) bad_file(path, "header is not a JSON object");

  const uint64_t data_start = 8 + n;
  const uint64_t buffer = size - data_start;
  std::map<std::string, Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) bad_file(path, "'__metadata__' is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) bad_file(path, "'__metadata__' value of " + quote(m.key()) + " is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) bad_tensor(path, name, "entry is not an object");
    for (auto f = v.begin(); f != v.end(); ++f)
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
        bad_tensor(path, name, "unknown field " + quote(f.key()));
    Entry e;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) bad_tensor(path, name, "missing or non-string 'dtype'");
    const std::string dname = dt->get<std::string>();
    const DtypeInfo* info = nullptr;
    for (const auto& d : kDtypes)
      if (dname == d.name) info = &d;
    if (info == nullptr) bad_tensor(path, name, "unknown or unsupported dtype " + quote(dname));
    e.dtype = info->type;

    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) bad_tensor(path, name, "missing or non-array 'shape'");
    uint64_t numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_integer()) bad_tensor(path, name, "shape holds a non-integer " + d.dump());
      if (d.is_number_unsigned() ? d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                                 : d.get<int64_t>() < 0)
        bad_tensor(path, name, "shape holds a negative or too large size " + d.dump());
      const int64_t s = d.get<int64_t>();
      e.shape.push_back(s);
      if (!mul_checked(numel, static_cast<uint64_t>(s), numel)) bad_tensor(path, name, "shape " + sh->dump() + " overflows");
    }
    uint64_t expected;
    if (!mul_checked(numel, c10::elementSize(e.dtype), expected)) bad_tensor(path, name, "shape " + sh->dump() + " overflows");

    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      bad_tensor(path, name, "'data_offsets' must be [begin, end] of non-negative integers");
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    if (e.end < e.begin) bad_tensor(path, name, "data_offsets " + off->dump() + " end before begin");
    if (e.end - e.begin != expected)
      bad_tensor(path, name,
                 "data_offsets " + off->dump() + " span " + std::to_string(e.end - e.begin) + " bytes but dtype " + dname +
                     " and shape " + sh->dump() + " need " + std::to_string(expected));
    if (e.end > buffer)
      bad_tensor(path, name,
                 "data_offsets " + off->dump() + " out of bounds: the byte buffer holds " + std::to_string(buffer) +
                     " bytes (truncated?)");
    entries.emplace(name, std::move(e));
  }

  // The entries must tile [0, buffer) exactly, in offset order.
  std::vector<std::pair<const std::string*, const Entry*>> order;
  for (const auto& [name, e] : entries) order.push_back({&name, &e});
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    if (a.second->begin != b.second->begin) return a.second->begin < b.second->begin;
    return a.second->end < b.second->end;
  });
  uint64_t pos = 0;
  for (const auto& [name, e] : order) {
    if (e->begin < pos)
      bad_tensor(path, *name, "data_offsets [" + std::to_string(e->begin) + ", " + std::to_string(e->end) +
                                  "] overlap the previous tensor, which ends at " + std::to_string(pos));
    if (e->begin > pos)
      bad_tensor(path, *name, "data_offsets [" + std::to_string(e->begin) + ", " + std::to_string(e->end) +
                                  "] leave a gap after byte " + std::to_string(pos));
    pos = e->end;
  }
  if (pos != buffer)
    bad_file(path, "the tensors cover " + std::to_string(pos) + " bytes of the " + std::to_string(buffer) +
                       "-byte buffer (trailing bytes)");

  entries_ = std::move(entries);
  data_start_ = data_start;
  file_size_ = size;
  path_ = path;
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  if (path_.empty()) throw std::invalid_argument("SafetensorsFile: no file open (tensor " + quote(name) + ")");
  auto it = entries_.find(name);
  if (it == entries_.end()) bad_tensor(path_, name, "no such tensor");
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& kv : entries_) out.push_back(kv.first);
  return out;
}

std::vector<int64_t> SafetensorsFile::shape(const std::string& name) const { return entry(name).shape; }
at::ScalarType SafetensorsFile::dtype(const std::string& name) const { return entry(name).dtype; }
uint64_t SafetensorsFile::nbytes(const std::string& name) const {
  const Entry& e = entry(name);
  return e.end - e.begin;
}

at::Tensor SafetensorsFile::load(const std::string& name) const {
  const Entry& e = entry(name);
  // The file may have changed since open(): check again.
  const uint64_t size = file_size_of(path_);
  if (size != file_size_)
    bad_tensor(path_, name, "file size changed from " + std::to_string(file_size_) + " to " + std::to_string(size) +
                                " since it was opened");
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype).device(at::kCPU));
  try {
    read_exact(path_, data_start_ + e.begin, t.data_ptr(), e.end - e.begin);
  } catch (const std::invalid_argument& ex) {
    bad_tensor(path_, name, ex.what());
  }
  return t;
}

at::Tensor SafetensorsFile::load_elements(const std::string& name, int64_t offset, int64_t count) const {
  const Entry& e = entry(name);
  const int64_t numel = static_cast<int64_t>(c10::multiply_integers(e.shape));
  if (offset < 0 || count < 0 || offset > numel || count > numel - offset)
    bad_tensor(path_, name, "elements [" + std::to_string(offset) + ", " + std::to_string(offset + count) +
                                ") are outside its " + std::to_string(numel) + " elements");
  const uint64_t size = file_size_of(path_);
  if (size != file_size_)
    bad_tensor(path_, name, "file size changed from " + std::to_string(file_size_) + " to " + std::to_string(size) +
                                " since it was opened");
  at::Tensor t = at::empty({count}, at::TensorOptions().dtype(e.dtype).device(at::kCPU));
  const uint64_t item = t.element_size();
  try {
    read_exact(path_, data_start_ + e.begin + static_cast<uint64_t>(offset) * item, t.data_ptr(),
               static_cast<uint64_t>(count) * item);
  } catch (const std::invalid_argument& ex) {
    bad_tensor(path_, name, ex.what());
  }
  return t;
}

void SafetensorsFile::read_elements_into(const std::string& name, int64_t offset, const at::Tensor& dst) const {
  const Entry& e = entry(name);
  const int64_t numel = static_cast<int64_t>(c10::multiply_integers(e.shape));
  const int64_t count = dst.numel();
  if (dst.dim() != 1 || offset < 0 || offset > numel || count > numel - offset)
    bad_tensor(path_, name, "elements [" + std::to_string(offset) + ", " + std::to_string(offset + count) +
                                ") are outside its " + std::to_string(numel) + " elements");
  if (count == 0) return;
  const uint64_t size = file_size_of(path_);
  if (size != file_size_)
    bad_tensor(path_, name, "file size changed from " + std::to_string(file_size_) + " to " + std::to_string(size) +
                                " since it was opened");
  const uint64_t item = c10::elementSize(e.dtype);
  const uint64_t first = data_start_ + e.begin + static_cast<uint64_t>(offset) * item;
  try {
    // Same dtype in host memory: the bytes go straight into place.
    if (dst.is_cpu() && dst.scalar_type() == e.dtype && dst.is_contiguous()) {
      read_exact(path_, first, dst.data_ptr(), static_cast<uint64_t>(count) * item);
      return;
    }
    const int64_t per_chunk = std::max<int64_t>(1, static_cast<int64_t>(kRangeChunkBytes / item));
    at::Tensor buffer = at::empty({std::min(per_chunk, count)}, at::TensorOptions().dtype(e.dtype));
    for (int64_t done = 0; done < count;) {
      const int64_t n = std::min(per_chunk, count - done);
      read_exact(path_, first + static_cast<uint64_t>(done) * item, buffer.data_ptr(), static_cast<uint64_t>(n) * item);
      dst.narrow(0, done, n).copy_(buffer.narrow(0, 0, n));
      done += n;
    }
  } catch (const std::invalid_argument& ex) {
    bad_tensor(path_, name, ex.what());
  }
}

std::pair<uint64_t, uint64_t> SafetensorsFile::file_byte_range(const std::string& name) const {
  const Entry& e = entry(name);
  return {data_start_ + e.begin, data_start_ + e.end};
}

std::map<std::string, at::Tensor> SafetensorsFile::load_all() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : entries_) out.emplace(kv.first, load(kv.first));
  return out;
}

// ---- folders ---------------------------------------------------------------------------------

std::vector<std::string> write_safetensors_sharded(const std::string& dir,
                                                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                                   uint64_t max_shard_bytes) {
  if (max_shard_bytes == 0) throw std::invalid_argument("write_safetensors_sharded " + quote(dir) + ": max_shard_bytes is 0");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error("write_safetensors_sharded: cannot create " + quote(dir) + ": " + ec.message());
  const std::map<std::string, std::string> meta{{"format", "pt"}};

  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (!seen.insert(name).second)
      throw std::invalid_argument("write_safetensors_sharded " + quote(dir) + ": duplicated tensor " + quote(name));
    if (!t.defined())
      throw std::invalid_argument("write_safetensors_sharded " + quote(dir) + ": tensor " + quote(name) + " is undefined");
    sizes.push_back(static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size()));
    total += sizes.back();
  }

  std::vector<std::string> written;
  if (total <= max_shard_bytes) {
    write_safetensors((fs::path(dir) / kSingleName).string(), tensors, meta);
    written.push_back(kSingleName);
  } else {
    std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards(1);
    uint64_t cur = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!shards.back().empty() && cur + sizes[i] > max_shard_bytes) {
        shards.emplace_back();
        cur = 0;
      }
      shards.back().push_back(tensors[i]);
      cur += sizes[i];
    }
    json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = json::object();
    for (size_t s = 0; s < shards.size(); ++s) {
      const std::string file = shard_name(s + 1, shards.size());
      write_safetensors((fs::path(dir) / file).string(), shards[s], meta);
      for (const auto& kv : shards[s]) index["weight_map"][kv.first] = file;
      written.push_back(file);
    }
    const std::string index_path = (fs::path(dir) / kIndexName).string();
    const std::string tmp = index_path + ".tmp." + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out << index.dump(2) << "\n";
      out.flush();
      if (!out) throw std::runtime_error("write_safetensors_sharded: cannot write " + quote(tmp));
    }
    fs::rename(tmp, index_path, ec);
    if (ec) throw std::runtime_error("write_safetensors_sharded: rename to " + quote(index_path) + " failed: " + ec.message());
    written.push_back(kIndexName);
  }

  // Remove what an earlier write left that would confuse a reader.
  static const std::regex stale(R"(model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?)");
  const std::set<std::string> keep(written.begin(), written.end());
  for (const std::string& fname : list_directory(dir))
    if (keep.count(fname) == 0 && std::regex_match(fname, stale)) fs::remove(fs::path(dir) / fname, ec);
  return written;
}

std::map<std::string, at::Tensor> read_safetensors_folder(const std::string& dir) {
  const fs::path index_path = fs::path(dir) / kIndexName;
  const fs::path single_path = fs::path(dir) / kSingleName;
  std::map<std::string, at::Tensor> out;
  if (!fs::exists(index_path)) {
    if (!fs::exists(single_path))
      throw std::invalid_argument("safetensors folder " + quote(dir) + ": neither " + kSingleName + " nor " + kIndexName);
    return SafetensorsFile(single_path.string()).load_all();
  }

  const std::string ip = index_path.string();
  json index;
  {
    std::ifstream in(ip, std::ios::binary);
    if (!in) throw std::invalid_argument("safetensors index " + quote(ip) + ": cannot open");
    try {
      index = parse_json(in);
    } catch (const json::exception& e) {
      throw std::invalid_argument("safetensors index " + quote(ip) + ": not valid JSON: " + e.what());
    }
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw std::invalid_argument("safetensors index " + quote(ip) + ": missing 'weight_map' object");
  std::map<std::string, std::set<std::string>> by_file;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      throw std::invalid_argument("safetensors index " + quote(ip) + ": weight_map entry of tensor " + quote(it.key()) +
                                  " is not a string");
    const std::string file = it.value().get<std::string>();
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
        file.find('\\') != std::string::npos)
      throw std::invalid_argument("safetensors index " + quote(ip) + ": tensor " + quote(it.key()) + " maps to " +
                                  quote(file) + ", not a file name inside the folder");
    by_file[file].insert(it.key());
  }
  for (const auto& [file, wanted] : by_file) {
    const std::string fp = (fs::path(dir) / file).string();
    if (!fs::exists(fp))
      throw std::invalid_argument("safetensors index " + quote(ip) + ": file " + quote(fp) + " (for tensor " +
                                  quote(*wanted.begin()) + ") does not exist");
    SafetensorsFile f(fp);
    for (const auto& name : f.names())
      if (wanted.count(name) == 0)
        bad_tensor(fp, name, "present in the file but the index maps it elsewhere or not at all");
    for (const auto& name : wanted) {
      if (!f.contains(name)) bad_tensor(fp, name, "mapped to this file by " + ip + " but missing from it");
      out.emplace(name, f.load(name));
    }
  }
  return out;
}

}  // namespace mfsdp
