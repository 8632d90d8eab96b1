// What happens to the text of a tokenizer.json tokenizer before the model, as the tokenizers
// library does it: the normalizers (normalizers/*.rs) and pre-tokenizers (pre_tokenizers/*.rs),
// with NormalizedString::split's behaviors, and the reading of their JSON fields.
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "mfsdp/data/tokenizer.h"
#include "tokenizer_hf_parts.h"

namespace mfsdp::hf {

using nlohmann::json;

namespace {

// The regex the ByteLevel pre-tokenizer splits with when use_regex (GPT-2's).
const char kGpt2Pattern[] = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Rust's regex \w, for the library's Whitespace pre-tokenizer.
const char kRustWord[] = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control})";

// NormalizedString::split: cuts `p` at `matches` (byte spans), inverted when `invert`, and appends
// the non-empty parts to `out`.
void split_piece(const Piece& p, const std::vector<std::pair<size_t, size_t>>& matches, Behavior behavior,
                 bool invert, std::vector<Piece>& out) {
  struct Span {
    size_t start, end;
    bool match;
  };
  const std::string& t = p.text;
  std::vector<Span> spans;
  size_t prev = 0;
  for (const auto& [s, e] : matches) {
    if (prev != s) spans.push_back({prev, s, false});
    spans.push_back({s, e, true});
    prev = e;
  }
  if (prev != t.size() || t.empty()) spans.push_back({prev, t.size(), false});
  if (invert) {
    for (Span& s : spans) s.match = !s.match;
  }
  std::vector<Span> kept;  // `match` now means "remove"
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kIsolated:
      for (const Span& s : spans) kept.push_back({s.start, s.end, false});
      break;
    case Behavior::kRemoved: kept = spans; break;
    case Behavior::kContiguous:
      for (const Span& s : spans) {
        if (s.match == previous_match && !kept.empty()) {
          kept.back().end = s.end;
        } else {
          kept.push_back({s.start, s.end, false});
        }
        previous_match = s.match;
      }
      break;
    case Behavior::kMergedWithPrevious:
      for (const Span& s : spans) {
        if (s.match && !previous_match && !kept.empty()) {
          kept.back().end = s.end;
        } else {
          kept.push_back({s.start, s.end, false});
        }
        previous_match = s.match;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !kept.empty()) {
          kept.back().start = it->start;
        } else {
          kept.push_back({it->start, it->end, false});
        }
        previous_match = it->match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  for (const Span& s : kept) {
    if (s.match || s.end == s.start) continue;
    out.push_back({t.substr(s.start, s.end - s.start), head_of_slice(p, s.start, s.end), -1});
  }
}

// Maps every byte to its ByteLevel character.
void byte_level_map(Piece& p) {
  const std::array<std::string, 256>& chars = byte_level_chars();
  std::string mapped;
  mapped.reserve(p.text.size() * 2);
  size_t head = 0;
  for (size_t i = 0; i < p.text.size(); ++i) {
    mapped += chars[static_cast<uint8_t>(p.text[i])];
    if (i < p.head) head = mapped.size();
  }
  p.text = std::move(mapped);
  p.head = head;
}

}  // namespace

void replace_spans(Piece& p, const std::vector<std::pair<size_t, size_t>>& spans,
                   const std::string& content) {
  if (spans.empty()) return;
  std::string out;
  size_t head = p.head == 0 ? 0 : std::string::npos;
  size_t prev = 0;
  for (const auto& [s, e] : spans) {
    if (head == std::string::npos && p.head <= s) head = out.size() + (p.head - prev);
    out.append(p.text, prev, s - prev);
    out += content;
    if (head == std::string::npos && p.head < e) head = out.size();  // the head ends in this match
    prev = e;
  }
  if (head == std::string::npos) head = out.size() + (p.head - prev);
  out.append(p.text, prev, std::string::npos);
  p.text = std::move(out);
  p.head = head;
}

namespace {

void prepend(Piece& p, const std::string& s) {
  p.text.insert(0, s);
  if (p.head > 0) p.head += s.size();
}

// ---- normalizers ---------------------------------------------------------------------------------

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void apply(Piece& p, size_t max_bytes) const override {
    for (const auto& s : steps_) s->apply(p, max_bytes);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string s) : s_(std::move(s)) {}
  void apply(Piece& p, size_t max_bytes) const override {
    if (p.text.empty()) return;
    check_size(p.text.size() + s_.size(), max_bytes);
    prepend(p, s_);
  }

