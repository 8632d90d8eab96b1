// torch.save's zip format, read without running code and written for single tensors: see
// include/mfsdp/checkpoint/torch_save.h. The zip container and the pickle VM are shared with PyTorch
// Distributed Checkpoints (src/checkpoint/formats/zip_archive.h, pickle.h).
#include "mfsdp/checkpoint/torch_save.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#include "checkpoint/formats/pickle.h"
#include "checkpoint/formats/zip_archive.h"

namespace mfsdp {
namespace {

using pickle::Value;
using zip::ZipReader;

std::string quote(const std::string& s) { return "'" + s + "'"; }

const std::pair<const char*, at::ScalarType> kStorageTypes[] = {
    {"FloatStorage", at::kFloat}, {"DoubleStorage", at::kDouble}, {"HalfStorage", at::kHalf},
    {"BFloat16Storage", at::kBFloat16}, {"LongStorage", at::kLong}, {"IntStorage", at::kInt},
    {"ShortStorage", at::kShort}, {"CharStorage", at::kChar}, {"ByteStorage", at::kByte},
    {"BoolStorage", at::kBool},
};

// What torch.save's data.pkl may name; nothing is imported or called.
const std::set<std::string>& allowed_globals() {
  static const std::set<std::string> allowed = [] {
    std::set<std::string> a = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                               "torch._utils._rebuild_parameter"};
    for (const auto& [type, dtype] : kStorageTypes) a.insert(std::string("torch.") + type);
    return a;
  }();
  return allowed;
}

// <archive>/data.pkl, with <archive> one folder deep, whatever its name: returns "<archive>/".
std::string archive_prefix(const ZipReader& zip) {
  std::string prefix;
  for (const std::string& name : zip.names()) {
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.compare(slash, std::string::npos, "/data.pkl") == 0) {
      if (!prefix.empty()) zip.window().fail("two data.pkl entries: " + quote(prefix + "data.pkl") + " and " + quote(name));
      prefix = name.substr(0, slash + 1);
    }
  }
  if (prefix.empty()) zip.window().fail("zip archive without an '<archive>/data.pkl' entry (not a torch.save file)");
  if (zip.contains(prefix + "constants.pkl"))
    zip.window().fail("a TorchScript archive (torch.jit.save or C++ torch::save), not a torch.save file");
  if (zip.contains(prefix + "byteorder")) {
    const std::string order = zip.read(prefix + "byteorder");
    if (order != "little") zip.window().fail("byteorder is " + quote(order) + "; only little-endian files are supported");
  }
  return prefix;
}

std::unique_ptr<pickle::Unpickled> unpickle_data(const ZipReader& zip, const std::string& prefix) {
  return pickle::unpickle(zip.read(prefix + "data.pkl"), allowed_globals(), zip.window().what() + ": data.pkl");
}

// Turns the tensors of an unpickled data.pkl into CPU tensors, reading each storage once (views
// of one storage come back as views of one buffer).
class TensorBuilder {
 public:
  TensorBuilder(const ZipReader& zip, std::string prefix) : zip_(zip), prefix_(std::move(prefix)) {}

  // The tensor `v` describes, or nullopt when `v` is not one (`name` is for errors).
  std::optional<at::Tensor> tensor(const Value& v, const std::string& name) {
    if (v.kind != Value::kCall) return std::nullopt;
    const std::string& callee = v.callee->s;
    if (callee == "torch._utils._rebuild_parameter") {  // (tensor, requires_grad, hooks)
      std::optional<at::Tensor> t;
      if (v.items.size() == 3) t = tensor(*v.items[0], name);
      if (!t) fail("calls 'torch._utils._rebuild_parameter' without a tensor");
      return t;
    }
    // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
    if (callee != "torch._utils._rebuild_tensor_v2") fail("calls " + quote(callee) + ", which is not callable");
    const auto& a = v.items;
    if ((a.size() != 6 && a.size() != 7) || a[0]->kind != Value::kPersistentId || a[1]->kind != Value::kInt ||
        a[1]->huge || a[1]->i < 0)
      fail("calls 'torch._utils._rebuild_tensor_v2' with arguments other than (storage, offset, size, stride, ...)");
    const std::vector<int64_t> size = ints(*a[2], "size"), stride = ints(*a[3], "stride");
    if (size.size() != stride.size()) fail("has a tensor whose size and stride differ in length");
    return view(storage_id(*a[0]->pid), a[1]->i, size, stride, name);
  }

