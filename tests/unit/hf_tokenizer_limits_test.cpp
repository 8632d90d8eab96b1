// Bounds on hostile tokenizer.json files (issue 45): regexes whose backtracking grows faster than
// the text, or that need gigabytes of PCRE2 memory, are refused within a budget proportional to the
// text (src/data/tokenizer_hf_regex.cpp, [Note: bounded matching]), naming the file and the JSON
// path; PCRE2-only verbs are refused when the file is read; error lines quote at most a few hundred
// characters of a pattern; Unigram vocabularies of very long pieces are bounded per pre-token.
// The bounded search must find exactly what one plain PCRE2 search per match found before: an
// oracle written here with PCRE2 itself (the former find_all) is compared with it on tokenizer
// patterns and on patterns built to reach every path (empty matches, lookarounds, anchors, invalid
// UTF-8, attempts longer than the plain search's window). Times are printed, never asserted.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../../src/data/tokenizer_hf_parts.h"
#include "harness/expect_error.h"
#include "harness/temp_dir.h"
#include "mfsdp/data/tokenizer.h"

namespace mfsdp::hf {
// Defined in src/data/tokenizer_hf_regex.cpp: run find_all by the interpreter, as on a machine
// without PCRE2's JIT.
void set_regex_interpreter_for_testing(bool on);
}  // namespace mfsdp::hf

namespace mfsdp {
namespace {

using hf::Regex;
using hf::RegexSyntax;
using nlohmann::json;
using Spans = std::vector<std::pair<size_t, size_t>>;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The former Regex::find_all: one unanchored PCRE2 search per match, from where the last match
// ended, moving one character on after an empty match there. `options` 0 is the JIT (where the
// JIT runs), PCRE2_NO_JIT the interpreter.
Spans plain_pcre2_spans(const std::string& pattern, RegexSyntax syntax, std::string_view text,
                        uint32_t options = 0) {
  const std::string compiled = syntax == RegexSyntax::kOniguruma ? hf::oniguruma_to_pcre2(pattern) : pattern;
  uint32_t flags = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
  flags |= syntax == RegexSyntax::kLiteral ? PCRE2_LITERAL : PCRE2_UCP;
  if (syntax == RegexSyntax::kOniguruma) flags |= PCRE2_MULTILINE;
  std::unique_ptr<pcre2_compile_context, decltype(&pcre2_compile_context_free)> context(
      pcre2_compile_context_create(nullptr), &pcre2_compile_context_free);
  pcre2_set_newline(context.get(), PCRE2_NEWLINE_LF);
  int error = 0;
  PCRE2_SIZE offset = 0;
  std::unique_ptr<pcre2_code, decltype(&pcre2_code_free)> code(
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(), flags, &error, &offset,
                    context.get()),
      &pcre2_code_free);
  if (!code) throw std::invalid_argument("oracle: the pattern does not compile: " + pattern);
  pcre2_jit_compile(code.get(), PCRE2_JIT_COMPLETE);
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(code.get(), nullptr), &pcre2_match_data_free);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  Spans spans;
  size_t search_from = 0;
  bool matched_before = false;
  size_t last_match_end = 0;
  while (search_from <= text.size()) {
    int rc = pcre2_match(code.get(), subject, text.size(), search_from, options, data.get(), nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      rc = pcre2_match(code.get(), subject, text.size(), search_from, PCRE2_NO_JIT, data.get(), nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw std::runtime_error("oracle: PCRE2 error " + std::to_string(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t start = ovector[0];
    const size_t end = ovector[1];
    if (start == end && matched_before && last_match_end == end) {
      search_from += search_from < text.size() ? hf::utf8_char_len(text, search_from) : 1;
      continue;
    }
    search_from = end;
    matched_before = true;
    last_match_end = end;
    spans.emplace_back(start, end);
  }
  return spans;
}

bool valid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const size_t n = hf::utf8_char_len(text, i);
    if (n == 1 && static_cast<unsigned char>(text[i]) >= 0x80) return false;
    i += n;
  }
  return true;
}

const char kGpt2[] = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char kLlama3[] = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3})"
                       R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char kQwen2[] = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N})"
                      R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Multilingual text in lines of words, numbers and punctuation, about `bytes` long.