 private:
  std::string s_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(Regex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void apply(Piece& p, size_t max_bytes) const override {
    const std::vector<std::pair<size_t, size_t>> spans = pattern_.find_all(p.text);
    size_t matched = 0;
    for (const auto& [s, e] : spans) matched += e - s;
    // Counted before anything is built: a character replaced by 64 KB must not take gigabytes.
    const size_t rest = p.text.size() - matched;
    const size_t most = std::numeric_limits<size_t>::max();
    check_size(content_.empty() || spans.size() <= (most - rest) / content_.size()
                   ? rest + spans.size() * content_.size()
                   : most,
               max_bytes);
    replace_spans(p, spans, content_);
  }

 private:
  Regex pattern_;
  std::string content_;
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void apply(Piece& p, size_t /*max_bytes: it only shrinks*/) const override {
    const std::string& t = p.text;
    size_t begin = 0, end = t.size();
    if (left_) {
      while (begin < end && is_white_space(hf::utf8_code_point(t, begin)))
        begin += hf::utf8_char_len(t, begin);
    }
    if (right_) {
      while (end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(t[start]) & 0xC0) == 0x80) --start;
        if (hf::utf8_char_len(t, start) != end - start || !is_white_space(hf::utf8_code_point(t, start)))
          break;
        end = start;
      }
    }
    p.head = begin > 0 ? 0 : std::min(p.head, end);
    p.text = t.substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

class ByteLevelNormalizer : public Normalizer {
 public:
  void apply(Piece& p, size_t max_bytes) const override {
    check_size(p.text.size() * 2, max_bytes);  // at most two bytes per byte
    byte_level_map(p);
  }
};

// ---- pre-tokenizers ------------------------------------------------------------------------------

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps)
      : steps_(std::move(steps)) {}
  void apply_one(Piece p, std::vector<Piece>& out) const override {
    std::vector<Piece> pieces{std::move(p)};
    for (const auto& s : steps_) s->apply(pieces);
    for (Piece& q : pieces) out.push_back(std::move(q));
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

// Split, and the pre-tokenizers that are a split at a character class (Digits, Punctuation, ...).
class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(Regex pattern, Behavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void apply_one(Piece p, std::vector<Piece>& out) const override {
    split_piece(p, pattern_.find_all(p.text), behavior_, invert_, out);
  }

 private:
  Regex pattern_;
  Behavior behavior_;
  bool invert_;
};

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex, const std::string& where)
      : add_prefix_space_(add_prefix_space) {
    if (use_regex) regex_.emplace(kGpt2Pattern, RegexSyntax::kOniguruma, where);
  }
  void apply_one(Piece p, std::vector<Piece>& out) const override {
    if (add_prefix_space_ && p.text[0] != ' ') prepend(p, " ");
    const size_t first = out.size();
    if (regex_) {
      split_piece(p, regex_->find_all(p.text), Behavior::kIsolated, false, out);
    } else {
      out.push_back(std::move(p));
    }
    for (size_t k = first; k < out.size(); ++k) byte_level_map(out[k]);
  }

 private:
  bool add_prefix_space_;
  std::optional<Regex> regex_;
};

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void apply_one(Piece p, std::vector<Piece>& out) const override {
    std::vector<std::pair<size_t, size_t>> spaces;
    for (size_t i = 0; i < p.text.size(); ++i)
      if (p.text[i] == ' ') spaces.emplace_back(i, i + 1);
    replace_spans(p, spaces, replacement_);
    const bool starts = p.text.compare(0, replacement_.size(), replacement_) == 0;
    if (!starts && (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && p.head > 0))) {
      prepend(p, replacement_);
    }
    if (!split_) {
      out.push_back(std::move(p));
      return;
    }
    std::vector<std::pair<size_t, size_t>> marks;
    for (size_t i = p.text.find(replacement_); i != std::string::npos;
         i = p.text.find(replacement_, i + replacement_.size()))
      marks.emplace_back(i, i + replacement_.size());
    split_piece(p, marks, Behavior::kMergedWithNext, false, out);
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

}  // namespace

// ---- shared --------------------------------------------------------------------------------------

std::string describe(const json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

const std::array<std::string, 256>& byte_level_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    for (int b = 0; b < 256; ++b) append_utf8(gpt2_byte_to_unicode(static_cast<uint8_t>(b)), t[b]);
    return t;
  }();
  return table;
}
const std::unordered_map<uint32_t, uint8_t>& byte_level_bytes() {
  static const std::unordered_map<uint32_t, uint8_t> table = [] {
    std::unordered_map<uint32_t, uint8_t> t;
    for (int b = 0; b < 256; ++b) t[gpt2_byte_to_unicode(static_cast<uint8_t>(b))] = static_cast<uint8_t>(b);
    return t;
  }();
  return table;
}