  // Set before tensor(): the first storage is described in `layout`, not read (tensor() then
  // returns an undefined tensor).
  TorchSaveTensorLayout* layout = nullptr;

 private:
  [[noreturn]] void fail(const std::string& what) const { zip_.window().fail("data.pkl " + what); }

  struct StorageId {
    at::ScalarType dtype;
    std::string key;
    int64_t numel;
  };

  // ('storage', torch.XStorage, key, location, numel)
  StorageId storage_id(const Value& pid) const {
    const auto& t = pid.items;
    const bool ok = pid.kind == Value::kTuple && t.size() == 5 && t[0]->kind == Value::kStr && t[0]->s == "storage" &&
                    t[1]->kind == Value::kGlobal && t[2]->kind == Value::kStr && t[3]->kind == Value::kStr &&
                    t[4]->kind == Value::kInt && !t[4]->huge && t[4]->i >= 0;
    if (ok)
      for (const auto& [type, dtype] : kStorageTypes)
        if (t[1]->s == std::string("torch.") + type) return {dtype, t[2]->s, t[4]->i};
    fail("has a persistent id that is not ('storage', torch.XStorage, key, location, numel)");
  }

  std::vector<int64_t> ints(const Value& r, const char* what) const {
    if (r.kind != Value::kTuple) fail(std::string("has a tensor ") + what + " that is a " + pickle::kind_name(r.kind));
    std::vector<int64_t> v;
    for (const Value* x : r.items) {
      if (x->kind != Value::kInt || x->huge || x->i < 0)
        fail(std::string("has a tensor ") + what + " with a negative or non-int entry");
      v.push_back(x->i);
    }
    return v;
  }

  at::Tensor view(const StorageId& st, int64_t offset, const std::vector<int64_t>& size,
                  const std::vector<int64_t>& stride, const std::string& name) {
    const std::string entry = prefix_ + "data/" + st.key;
    const uint64_t item = c10::elementSize(st.dtype);
    // Elements the view reaches: offset + sum((size - 1) * stride) + 1, overflow-checked.
    int64_t need = 0;
    bool overflow = false;
    if (std::all_of(size.begin(), size.end(), [](int64_t s) { return s > 0; })) {
      need = offset;
      for (size_t d = 0; d < size.size(); ++d) {
        int64_t span;
        overflow |= __builtin_mul_overflow(size[d] - 1, stride[d], &span) || __builtin_add_overflow(need, span, &need);
      }
      overflow |= __builtin_add_overflow(need, 1, &need) || __builtin_mul_overflow(need, static_cast<int64_t>(item), &need);
    }
    if (overflow) zip_.window().fail("tensor " + quote(name) + " has a size and stride that overflow");
    int64_t declared;
    if (!__builtin_mul_overflow(st.numel, static_cast<int64_t>(item), &declared) && need > declared)
      zip_.window().fail("tensor " + quote(name) + " needs " + std::to_string(need) + " bytes of storage " +
                         quote(entry) + ", which its persistent id declares as " + std::to_string(st.numel) +
                         " elements");

    auto cached = storages_.find(st.key);
    if (cached == storages_.end()) {
      if (!zip_.contains(entry))
        zip_.window().fail("no zip entry " + quote(entry) + " for the storage of tensor " + quote(name));
      const uint64_t bytes = zip_.size(entry);
      if (bytes % item)
        zip_.window().fail("storage " + quote(entry) + " is " + std::to_string(bytes) + " bytes, not a whole number of " +
                           c10::toString(st.dtype) + " elements");
      const uint64_t at = zip_.data_offset(entry);
      zip_.window().check(at, bytes, "storage " + quote(entry));  // before allocating for it
      if (layout != nullptr) {
        if (need > static_cast<int64_t>(bytes))
          zip_.window().fail("storage " + quote(entry) + " is " + std::to_string(bytes) + " bytes, tensor " +
                             quote(name) + " needs " + std::to_string(need));
        *layout = {st.dtype, size, stride, offset, at, bytes};
        return at::Tensor();
      }
      at::Tensor buf = at::empty({static_cast<int64_t>(bytes / item)}, at::TensorOptions().dtype(st.dtype));
      zip_.window().read(at, buf.data_ptr(), bytes, "storage " + quote(entry));
      cached = storages_.emplace(st.key, buf).first;
    }
    const at::Tensor& buf = cached->second;
    if (buf.scalar_type() != st.dtype)
      zip_.window().fail("storage " + quote(entry) + " is used as " + c10::toString(buf.scalar_type()) + " and as " +
                         c10::toString(st.dtype) + " (tensor " + quote(name) + ")");
    if (need > static_cast<int64_t>(buf.nbytes()))
      zip_.window().fail("storage " + quote(entry) + " is " + std::to_string(buf.nbytes()) + " bytes, tensor " +
                         quote(name) + " needs " + std::to_string(need));
    return buf.as_strided(size, stride, offset);
  }

