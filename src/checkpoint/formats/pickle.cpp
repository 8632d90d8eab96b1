// A restricted unpickler and a small pickler (src/checkpoint/formats/pickle.h).
#include "checkpoint/formats/pickle.h"

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

namespace mfsdp::pickle {
namespace {

uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

const char* kind_name(Value::Kind k) {
  static const char* names[] = {"None", "bool",  "int",    "float", "str",  "bytes",
                                "tuple", "list", "dict", "global", "object", "persistent id"};
  return names[k];
}

class Unpickler {
 public:
  Unpickler(const std::string& data, const std::set<std::string>& allowed, const std::string& where, bool any_global)
      : data_(data), allowed_(allowed), any_global_(any_global), where_(where), out_(std::make_unique<Unpickled>()) {}

  std::unique_ptr<Unpickled> load() {
    while (true) {
      op_at_ = pos_;
      const unsigned char op = *take(1);
      switch (op) {
        case 0x80: if (*take(1) > 5) fail("uses an unknown pickle protocol"); break;  // PROTO
        case 0x95: take(8); break;                                                    // FRAME: all is in memory
        case '}': push(make(Value::kDict)); break;
        case ']': push(make(Value::kList)); break;
        case ')': push(make(Value::kTuple)); break;
        case '(': marks_.push_back(stack_.size()); break;
        case 't': { Value* t = make(Value::kTuple); t->items = pop_mark(); push(t); break; }
        case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
          Value* t = make(Value::kTuple);
          t->items.resize(op - 0x84);
          for (size_t k = t->items.size(); k-- > 0;) t->items[k] = pop();
          push(t);
          break;
        }
        case 'X': push_str(Value::kStr, num(4)); break;     // BINUNICODE
        case 0x8c: push_str(Value::kStr, num(1)); break;    // SHORT_BINUNICODE
        case 0x8d: push_str(Value::kStr, num(8)); break;    // BINUNICODE8
        case 'B': push_str(Value::kBytes, num(4)); break;   // BINBYTES
        case 'C': push_str(Value::kBytes, num(1)); break;   // SHORT_BINBYTES
        case 0x8e: push_str(Value::kBytes, num(8)); break;  // BINBYTES8
        case 'J': push_int(static_cast<int32_t>(num(4))); break;  // BININT
        case 'K': push_int(static_cast<int64_t>(num(1))); break;  // BININT1
        case 'M': push_int(static_cast<int64_t>(num(2))); break;  // BININT2
        case 0x8a: {                                               // LONG1: n bytes, two's complement
          const uint64_t n = num(1);
          const unsigned char* b = take(n);
          Value* v = make(Value::kInt);
          if (n > 8) {
            v->huge = true;
          } else {
            uint64_t x = n ? le(b, static_cast<int>(n)) : 0;
            if (n && n < 8 && (b[n - 1] & 0x80)) x |= ~uint64_t{0} << (8 * n);
            v->i = static_cast<int64_t>(x);
          }
          push(v);
          break;
        }
        case 'G': {  // BINFLOAT: big-endian IEEE double
          const unsigned char* b = take(8);
          uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | b[k];
          Value* v = make(Value::kFloat);
          std::memcpy(&v->f, &bits, 8);
          push(v);
          break;
        }
        case 0x88: case 0x89: { Value* b = make(Value::kBool); b->i = op == 0x88; push(b); break; }
        case 'N': push(make(Value::kNone)); break;
        case 'c': { const std::string module = line(); push(global(module, line())); break; }
        case 0x93: {  // STACK_GLOBAL
          const Value* name = pop();
          const Value* module = pop();
          if (module->kind != Value::kStr || name->kind != Value::kStr) fail("has a STACK_GLOBAL of non-strings");
          push(global(module->s, name->s));
          break;
        }
        case 'Q': { Value* p = make(Value::kPersistentId); p->pid = pop(); push(p); break; }  // BINPERSID
        case 'R': { const Value* args = pop(); push(call(pop(), args, "REDUCE")); break; }
        case 0x81: { const Value* args = pop(); push(call(pop(), args, "NEWOBJ")); break; }
        case 'b': {  // BUILD
          const Value* state = pop();
          Value* obj = top();
          if (obj->kind == Value::kDict) break;  // an OrderedDict's attributes (state_dict's _metadata)
          if (obj->kind != Value::kCall) fail(std::string("BUILDs a ") + kind_name(obj->kind));
          if (obj->state != nullptr) fail("BUILDs the same object twice");
          obj->state = state;
          break;
        }
        case 's': { const Value* v = pop(); const Value* k = pop(); dict_top().push_back({k, v}); break; }
        case 'u': {
          std::vector<const Value*> kv = pop_mark();
          if (kv.size() % 2) fail("has SETITEMS with an odd number of items");
          auto& d = dict_top();
          for (size_t k = 0; k < kv.size(); k += 2) d.push_back({kv[k], kv[k + 1]});
          break;
        }
        case 'a': { const Value* v = pop(); list_top().push_back(v); break; }
        case 'e': {
          std::vector<const Value*> v = pop_mark();
          auto& l = list_top();
          l.insert(l.end(), v.begin(), v.end());
          break;
        }
        case 'q': memo_[num(1)] = top(); break;        // BINPUT
        case 'r': memo_[num(4)] = top(); break;        // LONG_BINPUT
        case 0x94: memo_[memo_.size()] = top(); break;  // MEMOIZE
        case 'h': push(memo(num(1))); break;           // BINGET
        case 'j': push(memo(num(4))); break;           // LONG_BINGET
        case '.':                                       // STOP
          if (stack_.size() != 1 || !marks_.empty())
            fail("stops with " + std::to_string(stack_.size()) + " values on the stack");
          out_->root_ = stack_.back();
          return std::move(out_);
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
    throw std::invalid_argument(where_ + " " + what + " (at byte " + std::to_string(op_at_) + ")");
  }

  const unsigned char* take(uint64_t n) {
    if (n > data_.size() - pos_) fail("ends early (truncated?)");
    pos_ += n;
    return reinterpret_cast<const unsigned char*>(data_.data()) + (pos_ - n);
  }
  uint64_t num(int n) { return le(take(n), n); }
  std::string line() {
    const size_t nl = data_.find('\n', pos_);
    if (nl == std::string::npos) fail("ends inside a GLOBAL");
    std::string s = data_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return s;
  }

  Value* make(Value::Kind kind) {
    out_->arena_.push_back(std::make_unique<Value>());
    out_->arena_.back()->kind = kind;
    return out_->arena_.back().get();
  }
  void push(Value* v) { stack_.push_back(v); }
  void push_str(Value::Kind kind, uint64_t n) {
    Value* s = make(kind);
    s->s.assign(reinterpret_cast<const char*>(take(n)), n);
    push(s);
  }
  void push_int(int64_t v) { Value* i = make(Value::kInt); i->i = v; push(i); }
  Value* top() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) fail("pops from an empty stack");
    return stack_.back();
  }
  Value* pop() { Value* v = top(); stack_.pop_back(); return v; }
  std::vector<const Value*> pop_mark() {
    if (marks_.empty()) fail("has no MARK to pop to");
    std::vector<const Value*> v(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return v;
  }
  std::vector<std::pair<const Value*, const Value*>>& dict_top() {
    Value* t = top();
    if (t->kind != Value::kDict) fail(std::string("sets an item on a ") + kind_name(t->kind));
    return t->dict;
  }
  std::vector<const Value*>& list_top() {
    Value* t = top();
    if (t->kind != Value::kList) fail(std::string("appends to a ") + kind_name(t->kind));
    return t->items;
  }
  Value* memo(uint64_t k) {
    auto it = memo_.find(k);
    if (it == memo_.end()) fail("reads memo slot " + std::to_string(k) + ", which was never written");
    return it->second;
  }

  // The allowlist: resolving a name is all a global does here; nothing is imported or called.
  Value* global(const std::string& module, const std::string& name) {
    Value* g = make(Value::kGlobal);
    g->s = module + "." + name;
    if (!any_global_ && !allowed_.count(g->s))
      fail("uses global '" + g->s + "', which is not allowed (this reader never runs code from the file)");
    return g;
  }

  Value* call(const Value* callee, const Value* args, const char* opcode) {
    if (callee->kind != Value::kGlobal) fail(std::string(opcode) + " calls a " + kind_name(callee->kind));
    if (args->kind != Value::kTuple)
      fail(std::string(opcode) + " calls '" + callee->s + "' with a " + kind_name(args->kind));
    if (callee->s == "collections.OrderedDict") {
      if (!args->items.empty()) fail("calls 'collections.OrderedDict' with arguments");
      return make(Value::kDict);
    }
    Value* c = make(Value::kCall);
    c->callee = callee;
    c->items = args->items;
    return c;
  }

  const std::string& data_;
  const std::set<std::string>& allowed_;
  const bool any_global_;
  std::string where_;
  std::unique_ptr<Unpickled> out_;
  size_t pos_ = 0;
  size_t op_at_ = 0;  // where the current opcode starts
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;  // stack heights at each MARK
  std::unordered_map<uint64_t, Value*> memo_;
};

std::unique_ptr<Unpickled> unpickle(const std::string& data, const std::set<std::string>& allowed,
                                    const std::string& where, bool any_global) {
  return Unpickler(data, allowed, where, any_global).load();
}

// ---- Writer --------------------------------------------------------------------------------------

Writer::Writer() { out_ = std::string("\x80\x02", 2); }

void Writer::u32(uint32_t v) {
  for (int k = 0; k < 4; ++k) out_.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

void Writer::none() { op('N'); }
void Writer::boolean(bool v) { op(v ? '\x88' : '\x89'); }

void Writer::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    op('K');
    out_.push_back(static_cast<char>(v));
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    op('J');
    u32(static_cast<uint32_t>(static_cast<int32_t>(v)));
  } else {  // LONG1 with 8 bytes, two's complement
    op('\x8a');
    out_.push_back(8);
    for (int k = 0; k < 8; ++k) out_.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * k)) & 0xff));
  }
}

void Writer::real(double v) {
  op('G');
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  for (int k = 7; k >= 0; --k) out_.push_back(static_cast<char>((bits >> (8 * k)) & 0xff));
}

void Writer::str(const std::string& v) {
  if (v.size() > UINT32_MAX) throw std::invalid_argument("pickle: a string over 4 GiB");
  op('X');
  u32(static_cast<uint32_t>(v.size()));
  out_ += v;
}

void Writer::global(const std::string& module, const std::string& name) {
  op('c');
  out_ += module + "\n" + name + "\n";
}

void Writer::mark() { op('('); }
void Writer::tuple() { op('t'); }

void Writer::tuple_of(const std::vector<int64_t>& v) {
  mark();
  for (int64_t x : v) integer(x);
  tuple();
}

void Writer::empty_dict() { op('}'); }
void Writer::set_items() { op('u'); }
void Writer::empty_list() { op(']'); }
void Writer::append_items() { op('e'); }
void Writer::reduce() { op('R'); }
void Writer::new_obj() { op('\x81'); }
void Writer::build() { op('b'); }
void Writer::binpersid() { op('Q'); }

std::string Writer::finish() {
  op('.');
  return std::move(out_);
}

}  // namespace mfsdp::pickle