std::string multilingual_text(size_t bytes, uint32_t seed) {
  static const std::vector<std::string> words = {
      "the",   "quick",   "brown", "fox",    "it's",    "don't",      "WE'LL",  "I'M",      "Hello",
      "world", "café",    "naïve", "straße", "façade",  "Ελληνικά",   "Привет", "日本語",   "テキスト",
      "中文",  "مرحبا",   "नमस्ते",  "हिन्दी",  "ภาษาไทย", "안녕하세요", "🙂",   "👍🏽", "€",
      "x=1;",  "(a+b)*c", "<tag>", "#hash",  "$5.00",   "50%",        "..."};
  std::mt19937 rng(seed);
  static const std::vector<std::string> separators = {" ", " ", " ", "  ", "\t", "\n", "\r\n", "\n\n"};
  std::string out;
  while (out.size() < bytes) {
    const size_t n = 3 + rng() % 12;
    const std::string& sep = separators[rng() % separators.size()];
    for (size_t k = 0; k < n; ++k) {
      if (k > 0) out += sep;
      out += rng() % 7 == 0 ? std::to_string(rng() % 10000000) : words[rng() % words.size()];
    }
    out += '\n';
  }
  return out;
}

// ---- regexes: the same spans as before -------------------------------------------------------

TEST(HfTokenizerLimits, TokenizerPatternsOnLargeTextsFindWhatPlainPcre2Finds) {
  std::vector<std::pair<std::string, std::string>> texts = {
      {"multilingual 2 MB", multilingual_text(2 << 20, 1)},
      {"1 MB of spaces", std::string(1 << 20, ' ')},
      {"1 MB of spaces, then x", std::string(1 << 20, ' ') + "x"},
      {"1 MB of digits", std::string(1 << 20, '7')},
      {"1 MB of newlines", std::string(1 << 20, '\n')},
      {"one word of 1 MB", std::string(1 << 20, 'a')},
  };
  std::string tabs;
  while (tabs.size() < (1u << 20)) tabs += " \t\r\n";
  texts.emplace_back("1 MB of mixed whitespace", tabs);
  std::string cjk;
  while (cjk.size() < (1u << 20)) cjk += "日本語の文章";
  texts.emplace_back("1 MB of CJK without spaces", cjk);
  const std::vector<std::pair<std::string, std::pair<std::string, RegexSyntax>>> patterns = {
      {"GPT-2", {kGpt2, RegexSyntax::kOniguruma}},
      {"Llama-3", {kLlama3, RegexSyntax::kOniguruma}},
      {"Qwen2", {kQwen2, RegexSyntax::kOniguruma}},
      {"Replace \\s+", {R"(\s+)", RegexSyntax::kOniguruma}},
      {"Replace \" \" (Regex)", {" ", RegexSyntax::kOniguruma}},
      {"Replace \" \" (String)", {" ", RegexSyntax::kLiteral}},
      {"DeepSeek CJK", {"[一-龥\u3040-ゟ゠-ヿ]+", RegexSyntax::kOniguruma}},
  };
  for (const auto& [text_name, text] : texts) {
    for (const auto& [name, pattern] : patterns) {
      const Regex re(pattern.first, pattern.second, "test.json: pre_tokenizer.pattern.Regex");
      auto start = std::chrono::steady_clock::now();
      const Spans expected = plain_pcre2_spans(pattern.first, pattern.second, text);
      const double plain = seconds_since(start);
      start = std::chrono::steady_clock::now();
      Spans got;
      EXPECT_NO_THROW(got = re.find_all(text)) << name << " on " << text_name;
      const double bounded = seconds_since(start);
      EXPECT_EQ(got, expected) << name << " on " << text_name;
      std::cout << "  " << name << " on " << text_name << " (" << text.size() << " bytes): " << got.size()
                << " spans, plain PCRE2 " << plain * 1e3 << " ms, bounded " << bounded * 1e3 << " ms\n";
    }
  }
}

