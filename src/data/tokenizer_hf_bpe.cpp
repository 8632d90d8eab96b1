// The BPE model of tokenizer.json files, as the tokenizers library runs it (models/bpe): a
// pre-token is split into characters, each looked up in the vocabulary (an unknown character
// becomes its <0xNN> byte pieces under byte_fallback, else the unk token, runs of which are fused
// under fuse_unk, else it is dropped, as the library drops it); then the merges apply, lowest rank
// first and leftmost first among equal ranks. Byte-level tokenizers (GPT-2, Llama-3, Qwen2) reach
// this model with their bytes already mapped to printable characters by the ByteLevel
// pre-tokenizer; SentencePiece-style ones (Llama-2, Mistral) with "▁" for spaces.
#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <queue>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "tokenizer_hf_parts.h"

namespace mfsdp::hf {
namespace {

using nlohmann::json;

uint64_t pair_key(int64_t left, int64_t right) {
  return (static_cast<uint64_t>(left) << 32) | static_cast<uint64_t>(right);
}

class Bpe : public Model {
 public:
  Bpe(const json& model, const std::string& file) : file_(file) {
    auto refuse = [&](const std::string& at, const std::string& what) {
      throw std::invalid_argument(file_ + ": model." + at + ": " + what);
    };
    const json dropout = model.value("dropout", json());
    if (!(dropout.is_null() || (dropout.is_number() && dropout.get<double>() == 0.0))) {
      refuse("dropout", "BPE dropout (random merges) is not supported, found " + describe(dropout));
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const json v = model.value(key, json());
      if (!(v.is_null() || (v.is_string() && v.get<std::string>().empty()))) {
        refuse(key,
               "subword prefixes and suffixes (WordPiece-style BPE) are not supported, found " + describe(v));
      }
    }
    auto flag = [&](const char* key) {
      const json v = model.value(key, json());
      if (v.is_null()) return false;
      if (!v.is_boolean()) refuse(key, "expected true or false, found " + describe(v));
      return v.get<bool>();
    };
    fuse_unk_ = flag("fuse_unk");
    byte_fallback_ = flag("byte_fallback");
    ignore_merges_ = flag("ignore_merges");
    const json unk = model.value("unk_token", json());
    if (unk.is_string()) {
      unk_token_ = unk.get<std::string>();
    } else if (!unk.is_null()) {
      refuse("unk_token", "expected a string or null, found " + describe(unk));
    }

    const auto vocab_it = model.find("vocab");
    if (vocab_it == model.end() || !vocab_it->is_object()) {
      refuse("vocab", "expected an object mapping pieces to ids");
    }
    for (auto it = vocab_it->begin(); it != vocab_it->end(); ++it) {
      const json& id = it.value();
      // Ids index 32-bit pairs below, and no real vocabulary comes near 2^31.
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        refuse("vocab[\"" + it.key() + "\"]", "the id " + describe(id) + " is not an integer in [0, 2^31)");
      }
      const int64_t value = id.get<int64_t>();
      auto [prev, inserted] = pieces_.emplace(value, it.key());
      if (!inserted) {
        refuse("vocab[\"" + it.key() + "\"]",
               "id " + std::to_string(value) + " is also the id of \"" + prev->second + "\"");
      }
      vocab_[it.key()] = value;
      max_id_ = std::max(max_id_, value);
    }
    for (int b = 0; b < 256; ++b) {
      auto it = vocab_.find(byte_fallback_piece(static_cast<uint8_t>(b)));
      byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
    }

