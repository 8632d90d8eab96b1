// The tokenizer.json normalizers that need Unicode's tables (NFC, NFD, NFKC, NFKD, Lowercase,
// StripAccents, BertNormalizer; Nmt, a character map, beside them) and SentencePiece's precompiled charsmaps (Precompiled), as the
// tokenizers library applies them (normalizers/unicode.rs, strip.rs, bert.rs, precompiled.rs and
// NormalizedString::lowercase). The tables come from utf8proc (Debian's libutf8proc-dev: normal
// forms, simple case mappings, general categories, grapheme clusters), not from tables of ours.
//
// Precompiled is read here, not through libsentencepiece: that library cannot be loaded into the
// programs that link LibTorch (CMakeLists.txt: its bundled protobuf), its normalizer takes the
// charsmap only inside a protobuf NormalizerSpec, and it replaces the longest matching prefix
// where the tokenizers library replaces the shortest match of each whole grapheme cluster. So
// the lookup in the charsmap (darts-clone's double-array trie: a few lines) and the base64 of the
// JSON field are written here.
//
// A normalizer maps each character (or grapheme) to its output in order, so the head of a piece
// ([Note: the first piece] in tokenizer_hf_parts.h) is what the characters of its head became.
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tokenizer_hf_parts.h"

namespace mfsdp::hf {
namespace {

using nlohmann::json;

// Maps each character of `p` by `f(code point, its bytes, out)` (an invalid byte comes as code
// point 0xFFFFFFFF and should be copied), checking the size as it grows.
template <class F>
void map_characters(const Normalizer& n, Piece& p, size_t max_bytes, F f) {
  std::string out;
  out.reserve(p.text.size());
  size_t head = 0;
  for (size_t i = 0; i < p.text.size();) {
    const size_t len = utf8_char_len(p.text, i);
    f(utf8_code_point(p.text, i), std::string_view(p.text).substr(i, len), out);
    if (i < p.head) head = out.size();
    i += len;
    n.check_size(out.size(), max_bytes);
  }
  p.text = std::move(out);
  p.head = head;
}

// utf8proc_map over the valid UTF-8 runs of `text` (the library never sees invalid bytes: they
// are copied).
std::string utf8proc_normalize(std::string_view text, utf8proc_option_t options) {
  std::string out;
  size_t run = 0;
  auto flush = [&](size_t end) {
    if (end == run) return;
    utf8proc_uint8_t* mapped = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + run),
                                            static_cast<utf8proc_ssize_t>(end - run), &mapped, options);
    if (n < 0) throw std::runtime_error(std::string("utf8proc: ") + utf8proc_errmsg(n));
    out.append(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
    std::free(mapped);
  };
  for (size_t i = 0; i < text.size();) {
    const size_t len = utf8_char_len(text, i);
    if (utf8_code_point(text, i) == 0xFFFFFFFFu) {
      flush(i);
      out += text[i];
      run = i + 1;
    }
    i += len;
  }
  flush(text.size());
  return out;
}

// NFC, NFD, NFKC, NFKD.
class NormalForm : public Normalizer {
 public:
  explicit NormalForm(utf8proc_option_t options) : options_(options) {}
  void apply(Piece& p, size_t max_bytes) const override {
    // A character becomes at most 18 under any normal form (U+FDFA), 4 bytes each: counted
    // before utf8proc allocates.
    if (p.text.size() > max_bytes / 18) check_size(utf8proc_decompose_bound(p.text), max_bytes);
    std::string out = utf8proc_normalize(p.text, options_);
    check_size(out.size(), max_bytes);
    if (p.head > 0) {
      // What the head's characters became; composition with the character after the head can
      // only lengthen the first output character, which still begins at offset 0.
      p.head = std::max<size_t>(1, std::min(out.size(), utf8proc_normalize(p.text.substr(0, p.head), options_).size()));
      if (out.empty()) p.head = 0;
    }
    p.text = std::move(out);
  }

 private:
  static size_t utf8proc_decompose_bound(const std::string& text) {
    size_t chars = 0;
    for (size_t i = 0; i < text.size(); i += utf8_char_len(text, i)) ++chars;
    return chars * 18 * 4;
  }
  utf8proc_option_t options_;
};

// Rust's char::to_lowercase: Unicode's simple lowercase mapping, and İ (U+0130), the one
// character SpecialCasing.txt lowercases to two unconditionally, to "i̇".
void append_lowercase(uint32_t cp, std::string_view bytes, std::string& out) {
  if (cp == 0xFFFFFFFFu) {
    out.append(bytes);
  } else if (cp == 0x130) {
    out += "i\xCC\x87";
  } else {
    append_utf8(static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))), out);
  }
}

