// torch.save's zip format read without running code: see include/mfsdp/torch_save.h.
#include "mfsdp/torch_save.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mfsdp {
namespace {

std::string quote(const std::string& s) { return "'" + s + "'"; }

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw std::invalid_argument("torch.save file " + quote(path) + ": " + what);
}

uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The file, read with pread; a read that does not lie inside the file is an error, checked
// before anything is allocated for it.
class File {
 public:
  explicit File(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) bad(path, std::string("cannot open: ") + std::strerror(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      bad(path, "not a regular file");
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~File() { ::close(fd_); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  uint64_t size() const { return size_; }

  void check(uint64_t offset, uint64_t n, const std::string& what) const {
    if (offset > size_ || n > size_ - offset)
      bad(path_, what + " at bytes [" + std::to_string(offset) + ", " + std::to_string(offset + n) +
                     ") lies outside the " + std::to_string(size_) + "-byte file (truncated?)");
  }
  void read(uint64_t offset, void* dst, uint64_t n, const std::string& what) const {
    check(offset, n, what);
    auto* p = static_cast<char*>(dst);
    for (uint64_t done = 0; done < n;) {
      ssize_t r = ::pread(fd_, p + done, std::min<uint64_t>(n - done, 1u << 30), static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        bad(path_, "reading " + what + " failed: " + (r == 0 ? "unexpected end of file" : std::strerror(errno)));
      done += static_cast<uint64_t>(r);
    }
  }
  std::string read(uint64_t offset, uint64_t n, const std::string& what) const {
    check(offset, n, what);
    std::string s(static_cast<size_t>(n), '\0');
    read(offset, s.data(), n, what);
    return s;
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

const unsigned char* bytes(const std::string& s, size_t at = 0) {
  return reinterpret_cast<const unsigned char*>(s.data()) + at;
}

// ---- zip: the central directory (at the end of the file) lists every entry ---------------------

struct Entry {
  uint64_t header = 0;  // offset of the local file header; the data follows it
  uint64_t size = 0;
};

const char kLegacyMagic[] = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";  // PROTO 2, LONG1 magic

std::map<std::string, Entry> read_directory(const File& f, const std::string& path) {
  const std::string head = f.read(0, std::min<uint64_t>(f.size(), 14), "the file header");
  if (head == std::string(kLegacyMagic, 14))
    bad(path, "not a zip archive: the legacy (pre-1.6) torch.save format; re-save with torch>=1.6 "
              "(_use_new_zipfile_serialization=True, the default)");
  if (head.compare(0, 4, "PK\x03\x04") != 0)
    bad(path, "not a zip archive (legacy torch.save format? re-save with torch>=1.6)");

  // The end-of-central-directory record: 22 bytes plus a comment of up to 64 KiB, which must
  // reach exactly to the end of the file (so bytes inside stored data do not pass for one).
  const uint64_t tail_len = std::min<uint64_t>(f.size(), 22 + 0xffff);
  const uint64_t tail_at = f.size() - tail_len;
  const std::string tail = f.read(tail_at, tail_len, "the end of the zip archive");
  size_t eocd = std::string::npos;
  for (size_t i = tail.size() >= 22 ? tail.size() - 22 + 1 : 0; i-- > 0;)
    if (tail.compare(i, 4, "PK\x05\x06") == 0 && le(bytes(tail, i + 20), 2) == tail.size() - i - 22) {
      eocd = i;
      break;
    }
  if (eocd == std::string::npos) bad(path, "truncated zip archive: no end-of-central-directory record");
  uint64_t count = le(bytes(tail, eocd + 10), 2), cd_size = le(bytes(tail, eocd + 12), 4),
           cd_at = le(bytes(tail, eocd + 16), 4);
  if (count == 0xffff || cd_size == 0xffffffff || cd_at == 0xffffffff) {  // zip64 (files > 4 GiB)
    if (eocd < 20 || tail.compare(eocd - 20, 4, "PK\x06\x07") != 0) bad(path, "zip64 archive without its locator");
    const std::string z = f.read(le(bytes(tail, eocd - 20 + 8), 8), 56, "the zip64 end-of-central-directory record");
    if (z.compare(0, 4, "PK\x06\x06") != 0) bad(path, "bad zip64 end-of-central-directory record");
    count = le(bytes(z, 32), 8), cd_size = le(bytes(z, 40), 8), cd_at = le(bytes(z, 48), 8);
  }
  const std::string cd = f.read(cd_at, cd_size, "the zip central directory");

  std::map<std::string, Entry> entries;
  size_t p = 0;
  for (uint64_t i = 0; i < count; ++i) {
    if (cd.size() - p < 46 || cd.compare(p, 4, "PK\x01\x02") != 0)
      bad(path, "zip central directory entry " + std::to_string(i) + " is malformed");
    const unsigned char* h = bytes(cd, p);
    const uint64_t flags = le(h + 8, 2), method = le(h + 10, 2), name_len = le(h + 28, 2),
                   extra_len = le(h + 30, 2), comment_len = le(h + 32, 2);
    uint64_t csize = le(h + 20, 4), size = le(h + 24, 4), header = le(h + 42, 4);
    if (cd.size() - p - 46 < name_len + extra_len + comment_len)
      bad(path, "zip central directory entry " + std::to_string(i) + " overruns the directory");
    const std::string name = cd.substr(p + 46, name_len);
    // The zip64 extra field holds the 8-byte values of those fields saturated at 0xffffffff.
    for (size_t x = p + 46 + name_len, end = x + extra_len; end - x >= 4;) {
      const uint64_t id = le(bytes(cd, x), 2), len = le(bytes(cd, x + 2), 2);
      if (end - x - 4 < len) bad(path, "zip entry " + quote(name) + " has a malformed extra field");
      size_t v = x + 4;
      for (uint64_t* field : {&size, &csize, &header})
        if (id == 1 && *field == 0xffffffff) {
          if (v + 8 > x + 4 + len) bad(path, "zip entry " + quote(name) + " has a short zip64 field");
          *field = le(bytes(cd, v), 8), v += 8;
        }
      x += 4 + len;
    }
    if (flags & 1) bad(path, "zip entry " + quote(name) + " is encrypted");
    if (method != 0 || csize != size)
      bad(path, "zip entry " + quote(name) + " is compressed (method " + std::to_string(method) +
                    "); torch.save stores entries uncompressed");
    if (!entries.emplace(name, Entry{header, size}).second) bad(path, "zip entry " + quote(name) + " appears twice");
    p += 46 + name_len + extra_len + comment_len;
  }
  return entries;
}

// Offset of an entry's data: after its local header, whose name and extra field (torch pads it
// to align storages to 64 bytes) may differ in length from the central directory's.
uint64_t data_offset(const File& f, const std::string& path, const std::string& name, const Entry& e) {
  const std::string h = f.read(e.header, 30, "the local header of zip entry " + quote(name));
  if (h.compare(0, 4, "PK\x03\x04") != 0) bad(path, "zip entry " + quote(name) + " has a bad local header");
  return e.header + 30 + le(bytes(h, 26), 2) + le(bytes(h, 28), 2);
}

// ---- the pickle VM: values, and only the opcodes torch.save emits ------------------------------

// Objects live in the unpickler's arena and point at each other with raw pointers, so a hostile
// file's deep nesting or reference cycles cannot recurse or leak on destruction.
struct Obj;
using Ref = Obj*;

struct Obj {
  enum Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict, kGlobal, kStorage, kTensor, kOther };
  Kind kind = kNone;
  int64_t i = 0;                          // kBool, kInt; kStorage: numel
  std::string s;                          // kStr; kGlobal: "module name"; kStorage: key
  at::ScalarType dtype = at::kFloat;      // kGlobal of a storage type, kStorage
  std::vector<Ref> items;                 // kTuple, kList; kTensor: {storage}
  std::vector<std::pair<Ref, Ref>> dict;  // kDict, in insertion order
  std::vector<int64_t> size, stride;      // kTensor (i: storage offset)
};

const char* kind_name(Obj::Kind k) {
  static const char* names[] = {"None",   "bool",    "int",     "float",  "str",   "tuple",
                                "list",   "dict",    "global",  "storage", "tensor", "object"};
  return names[k];
}

const std::pair<const char*, at::ScalarType> kStorageTypes[] = {
    {"FloatStorage", at::kFloat}, {"DoubleStorage", at::kDouble}, {"HalfStorage", at::kHalf},
    {"BFloat16Storage", at::kBFloat16}, {"LongStorage", at::kLong}, {"IntStorage", at::kInt},
    {"ShortStorage", at::kShort}, {"CharStorage", at::kChar}, {"ByteStorage", at::kByte},
    {"BoolStorage", at::kBool},
};

class Unpickler {
 public:
  Unpickler(const std::string& path, std::string data) : path_(path), data_(std::move(data)) {}

  // The unpickled object; it lives as long as this unpickler.
  Ref load() {
    while (true) {
      op_at_ = pos_;
      const unsigned char op = *take(1);
      switch (op) {
        case 0x80: if (*take(1) > 5) fail("uses an unknown pickle protocol"); break;  // PROTO
        case 0x95: take(8); break;                                                    // FRAME: all is in memory
        case '}': push(make(Obj::kDict)); break;
        case ']': push(make(Obj::kList)); break;
        case ')': push(make(Obj::kTuple)); break;
        case '(': marks_.push_back(stack_.size()); break;
        case 't': { auto t = make(Obj::kTuple); t->items = pop_mark(); push(t); break; }
        case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
          auto t = make(Obj::kTuple);
          t->items.resize(op - 0x84);
          for (size_t k = t->items.size(); k-- > 0;) t->items[k] = pop();
          push(t);
          break;
        }
        case 'X': push_str(num(4)); break;     // BINUNICODE
        case 0x8c: push_str(num(1)); break;    // SHORT_BINUNICODE
        case 0x8d: push_str(num(8)); break;    // BINUNICODE8
        case 'J': push_int(static_cast<int32_t>(num(4))); break;  // BININT
        case 'K': push_int(static_cast<int64_t>(num(1))); break;  // BININT1
        case 'M': push_int(static_cast<int64_t>(num(2))); break;  // BININT2
        case 0x8a: {                                                // LONG1: n bytes, two's complement
          const uint64_t n = num(1);
          const unsigned char* b = take(n);
          if (n > 8) { push(make(Obj::kOther)); break; }  // beyond int64: only ever a skipped leaf
          uint64_t v = n ? le(b, static_cast<int>(n)) : 0;
          if (n && n < 8 && (b[n - 1] & 0x80)) v |= ~uint64_t{0} << (8 * n);
          push_int(static_cast<int64_t>(v));
          break;
        }
        case 'G': take(8); push(make(Obj::kFloat)); break;  // BINFLOAT: the value is never needed
        case 0x88: case 0x89: { auto b = make(Obj::kBool); b->i = op == 0x88; push(b); break; }
        case 'N': push(make(Obj::kNone)); break;
        case 'c': { const std::string module = line(); push(global(module, line())); break; }
        case 0x93: {  // STACK_GLOBAL
          Ref name = pop(), module = pop();
          if (module->kind != Obj::kStr || name->kind != Obj::kStr) fail("has a STACK_GLOBAL of non-strings");
          push(global(module->s, name->s));
          break;
        }
        case 'Q': push(persistent(pop())); break;  // BINPERSID
        case 'R': { Ref args = pop(); push(reduce(pop(), args)); break; }
        case 'b': pop(); top(); break;  // BUILD: the state (OrderedDict._metadata) is not needed
        case 's': { Ref v = pop(), k = pop(); dict_top().push_back({k, v}); break; }
        case 'u': {
          std::vector<Ref> kv = pop_mark();
          if (kv.size() % 2) fail("has SETITEMS with an odd number of items");
          for (size_t k = 0; k < kv.size(); k += 2) dict_top().push_back({kv[k], kv[k + 1]});
          break;
        }
        case 'a': { Ref v = pop(); list_top().push_back(v); break; }
        case 'e': {
          std::vector<Ref> v = pop_mark();
          list_top().insert(list_top().end(), v.begin(), v.end());
          break;
        }
        case 'q': memo_[num(1)] = top(); break;             // BINPUT
        case 'r': memo_[num(4)] = top(); break;             // LONG_BINPUT
        case 0x94: memo_[memo_.size()] = top(); break;       // MEMOIZE
        case 'h': push(memo(num(1))); break;                // BINGET
        case 'j': push(memo(num(4))); break;                // LONG_BINGET
        case '.':                                            // STOP
          if (stack_.size() != 1 || !marks_.empty())
            fail("stops with " + std::to_string(stack_.size()) + " values on the stack");
          return stack_.back();
        default: {
          char hex[8];
          std::snprintf(hex, sizeof(hex), "0x%02x", op);
          fail(std::string("uses pickle opcode ") + hex + ", which this reader does not support");
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    bad(path_, "data.pkl " + what + " (at byte " + std::to_string(op_at_) + ")");
  }

  const unsigned char* take(uint64_t n) {
    if (n > data_.size() - pos_) fail("ends early (truncated?)");
    pos_ += n;
    return bytes(data_, pos_ - n);
  }
  uint64_t num(int n) { return le(take(n), n); }
  std::string line() {
    const size_t nl = data_.find('\n', pos_);
    if (nl == std::string::npos) fail("ends inside a GLOBAL");
    std::string s = data_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return s;
  }

  Ref make(Obj::Kind kind) {
    arena_.push_back(std::make_unique<Obj>());
    arena_.back()->kind = kind;
    return arena_.back().get();
  }
  void push(Ref r) { stack_.push_back(std::move(r)); }
  void push_str(uint64_t n) {
    auto s = make(Obj::kStr);
    s->s.assign(reinterpret_cast<const char*>(take(n)), n);
    push(s);
  }
  void push_int(int64_t v) { auto i = make(Obj::kInt); i->i = v; push(i); }
  Ref& top() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) fail("pops from an empty stack");
    return stack_.back();
  }
  Ref pop() { Ref r = top(); stack_.pop_back(); return r; }
  std::vector<Ref> pop_mark() {
    if (marks_.empty()) fail("has no MARK to pop to");
    std::vector<Ref> v(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return v;
  }
  std::vector<std::pair<Ref, Ref>>& dict_top() {
    if (top()->kind != Obj::kDict) fail(std::string("sets an item on a ") + kind_name(top()->kind));
    return top()->dict;
  }
  std::vector<Ref>& list_top() {
    if (top()->kind != Obj::kList) fail(std::string("appends to a ") + kind_name(top()->kind));
    return top()->items;
  }
  Ref memo(uint64_t k) {
    auto it = memo_.find(k);
    if (it == memo_.end()) fail("reads memo slot " + std::to_string(k) + ", which was never written");
    return it->second;
  }

  // The allowlist: resolving a name is all a global does here; nothing is imported or called.
  Ref global(const std::string& module, const std::string& name) {
    auto g = make(Obj::kGlobal);
    g->s = module + " " + name;
    if (g->s == "collections OrderedDict" || g->s == "torch._utils _rebuild_tensor_v2" ||
        g->s == "torch._utils _rebuild_parameter")
      return g;
    for (const auto& [type, dtype] : kStorageTypes)
      if (module == "torch" && name == type) {
        g->dtype = dtype;
        g->i = 1;  // a storage type
        return g;
      }
    fail("uses global " + quote(g->s) + ", which is not allowed (this reader never runs code from the file)");
  }

  // ('storage', torch.XStorage, key, location, numel): the storage bytes are read only when a
  // tensor that is returned needs them.
  Ref persistent(const Ref& pid) {
    const auto& t = pid->items;
    if (pid->kind != Obj::kTuple || t.size() != 5 || t[0]->kind != Obj::kStr || t[0]->s != "storage" ||
        t[1]->kind != Obj::kGlobal || t[1]->i != 1 || t[2]->kind != Obj::kStr || t[3]->kind != Obj::kStr ||
        t[4]->kind != Obj::kInt || t[4]->i < 0)
      fail("has a persistent id that is not ('storage', torch.XStorage, key, location, numel)");
    auto s = make(Obj::kStorage);
    s->dtype = t[1]->dtype, s->s = t[2]->s, s->i = t[4]->i;
    return s;
  }

  std::vector<int64_t> ints(const Ref& r, const char* what) {
    if (r->kind != Obj::kTuple) fail(std::string("has a tensor ") + what + " that is a " + kind_name(r->kind));
    std::vector<int64_t> v;
    for (const auto& x : r->items) {
      if (x->kind != Obj::kInt || x->i < 0)
        fail(std::string("has a tensor ") + what + " with a negative or non-int entry");
      v.push_back(x->i);
    }
    return v;
  }

  Ref reduce(const Ref& f, const Ref& args) {
    if (f->kind != Obj::kGlobal) fail(std::string("calls a ") + kind_name(f->kind));
    if (args->kind != Obj::kTuple) fail("calls " + quote(f->s) + " with a " + kind_name(args->kind));
    const auto& a = args->items;
    if (f->s == "collections OrderedDict") {
      if (!a.empty()) fail("calls 'collections OrderedDict' with arguments");
      return make(Obj::kDict);
    }
    if (f->s == "torch._utils _rebuild_parameter") {  // (tensor, requires_grad, hooks)
      if (a.size() != 3 || a[0]->kind != Obj::kTensor) fail("calls 'torch._utils _rebuild_parameter' without a tensor");
      return a[0];
    }
    // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
    if (f->s != "torch._utils _rebuild_tensor_v2") fail("calls " + quote(f->s) + ", which is not callable");
    if ((a.size() != 6 && a.size() != 7) || a[0]->kind != Obj::kStorage || a[1]->kind != Obj::kInt || a[1]->i < 0)
      fail("calls 'torch._utils _rebuild_tensor_v2' with arguments other than (storage, offset, size, stride, ...)");
    auto t = make(Obj::kTensor);
    t->items = {a[0]};
    t->i = a[1]->i;
    t->size = ints(a[2], "size");
    t->stride = ints(a[3], "stride");
    if (t->size.size() != t->stride.size()) fail("has a tensor whose size and stride differ in length");
    return t;
  }

  std::string path_;
  std::string data_;
  size_t pos_ = 0;
  size_t op_at_ = 0;  // where the current opcode starts
  std::vector<Ref> stack_;
  std::vector<size_t> marks_;  // stack heights at each MARK
  std::unordered_map<uint64_t, Ref> memo_;
  std::vector<std::unique_ptr<Obj>> arena_;
};

// ---- from the unpickled object to named CPU tensors --------------------------------------------

class Flattener {
 public:
  Flattener(const File& f, const std::string& path, const std::map<std::string, Entry>& entries, std::string prefix)
      : file_(f), path_(path), entries_(entries), prefix_(std::move(prefix)) {}

  void add(const Ref& v, const std::string& name, int depth) {
    if (depth > 100) bad(path_, "dicts nested deeper than 100 levels at " + quote(name));
    if (v->kind == Obj::kTensor) {
      if (!out.emplace(name, tensor(*v, name)).second) bad(path_, "two tensors are named " + quote(name));
    } else if (v->kind == Obj::kDict) {
      for (const auto& [k, child] : v->dict) {
        if (k->kind != Obj::kStr && k->kind != Obj::kInt)
          bad(path_, std::string("a dict key of type ") + kind_name(k->kind) + " under " + quote(name) +
                         " cannot become a tensor name");
        const std::string key = k->kind == Obj::kStr ? k->s : std::to_string(k->i);
        add(child, name.empty() ? key : name + "." + key, depth + 1);
      }
    }
  }

  std::map<std::string, at::Tensor> out;

 private:
  at::Tensor tensor(const Obj& t, const std::string& name) {
    const Obj& st = *t.items[0];
    const std::string entry = prefix_ + "data/" + st.s;
    const uint64_t item = c10::elementSize(st.dtype);
    // Elements the view reaches: offset + sum((size - 1) * stride) + 1, overflow-checked.
    int64_t need = 0;
    bool overflow = false;
    if (std::all_of(t.size.begin(), t.size.end(), [](int64_t s) { return s > 0; })) {
      need = t.i;
      for (size_t d = 0; d < t.size.size(); ++d) {
        int64_t span;
        overflow |= __builtin_mul_overflow(t.size[d] - 1, t.stride[d], &span) ||
                    __builtin_add_overflow(need, span, &need);
      }
      overflow |= __builtin_add_overflow(need, 1, &need) ||
                  __builtin_mul_overflow(need, static_cast<int64_t>(item), &need);
    }
    if (overflow) bad(path_, "tensor " + quote(name) + " has a size and stride that overflow");
    int64_t declared;
    if (!__builtin_mul_overflow(st.i, static_cast<int64_t>(item), &declared) && need > declared)
      bad(path_, "tensor " + quote(name) + " needs " + std::to_string(need) + " bytes of storage " + quote(entry) +
                     ", which its persistent id declares as " + std::to_string(st.i) + " elements");

    auto cached = storages_.find(st.s);
    if (cached == storages_.end()) {
      auto e = entries_.find(entry);
      if (e == entries_.end()) bad(path_, "no zip entry " + quote(entry) + " for the storage of tensor " + quote(name));
      if (e->second.size % item)
        bad(path_, "storage " + quote(entry) + " is " + std::to_string(e->second.size) +
                       " bytes, not a whole number of " + c10::toString(st.dtype) + " elements");
      const uint64_t offset = data_offset(file_, path_, entry, e->second);
      file_.check(offset, e->second.size, "storage " + quote(entry));  // before allocating for it
      at::Tensor buf = at::empty({static_cast<int64_t>(e->second.size / item)}, at::TensorOptions().dtype(st.dtype));
      file_.read(offset, buf.data_ptr(), e->second.size, "storage " + quote(entry));
      cached = storages_.emplace(st.s, buf).first;
    }
    const at::Tensor& buf = cached->second;
    if (buf.scalar_type() != st.dtype)
      bad(path_, "storage " + quote(entry) + " is used as " + c10::toString(buf.scalar_type()) + " and as " +
                     c10::toString(st.dtype) + " (tensor " + quote(name) + ")");
    if (need > static_cast<int64_t>(buf.nbytes()))
      bad(path_, "storage " + quote(entry) + " is " + std::to_string(buf.nbytes()) + " bytes, tensor " + quote(name) +
                     " needs " + std::to_string(need));
    return buf.as_strided(t.size, t.stride, t.i);
  }

  const File& file_;
  const std::string& path_;
  const std::map<std::string, Entry>& entries_;
  const std::string prefix_;
  std::map<std::string, at::Tensor> storages_;  // by storage key: views share one buffer
};

}  // namespace

std::map<std::string, at::Tensor> read_torch_save(const std::string& path) {
  const uint16_t one = 1;
  if (*reinterpret_cast<const unsigned char*>(&one) != 1)
    throw std::runtime_error("torch.save: only little-endian hosts are supported");
  File f(path);
  const std::map<std::string, Entry> entries = read_directory(f, path);

  // <archive>/data.pkl, with <archive> one folder deep, whatever its name.
  std::string prefix;
  for (const auto& [name, e] : entries) {
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.compare(slash, std::string::npos, "/data.pkl") == 0) {
      if (!prefix.empty()) bad(path, "two data.pkl entries: " + quote(prefix + "data.pkl") + " and " + quote(name));
      prefix = name.substr(0, slash + 1);
    }
  }
  if (prefix.empty()) bad(path, "zip archive without an '<archive>/data.pkl' entry (not a torch.save file)");
  if (entries.count(prefix + "constants.pkl"))
    bad(path, "a TorchScript archive (torch.jit.save or C++ torch::save), not a torch.save file");
  if (auto bo = entries.find(prefix + "byteorder"); bo != entries.end()) {
    const std::string order = f.read(data_offset(f, path, bo->first, bo->second), bo->second.size, "byteorder");
    if (order != "little") bad(path, "byteorder is " + quote(order) + "; only little-endian files are supported");
  }

  const Entry& pkl = entries.at(prefix + "data.pkl");
  Unpickler unpickler(path, f.read(data_offset(f, path, prefix + "data.pkl", pkl), pkl.size, "data.pkl"));
  Ref root = unpickler.load();
  if (root->kind != Obj::kDict)
    bad(path, std::string("holds a ") + kind_name(root->kind) + ", not a dict of tensors (a state_dict or checkpoint)");
  Flattener flat(f, path, entries, prefix);
  flat.add(root, "", 0);
  return std::move(flat.out);
}

}  // namespace mfsdp
