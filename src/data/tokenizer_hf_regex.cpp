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
//     letters other than i, m, x, conditionals and absent operators, and PCRE2's verbs and
//     start-of-pattern options ((*COMMIT), (*CRLF), (*LIMIT_MATCH=n)...), which Oniguruma does
//     not read as PCRE2 does.
// Left as a documented difference: Oniguruma's (?i) also matches multi-character case foldings
// (ß for "ss"), and the Unicode version (Debian's PCRE2 10.42 has Unicode 14, the library's
// Oniguruma 16), so characters assigned since Unicode 15 count as unassigned here.
// Matching is bounded in work and memory ([Note: bounded matching] below), and error lines quote
// at most a few hundred bytes of a pattern.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
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

bool is_continuation_byte(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// A pattern in an error line: all of it when short, else kQuoteBytes around byte `at` (cut at
// characters) and its length, so that a 2 MB pattern does not make a 2 MB line.
std::string quote_regex(const std::string& s, size_t at = 0) {
  constexpr size_t kQuoteBytes = 200;
  if (s.size() <= kQuoteBytes) return "\"" + s + "\"";
  size_t begin = std::min(at > kQuoteBytes / 2 ? at - kQuoteBytes / 2 : 0, s.size() - kQuoteBytes);
  while (begin > 0 && is_continuation_byte(s[begin])) --begin;
  size_t end = begin + kQuoteBytes;
  while (end < s.size() && is_continuation_byte(s[end])) ++end;
  return std::string("\"") + (begin > 0 ? "..." : "") + s.substr(begin, end - begin) +
         (end < s.size() ? "..." : "") + "\" (" + std::to_string(s.size()) + " bytes)";
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
    if (c == '(' && i + 1 < p.size() && p[i + 1] == '*') {
      refuse(
          "'(*' opens a PCRE2 verb or option such as (*CRLF), (*UTF), (*NO_JIT), (*LIMIT_MATCH=n), "
          "(*ACCEPT) or (*COMMIT), which the tokenizers library (Oniguruma) reads otherwise");
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

// ---- matching ------------------------------------------------------------------------------------
//
// [Note: bounded matching]
// PCRE2 bounds the steps of one match attempt (its match limit), but a search restarts that count
// at every start position, and the count does not see the characters a repeat scans (\p{L}+
// running to the end of the text is one step): `(?:(\w)|\s)*$` or `\p{L}+\d` cost O(n) at each of
// n positions, minutes for a few hundred KB. So find_all bounds the work of the whole call:
//   - a search runs plainly (JIT, with PCRE2's own start-of-match optimizations) on the next
//     kFastWindow bytes only (a shorter subject with PCRE2_PARTIAL_HARD: an attempt that needs to
//     look further stops as partial, so no attempt sees past the window) and with at most
//     kFastSteps steps per start position, so that an attempt costs at most about
//     kFastSteps * kFastWindow character comparisons; it is charged 1 plus the bytes it moves the
//     search on;
//   - an attempt that needs more (the start position PCRE2 reports for a partial match; where it
//     cannot say, each start position in turn) reruns anchored with PCRE2_AUTO_CALLOUT, whose
//     callout before every item charges one step plus the characters the match position moved
//     since the previous one (scans, backtracking, lookarounds) and stops the match when the
//     budget is spent;
//   - the budget of one find_all is kBudgetPerByte per byte of text plus kBudgetBase, more than
//     ten times what the tokenizers we know use on any text (GPT-2's, Llama-3's, Qwen2's and
//     GPT-4o's patterns and Replace's \s+: 1.1 to 1.4 per byte of multilingual text, 2 on a huge
//     word or runs of digits or newlines, at most 5 on a run of spaces); beyond it find_all
//     throws, naming the file, the JSON path and the text length (tests/unit/
//     hf_tokenizer_limits_test.cpp: 20 ms for `(?:(\w)|\s)*$` on 20,000 characters, which took
//     29 s, and 50 ms for `a*a*a*a*a*b` on 1 MB).
// An attempt's result does not depend on where the search began (lookbehinds see the text before
// it), so the anchored reruns find the same leftmost matches as one search; the bump-along between
// them is PCRE2's (next character, past stray continuation bytes, and only after a newline for a
// pattern whose branches all start with ^ or .*, which PCRE2 tries nowhere else).
// Memory is bounded too: the JIT's stack by kJitStackBytes (an attempt that overflows it is rerun
// by the interpreter), the interpreter's by kHeapLimitKiB and kDepthLimit (PCRE2's defaults, 20 GB
// and 10 million, let `(.)*` take 2.6 GB on 5 MB). A group repeated at every character of a match
// needs 26 to 50 bytes of JIT stack per repetition: a million fit.
// Literal patterns ({"String": ...}) need no PCRE2: a short one is found by std::string_view::find,
// a longer one by Knuth-Morris-Pratt, linear where PCRE2 compares the whole literal at each
// position (std::boyer_moore_searcher is not: 5 s to build for 100 KB).
//
// Invalid UTF-8 (PCRE2_MATCH_INVALID_UTF): the JIT reads an invalid sequence as a character nothing
// matches. The interpreter (no JIT on this machine, or the fallback) splits the text into fragments
// of valid UTF-8 instead; an attempt is given the fragment it starts in (with PCRE2_NOTEOL when an
// invalid byte ends it, and empty when it starts on one), which reads the same but for \z and \Z,
// true at the end of a fragment.
namespace regex_detail {

constexpr size_t kShortLiteral = 32;  // bytes: searched for by std::string_view::find
constexpr uint32_t kFastSteps = 16;
constexpr size_t kFastWindow = 128;
constexpr uint64_t kBudgetPerByte = 64;
constexpr uint64_t kBudgetBase = 1'000'000;
constexpr size_t kJitStackBytes = size_t{64} << 20;
constexpr uint32_t kHeapLimitKiB = 128 * 1024;
constexpr uint32_t kDepthLimit = 1'000'000;
// What the metering callout returns to stop a match: a negative value comes back from pcre2_match
// as it is.
constexpr int kBudgetSpent = -7001;
// Set by tests: the interpreter instead of the JIT.
std::atomic<bool> regex_force_interpreter{false};

struct RegexMeter {
  uint64_t used = 0;
  uint64_t limit = 0;
  size_t last = 0;  // the match position at the previous callout
};

int regex_meter_callout(pcre2_callout_block* block, void* data) {
  auto* meter = static_cast<RegexMeter*>(data);
  const size_t at = block->current_position;
  meter->used += 1 + (at > meter->last ? at - meter->last : meter->last - at);
  meter->last = at;
  return meter->used > meter->limit ? kBudgetSpent : 0;
}

// This thread's JIT stack: two threads may not run on one.
pcre2_jit_stack* regex_jit_stack() {
  thread_local std::unique_ptr<pcre2_jit_stack, decltype(&pcre2_jit_stack_free)> stack(
      pcre2_jit_stack_create(32 * 1024, kJitStackBytes, nullptr), &pcre2_jit_stack_free);
  return stack.get();
}

// What a Regex holds (named outside Regex for RegexRun).
struct CompiledRegex {
  CompiledRegex() = default;
  CompiledRegex(const CompiledRegex&) = delete;
  CompiledRegex& operator=(const CompiledRegex&) = delete;
  ~CompiledRegex() {
    for (pcre2_code* c : {code, anchored, metered}) {
      if (c != nullptr) pcre2_code_free(c);
    }
  }

  std::string where;
  bool literal = false;
  std::string text;                  // a literal's
  std::vector<size_t> borders;       // a long literal's Knuth-Morris-Pratt table
  pcre2_code* code = nullptr;        // the pattern itself
  pcre2_code* anchored = nullptr;    // with PCRE2_ANCHORED: one attempt at the start offset
  pcre2_code* metered = nullptr;     // with PCRE2_ANCHORED | PCRE2_AUTO_CALLOUT
  bool jit = false;                  // all three compiled by the JIT
  bool startline = false;            // PCRE2_INFO_FIRSTCODETYPE 2: tried only after a newline
  bool anchored_implicitly = false;  // PCRE2_ANCHORED in PCRE2_INFO_ALLOPTIONS (.* under (?m))
};

// The outcome of a search from one position.
struct RegexFound {
  enum Kind { kMatch, kNone, kAttempt } kind;
  size_t start = 0;  // kMatch: the match; kNone: no match starts before `start`;
  size_t end = 0;    // kAttempt: `start` needs an anchored attempt, and so do the positions
                     // after it up to `end`
};

// One find_all: the match data and context, and what is left of the budget.
class RegexRun {
 public:
  RegexRun(const CompiledRegex& re, std::string_view text)
      : re_(re),
        text_(text),
        subject_(reinterpret_cast<PCRE2_SPTR>(text.data())),
        data_(pcre2_match_data_create_from_pattern(re.code, nullptr), &pcre2_match_data_free),
        context_(pcre2_match_context_create(nullptr), &pcre2_match_context_free),
        budget_(kBudgetBase + kBudgetPerByte * static_cast<uint64_t>(text.size())),
        jit_(re.jit && !regex_force_interpreter) {
    if (!data_ || !context_) throw std::bad_alloc();
    pcre2_set_heap_limit(context_.get(), kHeapLimitKiB);
    pcre2_set_depth_limit(context_.get(), kDepthLimit);
    if (jit_) pcre2_jit_stack_assign(context_.get(), nullptr, regex_jit_stack());
  }

  // A plain search from p over the next kFastWindow bytes (the interpreter, which would check
  // the UTF-8 of the whole window at each call, asks for an attempt at p instead).
  RegexFound search(size_t p) {
    if (!jit_) return {RegexFound::kAttempt, p, p};
    const size_t end = window_end(p, kFastWindow);
    const bool partial = end < text_.size();
    pcre2_set_match_limit(context_.get(), kFastSteps);
    pcre2_set_callout(context_.get(), nullptr, nullptr);
    const int rc = pcre2_match(re_.code, subject_, end, p, partial ? PCRE2_PARTIAL_HARD : 0, data_.get(),
                               context_.get());
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data_.get());
    if (rc >= 0 && (ovector[0] < end || !partial)) {
      charge(1 + ovector[1] - p);
      return {RegexFound::kMatch, ovector[0], ovector[1]};
    }
    if (rc >= 0 || rc == PCRE2_ERROR_NOMATCH) {
      // A match at the end of a window is not trusted: an attempt there inspected nothing, so it
      // could not see that it needed more.
      charge(1 + end - p);
      return {RegexFound::kNone, partial ? end : text_.size() + 1, 0};
    }
    if (rc == PCRE2_ERROR_PARTIAL) {
      const size_t start = pcre2_get_startchar(data_.get());
      charge(1 + start - p);
      return {RegexFound::kAttempt, start, start};
    }
    if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      charge(1);
      return {RegexFound::kAttempt, p, end};
    }
    fail(rc, p);
  }

  // The match of an anchored attempt at p, if any (its start is p, or later when the interpreter
  // skips the continuation bytes p points into).
  std::optional<std::pair<size_t, size_t>> attempt(size_t p) {
    pcre2_set_match_limit(context_.get(), kFastSteps);
    pcre2_set_callout(context_.get(), nullptr, nullptr);
    int rc;
    if (jit_) {
      const size_t end = window_end(p, kFastWindow);
      rc = pcre2_match(re_.anchored, subject_, end, p, end < text_.size() ? PCRE2_PARTIAL_HARD : 0,
                       data_.get(), context_.get());
    } else {
      rc = run_interpreter(re_.anchored, p, kFastWindow);
    }
    if (rc == PCRE2_ERROR_NOMATCH) {
      charge(1);
      return std::nullopt;
    }
    if (rc >= 0) return take(1);
    if (rc != PCRE2_ERROR_PARTIAL && rc != PCRE2_ERROR_MATCHLIMIT && rc != PCRE2_ERROR_JIT_STACKLIMIT) {
      fail(rc, p);
    }
    rc = jit_ ? run_metered_jit(p) : PCRE2_ERROR_JIT_STACKLIMIT;
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) rc = run_metered_interpreter(p);
    if (rc == PCRE2_ERROR_NOMATCH) return std::nullopt;
    if (rc >= 0) return take(0);
    fail(rc, p);
  }

 private:
  // The end of a window of about `bytes` bytes from p: not inside a character.
  size_t window_end(size_t p, size_t bytes) const {
    if (bytes >= text_.size() - p) return text_.size();
    size_t end = p + bytes;
    while (end < text_.size() && is_continuation_byte(text_[end])) ++end;
    return end;
  }

  // The end of the interpreter's fragment for an attempt at p: the first invalid byte from p
  // (p itself when it is one, so that PCRE2 tries p as the JIT does, and does not skip to the
  // next character). Remembered, as the next attempts start inside the same fragment.
  size_t fragment_end(size_t p) {
    if (p >= fragment_from_ && p < fragment_end_) return fragment_end_;
    size_t q = p;
    while (q < text_.size()) {
      const size_t n = utf8_char_len(text_, q);
      if (n == 1 && static_cast<unsigned char>(text_[q]) >= 0x80) break;
      q += n;
    }
    fragment_from_ = p;
    fragment_end_ = q;
    return q;
  }

  int run_metered_jit(size_t p) {
    meter_ = RegexMeter{0, budget_, p};
    pcre2_set_match_limit(context_.get(), UINT32_MAX);
    pcre2_set_callout(context_.get(), &regex_meter_callout, &meter_);
    const int rc = pcre2_match(re_.metered, subject_, text_.size(), p, 0, data_.get(), context_.get());
    charge(std::min(meter_.used, budget_));
    return rc;
  }

  // The interpreter checks the UTF-8 of the whole subject it is given at each call, so it is
  // given a window that doubles while the attempt stops as partial, and each window is charged.
  int run_metered_interpreter(size_t p) {
    pcre2_set_match_limit(context_.get(), UINT32_MAX);
    pcre2_set_callout(context_.get(), &regex_meter_callout, &meter_);
    for (size_t window = kFastWindow * 2;; window *= 2) {
      charge(std::min(window, text_.size() - p));
      meter_ = RegexMeter{0, budget_, p};
      const int rc = run_interpreter(re_.metered, p, window);
      charge(std::min(meter_.used, budget_));
      if (rc != PCRE2_ERROR_PARTIAL) return rc;
    }
  }

  int run_interpreter(const pcre2_code* code, size_t p, size_t window) {
    const size_t fragment = fragment_end(p);
    const size_t end = std::min(window_end(p, window), fragment);
    uint32_t options = PCRE2_NO_JIT;
    if (end == fragment && end < text_.size()) {
      options |= PCRE2_NOTEOL;  // as PCRE2 ends a fragment at an invalid byte
    } else if (end < text_.size()) {
      options |= PCRE2_PARTIAL_HARD;
    }
    return pcre2_match(code, subject_, end, p, options, data_.get(), context_.get());
  }

  std::pair<size_t, size_t> take(uint64_t cost) {
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data_.get());
    charge(cost + (ovector[1] - ovector[0]));
    return {ovector[0], ovector[1]};
  }

  void charge(uint64_t units) {
    if (units > budget_) throw_budget();
    budget_ -= units;
  }

  [[noreturn]] void throw_budget() const {
    throw std::runtime_error(re_.where + ": the regex needs more than " +
                             std::to_string(kBudgetBase + kBudgetPerByte * text_.size()) + " PCRE2 steps (" +
                             std::to_string(kBudgetPerByte) + " per byte plus " +
                             std::to_string(kBudgetBase) + ") on a text of " + std::to_string(text_.size()) +
                             " bytes: its backtracking grows faster than the text");
  }

  [[noreturn]] void fail(int rc, size_t p) const {
    if (rc == kBudgetSpent) throw_budget();
    std::string why = pcre2_message(rc);
    if (rc == PCRE2_ERROR_HEAPLIMIT) {
      why =
          "it needs more than " + std::to_string(kHeapLimitKiB / 1024) + " MiB of PCRE2 backtracking memory";
    } else if (rc == PCRE2_ERROR_DEPTHLIMIT) {
      why = "its backtracking nests deeper than " + std::to_string(kDepthLimit);
    }
    throw std::runtime_error(re_.where + ": matching the regex failed at byte " + std::to_string(p) + ": " +
                             why + " (text of " + std::to_string(text_.size()) + " bytes)");
  }

  const CompiledRegex& re_;
  std::string_view text_;
  PCRE2_SPTR subject_;
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data_;
  std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> context_;
  uint64_t budget_;
  bool jit_;
  RegexMeter meter_;
  size_t fragment_from_ = 0;
  size_t fragment_end_ = 0;
};

}  // namespace regex_detail