bool is_mark(uint32_t cp) {
  const utf8proc_category_t c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return c == UTF8PROC_CATEGORY_MN || c == UTF8PROC_CATEGORY_MC || c == UTF8PROC_CATEGORY_ME;
}

class Lowercase : public Normalizer {
 public:
  void apply(Piece& p, size_t max_bytes) const override {
    map_characters(*this, p, max_bytes, append_lowercase);
  }
};

// Drops the combining marks (General_Category M: Mn, Mc, Me), as strip.rs's is_combining_mark.
class StripAccents : public Normalizer {
 public:
  void apply(Piece& p, size_t max_bytes) const override {
    map_characters(
        *this, p, max_bytes,
        [](uint32_t cp, std::string_view bytes, std::string& out) {
          if (cp == 0xFFFFFFFFu || !is_mark(cp)) out.append(bytes);
        });
  }
};

// bert.rs: clean_text drops NUL, U+FFFD and the "other" characters (Cc, Cf, Cn, Co, Cs) but
// tab, newline and carriage return, and turns white space into " "; handle_chinese_chars puts
// spaces around CJK ideographs; strip_accents (by default as lowercase) is NFD then no Mn;
// lowercase as Lowercase.
class BertNormalizer : public Normalizer {
 public:
  BertNormalizer(bool clean_text, bool chinese, bool strip_accents, bool lowercase)
      : clean_text_(clean_text), chinese_(chinese), strip_accents_(strip_accents), lowercase_(lowercase) {}
  void apply(Piece& p, size_t max_bytes) const override {
    if (clean_text_) {
      map_characters(
          *this, p, max_bytes,
          [](uint32_t cp, std::string_view bytes, std::string& out) {
            const bool kept_control = cp == '\t' || cp == '\n' || cp == '\r';
            if (cp == 0xFFFFFFFFu) {
              out.append(bytes);
            } else if (cp == 0 || cp == 0xFFFD || (is_other(cp) && !kept_control)) {
              // dropped (before white space is mapped: U+0085 is a control)
            } else if (kept_control || is_white_space(cp)) {
              out += ' ';
            } else {
              out.append(bytes);
            }
          });
    }
    if (chinese_) {
      map_characters(
          *this, p, max_bytes,
          [](uint32_t cp, std::string_view bytes, std::string& out) {
            const bool cjk = cp != 0xFFFFFFFFu && is_chinese(cp);
            if (cjk) out += ' ';
            out.append(bytes);
            if (cjk) out += ' ';
          });
    }
    if (strip_accents_) {
      NormalForm(UTF8PROC_DECOMPOSE).apply(p, max_bytes);
      map_characters(
          *this, p, max_bytes,
          [](uint32_t cp, std::string_view bytes, std::string& out) {
            if (cp == 0xFFFFFFFFu ||
                utf8proc_category(static_cast<utf8proc_int32_t>(cp)) != UTF8PROC_CATEGORY_MN) {
              out.append(bytes);
            }
          });
    }
    if (lowercase_) map_characters(*this, p, max_bytes, append_lowercase);
  }

 private:
  static bool is_other(uint32_t cp) {
    switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
      case UTF8PROC_CATEGORY_CC:
      case UTF8PROC_CATEGORY_CF:
      case UTF8PROC_CATEGORY_CN:
      case UTF8PROC_CATEGORY_CO:
      case UTF8PROC_CATEGORY_CS: return true;
      default: return false;
    }
  }
  // bert.rs's "CJK Unicode block" ranges (they are not Unicode data: BERT's own choice).
  static bool is_chinese(uint32_t cp) {
    return (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3400 && cp <= 0x4DBF) || (cp >= 0x20000 && cp <= 0x2A6DF) ||
           (cp >= 0x2A700 && cp <= 0x2B73F) || (cp >= 0x2B740 && cp <= 0x2B81F) ||
           (cp >= 0x2B920 && cp <= 0x2CEAF) || (cp >= 0xF900 && cp <= 0xFAFF) || (cp >= 0x2F800 && cp <= 0x2FA1F);
  }
  bool clean_text_, chinese_, strip_accents_, lowercase_;
};

