// The pieces of HuggingFaceTokenizer (src/data/tokenizer_hf.cpp): the Oniguruma-compatible regex
// over PCRE2 and the UTF-8 helpers (tokenizer_hf_regex.cpp), the normalizers and pre-tokenizers
// with the reading of tokenizer.json fields (tokenizer_hf_text.cpp), the decoders
// (tokenizer_hf_decoders.cpp), and the BPE and Unigram models (tokenizer_hf_bpe.cpp,
// tokenizer_hf_unigram.cpp). Private to src/data (and its tests); the public entry point is
// load_hf_tokenizer.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mfsdp::hf {

// ---- UTF-8 ---------------------------------------------------------------------------------------

// The byte length of the character starting at text[i]; an invalid or truncated sequence counts
// as a character of one byte (the tokenizers library never sees one: Python strings are valid).
size_t utf8_char_len(std::string_view text, size_t i);
// The code point starting at text[i], or 0xFFFFFFFF for an invalid byte.
uint32_t utf8_code_point(std::string_view text, size_t i);
void append_utf8(uint32_t cp, std::string& out);
// Rust's String::from_utf8_lossy: each maximal invalid subsequence becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// ---- regex ---------------------------------------------------------------------------------------

// How a Regex's pattern is written.
enum class RegexSyntax {
  kOniguruma,  // a tokenizer.json {"Regex": ...}, as the tokenizers library compiles it
  kLiteral,    // a tokenizer.json {"String": ...}: the text itself
  kPcre2,      // our own patterns, for the library's character predicates
};

// A regex run by PCRE2 in UTF mode with Unicode properties. Thread-safe.
class Regex {
 public:
  // `where` ("FILE: JSON path") prefixes every error: std::invalid_argument when the pattern uses
  // something that means something else in PCRE2 or does not compile.
  Regex(const std::string& pattern, RegexSyntax syntax, std::string where);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // The [start, end) byte spans of the successive matches, as the library's find_iter (the onig
  // crate) yields them: each search starts where the last match ended; an empty match right
  // where the last one ended is skipped by moving one character on. Invalid UTF-8 in `text`
  // never matches. Throws std::runtime_error naming `where` and the text length when matching
  // exceeds the bounds of [Note: bounded matching] (tokenizer_hf_regex.cpp).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs the following matches in PCRE2's interpreter instead of its JIT (tests only: the paths
// the machines without a JIT take).
void set_regex_interpreter_for_testing(bool on);

// The PCRE2 pattern that matches what Oniguruma's `pattern` matches (Ruby syntax with Unicode
// classes), or std::invalid_argument with the reason for a construct that has no faithful
// translation. Exposed for tests.
std::string oniguruma_to_pcre2(const std::string& pattern);

// ---- reading tokenizer.json (tokenizer_hf_text.cpp) ---------------------------------------------

// A JSON value in an error message, cut to 80 characters.
std::string describe(const nlohmann::json& v);

// SplitDelimiterBehavior: what becomes of the matches when a piece is cut at them.
enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
// Metaspace's: where it puts its replacement character before a piece.
enum class PrependScheme { kFirst, kNever, kAlways };

// Reads the fields of one tokenizer.json; every error is std::invalid_argument naming the file and
// the JSON path (`at`).
class JsonReader {
 public:
  explicit JsonReader(std::string file) : file_(std::move(file)) {}
  const std::string& file() const { return file_; }
  [[noreturn]] void refuse(const std::string& at, const std::string& what) const;
  // "FILE: at", for errors raised later (a regex that fails to match).
  std::string where(const std::string& at) const { return file_ + ": " + at; }

  std::string string_field(const nlohmann::json& o, const char* key, const std::string& at,
                           const char* fallback = nullptr) const;
  bool bool_field(const nlohmann::json& o, const char* key, const std::string& at, bool fallback) const;
  // A string of one character, as its code point.
  uint32_t char_field(const nlohmann::json& o, const char* key, const std::string& at) const;
  // "pattern": {"String": s} or {"Regex": r}.
  Regex pattern_field(const nlohmann::json& o, const std::string& at) const;
  Behavior behavior_field(const nlohmann::json& o, const std::string& at, Behavior fallback) const;
  // Metaspace's prepend_scheme, with the older add_prefix_space read as the library reads it.
  PrependScheme prepend_scheme_field(const nlohmann::json& o, const std::string& at) const;
  // o[key], an array of objects, each loaded by `load(element, its path)`; a null element is
  // refused (the library's serde refuses it), a null result (a step that does nothing here, e.g.
  // the ByteLevel post-processor) is dropped. By reference: a copy per level made nested
  // Sequences quadratic.
  template <class T, class F>
  std::vector<std::unique_ptr<T>> list_field(const nlohmann::json& o, const char* key, const std::string& at,
                                             F load) const {
    const auto it = o.find(key);
    if (it == o.end() || !it->is_array()) {
      refuse(at + "." + key, "expected an array, found " + (it == o.end() ? "nothing" : describe(*it)));
    }
    std::vector<std::unique_ptr<T>> steps;
    for (size_t k = 0; k < it->size(); ++k) {
      const std::string element_at = at + "." + key + "[" + std::to_string(k) + "]";
      if ((*it)[k].is_null()) refuse(element_at, "expected an object, found null");
      auto step = load((*it)[k], element_at);
      if (step) steps.push_back(std::move(step));
    }
    return steps;
  }