  const ZipReader& zip_;
  const std::string prefix_;
  std::map<std::string, at::Tensor> storages_;  // by storage key
};

// Nested dicts of tensors flattened to "a.b.c" names; other leaves are skipped.
void flatten(const Value& v, const std::string& name, int depth, TensorBuilder& builder, const ZipReader& zip,
             std::map<std::string, at::Tensor>& out) {
  if (depth > 100) zip.window().fail("dicts nested deeper than 100 levels at " + quote(name));
  if (std::optional<at::Tensor> t = builder.tensor(v, name)) {
    if (!out.emplace(name, *t).second) zip.window().fail("two tensors are named " + quote(name));
  } else if (v.kind == Value::kDict) {
    for (const auto& [k, child] : v.dict) {
      if (k->kind != Value::kStr && (k->kind != Value::kInt || k->huge))
        zip.window().fail(std::string("a dict key of type ") + pickle::kind_name(k->kind) + " under " + quote(name) +
                          " cannot become a tensor name");
      const std::string key = k->kind == Value::kStr ? k->s : std::to_string(k->i);
      flatten(*child, name.empty() ? key : name + "." + key, depth + 1, builder, zip, out);
    }
  }
}

void pickle_json(pickle::Writer& w, const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: w.none(); break;
    case nlohmann::json::value_t::boolean: w.boolean(v.get<bool>()); break;
    case nlohmann::json::value_t::number_integer: w.integer(v.get<int64_t>()); break;
    case nlohmann::json::value_t::number_unsigned: w.integer(static_cast<int64_t>(v.get<uint64_t>())); break;
    case nlohmann::json::value_t::number_float: w.real(v.get<double>()); break;
    case nlohmann::json::value_t::string: w.str(v.get<std::string>()); break;
    case nlohmann::json::value_t::array:
      w.empty_list();
      w.mark();
      for (const auto& x : v) pickle_json(w, x);
      w.append_items();
      break;
    case nlohmann::json::value_t::object:
      w.empty_dict();
      w.mark();
      for (const auto& [k, x] : v.items()) {
        w.str(k);
        pickle_json(w, x);
      }
      w.set_items();
      break;
    default: throw std::invalid_argument("DCP: cannot store a JSON " + std::string(v.type_name()));
  }
}

