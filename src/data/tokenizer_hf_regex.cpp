// The regexes of tokenizer.json files (Split pre-tokenizers, Replace normalizers and decoders,
// ByteLevel's own regex) run by PCRE2, a well-kept library with Unicode properties, instead of an
// engine of our own: earlier we matched three known patterns by string equality and ran them by
// hand over a Unicode table frozen in the source, so any other pattern was refused.
//
// The tokenizers library compiles these patterns with Oniguruma in its Ruby-like syntax. PCRE2
// (UTF mode, Unicode properties) reads most of that syntax the same way; oniguruma_to_pcre2
// rewrites what it reads differently and refuses what has no faithful rewrite:
//   - \s \S: Unicode's White_Space, as Oniguruma (PCRE2 also counts U+180E);
//   - \w \W \b \B: Oniguruma's word characters are Alphabetic, marks, decimal digits and
//     connector punctuation (PCRE2: letters, numbers and "_");
//   - \h \H: hex digits (PCRE2: horizontal space); \v: U+000B (PCRE2: vertical space);
//     \uHHHH: a code point (PCRE2 has no \u);
//   - ^ $: always line anchors (Ruby), so PCRE2's multiline mode; (?m) is Ruby's "dot matches
//     newline", PCRE2's (?s); a{,n} is a{0,n};
//   - refused: a{n,m}+ (a repeat of a repeat in Ruby, possessive in PCRE2), nested classes,
//     class intersections (&&) and [:posix:] classes, \K \G \X \Q \E and the like, option
//     letters other than i, m, x, conditionals and absent operators.
// Left as a documented difference: Oniguruma's (?i) also matches multi-character case foldings
// (ß for "ss"), and the Unicode version (Debian's PCRE2 10.42 has Unicode 14, the library's
// Oniguruma 16), so characters assigned since Unicode 15 count as unassigned here.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "tokenizer_hf_parts.h"

namespace mfsdp::hf {
namespace {

// Oniguruma's \w for Unicode text, as the body of a character class.
constexpr const char* kWordBody = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}";

bool is_hex(char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; }

[[noreturn]] void refuse(const std::string& why) { throw std::invalid_argument(why); }

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

}  // namespace