    const auto merges_it = model.find("merges");
    if (merges_it == model.end() || !merges_it->is_array()) refuse("merges", "expected an array");
    const json& merges = *merges_it;
    merges_.reserve(merges.size());
    for (size_t k = 0; k < merges.size(); ++k) {
      const json& m = merges[k];
      const std::string at = "merges[" + std::to_string(k) + "]";
      std::string left, right;
      // "left right" (tokenizers < 0.20) or ["left", "right"].
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
            s.find(' ', space + 1) != std::string::npos) {
          refuse(at, "expected \"left right\", found " + describe(m));
        }
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      } else {
        refuse(at, "expected \"left right\" or [left, right], found " + describe(m));
      }
      const auto l = vocab_.find(left);
      const auto r = vocab_.find(right);
      const auto merged = vocab_.find(left + right);
      for (const auto* piece : {&left, &right}) {
        if (vocab_.find(*piece) == vocab_.end()) refuse(at, "\"" + *piece + "\" is not in model.vocab");
      }
      if (merged == vocab_.end()) refuse(at, "\"" + left + right + "\" is not in model.vocab");
      // A repeated pair takes its last rank, as the library's map does.
      merges_[pair_key(l->second, r->second)] = {static_cast<uint32_t>(k), merged->second};
    }
  }

  void encode(std::string_view pretoken, std::vector<int64_t>& ids) const override {
    if (pretoken.empty()) return;
    std::string key(pretoken);
    if (ignore_merges_) {
      auto it = vocab_.find(key);
      if (it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    const bool cacheable = pretoken.size() < kMaxCachedBytes;
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      auto it = cache_.find(key);
      if (it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int64_t> out = merge_word(pretoken);
    ids.insert(ids.end(), out.begin(), out.end());
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (cache_.size() < kCacheEntries) cache_.emplace(std::move(key), std::move(out));
    }
  }

  const std::string* piece(int64_t id) const override {
    auto it = pieces_.find(id);
    return it == pieces_.end() ? nullptr : &it->second;
  }
  std::optional<int64_t> id_of(const std::string& piece) const override {
    auto it = vocab_.find(piece);
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
  }
  int64_t max_id() const override { return max_id_; }

 private:
  // The library's cache bounds (utils/cache.rs).
  static constexpr size_t kMaxCachedBytes = 256;
  static constexpr size_t kCacheEntries = 10000;

  struct Symbol {
    int64_t id;
    int64_t prev;
    int64_t next;
    size_t len;  // bytes of the pre-token it covers; 0 once merged into its left neighbour
  };
  struct Merge {
    uint32_t rank;
    size_t pos;
    int64_t new_id;
    // std::priority_queue pops the largest: make that the lowest rank, then the leftmost.
    bool operator<(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };

  int64_t unk_id() const {
    auto it = vocab_.find(*unk_token_);
    if (it == vocab_.end()) {
      throw std::runtime_error(file_ + ": model.unk_token \"" + *unk_token_ +
                               "\" is not in model.vocab (needed for a character it lacks)");
    }
    return it->second;
  }

  std::vector<int64_t> merge_word(std::string_view w) const {
    std::vector<Symbol> symbols;
    auto add = [&](int64_t id, size_t len) {
      const auto n = static_cast<int64_t>(symbols.size());
      if (!symbols.empty()) symbols.back().next = n;
      symbols.push_back({id, n - 1, -1, len});
    };
    int64_t unk = -1;    // a pending unk token ...
    size_t unk_len = 0;  // ... and the bytes it covers
    for (size_t i = 0; i < w.size();) {
      const size_t len = utf8_char_len(w, i);
      const std::string_view c = w.substr(i, len);
      i += len;
      auto it = vocab_.find(std::string(c));
      if (it != vocab_.end()) {
        if (unk >= 0) add(unk, unk_len);
        unk = -1;
        add(it->second, len);
        continue;
      }
      if (byte_fallback_) {
        bool all = true;
        for (char b : c) all = all && byte_ids_[static_cast<uint8_t>(b)] >= 0;
        if (all) {
          // As the library: a pending unk is not flushed first.
          for (char b : c) add(byte_ids_[static_cast<uint8_t>(b)], 1);
          continue;
        }
      }
      if (unk_token_) {
        if (unk >= 0 && fuse_unk_) {
          unk_len += len;
        } else {
          if (unk >= 0) add(unk, unk_len);
          unk = unk_id();
          unk_len = len;
        }
      }
    }
    if (unk >= 0) add(unk, unk_len);

    std::priority_queue<Merge> queue;
    auto lookup = [&](int64_t left, int64_t right) -> const std::pair<uint32_t, int64_t>* {
      auto it = merges_.find(pair_key(left, right));
      return it == merges_.end() ? nullptr : &it->second;
    };
    for (size_t k = 0; k + 1 < symbols.size(); ++k) {
      if (const auto* m = lookup(symbols[k].id, symbols[k + 1].id)) queue.push({m->first, k, m->second});
    }
    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      Symbol& cur = symbols[top.pos];
      if (cur.len == 0 || cur.next == -1) continue;
      const auto next_pos = static_cast<size_t>(cur.next);
      const Symbol right = symbols[next_pos];
      // A stale entry: the pair changed since it was queued.
      const auto* m = lookup(cur.id, right.id);
      if (m == nullptr || m->second != top.new_id) continue;
      cur.id = top.new_id;
      cur.len += right.len;
      cur.next = right.next;
      symbols[next_pos].len = 0;
      if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = static_cast<int64_t>(top.pos);
      if (cur.prev >= 0) {
        const auto prev = static_cast<size_t>(cur.prev);
        if (const auto* pm = lookup(symbols[prev].id, cur.id)) queue.push({pm->first, prev, pm->second});
      }
      if (cur.next >= 0) {
        if (const auto* nm = lookup(cur.id, symbols[static_cast<size_t>(cur.next)].id)) {
          queue.push({nm->first, top.pos, nm->second});
        }
      }
    }
    std::vector<int64_t> out;
    for (const Symbol& s : symbols)
      if (s.len != 0) out.push_back(s.id);
    return out;
  }

  std::string file_;
  std::unordered_map<std::string, int64_t> vocab_;
  std::unordered_map<int64_t, std::string> pieces_;
  std::unordered_map<uint64_t, std::pair<uint32_t, int64_t>> merges_;  // pair -> (rank, new id)
  std::array<int64_t, 256> byte_ids_{};
  std::optional<std::string> unk_token_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  int64_t max_id_ = -1;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;  // pre-token -> ids
};

}  // namespace

std::string byte_fallback_piece(uint8_t byte) {
  static const char kHex[] = "0123456789ABCDEF";
  return std::string("<0x") + kHex[byte >> 4] + kHex[byte & 15] + ">";
}

std::unique_ptr<Model> load_bpe_model(const json& model, const std::string& file) {
  return std::make_unique<Bpe>(model, file);
}

}  // namespace mfsdp::hf