// An unpickled value as JSON (depth-limited: a hostile file may nest or cycle).
nlohmann::json json_value(const Value& v, const std::string& where, ObjectPolicy policy, int depth = 0) {
  if (depth > 64) throw std::invalid_argument(where + ": nested deeper than 64 levels");
  switch (v.kind) {
    case Value::kNone: return nullptr;
    case Value::kBool: return v.i != 0;
    case Value::kInt:
      if (v.huge) throw std::invalid_argument(where + ": an integer beyond 64 bits");
      return v.i;
    case Value::kFloat: return v.f;
    case Value::kStr: return v.s;
    case Value::kTuple:
    case Value::kList: {
      nlohmann::json out = nlohmann::json::array();
      for (const Value* x : v.items) out.push_back(json_value(*x, where, policy, depth + 1));
      return out;
    }
    case Value::kDict: {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& [k, x] : v.dict) {
        if (k->kind != Value::kStr && (k->kind != Value::kInt || k->huge))
          throw std::invalid_argument(where + ": a dict key of type " + pickle::kind_name(k->kind));
        out[k->kind == Value::kStr ? k->s : std::to_string(k->i)] = json_value(*x, where, policy, depth + 1);
      }
      return out;
    }
    default:
      if (policy == ObjectPolicy::kDescribeObjects) {
        if (v.kind == Value::kCall && v.state != nullptr && v.state->kind == Value::kDict)
          return json_value(*v.state, where, policy, depth + 1);
        if (v.kind == Value::kCall && v.callee->s == "torch._utils._rebuild_tensor_v2") return "<tensor>";
        if (v.kind == Value::kCall || v.kind == Value::kGlobal)
          return "<" + (v.kind == Value::kCall ? v.callee->s : v.s) + ">";
      }
      throw std::invalid_argument(where + ": holds " +
                                  (v.kind == Value::kCall ? "an object of " + v.callee->s
                                                          : std::string("a ") + pickle::kind_name(v.kind)) +
                                  ", not a plain value");
  }
}

void check_little_endian_host() {
  const uint16_t one = 1;
  if (*reinterpret_cast<const unsigned char*>(&one) != 1)
    throw std::runtime_error("torch.save: only little-endian hosts are supported");
}

}  // namespace

std::map<std::string, at::Tensor> read_torch_save(const std::string& path) {
  check_little_endian_host();
  const ZipReader zip(path, "torch.save file " + quote(path));
  const std::string prefix = archive_prefix(zip);
  const auto data = unpickle_data(zip, prefix);
  const Value& root = data->root();
  if (root.kind != Value::kDict)
    zip.window().fail(std::string("data.pkl holds a ") + pickle::kind_name(root.kind) +
                      ", not a dict of tensors (a state_dict or checkpoint)");
  TensorBuilder builder(zip, prefix);
  std::map<std::string, at::Tensor> out;
  flatten(root, "", 0, builder, zip, out);
  return out;
}

at::Tensor read_torch_save_tensor(const std::string& path, uint64_t offset, uint64_t length, const std::string& what) {
  check_little_endian_host();
  const ZipReader zip(path, what, offset, length);
  const std::string prefix = archive_prefix(zip);
  const auto data = unpickle_data(zip, prefix);
  TensorBuilder builder(zip, prefix);
  std::optional<at::Tensor> t = builder.tensor(data->root(), "");
  if (!t) zip.window().fail(std::string("data.pkl holds a ") + pickle::kind_name(data->root().kind) + ", not a tensor");
  return *t;
}

TorchSaveTensorLayout read_torch_save_tensor_layout(const std::string& path, uint64_t offset, uint64_t length,
                                                    const std::string& what) {
  check_little_endian_host();
  const ZipReader zip(path, what, offset, length);
  const std::string prefix = archive_prefix(zip);
  const auto data = unpickle_data(zip, prefix);
  TensorBuilder builder(zip, prefix);
  TorchSaveTensorLayout layout;
  builder.layout = &layout;
  if (!builder.tensor(data->root(), ""))
    zip.window().fail(std::string("data.pkl holds a ") + pickle::kind_name(data->root().kind) + ", not a tensor");
  return layout;
}