// SentencePiece's nmt rule as the library spells it (unicode.rs): ASCII controls but tab, line
// feed, form feed and carriage return (and U+008F, U+009F) dropped; those four and other
// invisible separators become " ".
class Nmt : public Normalizer {
 public:
  void apply(Piece& p, size_t max_bytes) const override {
    map_characters(*this, p, max_bytes, [](uint32_t cp, std::string_view bytes, std::string& out) {
      if ((cp >= 0x01 && cp <= 0x08) || cp == 0x0B || (cp >= 0x0E && cp <= 0x1F) || cp == 0x7F || cp == 0x8F ||
          cp == 0x9F) {
        return;
      }
      if (cp == 0x09 || cp == 0x0A || cp == 0x0C || cp == 0x0D || cp == 0x1680 || (cp >= 0x200B && cp <= 0x200F) ||
          cp == 0x2028 || cp == 0x2029 || cp == 0x2581 || cp == 0xFEFF || cp == 0xFFFD) {
        out += ' ';
        return;
      }
      out.append(bytes);
    });
  }
};

// RFC 4648 base64, as serde writes Precompiled's precompiled_charsmap; nullopt when malformed.
std::optional<std::string> base64_decode(const std::string& in) {
  std::array<int, 256> value;
  value.fill(-1);
  const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (int k = 0; k < 64; ++k) value[static_cast<unsigned char>(alphabet[k])] = k;
  if (in.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (size_t i = 0; i < in.size(); i += 4) {
    uint32_t bits = 0;
    int pad = 0;
    for (size_t k = 0; k < 4; ++k) {
      const unsigned char c = static_cast<unsigned char>(in[i + k]);
      if (c == '=' && i + 4 == in.size() && k >= 2) {
        ++pad;
        bits <<= 6;
        continue;
      }
      if (value[c] < 0 || pad > 0) return std::nullopt;
      bits = (bits << 6) | static_cast<uint32_t>(value[c]);
    }
    out += static_cast<char>(bits >> 16);
    if (pad < 2) out += static_cast<char>((bits >> 8) & 0xFF);
    if (pad < 1) out += static_cast<char>(bits & 0xFF);
  }
  return out;
}

// A SentencePiece precompiled charsmap: a little-endian u32 byte size of the trie, the trie
// (darts-clone double-array units), then the replacement strings, each ended by NUL.
class Precompiled : public Normalizer {
 public:
  Precompiled(const std::string& blob, const std::string& where_blob) {
    auto bad = [&](const std::string& why) {
      throw std::invalid_argument(where_blob + ": not a SentencePiece precompiled charsmap: " + why);
    };
    if (blob.empty()) return;  // an empty charsmap maps nothing (the library's too)
    if (blob.size() < 4) bad("shorter than its 4-byte header");
    uint32_t trie_bytes = 0;
    for (int k = 3; k >= 0; --k) trie_bytes = (trie_bytes << 8) | static_cast<unsigned char>(blob[k]);
    if (trie_bytes % 4 != 0 || trie_bytes > blob.size() - 4) {
      bad("its trie of " + std::to_string(trie_bytes) + " bytes does not fit in " + std::to_string(blob.size()) +
          " bytes");
    }
    units_.resize(trie_bytes / 4);
    for (size_t u = 0; u < units_.size(); ++u) {
      uint32_t v = 0;
      for (int k = 3; k >= 0; --k) v = (v << 8) | static_cast<unsigned char>(blob[4 + u * 4 + k]);
      units_[u] = v;
    }
    strings_ = blob.substr(4 + trie_bytes);
    // The library refuses replacements that are not UTF-8; a value pointing outside them is
    // checked where it is used.
    if (utf8_lossy(strings_) != strings_) bad("its replacement strings are not UTF-8");
  }

  void apply(Piece& p, size_t max_bytes) const override {
    if (units_.empty()) return;
    const std::string& t = p.text;
    std::string out;
    out.reserve(t.size());
    size_t head = 0;
    // Each extended grapheme cluster (utf8proc's UAX #29 rules, as unicode-segmentation's).
    size_t start = 0;
    utf8proc_int32_t state = 0;
    uint32_t previous = 0;
    auto emit_cluster = [&](size_t begin, size_t end) {
      const std::string_view g = std::string_view(t).substr(begin, end - begin);
      const std::optional<std::string_view> whole = g.size() < 6 ? lookup(g) : std::nullopt;
      if (whole) {
        out += *whole;
      } else {
        for (size_t i = 0; i < g.size();) {
          const size_t len = utf8_char_len(g, i);
          if (const std::optional<std::string_view> one = lookup(g.substr(i, len))) {
            out += *one;
          } else {
            out.append(g, i, len);
          }
          i += len;
        }
      }
      if (begin < p.head) head = out.size();
      check_size(out.size(), max_bytes);
    };
    for (size_t i = 0; i < t.size();) {
      const size_t len = utf8_char_len(t, i);
      const uint32_t cp = utf8_code_point(t, i);
      // An invalid byte is a cluster of its own (the library never sees one).
      const bool invalid = cp == 0xFFFFFFFFu;
      if (i > start &&
          (invalid || previous == 0xFFFFFFFFu ||
           utf8proc_grapheme_break_stateful(static_cast<utf8proc_int32_t>(previous),
                                            static_cast<utf8proc_int32_t>(cp), &state))) {
        emit_cluster(start, i);
        start = i;
      }
      previous = cp;
      i += len;
    }
    if (start < t.size()) emit_cluster(start, t.size());
    p.text = std::move(out);
    p.head = head;
  }

 private:
  // darts-clone's unit fields.
  static bool has_leaf(uint32_t u) { return ((u >> 8) & 1) != 0; }
  static uint32_t value(uint32_t u) { return u & ((1u << 31) - 1); }
  static uint32_t label(uint32_t u) { return u & ((1u << 31) | 0xFF); }
  static size_t offset(uint32_t u) { return static_cast<size_t>(u >> 10) << ((u & (1u << 9)) >> 6); }

  // The replacement of the shortest key that is a prefix of `key` (the first result of
  // darts-clone's commonPrefixSearch, as precompiled.rs takes), or null.
  std::optional<std::string_view> lookup(std::string_view key) const {
    size_t node = offset(units_[0]);
    for (const char ch : key) {
      const auto c = static_cast<unsigned char>(ch);
      if (c == 0) return std::nullopt;
      node ^= c;
      if (node >= units_.size() || label(units_[node]) != c) return std::nullopt;
      const uint32_t unit = units_[node];
      node ^= offset(unit);
      if (has_leaf(unit)) {
        if (node >= units_.size()) return std::nullopt;
        const size_t at = value(units_[node]);
        if (at >= strings_.size()) return std::nullopt;
        const size_t end = strings_.find('\0', at);
        return std::string_view(strings_).substr(at, (end == std::string::npos ? strings_.size() : end) - at);
      }
    }
    return std::nullopt;
  }

  std::vector<uint32_t> units_;
  std::string strings_;
};

}  // namespace