// Patterns and texts built to reach every path of the bounded search: matches longer than its
// window, empty matches, lookarounds at the window's edge, anchors, startline patterns (.*, ^)
// and invalid UTF-8, which the JIT reads as a character nothing matches.
TEST(HfTokenizerLimits, ManyPatternsOnManyTextsFindWhatPlainPcre2Finds) {
  const std::vector<std::pair<std::string, RegexSyntax>> patterns = {
      {kGpt2, RegexSyntax::kOniguruma},
      {kLlama3, RegexSyntax::kOniguruma},
      {R"(\w+|[^\w\s]+)", RegexSyntax::kOniguruma},
      {R"(\b\p{L}+\b|\B.)", RegexSyntax::kOniguruma},
      {R"(\W+)", RegexSyntax::kOniguruma},
      {R"(^\s+|\s+$|^.)", RegexSyntax::kOniguruma},
      {R"(\h+|\H)", RegexSyntax::kOniguruma},
      {R"(\p{L}{,3}?\p{L}|\p{N}{2,})", RegexSyntax::kOniguruma},
      {R"(\p{N}*)", RegexSyntax::kOniguruma},
      {R"((?<=\p{L})(?=\p{N})|(?<=\p{N})(?=\p{L})|\s)", RegexSyntax::kOniguruma},
      {R"((?m)[\r\n].)", RegexSyntax::kOniguruma},
      {R"((?i)(?:the|it's|ſ|k))", RegexSyntax::kOniguruma},
      {R"(\p{Han}+|\p{Hiragana}+|\p{Katakana}+|\p{Greek}+)", RegexSyntax::kOniguruma},
      {R"(x|)", RegexSyntax::kOniguruma},
      {R"($)", RegexSyntax::kOniguruma},
      {R"((?!a))", RegexSyntax::kOniguruma},
      {R"(\b)", RegexSyntax::kOniguruma},
      {R"((?<=x))", RegexSyntax::kOniguruma},
      {R"(a+$)", RegexSyntax::kOniguruma},
      {R"((?<!a)b+(?=\s|$))", RegexSyntax::kOniguruma},
      {R"((a|b)\1+)", RegexSyntax::kOniguruma},
      {R"(.*?x)", RegexSyntax::kOniguruma},
      {R"(.*)", RegexSyntax::kOniguruma},
      {R"((?m).*x)", RegexSyntax::kOniguruma},
      {R"(^a|^\s)", RegexSyntax::kOniguruma},
      {R"(\Ab|.*?b)", RegexSyntax::kOniguruma},
      {R"([^x]*x?)", RegexSyntax::kOniguruma},
      {R"(a{3,}|b{2})", RegexSyntax::kOniguruma},
      {R"((?<=\s)\p{L}+(?=\p{P}))", RegexSyntax::kOniguruma},
      {R"(\p{L}+(?:'\p{L}+)*)", RegexSyntax::kOniguruma},
      {R"(\z)", RegexSyntax::kOniguruma},
      {R"(x\z|y)", RegexSyntax::kOniguruma},
      {" ", RegexSyntax::kLiteral},
      {"aa", RegexSyntax::kLiteral},
      {"", RegexSyntax::kLiteral},
      {"é", RegexSyntax::kLiteral},
      {std::string(40, 'a'), RegexSyntax::kLiteral},  // long enough for Knuth-Morris-Pratt
      {R"([\p{P}!-/:-@\[-`{-~])", RegexSyntax::kPcre2},
  };
  const std::vector<std::string> alphabet = {
      "a", "b", "x", "y", "A", "k", "K", "t", "h", "e", "'", "s", "'S", "1", "2", " ", "  ", "\t", "\n",
      "\r\n", ".", ",", "!", "-", "é", "ß", "日", "あ", "カ", "🙂", "\xCC\x81", "α", "ا", "न",
      "\xE2\x80\x8D", "aaaa", "    ", "1234",
      // invalid UTF-8: a stray continuation byte, a byte never valid, truncated sequences, a surrogate
      "\x80", "\xFF", "\xE2\x82", "\xC3", "\xF0\x9F", "\xED\xA0\x80"};
  constexpr size_t kInvalid = 6;  // the last entries of `alphabet`
  std::mt19937 rng(45);
  size_t compared = 0;
  size_t interpreter_compared = 0;
  const auto start = std::chrono::steady_clock::now();
  for (const auto& [pattern, syntax] : patterns) {
    const Regex re(pattern, syntax, "test.json: pattern");
    const bool z_anchor = pattern.find("\\z") != std::string::npos;
    for (int k = 0; k < 60; ++k) {
      const bool invalid = k % 2 == 0;
      const size_t length = k % 10 == 0 ? 1500 : k % 3 == 0 ? 300 : 30;
      std::string text;
      if (k % 7 == 0) text.assign(300, "a \n"[k % 3]);  // a run longer than the search window
      while (text.size() < length) {
        const size_t pick = rng() % (invalid ? alphabet.size() : alphabet.size() - kInvalid);
        text += alphabet[pick];
      }
      hf::set_regex_interpreter_for_testing(false);
      ASSERT_EQ(re.find_all(text), plain_pcre2_spans(pattern, syntax, text)) << pattern << " on text " << k;
      ++compared;
      // The interpreter (no JIT, or the fallback for a JIT stack overflow) reads the same, but
      // that it ends a fragment of valid UTF-8 at an invalid byte, where \z holds.
      hf::set_regex_interpreter_for_testing(true);
      if (valid_utf8(text)) {
        ASSERT_EQ(re.find_all(text), plain_pcre2_spans(pattern, syntax, text, PCRE2_NO_JIT))
            << pattern << " (interpreter) on text " << k;
        ++interpreter_compared;
      } else if (!z_anchor) {
        ASSERT_EQ(re.find_all(text), plain_pcre2_spans(pattern, syntax, text))
            << pattern << " (interpreter) on text " << k;
        ++interpreter_compared;
      }
      hf::set_regex_interpreter_for_testing(false);
    }
  }
  std::cout << "  " << compared << " pattern x text pairs (JIT) and " << interpreter_compared
            << " (interpreter) equal to plain PCRE2 in " << seconds_since(start) << " s\n";
}

