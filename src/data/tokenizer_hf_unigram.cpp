// The Unigram model of tokenizer.json files (T5, ALBERT, XLNet and other SentencePiece unigram
// conversions), as the tokenizers library encodes (models/unigram, its "optimized" Viterbi pass):
// the segmentation of the pre-token into vocabulary pieces with the highest total score; a
// character no piece starts with costs the lowest score minus 10 and becomes the unk piece, and
// consecutive unknown characters fuse into one. A fused unknown run becomes its <0xNN> byte
// pieces under byte_fallback when all of them exist, else unk_id.
//
// The pieces that start at a position are found by walking a byte trie of the vocabulary (our
// own, a few dozen lines over the sorted pieces, rather than another dependency), which
// stops where no piece continues, as the library's trie does (looking up every prefix up to the
// longest piece made each position cost the square of that length: pieces of 3,000 characters
// took 79 s for 20 KB). The walk can still be long at every position (a piece of 3,000 "a" over a
// text of "a"), so the trie steps of one pre-token are bounded by kLatticeStepsPerByte per byte
// plus kLatticeStepsBase, far above what real vocabularies need (a few per byte; runs of
// whitespace or "=" against pieces of 16 to 64 of them, tens); beyond it encode throws, naming
// the file and model.vocab.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tokenizer_hf_parts.h"

namespace mfsdp::hf {
namespace {

using nlohmann::json;

class Unigram : public Model {
 public:
  Unigram(const json& model, const std::string& file) : file_(file) {
    auto refuse = [&](const std::string& at, const std::string& what) {
      throw std::invalid_argument(file_ + ": model." + at + ": " + what);
    };
    const auto vocab_it = model.find("vocab");
    if (vocab_it == model.end() || !vocab_it->is_array()) {
      refuse("vocab", "expected an array of [piece, score]");
    }
    const json& vocab = *vocab_it;
    if (vocab.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
      refuse("vocab", "too many pieces");
    }
    for (size_t k = 0; k < vocab.size(); ++k) {
      const json& e = vocab[k];
      if (!e.is_array() || e.size() != 2 || !e[0].is_string() || !e[1].is_number()) {
        refuse("vocab[" + std::to_string(k) + "]", "expected [piece, score], found " + describe(e));
      }
      std::string piece = e[0].get<std::string>();
      if (piece.empty()) refuse("vocab[" + std::to_string(k) + "]", "an empty piece");
      const double score = e[1].get<double>();
      min_score_ = std::min(min_score_, score);
      max_piece_bytes_ = std::max(max_piece_bytes_, piece.size());
      ids_[piece] = static_cast<int64_t>(k);  // a repeated piece takes its last id, as the library
      pieces_.push_back(std::move(piece));
      scores_.push_back(score);
    }
    const json unk = model.value("unk_id", json());
    if (unk.is_number_integer()) {
      if (unk.get<int64_t>() < 0 || unk.get<int64_t>() >= static_cast<int64_t>(pieces_.size())) {
        refuse("unk_id", describe(unk) + " is not the index of a piece of model.vocab");
      }
      unk_id_ = unk.get<int64_t>();
    } else if (!unk.is_null()) {
      refuse("unk_id", "expected an integer or null, found " + describe(unk));
    }
    const json fallback = model.value("byte_fallback", json(false));
    if (!fallback.is_boolean()) refuse("byte_fallback", "expected true or false");
    byte_fallback_ = fallback.get<bool>();
    build_trie();
  }