std::string oniguruma_to_pcre2(const std::string& p) {
  const std::string word_class = std::string("[") + kWordBody + "]";
  const std::string not_word_class = std::string("[^") + kWordBody + "]";
  std::string out;
  bool in_class = false;
  size_t class_body = 0;        // index in p of the first character of the class body
  bool after_interval = false;  // the last thing written was a {n,m} quantifier
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    const bool interval_before = after_interval;
    after_interval = false;
    if (c == '\\') {
      if (i + 1 == p.size()) refuse("the pattern ends with a lone backslash");
      const char e = p[++i];
      switch (e) {
        case 's': out += "\\p{White_Space}"; break;
        case 'S': out += "\\P{White_Space}"; break;
        case 'w': out += in_class ? std::string(kWordBody) : word_class; break;
        case 'W':
          if (in_class) refuse("\\W inside a character class has no PCRE2 spelling");
          out += not_word_class;
          break;
        case 'b':
          // In a class \b is a backspace in both.
          out += in_class ? std::string("\\b")
                          : "(?:(?<=" + word_class + ")(?!" + word_class + ")|(?<!" + word_class +
                                ")(?=" + word_class + "))";
          break;
        case 'B':
          if (in_class) refuse("\\B inside a character class");
          out += "(?:(?<=" + word_class + ")(?=" + word_class + ")|(?<!" + word_class + ")(?!" + word_class +
                 "))";
          break;
        case 'h': out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]"; break;
        case 'H':
          if (in_class) refuse("\\H inside a character class has no PCRE2 spelling");
          out += "[^0-9a-fA-F]";
          break;
        case 'v': out += "\\x{0B}"; break;
        case 'u':
          if (i + 4 >= p.size() || !is_hex(p[i + 1]) || !is_hex(p[i + 2]) || !is_hex(p[i + 3]) ||
              !is_hex(p[i + 4])) {
            refuse("\\u must be followed by four hex digits");
          }
          out += "\\x{" + p.substr(i + 1, 4) + "}";
          i += 4;
          break;
        default:
          // Escapes that mean the same in both: classes, anchors, control characters, code
          // points (\x \o \c), properties, back-references and subroutine calls.
          if (e != '\0' && std::strchr("dDaefnrtAzZRNxcopPkg0123456789", e) != nullptr) {
            out += '\\';
            out += e;
            break;
          }
          if (std::isalnum(static_cast<unsigned char>(e))) {
            refuse(std::string("the escape \\") + e + " means something else in PCRE2 or is not supported");
          }
          out += '\\';  // an escaped punctuation character (or the first byte of one) is literal
          out += e;
      }
      continue;
    }
    if (in_class) {
      if (c == ']' && i > class_body) {
        in_class = false;
      } else if (c == '[') {
        refuse("'[' inside a character class (Oniguruma's nested classes and [:posix:] classes)");
      } else if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') {
        refuse("class intersection '&&'");
      }
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      class_body = i + 1 < p.size() && p[i + 1] == '^' ? i + 2 : i + 1;
      out += c;
      continue;
    }
    if (c == '(' && i + 1 < p.size() && p[i + 1] == '?') {
      if (i + 2 >= p.size()) refuse("unterminated group");
      const char k = p[i + 2];
      if (k == ':' || k == '=' || k == '!' || k == '>' || k == '<' || k == '\'' || k == '#') {
        out += "(?";
        ++i;
        continue;  // the next character is copied as it is
      }
      // Options: (?imx-imx) or (?imx-imx:...).
      size_t j = i + 2;
      std::string options;
      while (j < p.size() && (std::isalpha(static_cast<unsigned char>(p[j])) || p[j] == '-')) {
        const char o = p[j];
        if (o == 'm') {
          options += 's';
        } else if (o == 'i' || o == 'x' || o == '-') {
          options += o;
        } else {
          refuse(std::string("the group option '") + o + "' (supported: i, m, x)");
        }
        ++j;
      }
      if (options.empty() || j >= p.size() || (p[j] != ':' && p[j] != ')')) {
        refuse(std::string("the group (?") + k + " is not supported");
      }
      out += "(?" + options + p[j];
      i = j;
      continue;
    }
    if (c == '{') {
      // {n}, {n,}, {n,m} and Oniguruma's {,m}; anything else is a literal brace in both.
      size_t j = i + 1;
      while (j < p.size() && std::isdigit(static_cast<unsigned char>(p[j]))) ++j;
      const bool lower = j > i + 1;
      bool upper = false;
      if (j < p.size() && p[j] == ',') {
        ++j;
        const size_t digits = j;
        while (j < p.size() && std::isdigit(static_cast<unsigned char>(p[j]))) ++j;
        upper = j > digits;
      }
      if (j < p.size() && p[j] == '}' && (lower || upper)) {
        out += lower ? p.substr(i, j + 1 - i) : "{0" + p.substr(i + 1, j - i);
        i = j;
        after_interval = true;
        continue;
      }
    }
    if (c == '+' && interval_before) {
      refuse("a{n,m}+ (a repeated repeat in Oniguruma, possessive in PCRE2); write (?:a{n,m})+");
    }
    out += c;
  }
  return out;
}

struct Regex::Impl {
  pcre2_code* code = nullptr;
  std::string where;
  ~Impl() {
    if (code != nullptr) pcre2_code_free(code);
  }
};