// ---- regexes: hostile patterns refused --------------------------------------------------------

std::string refusal(const std::string& pattern, const std::string& text, double* seconds) {
  const Regex re(pattern, RegexSyntax::kOniguruma, "hostile/tokenizer.json: pre_tokenizer.pattern.Regex");
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of([&] { re.find_all(text); });
  *seconds = seconds_since(start);
  std::cout << "  " << pattern << " on " << text.size() << " bytes: " << *seconds * 1e3 << " ms: " << error
            << "\n";
  return error;
}

TEST(HfTokenizerLimits, SuperlinearPatternsAreRefusedNamingThePath) {
  const std::string path = "hostile/tokenizer.json: pre_tokenizer.pattern.Regex";
  double seconds = 0;
  // O(n) per start position: 29 s for these 20,000 characters before.
  std::string word(20000, 'a');
  word += "!";
  expect_contains(refusal(R"((?:(\w)|\s)*$)", word, &seconds), {path, "20001 bytes", "steps"});
  std::string words;
  while (words.size() < 20000) words += "ab cd ";
  words += "!";
  expect_contains(refusal(R"((?:(\w)|\s)*$)", words, &seconds), {path, "steps"});
  // Polynomial backtracking at each position: past 60 s before.
  const std::string a(1 << 20, 'a');
  expect_contains(refusal("a*a*a*a*a*b", a, &seconds), {path, "1048576 bytes", "steps"});
  // A scan to the end of the text at each position, which PCRE2 counts as one step.
  expect_contains(refusal(R"(\p{L}+\d)", a, &seconds), {path, "steps"});
  expect_contains(refusal(R"((?:\p{L}+\d|\p{L})*)", a, &seconds), {path, "steps"});
  // The same through the interpreter.
  hf::set_regex_interpreter_for_testing(true);
  expect_contains(refusal(R"((?:(\w)|\s)*$)", word, &seconds), {path, "steps"});
  expect_contains(refusal("a*a*a*a*a*b", std::string(100000, 'a'), &seconds), {path, "steps"});
  hf::set_regex_interpreter_for_testing(false);
}