void set_regex_interpreter_for_testing(bool on) { regex_detail::regex_force_interpreter = on; }

struct Regex::Impl : regex_detail::CompiledRegex {};

Regex::Regex(const std::string& pattern, RegexSyntax syntax, std::string where)
    : impl_(std::make_unique<Impl>()) {
  regex_detail::CompiledRegex& re = *impl_;
  re.where = std::move(where);
  re.literal = syntax == RegexSyntax::kLiteral;
  if (re.literal) {
    // Found without PCRE2 (see find_all).
    re.text = pattern;
    if (re.text.size() > regex_detail::kShortLiteral) {
      // borders[k]: the length of the longest proper prefix of text[0, k] that is also its suffix.
      re.borders.assign(re.text.size(), 0);
      for (size_t k = 1, b = 0; k < re.text.size(); ++k) {
        while (b > 0 && re.text[k] != re.text[b]) b = re.borders[b - 1];
        if (re.text[k] == re.text[b]) ++b;
        re.borders[k] = b;
      }
    }
    return;
  }
  std::string compiled = pattern;
  uint32_t options = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | PCRE2_UCP;
  if (syntax == RegexSyntax::kOniguruma) {
    try {
      compiled = oniguruma_to_pcre2(pattern);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(re.where + ": unsupported regex " + quote_regex(pattern) + ": " + e.what());
    }
    options |= PCRE2_MULTILINE;
  }
  std::unique_ptr<pcre2_compile_context, decltype(&pcre2_compile_context_free)> context(
      pcre2_compile_context_create(nullptr), &pcre2_compile_context_free);
  pcre2_set_newline(context.get(), PCRE2_NEWLINE_LF);  // Oniguruma's newline is "\n" alone
  auto compile = [&](uint32_t extra) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(),
                                     options | extra, &error, &offset, context.get());
    if (code == nullptr) {
      throw std::invalid_argument(re.where + ": regex " + quote_regex(pattern) +
                                  " does not compile in PCRE2: " + pcre2_message(error) + " (at offset " +
                                  std::to_string(offset) + " of " + quote_regex(compiled, offset) + ")");
    }
    return code;
  };
  re.code = compile(0);
  re.anchored = compile(PCRE2_ANCHORED);
  re.metered = compile(PCRE2_ANCHORED | PCRE2_AUTO_CALLOUT);
  // JIT makes matching several times faster; without it (no JIT on this CPU) PCRE2 interprets.
  re.jit = pcre2_jit_compile(re.code, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD) == 0 &&
           pcre2_jit_compile(re.anchored, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD) == 0 &&
           pcre2_jit_compile(re.metered, PCRE2_JIT_COMPLETE) == 0;
  uint32_t first_code_type = 0;
  uint32_t all_options = 0;
  pcre2_pattern_info(re.code, PCRE2_INFO_FIRSTCODETYPE, &first_code_type);
  pcre2_pattern_info(re.code, PCRE2_INFO_ALLOPTIONS, &all_options);
  re.startline = first_code_type == 2;
  re.anchored_implicitly = (all_options & PCRE2_ANCHORED) != 0;
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> spans;
  const regex_detail::CompiledRegex& re = *impl_;
  auto next_char = [&](size_t p) { return p + (p < text.size() ? utf8_char_len(text, p) : 1); };
  if (re.literal && !re.text.empty() && re.text.size() <= regex_detail::kShortLiteral) {
    // A short literal: the leftmost occurrences, each search from the end of the last.
    for (size_t at = text.find(re.text); at != std::string_view::npos; at = text.find(re.text, at)) {
      spans.emplace_back(at, at + re.text.size());
      at += re.text.size();
    }
    return spans;
  }
  if (re.literal && !re.text.empty()) {
    // A longer one by Knuth-Morris-Pratt, which does not compare the whole literal again at
    // each position: a match starts the next search with nothing matched.
    const std::string& literal = re.text;
    size_t matched = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      while (matched > 0 && text[i] != literal[matched]) matched = re.borders[matched - 1];
      if (text[i] == literal[matched]) ++matched;
      if (matched == literal.size()) {
        spans.emplace_back(i + 1 - matched, i + 1);
        matched = 0;
      }
    }
    return spans;
  }
  if (re.literal) {
    // The empty literal matches wherever a search starts.
    for (size_t p = 0; p <= text.size(); p = next_char(p)) spans.emplace_back(p, p);
    return spans;
  }
  // PCRE2's bump-along (see [Note: bounded matching]): after a failed start, the next character,
  // past stray continuation bytes, and after a newline for a startline pattern. A search start
  // (0, the end of the last match, or one character after an empty match there) is tried as it is.
  auto bump_along = [&](size_t p) {
    while (p < text.size() && is_continuation_byte(text[p])) ++p;
    if (re.startline) {
      while (p < text.size() && text[p - 1] != '\n') ++p;
    }
    return p;
  };
  regex_detail::RegexRun run(re, text);
  bool matched_before = false;
  size_t last_match_end = 0;
  size_t p = 0;
  size_t attempts_until = 0;  // positions before this one are tried one by one
  while (p <= text.size()) {
    std::optional<std::pair<size_t, size_t>> match;
    if (p >= attempts_until) {
      const regex_detail::RegexFound found = run.search(p);
      if (found.kind == regex_detail::RegexFound::kMatch) {
        match.emplace(found.start, found.end);
      } else if (found.kind == regex_detail::RegexFound::kNone) {
        if (re.anchored_implicitly || found.start > text.size()) break;
        p = bump_along(found.start);
        continue;
      } else {
        p = found.start;
        attempts_until = found.end;
      }
    }
    if (!match) match = run.attempt(p);
    if (!match) {
      if (re.anchored_implicitly) break;  // PCRE2 tries such a pattern at the search start only
      p = bump_along(next_char(p));
      continue;
    }
    const auto [start, end] = *match;
    if (start == end && matched_before && last_match_end == end) {
      // An empty match right where the last match ended: the library moves one character on.
      p = next_char(start);
      continue;
    }
    spans.emplace_back(start, end);
    matched_before = true;
    last_match_end = end;
    p = end;
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