void PreTokenizer::apply(std::vector<Piece>& pieces) const {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& p : pieces) {
    if (p.id >= 0) {
      out.push_back(std::move(p));
    } else {
      apply_one(std::move(p), out);
    }
  }
  pieces.swap(out);
}

// ---- JSON fields ---------------------------------------------------------------------------------

void JsonReader::refuse(const std::string& at, const std::string& what) const {
  throw std::invalid_argument(file_ + ": " + (at.empty() ? "" : at + ": ") + what);
}

std::string JsonReader::string_field(const json& o, const char* key, const std::string& at,
                                     const char* fallback) const {
  const json v = o.value(key, json());
  if (v.is_null() && fallback != nullptr) return fallback;
  if (!v.is_string()) refuse(at + "." + key, "expected a string, found " + describe(v));
  return v.get<std::string>();
}

bool JsonReader::bool_field(const json& o, const char* key, const std::string& at, bool fallback) const {
  const json v = o.value(key, json());
  if (v.is_null()) return fallback;
  if (!v.is_boolean()) refuse(at + "." + key, "expected true or false, found " + describe(v));
  return v.get<bool>();
}

uint32_t JsonReader::char_field(const json& o, const char* key, const std::string& at) const {
  const std::string s = string_field(o, key, at);
  if (s.empty() || hf::utf8_char_len(s, 0) != s.size() || hf::utf8_code_point(s, 0) == 0xFFFFFFFFu) {
    refuse(at + "." + key, "expected one character, found " + describe(json(s)));
  }
  return hf::utf8_code_point(s, 0);
}

Regex JsonReader::pattern_field(const json& o, const std::string& at) const {
  const json p = o.value("pattern", json());
  if (p.is_object() && p.size() == 1 && p.contains("Regex") && p["Regex"].is_string()) {
    return Regex(p["Regex"].get<std::string>(), RegexSyntax::kOniguruma, where(at + ".pattern.Regex"));
  }
  if (p.is_object() && p.size() == 1 && p.contains("String") && p["String"].is_string()) {
    return Regex(p["String"].get<std::string>(), RegexSyntax::kLiteral, where(at + ".pattern.String"));
  }
  refuse(at + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}, found " + describe(p));
}