TEST(HfTokenizerLimits, BacktrackingMemoryIsBounded) {
  // (.)* keeps a frame per character: 2.6 GB on 5 MB before. The JIT's stack overflows first,
  // then the interpreter's heap limit stops it.
  std::string doc;
  while (doc.size() < (5u << 20)) doc += "The quick brown fox jumps over the lazy dog. ";
  double seconds = 0;
  expect_contains(refusal("(.)*", doc, &seconds),
                  {"hostile/tokenizer.json: pre_tokenizer.pattern.Regex", "MiB"});
  // A long match by a repeated group is legitimate, and fits.
  const Regex re(R"((?:\p{L}|')+)", RegexSyntax::kOniguruma, "test.json: pattern");
  EXPECT_EQ(re.find_all(std::string(100000, 'a')), (Spans{{0, 100000}}));
}

TEST(HfTokenizerLimits, LongLiteralsAreFoundInLinearTime) {
  // PCRE2 compared the whole literal at each position: 100 KB x 1 MB.
  std::string literal(100000, 'a');
  literal += "b";
  const Regex re(literal, RegexSyntax::kLiteral, "test.json: pattern.String");
  std::string text(1 << 20, 'a');
  auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(re.find_all(text).empty());
  text += "b";
  EXPECT_EQ(re.find_all(text), (Spans{{text.size() - literal.size(), text.size()}}));
  std::cout << "  a literal of 100 KB over 1 MB: " << seconds_since(start) * 1e3 << " ms\n";
}

TEST(HfTokenizerLimits, HostileRegexThroughTheLoaderNamesFileAndPath) {
  mfsdp::testing::TempDir dir("mfsdp-hflimits");
  const std::string file = dir.file("tokenizer.json");
  json vocab = json::array({json::array({"<unk>", 0.0})});
  for (const char* piece : {"a", "b", "!", " ", "</s>"}) vocab.push_back(json::array({piece, -1.0}));
  const json eod = {{"id", 5},         {"content", "</s>"},   {"single_word", false}, {"lstrip", false},
                    {"rstrip", false}, {"normalized", false}, {"special", true}};
  const json tokenizer = {{"version", "1.0"},
                          {"added_tokens", json::array({eod})},
                          {"normalizer", nullptr},
                          {"pre_tokenizer",
                           {{"type", "Sequence"},
                            {"pretokenizers", json::array({{{"type", "Split"},
                                                            {"pattern", {{"Regex", R"((?:(\w)|\s)*$)"}}},
                                                            {"behavior", "Isolated"},
                                                            {"invert", false}}})}}},
                          {"post_processor", nullptr},
                          {"decoder", nullptr},
                          {"model", {{"type", "Unigram"}, {"unk_id", 0}, {"vocab", vocab}}}};
  std::ofstream(file) << tokenizer.dump();
  const auto t = load_hf_tokenizer(file);
  EXPECT_EQ(t->encode("ab a!").size(), 5u);
  std::string text(20000, 'a');
  text += "!";
  const auto start = std::chrono::steady_clock::now();
  expect_contains(error_of([&] { t->encode(text); }),
                  {file, "pre_tokenizer.pretokenizers[0].pattern.Regex", "20001 bytes"});
  std::cout << "  refused through load_hf_tokenizer in " << seconds_since(start) * 1e3 << " ms\n";
}

// ---- regexes: refused when the file is read ---------------------------------------------------

TEST(HfTokenizerLimits, Pcre2VerbsAreRefused) {
  for (const std::string verb : {"(*CRLF)a", "(*NO_JIT)a", "(*LIMIT_MATCH=1)a", "a(*ACCEPT)b",
                                 "a(*COMMIT)b|ac", "(*UTF)a", "(?:a(*SKIP)b)", "(*FAIL)|a", "a(*PRUNE:x)b"}) {
    expect_contains(
        error_of([&] { Regex(verb, RegexSyntax::kOniguruma, "f.json: normalizer.pattern.Regex"); }),
        {"f.json: normalizer.pattern.Regex", "(*", "Oniguruma"});
  }
  // Escaped, or in a class, "(*" is no verb.
  EXPECT_EQ(Regex(R"(\(*a)", RegexSyntax::kOniguruma, "f").find_all("((a"), (Spans{{0, 3}}));
  EXPECT_EQ(Regex(R"([(*]+)", RegexSyntax::kOniguruma, "f").find_all("a(*b"), (Spans{{1, 3}}));
}