 private:
  std::string file_;
};

// ---- the text before the model (tokenizer_hf_text.cpp) -------------------------------------------

// Rust's char::is_whitespace: Unicode's White_Space property.
bool is_white_space(uint32_t cp);
// ByteLevel's character of each byte (GPT-2's bytes_to_unicode), as UTF-8, and the inverse.
const std::array<std::string, 256>& byte_level_chars();
const std::unordered_map<uint32_t, uint8_t>& byte_level_bytes();

// [Note: the first piece]
// Metaspace with prepend_scheme "first" adds its "▁" only to a piece that begins where the whole
// text begins (the library checks that the piece's offset in the original text is 0), so after an
// added token at the start, or in a later piece, it adds none. A piece carries `head`: how many of
// its leading bytes stand for original offset 0 (the first character, and what normalizers put
// before it, e.g. Prepend's "▁"); a piece cut off at a byte within its head begins at offset 0,
// and head 0 means it does not.
struct Piece {
  std::string text;
  size_t head = 0;
  int64_t id = -1;  // an added token's id; its text is left alone
};

// The head of the part [start, end) of `p`.
inline size_t head_of_slice(const Piece& p, size_t start, size_t end) {
  return start < p.head ? std::min(end, p.head) - start : 0;
}

// Replaces the byte spans of `p.text` by `content`.
void replace_spans(Piece& p, const std::vector<std::pair<size_t, size_t>>& spans, const std::string& content);

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // Normalizes p.text. `max_bytes` caps what it may grow to (normalized_size_limit of the
  // segment): past it, std::runtime_error naming `where`, before the text is built.
  virtual void apply(Piece& p, size_t max_bytes) const = 0;
  // Refuses (std::runtime_error naming `where`) a result of `bytes` bytes over `max_bytes`.
  void check_size(size_t bytes, size_t max_bytes) const;
  // "FILE: JSON path" of this normalizer, for errors; set by load_normalizer.
  std::string where;
};
// The "normalizer" at `at`; null for none.
std::unique_ptr<Normalizer> load_normalizer(const JsonReader& r, const nlohmann::json& n,
                                            const std::string& at);
// The most bytes a segment of `bytes` bytes may become through the normalizer: 64 times its size
// plus 64 KiB, far above what Unicode's normal forms (at most 18 characters for one) or a
// tokenizer's Replace rules make, far below what a hostile Replace can (docs/data.md).
size_t normalized_size_limit(size_t bytes);

// The normalizers built on Unicode's tables (utf8proc) and SentencePiece's precompiled charsmap
// (tokenizer_hf_unicode.cpp): NFC, NFD, NFKC, NFKD, Lowercase, StripAccents, BertNormalizer, Nmt,
// Precompiled. Null when `type` is none of them.
std::unique_ptr<Normalizer> load_unicode_normalizer(const JsonReader& r, const nlohmann::json& n,
                                                    const std::string& type, const std::string& at);

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Cuts or rewrites the text pieces of `pieces` (added tokens stay as they are).
  void apply(std::vector<Piece>& pieces) const;
  virtual void apply_one(Piece p, std::vector<Piece>& out) const = 0;
};
std::unique_ptr<PreTokenizer> load_pre_tokenizer(const JsonReader& r, const nlohmann::json& p,
                                                 const std::string& at);

// ---- decoders (tokenizer_hf_decoders.cpp) --------------------------------------------------------

class Decoder {
 public:
  virtual ~Decoder() = default;
  // The library's decode_chain: tokens in, tokens out; decode joins what the last one leaves.
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};
std::unique_ptr<Decoder> load_decoder(const JsonReader& r, const nlohmann::json& d, const std::string& at);

// ---- models --------------------------------------------------------------------------------------

// A tokenizer.json "model": a pre-token (a string of the characters the pre-tokenizers left) to
// ids. Thread-safe.
class Model {
 public:
  virtual ~Model() = default;
  // Appends the ids of one non-empty pre-token. Throws std::runtime_error naming the file when
  // the pre-token cannot be encoded (no unk token for an unknown character).
  virtual void encode(std::string_view pretoken, std::vector<int64_t>& ids) const = 0;
  // The piece of `id`, null when no piece has it.
  virtual const std::string* piece(int64_t id) const = 0;
  virtual std::optional<int64_t> id_of(const std::string& piece) const = 0;
  // The largest id, -1 when the vocabulary is empty.
  virtual int64_t max_id() const = 0;
};

// model.type "BPE" / "Unigram". `model` is the JSON object, `file` names the tokenizer.json in
// errors (std::invalid_argument with the JSON path).
std::unique_ptr<Model> load_bpe_model(const nlohmann::json& model, const std::string& file);
std::unique_ptr<Model> load_unigram_model(const nlohmann::json& model, const std::string& file);

// The <0xNN> piece of a byte, as byte_fallback spells it.
std::string byte_fallback_piece(uint8_t byte);

}  // namespace mfsdp::hf
