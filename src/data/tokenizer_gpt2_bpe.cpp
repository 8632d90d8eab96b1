// GPT-2's byte-level BPE (vocab.json + merges.txt), as Megatron's GPT2BPETokenizer
// (megatron/training/tokenizer/gpt2_tokenization.py, itself OpenAI's encoder.py).
//
// encode(text): split the text into pre-tokens with GPT-2's regex (gpt2_pretokenize), map each
// pre-token's bytes to printable code points (bytes_to_unicode), apply the BPE merges by rank,
// and look the resulting pieces up in vocab.json. decode(ids): concatenate the pieces and map the
// code points back to bytes. The text "<|endoftext|>" inside a document is encoded as ordinary
// text, as Megatron does; only --append-eod adds the EOD id.
#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <climits>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "mfsdp/base/json_parse.h"
#include "mfsdp/data/tokenizer.h"
#include "tokenizer_hf_parts.h"

namespace mfsdp {
namespace {

// ---- UTF-8 and character classes -------------------------------------------------------------

using hf::append_utf8;  // one UTF-8 encoder for every tokenizer (tokenizer_hf_parts.h)

// Decodes the code point at text[i]; sets `len` to its byte length. An invalid or truncated
// sequence yields kInvalid with len 1 (the byte stands alone).
constexpr uint32_t kInvalid = 0xFFFFFFFFu;
uint32_t next_code_point(std::string_view text, size_t i, size_t& len) {
  len = hf::utf8_char_len(text, i);
  return hf::utf8_code_point(text, i);
}

// [Note: Unicode classes]
// The pre-tokenisation regexes use \s, \p{L} (letters) and \p{N} (numbers) over all of Unicode:
//   - \s: Unicode's White_Space code points (hf::is_white_space);
//   - \p{L}: general categories Lu, Ll, Lt, Lm, Lo; \p{N}: Nd, Nl, No (utf8proc's tables,
//     Unicode 15 in Debian 12's libutf8proc);
//   - everything else (punctuation, symbols, marks such as Devanagari vowel signs, format and
//     private-use characters, unassigned code points) is "other".
// Invalid UTF-8 bytes are "other", one byte each (the tokenizers library never sees them: Python
// strings are valid Unicode).
enum class CharClass { kSpace = 0, kLetter = 1, kNumber = 2, kOther = 3 };

CharClass classify(uint32_t cp) {
  if (cp == kInvalid || cp > 0x10FFFF) return CharClass::kOther;
  if (hf::is_white_space(cp)) return CharClass::kSpace;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: return CharClass::kLetter;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO: return CharClass::kNumber;
    default: return CharClass::kOther;
  }
}

// ---- bytes_to_unicode ----------------------------------------------------------------------------

// GPT-2's own byte-to-character table (encoder.py's bytes_to_unicode), not Unicode data: no
// Unicode library has it, so it stays here (tokenizer.json files store pieces in its alphabet).
// Printable bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) stand for
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

// Megatron's GPT2BPETokenizer: vocab.json + merges.txt over ByteLevelBpe.
class GPT2BPETokenizer : public Tokenizer {
 public:
  GPT2BPETokenizer(const std::string& vocab_file, const std::string& merge_file)
      : vocab_file_(vocab_file) {
    auto vocab = load_vocab(vocab_file);
    bpe_ = std::make_unique<ByteLevelBpe>(vocab, load_merges(merge_file), /*ignore_merges=*/false,
                                          vocab_file);
    // Megatron uses len(encoder); for every real vocabulary (ids 0..n-1) that is max_id + 1.
    vocab_size_ = bpe_->max_id() + 1;
    const std::optional<int64_t> eod = bpe_->id_of("<|endoftext|>");
    if (!eod) {
      throw std::runtime_error(vocab_file + ": has no \"<|endoftext|>\" entry, which GPT-2 BPE " +
                               "uses as the end-of-document id");
    }
    eod_ = *eod;
  }

  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<int64_t> ids;
    for (const std::string& piece : gpt2_pretokenize(text)) bpe_->encode(piece, ids);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string text;
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size_ || !bpe_->decode(id, text)) {
        throw std::out_of_range(vocab_file_ + ": id " + std::to_string(id) +
                                " is not in the vocabulary");
      }
    }
    return text;
  }

  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }
  std::string name() const override { return "GPT2BPETokenizer"; }
  std::optional<int64_t> special_token_id(std::string_view token) const override {
    if (token == "<|endoftext|>") return eod_;
    return std::nullopt;
  }

 private:
  static std::vector<std::pair<std::string, int64_t>> load_vocab(const std::string& path) {
    nlohmann::json vocab;
    try {
      vocab = parse_json(read_text_file(path));
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(path + ": not valid JSON: " + e.what());
    }
    if (!vocab.is_object()) {
      throw std::runtime_error(path + ": expected a JSON object mapping pieces to ids");
    }
    std::vector<std::pair<std::string, int64_t>> out;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0) {
        throw std::runtime_error(path + ": the id of piece \"" + it.key() +
                                 "\" is not a non-negative integer");
      }
      out.emplace_back(it.key(), it.value().get<int64_t>());
    }
    return out;
  }

  static std::vector<std::pair<std::string, std::string>> load_merges(const std::string& path) {
    std::istringstream in(read_text_file(path));
    std::string line;
    int64_t line_no = 0;
    std::vector<std::pair<std::string, std::string>> merges;
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
      merges.emplace_back(std::move(left), std::move(right));
    }
    return merges;
  }

  std::string vocab_file_;
  std::unique_ptr<ByteLevelBpe> bpe_;
  int64_t vocab_size_ = 0;
  int64_t eod_ = -1;
};

}  // namespace