TEST(HfTokenizerLimits, ErrorLinesQuoteAtMostAFewHundredCharactersOfAPattern) {
  const std::string huge = "(" + std::string(2 << 20, 'a');  // unbalanced: does not compile
  const std::string error = error_of([&] { Regex(huge, RegexSyntax::kOniguruma, "f.json: pattern.Regex"); });
  EXPECT_LT(error.size(), 1000u) << error.substr(0, 2000);
  expect_contains(error, {"f.json: pattern.Regex", "does not compile", "(2097153 bytes)"});
  const std::string unsupported = std::string(2 << 20, 'a') + "\\K";
  const std::string refused =
      error_of([&] { Regex(unsupported, RegexSyntax::kOniguruma, "f.json: pattern.Regex"); });
  EXPECT_LT(refused.size(), 1000u) << refused.substr(0, 2000);
  expect_contains(refused, {"f.json: pattern.Regex", "\\K", "(2097154 bytes)"});
  // A short pattern is quoted whole.
  expect_contains(error_of([] { Regex("(ab", RegexSyntax::kOniguruma, "f"); }), {"\"(ab\""});
}

// ---- Unigram ----------------------------------------------------------------------------------

std::unique_ptr<hf::Model> unigram(const std::vector<std::pair<std::string, double>>& pieces) {
  json vocab = json::array({json::array({"<unk>", 0.0})});
  for (const auto& [piece, score] : pieces) vocab.push_back(json::array({piece, score}));
  return hf::load_unigram_model({{"type", "Unigram"}, {"unk_id", 0}, {"vocab", vocab}}, "uni/tokenizer.json");
}

TEST(HfTokenizerLimits, UnigramLongPiecesAreFoundByATrie) {
  // Pieces of 3,000 characters: 79 s for 20 KB before, as every prefix up to the longest piece
  // was looked up at every position. A trie walk stops where no piece continues.
  std::mt19937 rng(3);
  std::vector<std::pair<std::string, double>> pieces;
  for (char c = 'a'; c <= 'z'; ++c) pieces.emplace_back(std::string(1, c), -5.0);
  for (int k = 0; k < 20; ++k) {
    std::string piece;
    for (int i = 0; i < 3000; ++i) piece += static_cast<char>('a' + rng() % 26);
    pieces.emplace_back(piece, -1.0);
  }
  const auto model = unigram(pieces);
  std::string text;
  std::vector<int64_t> expected;
  for (int k : {3, 17, 0, 9, 9, 12, 5}) {
    text += pieces[26 + k].first;
    expected.push_back(1 + 26 + k);  // after <unk>
  }
  std::vector<int64_t> ids;
  const auto start = std::chrono::steady_clock::now();
  model->encode(text, ids);
  std::cout << "  " << text.size() << " bytes of pieces of 3,000 bytes: " << seconds_since(start) * 1e3
            << " ms\n";
  EXPECT_EQ(ids, expected);
}

TEST(HfTokenizerLimits, UnigramLatticeWorkIsBounded) {
  // Every position starts a walk of 3,000 steps down the trie: refused, naming the vocabulary.
  std::vector<std::pair<std::string, double>> pieces = {{"a", -2.0}, {std::string(3000, 'a') + "b", -1.0}};
  const auto model = unigram(pieces);
  const std::string text(20000, 'a');
  std::vector<int64_t> ids;
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of([&] { model->encode(text, ids); });
  std::cout << "  " << error << " (" << seconds_since(start) * 1e3 << " ms)\n";
  expect_contains(error, {"uni/tokenizer.json", "model.vocab", "20000 bytes"});
  // The same vocabulary on a shorter text fits in the budget.
  ids.clear();
  model->encode(std::string(500, 'a'), ids);
  EXPECT_EQ(ids, std::vector<int64_t>(500, 1));
}

}  // namespace
}  // namespace mfsdp
