// GPT-2's byte-level BPE (vocab.json + merges.txt), as Megatron's GPT2BPETokenizer
// (megatron/training/tokenizer/gpt2_tokenization.py, itself OpenAI's encoder.py).
//
// encode(text): split the text into pre-tokens with GPT-2's regex (gpt2_pretokenize), map each
// pre-token's bytes to printable code points (bytes_to_unicode), apply the BPE merges by rank,
// and look the resulting pieces up in vocab.json. decode(ids): concatenate the pieces and map the
// code points back to bytes. The text "<|endoftext|>" inside a document is encoded as ordinary
// text, as Megatron does; only --append-eod adds the EOD id.
#include <nlohmann/json.hpp>

#include <array>
#include <climits>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "mfsdp/tokenizer.h"

namespace mfsdp {
namespace {

// ---- UTF-8 ---------------------------------------------------------------------------------------

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

// Decodes the code point at text[i]; sets `len` to its byte length. An invalid or truncated
// sequence yields kInvalid with len 1 (the byte stands alone).
constexpr uint32_t kInvalid = 0xFFFFFFFFu;
uint32_t next_code_point(std::string_view text, size_t i, size_t& len) {
  const auto b0 = static_cast<unsigned char>(text[i]);
  len = 1;
  if (b0 < 0x80) return b0;
  int n;
  uint32_t cp;
  if ((b0 & 0xE0) == 0xC0) { n = 2; cp = b0 & 0x1F; }
  else if ((b0 & 0xF0) == 0xE0) { n = 3; cp = b0 & 0x0F; }
  else if ((b0 & 0xF8) == 0xF0) { n = 4; cp = b0 & 0x07; }
  else return kInvalid;
  if (i + n > text.size()) return kInvalid;
  for (int k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(text[i + k]);
    if ((b & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (b & 0x3F);
  }
  // Overlong forms, surrogates and values beyond U+10FFFF are invalid.
  if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
      (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
    return kInvalid;
  }
  len = static_cast<size_t>(n);
  return cp;
}

// ---- character classes ---------------------------------------------------------------------------
//
// [Note: Unicode classes]
// GPT-2's regex uses \s, \p{L} (letters) and \p{N} (numbers) over all of Unicode. Without a
// Unicode database we classify code points as follows:
//   - U+0000..U+00FF (ASCII and Latin-1): exactly as Unicode does.
//   - \s: Unicode's White_Space code points (U+0009..U+000D, U+0020, U+0085, U+00A0, U+1680,
//     U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000).
//   - \p{N}: ASCII and Latin-1 digits, superscripts and fractions, plus the digit blocks listed in
//     kNumberRanges (Arabic-Indic, Devanagari, super/subscripts, number forms, enclosed numbers,
//     fullwidth digits).
//   - neither (punctuation, symbols, marks): the ranges in kOtherRanges (combining marks, general
//     punctuation, currency, arrows and math, box drawing, dingbats, CJK punctuation, fullwidth
//     punctuation, emoji, variation selectors).
//   - every other code point is a letter.
// Invalid UTF-8 bytes are treated as punctuation, one byte each. So the split is exact for
// ASCII/Latin-1 text, and elsewhere differs from GPT-2's only for code points outside the listed
// ranges that are not letters in Unicode (digits of other scripts, rarer symbols), which then
// join the neighbouring letters' pre-token. Tokens still round-trip: BPE works on the bytes.
enum class CharClass { kSpace, kLetter, kNumber, kOther };

struct Range { uint32_t lo, hi; };

constexpr Range kSpaceRanges[] = {
    {0x09, 0x0D}, {0x20, 0x20}, {0x85, 0x85}, {0xA0, 0xA0}, {0x1680, 0x1680},
    {0x2000, 0x200A}, {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}};
constexpr Range kNumberRanges[] = {
    {0x30, 0x39}, {0xB2, 0xB3}, {0xB9, 0xB9}, {0xBC, 0xBE}, {0x660, 0x669}, {0x6F0, 0x6F9},
    {0x966, 0x96F}, {0x2070, 0x2070}, {0x2074, 0x2079}, {0x2080, 0x2089}, {0x2150, 0x2189},
    {0x2460, 0x249B}, {0x24EA, 0x24FF}, {0x2776, 0x2793}, {0xFF10, 0xFF19}};
constexpr Range kLatin1Letters[] = {
    {0x41, 0x5A}, {0x61, 0x7A}, {0xAA, 0xAA}, {0xB5, 0xB5}, {0xBA, 0xBA},
    {0xC0, 0xD6}, {0xD8, 0xF6}, {0xF8, 0xFF}};
constexpr Range kOtherRanges[] = {
    {0x2C2, 0x2C5}, {0x2D2, 0x2DF}, {0x2E5, 0x2EB}, {0x2ED, 0x2ED}, {0x2EF, 0x36F},
    {0x483, 0x489}, {0x2000, 0x206F}, {0x20A0, 0x20FF}, {0x2190, 0x245F}, {0x2500, 0x2775},
    {0x2794, 0x2BFF}, {0x2E00, 0x2E7F}, {0x3001, 0x3004}, {0x3008, 0x3020}, {0x3030, 0x3030},
    {0x303D, 0x303F}, {0xFE00, 0xFE0F}, {0xFE10, 0xFE1F}, {0xFE30, 0xFE6F}, {0xFF01, 0xFF0F},
    {0xFF1A, 0xFF20}, {0xFF3B, 0xFF40}, {0xFF5B, 0xFF65}, {0xFFF0, 0xFFFF}, {0x1F000, 0x1FAFF},
    {0xE0000, 0xE007F}};

template <size_t N>
bool in_ranges(uint32_t cp, const Range (&ranges)[N]) {
  for (const Range& r : ranges) {
    if (cp >= r.lo && cp <= r.hi) return true;
  }
  return false;
}

CharClass classify(uint32_t cp) {
  if (cp == kInvalid) return CharClass::kOther;
  if (in_ranges(cp, kSpaceRanges)) return CharClass::kSpace;
  if (in_ranges(cp, kNumberRanges)) return CharClass::kNumber;
  if (cp <= 0xFF) return in_ranges(cp, kLatin1Letters) ? CharClass::kLetter : CharClass::kOther;
  if (in_ranges(cp, kOtherRanges)) return CharClass::kOther;
  return CharClass::kLetter;
}

// ---- bytes_to_unicode ----------------------------------------------------------------------------

// GPT-2's table: printable bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) stand for
// themselves; the other 68 bytes, in increasing order, map to U+0100, U+0101, ...
std::array<uint32_t, 256> make_byte_to_unicode() {
  std::array<uint32_t, 256> table{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    table[b] = printable ? b : next++;
  }
  return table;
}

const std::array<uint32_t, 256>& byte_to_unicode_table() {
  static const std::array<uint32_t, 256> table = make_byte_to_unicode();
  return table;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class GPT2BPETokenizer : public Tokenizer {
 public:
  GPT2BPETokenizer(const std::string& vocab_file, const std::string& merge_file)
      : vocab_file_(vocab_file) {
    load_vocab(vocab_file);
    load_merges(merge_file);
    const auto& table = byte_to_unicode_table();
    for (int b = 0; b < 256; ++b) {
      byte_symbol_[b].clear();
      append_utf8(table[b], byte_symbol_[b]);
      unicode_to_byte_[table[b]] = static_cast<uint8_t>(b);
    }
  }

  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<int64_t> ids;
    for (const std::string& piece : gpt2_pretokenize(text)) {
      const std::vector<int64_t>& piece_ids = bpe_ids(piece);
      ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
    }
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string symbols;
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size_ || !has_id_[static_cast<size_t>(id)]) {
        throw std::out_of_range(vocab_file_ + ": id " + std::to_string(id) +
                                " is not in the vocabulary");
      }
      symbols += decoder_[static_cast<size_t>(id)];
    }
    std::string text;
    text.reserve(symbols.size());
    for (size_t i = 0; i < symbols.size();) {
      size_t len;
      const uint32_t cp = next_code_point(symbols, i, len);
      auto it = unicode_to_byte_.find(cp);
      if (it != unicode_to_byte_.end()) {
        text.push_back(static_cast<char>(it->second));
      } else {
        text.append(symbols, i, len);  // not a byte symbol: keep the character itself
      }
      i += len;
    }
    return text;
  }

  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }
  std::string name() const override { return "GPT2BPETokenizer"; }