// ---- ByteLevelBpe --------------------------------------------------------------------------------

struct ByteLevelBpe::Impl {
  std::string source;
  bool ignore_merges = false;
  std::unordered_map<std::string, int64_t> encoder;   // piece -> id
  std::unordered_map<int64_t, std::string> decoder;   // id -> the bytes it stands for
  std::unordered_map<std::string, int> merge_ranks;   // "left right" -> rank (lower first)
  std::array<std::string, 256> byte_symbol;           // byte -> UTF-8 of its code point
  int64_t max_id = -1;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache;  // pre-token -> ids
};

ByteLevelBpe::ByteLevelBpe(const std::vector<std::pair<std::string, int64_t>>& vocab,
                           const std::vector<std::pair<std::string, std::string>>& merges,
                           bool ignore_merges, std::string source)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.source = std::move(source);
  m.ignore_merges = ignore_merges;
  const auto& table = byte_to_unicode_table();
  std::unordered_map<uint32_t, uint8_t> unicode_to_byte;
  for (int b = 0; b < 256; ++b) {
    append_utf8(table[b], m.byte_symbol[b]);
    unicode_to_byte[table[b]] = static_cast<uint8_t>(b);
  }
  for (const auto& [piece, id] : vocab) {
    m.encoder[piece] = id;
    m.max_id = std::max(m.max_id, id);
    // The bytes of the piece: each symbol back to its byte; a character that is no byte symbol
    // (not produced by byte-level pre-tokenisation) stands for its own UTF-8.
    std::string bytes;
    for (size_t i = 0; i < piece.size();) {
      size_t len;
      const uint32_t cp = next_code_point(piece, i, len);
      auto it = unicode_to_byte.find(cp);
      if (it != unicode_to_byte.end()) {
        bytes.push_back(static_cast<char>(it->second));
      } else {
        bytes.append(piece, i, len);
      }
      i += len;
    }
    m.decoder[id] = std::move(bytes);
  }
  int rank = 0;
  for (const auto& [left, right] : merges) m.merge_ranks.emplace(left + " " + right, rank++);
}

ByteLevelBpe::~ByteLevelBpe() = default;