std::string read_torch_save_pickle(const std::string& path, uint64_t offset, uint64_t length, const std::string& what) {
  const ZipReader zip(path, what, offset, length);
  return zip.read(archive_prefix(zip) + "data.pkl");
}

std::string torch_save_pickle(const std::string& data_pkl) {
  return zip::write_stored_zip(
      {{"archive/data.pkl", data_pkl}, {"archive/byteorder", "little"}, {"archive/version", "3\n"}});
}

nlohmann::json read_torch_save_value(const std::string& path, uint64_t offset, uint64_t length,
                                     const std::string& what, ObjectPolicy policy) {
  const std::string data = read_torch_save_pickle(path, offset, length, what);
  static const std::set<std::string> kPlainOnly = {"collections.OrderedDict"};
  const auto tree = pickle::unpickle(data, kPlainOnly, what + ": data.pkl", policy == ObjectPolicy::kDescribeObjects);
  return json_value(tree->root(), what, policy);
}

std::string torch_save_value(const nlohmann::json& value) {
  pickle::Writer w;
  pickle_json(w, value);
  return torch_save_pickle(w.finish());
}

std::string torch_save_namespace(const nlohmann::json& fields) {
  pickle::Writer w;
  w.global("argparse", "Namespace");
  w.mark();
  w.tuple();
  w.new_obj();
  pickle_json(w, fields.is_object() ? fields : nlohmann::json::object());
  w.build();
  return torch_save_pickle(w.finish());
}

TorchSaveParts torch_save_tensor_parts(const at::Tensor& tensor, std::optional<uint32_t> data_crc32) {
  check_little_endian_host();
  const at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
  const char* storage_type = nullptr;
  for (const auto& [type, dtype] : kStorageTypes)
    if (dtype == t.scalar_type()) storage_type = type;
  if (storage_type == nullptr)
    throw std::invalid_argument(std::string("torch_save_tensor: dtype ") + c10::toString(t.scalar_type()) +
                                " has no torch.save storage type here");
  // _rebuild_tensor_v2(persistent_load(('storage', torch.XStorage, '0', 'cpu', numel)), 0, size,
  // stride, False, OrderedDict()), as torch.save writes a tensor.
  pickle::Writer w;
  w.global("torch._utils", "_rebuild_tensor_v2");
  w.mark();
  w.mark();
  w.str("storage");
  w.global("torch", storage_type);
  w.str("0");
  w.str("cpu");
  w.integer(t.numel());
  w.tuple();
  w.binpersid();
  w.integer(0);
  w.tuple_of(t.sizes().vec());
  w.tuple_of(t.strides().vec());
  w.boolean(false);
  w.global("collections", "OrderedDict");
  w.mark();
  w.tuple();
  w.reduce();
  w.tuple();
  w.reduce();
  const std::string data_pkl = w.finish(), byteorder = "little", version = "3\n";
  const uint64_t bytes = t.nbytes();
  auto entry = [](const char* name, const std::string& data) {
    return zip::StoredEntry{name, data.size(), zip::crc32(0, data.data(), data.size())};
  };
  const std::vector<std::string> frame =
      zip::stored_zip_frame({entry("archive/data.pkl", data_pkl),
                             entry("archive/byteorder", byteorder),
                             {"archive/data/0", bytes, data_crc32 ? *data_crc32 : zip::crc32(0, t.data_ptr(), bytes)},
                             entry("archive/version", version)});
  TorchSaveParts out;
  out.data = t;
  out.head = frame[0] + data_pkl + frame[1] + byteorder + frame[2];
  out.tail = frame[3] + version + frame[4];
  return out;
}

std::string torch_save_tensor(const at::Tensor& tensor) {
  const TorchSaveParts parts = torch_save_tensor_parts(tensor);
  std::string out;
  out.reserve(parts.head.size() + parts.data.nbytes() + parts.tail.size());
  out += parts.head;
  out.append(static_cast<const char*>(parts.data.data_ptr()), parts.data.nbytes());
  out += parts.tail;
  return out;
}

}  // namespace mfsdp