Behavior JsonReader::behavior_field(const json& o, const std::string& at, Behavior fallback) const {
  const json v = o.value("behavior", json());
  if (v.is_null()) return fallback;
  static const std::pair<const char*, Behavior> kNames[] = {
      {"Removed", Behavior::kRemoved},
      {"Isolated", Behavior::kIsolated},
      {"MergedWithPrevious", Behavior::kMergedWithPrevious},
      {"MergedWithNext", Behavior::kMergedWithNext},
      {"Contiguous", Behavior::kContiguous}};
  for (const auto& [name, b] : kNames)
    if (v == name) return b;
  refuse(at + ".behavior", "unknown behavior " + describe(v) +
                               " (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
}

PrependScheme JsonReader::prepend_scheme_field(const json& o, const std::string& at) const {
  PrependScheme scheme = PrependScheme::kAlways;
  const json v = o.value("prepend_scheme", json());
  if (v == "first") {
    scheme = PrependScheme::kFirst;
  } else if (v == "never") {
    scheme = PrependScheme::kNever;
  } else if (!(v.is_null() || v == "always")) {
    refuse(at + ".prepend_scheme", "expected \"first\", \"always\" or \"never\", found " + describe(v));
  }
  const json add = o.value("add_prefix_space", json());
  if (add == false) {
    if (scheme != PrependScheme::kNever) {
      refuse(at + ".add_prefix_space", "false contradicts prepend_scheme " + describe(v));
    }
    scheme = PrependScheme::kNever;
  }
  return scheme;
}

// ---- loading ---------------------------------------------------------------------------------------

void Normalizer::check_size(size_t bytes, size_t max_bytes) const {
  if (bytes <= max_bytes) return;
  throw std::runtime_error(where + ": the normalized text would be " +
                           (bytes == std::numeric_limits<size_t>::max() ? std::string("too many")
                                                                        : std::to_string(bytes)) +
                           " bytes, more than the " + std::to_string(max_bytes) +
                           " bytes a segment of this text may grow to (64 times its size plus 64 KiB: "
                           "the cap on normalizer expansion, docs/data.md)");
}

size_t normalized_size_limit(size_t bytes) {
  constexpr size_t kFactor = 64, kSlack = size_t{64} << 10;
  return bytes > (std::numeric_limits<size_t>::max() - kSlack) / kFactor ? std::numeric_limits<size_t>::max()
                                                                            : bytes * kFactor + kSlack;
}

namespace {

std::unique_ptr<Normalizer> make_normalizer(const JsonReader& r, const json& n, const std::string& at) {
  const json type = n.value("type", json());
  if (type == "Sequence") {
    return std::make_unique<SequenceNormalizer>(r.list_field<Normalizer>(
        n, "normalizers", at, [&](const json& s, const std::string& a) { return load_normalizer(r, s, a); }));
  }
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(r.string_field(n, "prepend", at));
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(r.pattern_field(n, at), r.string_field(n, "content", at));
  }
  if (type == "Strip") {
    return std::make_unique<StripNormalizer>(r.bool_field(n, "strip_left", at, true),
                                             r.bool_field(n, "strip_right", at, true));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelNormalizer>();
  if (type.is_string()) {
    if (auto unicode = load_unicode_normalizer(r, n, type.get<std::string>(), at)) return unicode;
  }
  r.refuse(at + ".type", "unsupported normalizer " + describe(type) +
                             " (supported: Sequence, NFC, NFD, NFKC, NFKD, Lowercase, StripAccents, "
                             "BertNormalizer, Nmt, Precompiled, Prepend, Replace, Strip, ByteLevel)");
}

}  // namespace

std::unique_ptr<Normalizer> load_normalizer(const JsonReader& r, const json& n, const std::string& at) {
  if (n.is_null()) return nullptr;
  if (!n.is_object()) r.refuse(at, "expected an object, found " + describe(n));
  std::unique_ptr<Normalizer> made = make_normalizer(r, n, at);
  made->where = r.where(at);
  return made;
}

std::unique_ptr<PreTokenizer> load_pre_tokenizer(const JsonReader& r, const json& p, const std::string& at) {
  if (p.is_null()) return nullptr;
  if (!p.is_object()) r.refuse(at, "expected an object, found " + describe(p));
  const json type = p.value("type", json());
  auto split = [&](const std::string& pcre2, Behavior b, bool invert) {
    return std::make_unique<SplitPreTokenizer>(Regex(pcre2, RegexSyntax::kPcre2, r.where(at)), b, invert);
  };
  // Rust's char::is_ascii_punctuation or Unicode's P* (the library's Punctuation predicate).
  const std::string punctuation = R"([\p{P}!-/:-@\[-`{-~])";
  if (type == "Sequence") {
    return std::make_unique<SequencePreTokenizer>(r.list_field<PreTokenizer>(
        p, "pretokenizers", at,
        [&](const json& s, const std::string& a) { return load_pre_tokenizer(r, s, a); }));
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(r.bool_field(p, "add_prefix_space", at, false),
                                                   r.bool_field(p, "use_regex", at, true), r.where(at));
  }
  if (type == "Split") {
    const json behavior = p.value("behavior", json());
    if (behavior.is_null()) r.refuse(at + ".behavior", "missing");
    return std::make_unique<SplitPreTokenizer>(r.pattern_field(p, at),
                                               r.behavior_field(p, at, Behavior::kIsolated),
                                               r.bool_field(p, "invert", at, false));
  }
  if (type == "Metaspace") {
    std::string replacement;
    hf::append_utf8(r.char_field(p, "replacement", at), replacement);
    return std::make_unique<MetaspacePreTokenizer>(replacement, r.prepend_scheme_field(p, at),
                                                   r.bool_field(p, "split", at, true));
  }
  if (type == "Digits") {
    return split(
        R"(\p{N})",
        r.bool_field(p, "individual_digits", at, false) ? Behavior::kIsolated : Behavior::kContiguous, false);
  }
  if (type == "WhitespaceSplit") return split(R"(\p{White_Space})", Behavior::kRemoved, false);
  if (type == "Whitespace") {
    return split(std::string("[") + kRustWord + "]+|[^" + kRustWord + R"(\p{White_Space}]+)",
                 Behavior::kRemoved, true);
  }
  if (type == "Punctuation") return split(punctuation, r.behavior_field(p, at, Behavior::kIsolated), false);
  if (type == "CharDelimiterSplit") {
    std::string delimiter;
    hf::append_utf8(r.char_field(p, "delimiter", at), delimiter);
    return std::make_unique<SplitPreTokenizer>(Regex(delimiter, RegexSyntax::kLiteral, r.where(at)),
                                               Behavior::kRemoved, false);
  }
  if (type == "BertPreTokenizer") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    steps.push_back(split(R"(\p{White_Space})", Behavior::kRemoved, false));
    steps.push_back(split(punctuation, Behavior::kIsolated, false));
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  r.refuse(at + ".type", "unsupported pre-tokenizer " + describe(type) +
                             " (supported: Sequence, Split, ByteLevel, Metaspace, Digits, "
                             "Whitespace, WhitespaceSplit, Punctuation, CharDelimiterSplit, "
                             "BertPreTokenizer)");
}

}  // namespace mfsdp::hf