 private:
  void load_vocab(const std::string& path) {
    nlohmann::json vocab;
    try {
      vocab = nlohmann::json::parse(read_text_file(path));
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(path + ": not valid JSON: " + e.what());
    }
    if (!vocab.is_object()) {
      throw std::runtime_error(path + ": expected a JSON object mapping pieces to ids");
    }
    int64_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0) {
        throw std::runtime_error(path + ": the id of piece \"" + it.key() +
                                 "\" is not a non-negative integer");
      }
      const int64_t id = it.value().get<int64_t>();
      encoder_.emplace(it.key(), id);
      max_id = std::max(max_id, id);
    }
    // Megatron uses len(encoder); for every real vocabulary (ids 0..n-1) that is max_id + 1.
    vocab_size_ = max_id + 1;
    decoder_.assign(static_cast<size_t>(vocab_size_), std::string());
    has_id_.assign(static_cast<size_t>(vocab_size_), false);
    for (const auto& [piece, id] : encoder_) {
      decoder_[static_cast<size_t>(id)] = piece;
      has_id_[static_cast<size_t>(id)] = true;
    }
    auto eod = encoder_.find("<|endoftext|>");
    if (eod == encoder_.end()) {
      throw std::runtime_error(path + ": has no \"<|endoftext|>\" entry, which GPT-2 BPE uses as " +
                               "the end-of-document id");
    }
    eod_ = eod->second;
  }

  void load_merges(const std::string& path) {
    std::istringstream in(read_text_file(path));
    std::string line;
    int64_t line_no = 0;
    int rank = 0;
    while (std::getline(in, line)) {
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line_no == 1 && line.rfind("#version", 0) == 0) continue;
      std::istringstream fields(line);
      std::string left, right, extra;
      if (!(fields >> left)) continue;  // blank line
      if (!(fields >> right) || (fields >> extra)) {
        throw std::runtime_error(path + ":" + std::to_string(line_no) +
                                 ": expected two space-separated pieces, found \"" + line + "\"");
      }
      merge_ranks_.emplace(left + " " + right, rank++);
    }
  }

  // The ids of one pre-token, cached (pre-tokens repeat a lot in text).
  const std::vector<int64_t>& bpe_ids(const std::string& piece) const {
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      auto it = cache_.find(piece);
      if (it != cache_.end()) return it->second;
    }
    std::vector<std::string> word;
    word.reserve(piece.size());
    for (unsigned char b : piece) word.push_back(byte_symbol_[b]);

    while (word.size() > 1) {
      int best_rank = INT_MAX;
      size_t best = 0;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        auto it = merge_ranks_.find(word[i] + " " + word[i + 1]);
        if (it != merge_ranks_.end() && it->second < best_rank) {
          best_rank = it->second;
          best = i;
        }
      }
      if (best_rank == INT_MAX) break;
      const std::string first = word[best], second = word[best + 1];
      // Merge every occurrence of the pair, left to right, without overlaps (as GPT-2's bpe()).
      std::vector<std::string> merged;
      merged.reserve(word.size());
      for (size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
          merged.push_back(first + second);
          i += 2;
        } else {
          merged.push_back(word[i]);
          i += 1;
        }
      }
      word.swap(merged);
    }

    std::vector<int64_t> ids;
    ids.reserve(word.size());
    for (const std::string& symbol : word) {
      auto it = encoder_.find(symbol);
      if (it == encoder_.end()) {
        throw std::runtime_error(vocab_file_ + ": no entry for the BPE piece \"" + symbol +
                                 "\" (the vocabulary and merges do not belong together, or the "
                                 "vocabulary lacks a byte symbol)");
      }
      ids.push_back(it->second);
    }
    std::lock_guard<std::mutex> lock(cache_mutex_);
    // Entries are never erased, so the reference stays valid (unordered_map keeps nodes stable).
    return cache_.emplace(piece, std::move(ids)).first->second;
  }

  std::string vocab_file_;
  std::unordered_map<std::string, int64_t> encoder_;   // piece -> id
  std::vector<std::string> decoder_;                   // [vocab_size] id -> piece
  std::vector<bool> has_id_;                           // [vocab_size]
  std::unordered_map<std::string, int> merge_ranks_;   // "left right" -> rank (lower first)
  std::array<std::string, 256> byte_symbol_;           // byte -> UTF-8 of its code point
  std::unordered_map<uint32_t, uint8_t> unicode_to_byte_;
  int64_t vocab_size_ = 0;
  int64_t eod_ = -1;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace

uint32_t gpt2_byte_to_unicode(uint8_t byte) { return byte_to_unicode_table()[byte]; }

std::vector<std::string> gpt2_pretokenize(std::string_view text) {
  // Code points with their byte spans and classes.
  struct Cp { uint32_t cp; size_t begin, len; CharClass cls; };
  std::vector<Cp> cps;
  cps.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    size_t len;
    const uint32_t cp = next_code_point(text, i, len);
    cps.push_back({cp, i, len, classify(cp)});
    i += len;
  }
  const size_t n = cps.size();
  auto cls = [&](size_t k) { return cps[k].cls; };
  auto is = [&](size_t k, char c) { return k < n && cps[k].cp == static_cast<uint32_t>(c); };

  std::vector<std::string> pieces;
  size_t i = 0;
  auto emit = [&](size_t end) {  // pre-token = code points [i, end)
    const size_t b = cps[i].begin;
    const size_t e = cps[end - 1].begin + cps[end - 1].len;
    pieces.emplace_back(text.substr(b, e - b));
    i = end;
  };
  auto run_end = [&](size_t k, CharClass c) {  // first index >= k not of class c
    while (k < n && cls(k) == c) ++k;
    return k;
  };

  while (i < n) {
    // 's|'t|'re|'ve|'m|'ll|'d
    if (is(i, '\'')) {
      if (is(i + 1, 's') || is(i + 1, 't') || is(i + 1, 'm') || is(i + 1, 'd')) {
        emit(i + 2);
        continue;
      }
      if ((is(i + 1, 'r') && is(i + 2, 'e')) || (is(i + 1, 'v') && is(i + 2, 'e')) ||
          (is(i + 1, 'l') && is(i + 2, 'l'))) {
        emit(i + 3);
        continue;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional U+0020, then a run of one class.
    const size_t start = is(i, ' ') && i + 1 < n && cls(i + 1) != CharClass::kSpace ? i + 1 : i;
    const CharClass c = cls(start);
    if (c != CharClass::kSpace) {
      emit(run_end(start, c));
      continue;
    }
    // `\s+(?!\S)|\s+`: a whitespace run; when a non-space follows, the run's last character is
    // left to start the next pre-token (unless the run is that one character).
    const size_t end = run_end(i, CharClass::kSpace);
    emit(end < n && end - i >= 2 ? end - 1 : end);
  }
  return pieces;
}

std::unique_ptr<Tokenizer> load_gpt2_bpe_tokenizer(const std::string& vocab_file,
                                                   const std::string& merge_file) {
  return std::make_unique<GPT2BPETokenizer>(vocab_file, merge_file);
}

}  // namespace mfsdp