void ByteLevelBpe::encode(std::string_view pretoken, std::vector<int64_t>& out) const {
  const Impl& m = *impl_;
  const std::string key(pretoken);
  {
    std::lock_guard<std::mutex> lock(m.cache_mutex);
    auto it = m.cache.find(key);
    if (it != m.cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<std::string> word;
  word.reserve(pretoken.size());
  for (unsigned char b : pretoken) word.push_back(m.byte_symbol[b]);

  std::vector<int64_t> ids;
  std::string whole;
  for (const std::string& symbol : word) whole += symbol;
  auto direct = m.ignore_merges ? m.encoder.find(whole) : m.encoder.end();
  if (direct != m.encoder.end()) {
    ids.push_back(direct->second);
  } else {
    while (word.size() > 1) {
      int best_rank = INT_MAX;
      size_t best = 0;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        auto it = m.merge_ranks.find(word[i] + " " + word[i + 1]);
        if (it != m.merge_ranks.end() && it->second < best_rank) {
          best_rank = it->second;
          best = i;
        }
      }
      if (best_rank == INT_MAX) break;
      const std::string first = word[best], second = word[best + 1];
      // Merge every occurrence of the pair, left to right, without overlaps (as GPT-2's bpe();
      // the tokenizers library's priority queue gives the same result for trained merges).
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
    ids.reserve(word.size());
    for (const std::string& symbol : word) {
      auto it = m.encoder.find(symbol);
      if (it == m.encoder.end()) {
        throw std::runtime_error(m.source + ": no entry for the BPE piece \"" + symbol +
                                 "\" (the vocabulary and merges do not belong together, or the "
                                 "vocabulary lacks a byte symbol)");
      }
      ids.push_back(it->second);
    }
  }
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(m.cache_mutex);
  m.cache.emplace(key, std::move(ids));
}

bool ByteLevelBpe::decode(int64_t id, std::string& out) const {
  auto it = impl_->decoder.find(id);
  if (it == impl_->decoder.end()) return false;
  out += it->second;
  return true;
}

std::optional<int64_t> ByteLevelBpe::id_of(const std::string& piece) const {
  auto it = impl_->encoder.find(piece);
  if (it == impl_->encoder.end()) return std::nullopt;
  return it->second;
}

int64_t ByteLevelBpe::max_id() const { return impl_->max_id; }

uint32_t gpt2_byte_to_unicode(uint8_t byte) { return byte_to_unicode_table()[byte]; }

namespace {

// The code points of a text with their byte spans and classes, and the helpers both
// pre-tokenisers match with.
struct CodePoints {
  struct Cp { uint32_t cp; size_t begin, len; CharClass cls; };
  std::string_view text;
  std::vector<Cp> cps;
  std::vector<std::string> pieces;
  size_t i = 0;  // start of the next pre-token

  explicit CodePoints(std::string_view t) : text(t) {
    cps.reserve(text.size());
    for (size_t k = 0; k < text.size();) {
      size_t len;
      const uint32_t cp = next_code_point(text, k, len);
      cps.push_back({cp, k, len, classify(cp)});
      k += len;
    }
  }
  size_t size() const { return cps.size(); }
  CharClass cls(size_t k) const { return cps[k].cls; }
  bool is(size_t k, char c) const { return k < cps.size() && cps[k].cp == static_cast<uint32_t>(c); }
  bool is_newline(size_t k) const { return is(k, '\r') || is(k, '\n'); }
  // The pre-token is code points [i, end).
  void emit(size_t end) {
    const size_t b = cps[i].begin;
    const size_t e = cps[end - 1].begin + cps[end - 1].len;
    pieces.emplace_back(text.substr(b, e - b));
    i = end;
  }
  // The first index >= k not of class c.
  size_t run_end(size_t k, CharClass c) const {
    while (k < cps.size() && cls(k) == c) ++k;
    return k;
  }
  // `\s+(?!\S)|\s+` at i: a whitespace run; when a non-space follows, the run's last character
  // is left to start the next pre-token (unless the run is that one character).
  void emit_whitespace() {
    const size_t end = run_end(i, CharClass::kSpace);
    emit(end < size() && end - i >= 2 ? end - 1 : end);
  }
};

}  // namespace

std::vector<std::string> gpt2_pretokenize(std::string_view text) {
  CodePoints t(text);
  const size_t n = t.size();
  size_t& i = t.i;
  auto cls = [&](size_t k) { return t.cls(k); };
  auto is = [&](size_t k, char c) { return t.is(k, c); };
  auto emit = [&](size_t end) { t.emit(end); };
  auto run_end = [&](size_t k, CharClass c) { return t.run_end(k, c); };

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
    // `\s+(?!\S)|\s+`
    t.emit_whitespace();
  }
  return std::move(t.pieces);
}

std::vector<std::string> llama3_pretokenize(std::string_view text, int max_digits) {
  CodePoints t(text);
  const size_t n = t.size();
  size_t& i = t.i;
  // Case-insensitive ASCII letter test; (?i) also lets 's match U+017F (long s), which Unicode
  // case-folds to 's'.
  auto is_ci = [&](size_t k, char lower) {
    return t.is(k, lower) || t.is(k, static_cast<char>(lower - 'a' + 'A')) ||
           (lower == 's' && k < n && t.cps[k].cp == 0x17F);
  };
  while (i < n) {
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (t.is(i, '\'')) {
      if (is_ci(i + 1, 's') || is_ci(i + 1, 't') || is_ci(i + 1, 'm') || is_ci(i + 1, 'd')) {
        t.emit(i + 2);
        continue;
      }
      if ((is_ci(i + 1, 'r') && is_ci(i + 2, 'e')) || (is_ci(i + 1, 'v') && is_ci(i + 2, 'e')) ||
          (is_ci(i + 1, 'l') && is_ci(i + 2, 'l'))) {
        t.emit(i + 3);
        continue;
      }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+: letters, after at most one character that is no newline,
    // letter or number (a space, tab, punctuation mark).
    if (t.cls(i) == CharClass::kLetter) {
      t.emit(t.run_end(i, CharClass::kLetter));
      continue;
    }
    if (!t.is_newline(i) && t.cls(i) != CharClass::kNumber && i + 1 < n &&
        t.cls(i + 1) == CharClass::kLetter) {
      t.emit(t.run_end(i + 1, CharClass::kLetter));
      continue;
    }
    // \p{N}{1,3}
    if (t.cls(i) == CharClass::kNumber) {
      size_t end = i;
      while (end < n && end - i < static_cast<size_t>(max_digits) &&
             t.cls(end) == CharClass::kNumber) {
        ++end;
      }
      t.emit(end);
      continue;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`: punctuation and symbols (after an optional U+0020), with
    // the newlines that follow them.
    const size_t start = t.is(i, ' ') && i + 1 < n && t.cls(i + 1) == CharClass::kOther ? i + 1 : i;
    if (t.cls(start) == CharClass::kOther) {
      size_t end = t.run_end(start, CharClass::kOther);
      while (t.is_newline(end)) ++end;
      t.emit(end);
      continue;
    }
    // Here cps[i] is whitespace. `\s*[\r\n]+`: the whitespace run up to its last newline.
    const size_t ws_end = t.run_end(i, CharClass::kSpace);
    size_t last_newline = ws_end;
    for (size_t k = i; k < ws_end; ++k) {
      if (t.is_newline(k)) last_newline = k;
    }
    if (last_newline < ws_end) {
      t.emit(last_newline + 1);
      continue;
    }
    // `\s+(?!\S)|\s+`
    t.emit_whitespace();
  }
  return std::move(t.pieces);
}

std::unique_ptr<Tokenizer> load_gpt2_bpe_tokenizer(const std::string& vocab_file,
                                                   const std::string& merge_file) {
  return std::make_unique<GPT2BPETokenizer>(vocab_file, merge_file);
}

}  // namespace mfsdp