std::unique_ptr<Normalizer> load_unicode_normalizer(const JsonReader& r, const json& n, const std::string& type,
                                                    const std::string& at) {
  const auto compose = static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  const auto decompose = static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
  if (type == "NFC") return std::make_unique<NormalForm>(compose);
  if (type == "NFD") return std::make_unique<NormalForm>(decompose);
  if (type == "NFKC") return std::make_unique<NormalForm>(static_cast<utf8proc_option_t>(compose | UTF8PROC_COMPAT));
  if (type == "NFKD") {
    return std::make_unique<NormalForm>(static_cast<utf8proc_option_t>(decompose | UTF8PROC_COMPAT));
  }
  if (type == "Lowercase") return std::make_unique<Lowercase>();
  if (type == "Nmt") return std::make_unique<Nmt>();
  if (type == "StripAccents") return std::make_unique<StripAccents>();
  if (type == "BertNormalizer") {
    const bool lowercase = r.bool_field(n, "lowercase", at, true);
    return std::make_unique<BertNormalizer>(r.bool_field(n, "clean_text", at, true),
                                            r.bool_field(n, "handle_chinese_chars", at, true),
                                            r.bool_field(n, "strip_accents", at, lowercase), lowercase);
  }
  if (type == "Precompiled") {
    const std::string field = r.string_field(n, "precompiled_charsmap", at);
    const std::optional<std::string> blob = base64_decode(field);
    if (!blob) r.refuse(at + ".precompiled_charsmap", "not base64");
    return std::make_unique<Precompiled>(*blob, r.where(at + ".precompiled_charsmap"));
  }
  return nullptr;
}

}  // namespace mfsdp::hf