  void encode(std::string_view pretoken, std::vector<int64_t>& ids) const override {
    if (pretoken.empty()) return;
    const bool cacheable = pretoken.size() < kMaxCachedBytes;
    std::string key;
    if (cacheable) {
      key.assign(pretoken);
      std::lock_guard<std::mutex> lock(cache_mutex_);
      auto it = cache_.find(key);
      if (it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int64_t> out;
    for (const std::string& piece : segment(pretoken)) {
      auto it = ids_.find(piece);
      if (it != ids_.end()) {
        out.push_back(it->second);
        continue;
      }
      if (byte_fallback_) {
        std::vector<int64_t> bytes;
        for (char b : piece) {
          auto byte = ids_.find(byte_fallback_piece(static_cast<uint8_t>(b)));
          if (byte == ids_.end()) break;
          bytes.push_back(byte->second);
        }
        if (bytes.size() == piece.size()) {
          out.insert(out.end(), bytes.begin(), bytes.end());
          continue;
        }
      }
      out.push_back(require_unk());
    }
    ids.insert(ids.end(), out.begin(), out.end());
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (cache_.size() < kCacheEntries) cache_.emplace(std::move(key), std::move(out));
    }
  }

  const std::string* piece(int64_t id) const override {
    if (id < 0 || id >= static_cast<int64_t>(pieces_.size())) return nullptr;
    return &pieces_[static_cast<size_t>(id)];
  }
  std::optional<int64_t> id_of(const std::string& piece) const override {
    auto it = ids_.find(piece);
    if (it == ids_.end()) return std::nullopt;
    return it->second;
  }
  int64_t max_id() const override { return static_cast<int64_t>(pieces_.size()) - 1; }

 private:
  static constexpr double kUnkPenalty = 10.0;
  static constexpr size_t kMaxCachedBytes = 256;
  static constexpr size_t kCacheEntries = 10000;
  static constexpr uint64_t kLatticeStepsPerByte = 1024;
  static constexpr uint64_t kLatticeStepsBase = 1'000'000;

  // A node of the byte trie of the pieces: its children are the edges [first, first + count),
  // sorted by byte; `id` is the piece that ends here, -1 for none.
  struct TrieNode {
    uint32_t first = 0;
    uint32_t count = 0;
    int64_t id = -1;
  };

  // Breadth first over the sorted pieces, so that each node's edges are contiguous: a node is the
  // range of pieces that share its prefix.
  void build_trie() {
    std::vector<std::pair<std::string_view, int64_t>> sorted(ids_.begin(), ids_.end());
    std::sort(sorted.begin(), sorted.end());
    struct Pending {
      size_t node, lo, hi, depth;
    };
    std::vector<Pending> queue{{0, 0, sorted.size(), 0}};
    nodes_.emplace_back();
    for (size_t head = 0; head < queue.size(); ++head) {
      const Pending at = queue[head];
      size_t i = at.lo;
      if (i < at.hi && sorted[i].first.size() == at.depth) nodes_[at.node].id = sorted[i++].second;
      nodes_[at.node].first = static_cast<uint32_t>(edge_bytes_.size());
      while (i < at.hi) {
        const char b = sorted[i].first[at.depth];
        size_t j = i;
        while (j < at.hi && sorted[j].first[at.depth] == b) ++j;
        edge_bytes_.push_back(static_cast<uint8_t>(b));
        edge_nodes_.push_back(static_cast<uint32_t>(nodes_.size()));
        queue.push_back({nodes_.size(), i, j, at.depth + 1});
        nodes_.emplace_back();
        i = j;
      }
      nodes_[at.node].count = static_cast<uint32_t>(edge_bytes_.size()) - nodes_[at.node].first;
    }
  }

  // The child of `node` by byte b, or -1.
  int64_t child(size_t node, uint8_t b) const {
    const TrieNode& n = nodes_[node];
    const uint8_t* begin = edge_bytes_.data() + n.first;
    const uint8_t* end = begin + n.count;
    const uint8_t* it = n.count <= 8 ? std::find(begin, end, b) : std::lower_bound(begin, end, b);
    if (it == end || *it != b) return -1;
    return edge_nodes_[static_cast<size_t>(it - edge_bytes_.data())];
  }

  int64_t require_unk() const {
    if (!unk_id_) {
      throw std::runtime_error(file_ +
                               ": model.unk_id is null, and the text has a character no "
                               "piece of model.vocab covers");
    }
    return *unk_id_;
  }

  // The best segmentation, as strings; fused unknown runs are single strings.
  std::vector<std::string> segment(std::string_view s) const {
    struct Node {
      int64_t id = -1;
      double score = 0.0;
      int64_t starts_at = -1;  // -1: not reached yet
    };
    const double unk_score = min_score_ - kUnkPenalty;
    std::vector<Node> best(s.size() + 1);
    uint64_t steps_left = kLatticeStepsBase + kLatticeStepsPerByte * static_cast<uint64_t>(s.size());
    for (size_t start = 0; start < s.size();) {
      const double here = best[start].score;
      const size_t char_len = utf8_char_len(s, start);
      bool single = false;
      // The pieces that start here, shortest first.
      size_t node = 0;
      for (size_t end = start; end < s.size();) {
        const int64_t next = child(node, static_cast<uint8_t>(s[end]));
        if (next < 0) break;
        if (steps_left-- == 0) refuse_lattice(s.size());
        node = static_cast<size_t>(next);
        ++end;
        const int64_t id = nodes_[node].id;
        if (id < 0) continue;
        const size_t len = end - start;
        Node& target = best[end];
        const double candidate = scores_[static_cast<size_t>(id)] + here;
        if (target.starts_at < 0 || candidate > target.score) {
          target = {id, candidate, static_cast<int64_t>(start)};
        }
        single = single || len == char_len;
      }
      if (!single) {
        Node& target = best[start + char_len];
        const double candidate = unk_score + here;
        if (target.starts_at < 0 || candidate > target.score) {
          target = {require_unk(), candidate, static_cast<int64_t>(start)};
        }
      }
      start += char_len;
    }
    std::vector<std::string> out;
    // A run of unknown pieces, found backwards: [unknown_start, unknown_end) once it is over (cut
    // out once; building it by inserting each piece at its front was quadratic in its length).
    size_t unknown_start = 0;
    size_t unknown_end = 0;
    for (size_t end = s.size(); end > 0;) {
      const Node& node = best[end];
      const auto start = static_cast<size_t>(node.starts_at);
      if (unk_id_ && node.id == *unk_id_) {
        if (unknown_start == unknown_end) unknown_end = end;
        unknown_start = start;
      } else {
        if (unknown_start != unknown_end)
          out.emplace_back(s.substr(unknown_start, unknown_end - unknown_start));
        unknown_start = unknown_end = 0;
        out.emplace_back(s.substr(start, end - start));
      }
      end = start;
    }
    if (unknown_start != unknown_end) out.emplace_back(s.substr(unknown_start, unknown_end - unknown_start));
    std::reverse(out.begin(), out.end());
    return out;
  }

  [[noreturn]] void refuse_lattice(size_t bytes) const {
    throw std::runtime_error(
        file_ + ": model.vocab: a pre-token of " + std::to_string(bytes) + " bytes needs more than " +
        std::to_string(kLatticeStepsBase + kLatticeStepsPerByte * bytes) + " trie steps (" +
        std::to_string(kLatticeStepsPerByte) + " per byte plus " + std::to_string(kLatticeStepsBase) +
        "): pieces of up to " + std::to_string(max_piece_bytes_) + " bytes match at most of its positions");
  }

  std::string file_;
  std::vector<std::string> pieces_;
  std::vector<double> scores_;
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<TrieNode> nodes_;
  std::vector<uint8_t> edge_bytes_;
  std::vector<uint32_t> edge_nodes_;  // the node each edge leads to
  std::optional<int64_t> unk_id_;
  bool byte_fallback_ = false;
  double min_score_ = std::numeric_limits<double>::infinity();
  size_t max_piece_bytes_ = 0;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace

std::unique_ptr<Model> load_unigram_model(const json& model, const std::string& file) {
  return std::make_unique<Unigram>(model, file);
}

}  // namespace mfsdp::hf
