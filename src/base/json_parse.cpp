// parse_json: nlohmann's SAX parser with a handler that builds the value as json::parse does and
// counts the nesting while it reads (include/mfsdp/base/json_parse.h says why).
//
// nlohmann's parser itself is iterative (its nesting stack is a vector of bits), so the events
// of a document nested a million deep arrive without recursion; it is the value they would
// build, and the recursive code that walks it, that must not be deep. The handler therefore
// throws at the first container past the limit, and what was built so far (at most
// kMaxJsonDepth deep) is freed as the exception leaves. The handler is written against the
// documented SAX interface (nlohmann::json::sax_parse), not
// nlohmann::detail::json_sax_dom_parser, whose template parameters change between releases.
#include "mfsdp/base/json_parse.h"

#include <istream>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace mfsdp {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

// nlohmann::json::exception's constructor is protected; deriving is how a refusal becomes one,
// so that every `catch (const nlohmann::json::exception&)` of a call site reports it as it
// reports a syntax error. The id is one nlohmann does not use.
class JsonNestingError : public json::exception {
 public:
  explicit JsonNestingError(const std::string& what) : json::exception(kId, what.c_str()) {}
  static constexpr int kId = 1256;
};

// How much of the path to the refused container an error quotes: a few keys of each level up
// to about this many characters (the path of a hostile file can be megabytes long).
constexpr size_t kPathChars = 200;
constexpr size_t kKeyChars = 40;

// `s` cut to at most `n` bytes at a UTF-8 character boundary (keys are valid UTF-8: the lexer
// checks), "..." marking the cut.
std::string cut(const std::string& s, size_t n) {
  if (s.size() <= n) return s;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return s.substr(0, n) + "...";
}

bool plain_key(const std::string& k) {
  if (k.empty()) return false;
  for (char c : k)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
      return false;
  return true;
}

// Json: nlohmann::json or nlohmann::ordered_json.
template <class Json>
class DepthLimitedBuilder {
 public:
  using number_integer_t = typename Json::number_integer_t;
  using number_unsigned_t = typename Json::number_unsigned_t;
  using number_float_t = typename Json::number_float_t;
  using string_t = typename Json::string_t;
  using binary_t = typename Json::binary_t;

  DepthLimitedBuilder(Json& root, const JsonKeyObserver& on_key) : root_(root), on_key_(on_key) {}

  bool null() { return put(nullptr) != nullptr; }
  bool boolean(bool v) { return put(v) != nullptr; }
  bool number_integer(number_integer_t v) { return put(v) != nullptr; }
  bool number_unsigned(number_unsigned_t v) { return put(v) != nullptr; }
  bool number_float(number_float_t v, const string_t& /*token*/) { return put(v) != nullptr; }
  // The SAX interface lets the handler move the strings it is given.
  bool string(string_t& v) { return put(std::move(v)) != nullptr; }
  bool binary(binary_t& v) { return put(std::move(v)) != nullptr; }

  bool start_object(std::size_t /*elements*/) { return open(Json::value_t::object, false); }
  bool start_array(std::size_t /*elements*/) { return open(Json::value_t::array, true); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(string_t& k) {
    Frame& f = frames_.back();
    if (on_key_) on_key_(static_cast<int>(frames_.size()), k);
    // A repeated key keeps its place and put() replaces its value, as in json::parse.
    auto& object = f.value->template get_ref<typename Json::object_t&>();
    const auto it = object.emplace(std::move(k), Json()).first;
    // The key stays where it is while its value is read: the object grows only at its next key.
    f.key = &it->first;
    slot_ = &it->second;
    return true;
  }

  // Syntax errors and numbers out of range: thrown as json::parse throws them (the handler is
  // only used with exceptions; try_parse_json catches).
  template <class Exception>
  bool parse_error(std::size_t /*position*/, const std::string& /*token*/, const Exception& e) {
    throw e;
  }

 private:
  struct Frame {
    Json* value;
    bool array;
    int64_t index;           // of the element being read, in an array (-1 before the first)
    const std::string* key;  // of the value being read, in an object (its key in `value`)
  };

  // Places a value where the parser is: the root, the next array element or the value of the
  // key just read.
  template <class V>
  Json* put(V&& v) {
    if (frames_.empty()) {
      root_ = Json(std::forward<V>(v));
      return &root_;
    }
    Frame& f = frames_.back();
    if (f.array) {
      ++f.index;
      return &f.value->emplace_back(std::forward<V>(v));
    }
    *slot_ = Json(std::forward<V>(v));
    return slot_;
  }

  bool open(typename Json::value_t type, bool array) {
    if (frames_.size() >= static_cast<size_t>(kMaxJsonDepth)) refuse();
    Json* v = put(type);
    frames_.push_back(Frame{v, array, -1, nullptr});
    return true;
  }

  bool close() {
    frames_.pop_back();
    return true;
  }

  // The container about to open would be level kMaxJsonDepth + 1: names where it is.
  [[noreturn]] void refuse() const {
    std::string path;
    bool cut_short = false;
    for (const Frame& f : frames_) {
      if (path.size() >= kPathChars) {
        cut_short = true;
        break;
      }
      // The element being opened is the next one of the innermost array (its index not yet
      // counted); the others are at their current element.
      const int64_t index = &f == &frames_.back() && f.array ? f.index + 1 : f.index;
      if (f.array)
        path += "[" + std::to_string(index) + "]";
      else if (plain_key(*f.key))
        path += (path.empty() ? "" : ".") + cut(*f.key, kKeyChars);
      else
        path += "[" + json(cut(*f.key, kKeyChars)).dump(-1, ' ', false, json::error_handler_t::replace) + "]";
    }
    if (cut_short) path += "...";
    throw JsonNestingError("JSON nested too deep at " + path + " (" + std::to_string(frames_.size() + 1) +
                           " levels; the limit is " + std::to_string(kMaxJsonDepth) + ")");
  }

  Json& root_;
  const JsonKeyObserver& on_key_;
  std::vector<Frame> frames_;
  Json* slot_ = nullptr;
};

template <class Json, class Input>
Json parse_with_limit(Input&& input, const JsonKeyObserver& on_key) {
  Json result;
  DepthLimitedBuilder<Json> builder(result, on_key);
  Json::sax_parse(std::forward<Input>(input), &builder);
  return result;
}

template <class Json>
Json try_parse_with_limit(std::string_view text) {
  try {
    return parse_with_limit<Json>(text, nullptr);
  } catch (const json::exception&) {  // parse_error, out_of_range (1e999999), the nesting limit
    return Json(Json::value_t::discarded);
  }
}

}  // namespace

nlohmann::json parse_json(std::string_view text, const JsonKeyObserver& on_key) {
  return parse_with_limit<json>(text, on_key);
}

nlohmann::json parse_json(std::istream& in, const JsonKeyObserver& on_key) {
  return parse_with_limit<json>(in, on_key);
}

nlohmann::json try_parse_json(std::string_view text) { return try_parse_with_limit<json>(text); }

nlohmann::ordered_json parse_ordered_json(std::string_view text, const JsonKeyObserver& on_key) {
  return parse_with_limit<ordered_json>(text, on_key);
}

nlohmann::ordered_json try_parse_ordered_json(std::string_view text) {
  return try_parse_with_limit<ordered_json>(text);
}

}  // namespace mfsdp
