// Internal to src/checkpoint/formats: Python pickles without Python, for the two pickled files
// mfsdp reads and writes (torch.save's data.pkl, src/checkpoint/formats/torch_save.cpp, and a
// PyTorch Distributed Checkpoint's .metadata, dcp.cpp).
//
// Reading never runs code from the file. The unpickler builds a tree of values; a global the
// caller did not allow is an error naming it, and REDUCE / NEWOBJ / BUILD only *record* the call
// (callee, arguments, state) for the caller to interpret. Values live in an arena and point at
// each other with raw pointers, so deep nesting or reference cycles in a hostile file cannot
// recurse or leak on destruction.
//
// Writing emits protocol 2 (which every Python 3 and every torch reads), without memo.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace mfsdp::pickle {

struct Value {
  enum Kind { kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict, kGlobal, kCall, kPersistentId };
  Kind kind = kNone;
  int64_t i = 0;       // kBool, kInt
  bool huge = false;   // kInt beyond int64 (LONG1 of more than 8 bytes): i is meaningless
  double f = 0;        // kFloat
  std::string s;       // kStr, kBytes; kGlobal: "module.name"
  std::vector<const Value*> items;                         // kTuple, kList; kCall: the arguments
  std::vector<std::pair<const Value*, const Value*>> dict;  // kDict, in insertion order
  const Value* callee = nullptr;    // kCall: the kGlobal called (REDUCE) or instantiated (NEWOBJ)
  const Value* state = nullptr;     // kCall: what BUILD gave it, or null
  const Value* pid = nullptr;       // kPersistentId: the id (torch.save: a tuple)
};

const char* kind_name(Value::Kind kind);

// The unpickled tree; its values live as long as it does.
class Unpickled {
 public:
  const Value& root() const { return *root_; }

 private:
  friend class Unpickler;
  std::vector<std::unique_ptr<Value>> arena_;
  const Value* root_ = nullptr;
};

// Unpickles `data` (protocols 0-5 as far as the opcodes below go: the binary opcodes of
// protocols 2-4 that torch.save and dcp.save emit, plus PROTO/FRAME/MEMOIZE). `allowed` holds the
// globals ("module.name") the data may name; with `any_global`, every global is recorded (still
// never imported or called: for describing objects such as Megatron's argparse.Namespace).
// `collections.OrderedDict()` becomes a kDict. Errors are std::invalid_argument: "<where> <what
// is wrong> (at byte N)", naming a refused global or an unsupported opcode.
std::unique_ptr<Unpickled> unpickle(const std::string& data, const std::set<std::string>& allowed,
                                    const std::string& where, bool any_global = false);

// Emits a pickle value by value. Each method pushes one value (or, for the container ones, adds
// to the container on top); finish() appends STOP and returns the bytes.
class Writer {
 public:
  Writer();
  void none();
  void boolean(bool v);
  void integer(int64_t v);
  void real(double v);
  void str(const std::string& v);
  void global(const std::string& module, const std::string& name);
  void mark();
  void tuple();             // the values since the last mark()
  void tuple_of(const std::vector<int64_t>& v);
  void empty_dict();
  void set_items();         // key, value pairs since the last mark() into the dict below the mark
  void empty_list();
  void append_items();      // values since the last mark() onto the list below the mark
  void reduce();            // callee, args tuple -> callee(*args)
  void new_obj();           // cls, args tuple -> cls.__new__(cls, *args)
  void build();             // obj, state -> obj.__setstate__(state) (or __dict__.update)
  void binpersid();         // id -> persistent_load(id)
  std::string finish();

 private:
  void op(char c) { out_.push_back(c); }
  void u32(uint32_t v);
  std::string out_;
};

}  // namespace mfsdp::pickle