Regex::Regex(const std::string& pattern, RegexSyntax syntax, std::string where)
    : impl_(std::make_unique<Impl>()) {
  impl_->where = std::move(where);
  std::string compiled = pattern;
  uint32_t options = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
  if (syntax == RegexSyntax::kLiteral) {
    options |= PCRE2_LITERAL;  // which takes no PCRE2_UCP; a literal needs no classes
  } else {
    options |= PCRE2_UCP;
  }
  if (syntax == RegexSyntax::kOniguruma) {
    try {
      compiled = oniguruma_to_pcre2(pattern);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(impl_->where + ": unsupported regex \"" + pattern + "\": " + e.what());
    }
    options |= PCRE2_MULTILINE;
  }
  std::unique_ptr<pcre2_compile_context, decltype(&pcre2_compile_context_free)> context(
      pcre2_compile_context_create(nullptr), &pcre2_compile_context_free);
  pcre2_set_newline(context.get(), PCRE2_NEWLINE_LF);  // Oniguruma's newline is "\n" alone
  int error = 0;
  PCRE2_SIZE offset = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(), options, &error,
                              &offset, context.get());
  if (impl_->code == nullptr) {
    throw std::invalid_argument(impl_->where + ": regex \"" + pattern +
                                "\" does not compile in PCRE2: " + pcre2_message(error) + " (at offset " +
                                std::to_string(offset) + " of \"" + compiled + "\")");
  }
  // JIT makes matching several times faster; without it (no JIT on this CPU) PCRE2 interprets.
  pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> spans;
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(impl_->code, nullptr), &pcre2_match_data_free);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t search_from = 0;
  bool matched_before = false;
  size_t last_match_end = 0;
  while (search_from <= text.size()) {
    int rc = pcre2_match(impl_->code, subject, text.size(), search_from, 0, data.get(), nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // The JIT's small default stack; the interpreter keeps its backtracking on the heap.
      rc = pcre2_match(impl_->code, subject, text.size(), search_from, PCRE2_NO_JIT, data.get(), nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      throw std::runtime_error(impl_->where + ": matching the regex failed: " + pcre2_message(rc) +
                               " (text of " + std::to_string(text.size()) + " bytes)");
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t start = ovector[0];
    const size_t end = ovector[1];
    if (start == end && matched_before && last_match_end == end) {
      search_from += search_from < text.size() ? utf8_char_len(text, search_from) : 1;
      continue;
    }
    search_from = end;
    matched_before = true;
    last_match_end = end;
    spans.emplace_back(start, end);
  }
  return spans;
}

// ---- UTF-8 ---------------------------------------------------------------------------------------

size_t utf8_char_len(std::string_view text, size_t i) {
  const auto b0 = static_cast<unsigned char>(text[i]);
  if (b0 < 0x80) return 1;
  size_t n;
  uint32_t min;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
    min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 3;
    min = 0x800;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    min = 0x10000;
  } else {
    return 1;
  }
  if (i + n > text.size()) return 1;
  uint32_t cp = b0 & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(text[i + k]);
    if ((b & 0xC0) != 0x80) return 1;
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return 1;
  return n;
}

uint32_t utf8_code_point(std::string_view text, size_t i) {
  const size_t n = utf8_char_len(text, i);
  const auto b0 = static_cast<unsigned char>(text[i]);
  if (n == 1) return b0 < 0x80 ? b0 : 0xFFFFFFFFu;
  uint32_t cp = b0 & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3F);
  return cp;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string utf8_lossy(std::string_view bytes) {
  // Unicode's "maximal subpart" rule, which Rust follows: an invalid sequence is replaced up to
  // the first byte that cannot continue it.
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const size_t n = utf8_char_len(bytes, i);
    const auto b0 = static_cast<unsigned char>(bytes[i]);
    if (n > 1 || b0 < 0x80) {
      out.append(bytes, i, n);
      i += n;
      continue;
    }
    // Count the bytes of the longest valid prefix of a sequence starting with b0.
    size_t len = 1;
    unsigned char lo = 0x80, hi = 0xBF;
    size_t need = 0;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      need = 1;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      need = 2;
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      need = 3;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    }
    for (size_t k = 0; k < need && i + len < bytes.size(); ++k) {
      const auto b = static_cast<unsigned char>(bytes[i + len]);
      if (b < lo || b > hi) break;
      ++len;
      lo = 0x80;
      hi = 0xBF;
    }
    out += "\xEF\xBF\xBD";
    i += len;
  }
  return out;
}

}  // namespace mfsdp::hf
