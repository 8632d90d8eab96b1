// Hugging Face tokenizer.json for byte-level BPE (GPT-2, Llama-3, Qwen2), as the `tokenizers`
// library encodes it (Tokenizer.encode(text, add_special_tokens=False)):
//   1. added tokens (<|im_end|>, ...) are found in the raw text, leftmost then longest first, and
//      become their ids; the text between them is processed on its own (AddedVocabulary);
//   2. each such segment is pre-tokenised: Split steps cut it with a regex (hand-written here:
//      gpt2_pretokenize / llama3_pretokenize), then ByteLevel adds a leading space to each piece
//      when add_prefix_space and, when use_regex, cuts it again with GPT-2's regex;
//   3. each piece goes through the BPE model (ByteLevelBpe, shared with GPT2BPETokenizer).
// Only what these tokenizers use is accepted; everything else is refused by its JSON path, so a
// tokenizer.json never loads into something that encodes differently (docs/data.md).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "mfsdp/data/tokenizer.h"

namespace mfsdp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The regexes of the Split pre-tokenizer that are implemented by hand.
const char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char kLlama3Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char kQwen2Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json_file(const std::string& path) {
  try {
    return json::parse(read_file(path));
  } catch (const json::exception& e) {
    throw std::runtime_error(path + ": not valid JSON: " + e.what());
  }
}

std::string describe(const json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

// One pre-tokenisation step.
struct PreStep {
  enum Kind { kSplitGpt2, kSplitLlama3, kByteLevel } kind;
  int max_digits = 3;             // kSplitLlama3: 3 for Llama-3, 1 for Qwen2
  bool add_prefix_space = false;  // kByteLevel
  bool use_regex = true;          // kByteLevel
};

class HuggingFaceTokenizer : public Tokenizer {
 public:
  explicit HuggingFaceTokenizer(const std::string& path) {
    file_ = fs::is_directory(path) ? (fs::path(path) / "tokenizer.json").string() : path;
    if (!fs::exists(file_)) {
      throw std::runtime_error(file_ + ": no such file (--tokenizer-model of HuggingFaceTokenizer "
                                       "is a tokenizer.json or the folder holding one)");
    }
    const json root = parse_json_file(file_);
    if (!root.is_object()) unsupported("", "expected a JSON object");
    load_normalizer(root);
    load_pre_tokenizer(root);
    load_decoder(root);
    load_model(root);
    load_added_tokens(root);
    vocab_size_ = bpe_->max_id() + 1;
    for (const auto& [id, content] : added_by_id_) vocab_size_ = std::max(vocab_size_, id + 1);
    eod_ = find_eod();
  }

  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<int64_t> ids;
    size_t segment = 0;  // start of the text not yet encoded
    for (size_t pos = 0; pos < text.size();) {
      const Added* match = added_at(text, pos);
      if (match == nullptr) {
        ++pos;
        continue;
      }
      encode_segment(text.substr(segment, pos - segment), ids);
      ids.push_back(match->id);
      pos += match->content.size();
      segment = pos;
    }
    encode_segment(text.substr(segment), ids);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string text;
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size_) {
        throw std::out_of_range(file_ + ": id " + std::to_string(id) + " is outside [0, " +
                                std::to_string(vocab_size_) + ")");
      }
      // Added tokens decode to their text, as they were matched in it.
      auto added = added_by_id_.find(id);
      if (added != added_by_id_.end()) {
        text += added->second;
      } else if (!bpe_->decode(id, text)) {
        throw std::out_of_range(file_ + ": id " + std::to_string(id) + " is not in the vocabulary");
      }
    }
    return text;
  }

  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }
  std::string name() const override { return "HuggingFaceTokenizer"; }
  std::optional<int64_t> special_token_id(std::string_view token) const override {
    auto it = added_by_content_.find(std::string(token));
    if (it == added_by_content_.end()) return std::nullopt;
    return it->second;
  }

 private:
  struct Added {
    std::string content;
    int64_t id;
  };

  [[noreturn]] void unsupported(const std::string& json_path, const std::string& what) const {
    throw std::invalid_argument(file_ + ": " + (json_path.empty() ? "" : json_path + ": ") + what);
  }

  // ---- loading -----------------------------------------------------------------------------------

  void load_normalizer(const json& root) {
    const json normalizer = root.value("normalizer", json());
    if (normalizer.is_null()) return;
    const std::string type = normalizer.value("type", "");
    // NFC leaves NFC text as it is, and text is NFC almost always; we do not carry Unicode's
    // composition tables, so input is taken as already NFC (docs/data.md).
    if (type == "NFC") return;
    unsupported("normalizer.type", "unsupported normalizer \"" + type +
                                       "\" (supported: none, NFC)");
  }

  void add_pre_step(const json& p, const std::string& at) {
    if (!p.is_object()) unsupported(at, "expected an object, found " + describe(p));
    const std::string type = p.value("type", "");
    if (type == "Sequence") {
      const json list = p.value("pretokenizers", json());
      if (!list.is_array()) unsupported(at + ".pretokenizers", "expected an array");
      for (size_t k = 0; k < list.size(); ++k)
        add_pre_step(list[k], at + ".pretokenizers[" + std::to_string(k) + "]");
    } else if (type == "ByteLevel") {
      PreStep step{PreStep::kByteLevel};
      step.add_prefix_space = p.value("add_prefix_space", false);
      step.use_regex = p.value("use_regex", true);
      pre_steps_.push_back(step);
    } else if (type == "Split") {
      if (p.value("behavior", "") != "Isolated") {
        unsupported(at + ".behavior", "Split behavior " + describe(p.value("behavior", json())) +
                                          " is not supported (supported: Isolated)");
      }
      if (p.value("invert", false)) unsupported(at + ".invert", "inverted Split is not supported");
      const json pattern = p.value("pattern", json());
      if (!pattern.is_object() || !pattern.contains("Regex") || !pattern["Regex"].is_string()) {
        unsupported(at + ".pattern", "expected {\"Regex\": ...}, found " + describe(pattern));
      }
      const std::string regex = pattern["Regex"].get<std::string>();
      if (regex == kGpt2Pattern) {
        pre_steps_.push_back({PreStep::kSplitGpt2});
      } else if (regex == kLlama3Pattern || regex == kQwen2Pattern) {
        PreStep step{PreStep::kSplitLlama3};
        step.max_digits = regex == kLlama3Pattern ? 3 : 1;
        pre_steps_.push_back(step);
      } else {
        unsupported(at + ".pattern.Regex",
                    "unsupported regex \"" + regex +
                        "\" (implemented by hand: GPT-2's, Llama-3's and Qwen2's)");
      }
    } else {
      unsupported(at + ".type", "unsupported pre-tokenizer \"" + type +
                                    "\" (supported: ByteLevel, Split, Sequence)");
    }
  }

  void load_pre_tokenizer(const json& root) {
    const json p = root.value("pre_tokenizer", json());
    if (p.is_null()) {
      unsupported("pre_tokenizer", "missing; a byte-level BPE needs a ByteLevel pre-tokenizer");
    }
    add_pre_step(p, "pre_tokenizer");
    for (size_t k = 0; k < pre_steps_.size(); ++k) {
      const bool last = k + 1 == pre_steps_.size();
      if ((pre_steps_[k].kind == PreStep::kByteLevel) != last) {
        unsupported("pre_tokenizer", "ByteLevel must be the last pre-tokenizer, exactly once "
                                     "(a byte-level BPE maps bytes to symbols at the end)");
      }
    }
  }

  void load_decoder(const json& root) {
    const json d = root.value("decoder", json());
    if (!d.is_object()) unsupported("decoder", "expected a ByteLevel decoder, found " + describe(d));
    const json type = d.value("type", json());
    if (type != "ByteLevel") {
      unsupported("decoder.type", "unsupported decoder " + describe(type) + " (supported: ByteLevel)");
    }
  }

  void load_model(const json& root) {
    const auto model_it = root.find("model");
    if (model_it == root.end() || !model_it->is_object()) {
      unsupported("model", "missing or not an object");
    }
    const json& model = *model_it;
    const std::string type = model.value("type", "");
    if (type != "BPE") {
      unsupported("model.type", "unsupported model type \"" + type + "\" (supported: BPE)");
    }
    auto empty_or_null = [&](const char* key) {
      const json v = model.value(key, json());
      if (!(v.is_null() || (v.is_string() && v.get<std::string>().empty()))) {
        unsupported(std::string("model.") + key, "unsupported value " + describe(v));
      }
    };
    empty_or_null("continuing_subword_prefix");
    empty_or_null("end_of_word_suffix");
    const json dropout = model.value("dropout", json());
    if (!(dropout.is_null() || (dropout.is_number() && dropout.get<double>() == 0.0))) {
      unsupported("model.dropout", "BPE dropout is not supported (found " + describe(dropout) + ")");
    }
    if (model.value("byte_fallback", false)) {
      unsupported("model.byte_fallback", "byte_fallback BPE (SentencePiece-style) is not supported");
    }
    static const json kNull;
    const json& vocab = model.contains("vocab") ? model["vocab"] : kNull;
    if (!vocab.is_object()) unsupported("model.vocab", "expected an object mapping pieces to ids");
    std::vector<std::pair<std::string, int64_t>> pieces;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0) {
        unsupported("model.vocab[\"" + it.key() + "\"]", "the id is not a non-negative integer");
      }
      pieces.emplace_back(it.key(), it.value().get<int64_t>());
    }
    const json& merges = model.contains("merges") ? model["merges"] : kNull;
    if (!merges.is_array()) unsupported("model.merges", "expected an array");
    std::vector<std::pair<std::string, std::string>> pairs;
    pairs.reserve(merges.size());
    for (size_t k = 0; k < merges.size(); ++k) {
      const json& m = merges[k];
      // "left right" (tokenizers < 0.20) or ["left", "right"].
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
            s.find(' ', space + 1) != std::string::npos) {
          unsupported("model.merges[" + std::to_string(k) + "]",
                      "expected \"left right\", found " + describe(m));
        }
        pairs.emplace_back(s.substr(0, space), s.substr(space + 1));
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        pairs.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else {
        unsupported("model.merges[" + std::to_string(k) + "]",
                    "expected \"left right\" or [left, right], found " + describe(m));
      }
    }
    bpe_ = std::make_unique<ByteLevelBpe>(pieces, pairs, model.value("ignore_merges", false), file_);
  }

  void load_added_tokens(const json& root) {
    if (!root.contains("added_tokens")) return;
    const json& list = root["added_tokens"];
    if (!list.is_array()) unsupported("added_tokens", "expected an array");
    for (size_t k = 0; k < list.size(); ++k) {
      const std::string at = "added_tokens[" + std::to_string(k) + "]";
      const json& t = list[k];
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
          t["id"].get<int64_t>() < 0 || !t.contains("content") || !t["content"].is_string() ||
          t["content"].get<std::string>().empty()) {
        unsupported(at, "expected {\"id\": non-negative integer, \"content\": non-empty string}");
      }
      // These change where the token matches; the tokenizers we support leave them false.
      for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
        if (t.value(flag, false)) unsupported(at + "." + flag, "true is not supported");
      }
      Added a{t["content"].get<std::string>(), t["id"].get<int64_t>()};
      added_by_id_[a.id] = a.content;
      added_by_content_[a.content] = a.id;
      added_.push_back(std::move(a));
    }
    // Candidates by first byte, longest first: the longest match wins at a position.
    for (size_t k = 0; k < added_.size(); ++k)
      by_first_byte_[static_cast<unsigned char>(added_[k].content[0])].push_back(k);
    for (auto& candidates : by_first_byte_) {
      std::stable_sort(candidates.begin(), candidates.end(), [&](size_t a, size_t b) {
        return added_[a].content.size() > added_[b].content.size();
      });
    }
  }

  int64_t find_eod() const {
    const fs::path config = fs::path(file_).parent_path() / "tokenizer_config.json";
    if (fs::exists(config)) {
      const json c = parse_json_file(config.string());
      const json eos = c.is_object() ? c.value("eos_token", json()) : json();
      std::string token;
      if (eos.is_string()) token = eos.get<std::string>();
      if (eos.is_object() && eos.contains("content") && eos["content"].is_string())
        token = eos["content"].get<std::string>();
      if (!token.empty()) {
        if (auto id = special_token_id(token)) return *id;
        if (auto id = bpe_->id_of(token)) return *id;
        throw std::invalid_argument(config.string() + ": eos_token: \"" + token +
                                    "\" is not a token of " + file_);
      }
      if (!eos.is_null()) {
        throw std::invalid_argument(config.string() + ": eos_token: expected a string or "
                                    "{\"content\": ...}, found " + describe(eos));
      }
    }
    for (const char* token : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>"}) {
      if (auto id = special_token_id(token)) return *id;
    }
    throw std::invalid_argument(
        file_ + ": added_tokens: no end-of-document token (none of <|endoftext|>, "
                "<|end_of_text|>, </s>, <|im_end|>, and no tokenizer_config.json with eos_token "
                "next to it)");
  }

  // ---- encoding ----------------------------------------------------------------------------------

  // The longest added token starting at text[pos], or null.
  const Added* added_at(std::string_view text, size_t pos) const {
    for (size_t k : by_first_byte_[static_cast<unsigned char>(text[pos])]) {
      const std::string& c = added_[k].content;
      if (text.compare(pos, c.size(), c) == 0) return &added_[k];
    }
    return nullptr;
  }

  void encode_segment(std::string_view segment, std::vector<int64_t>& ids) const {
    if (segment.empty()) return;
    std::vector<std::string> pieces{std::string(segment)};
    for (const PreStep& step : pre_steps_) {
      std::vector<std::string> next;
      for (std::string& piece : pieces) {
        std::vector<std::string> parts;
        if (step.kind == PreStep::kSplitGpt2) {
          parts = gpt2_pretokenize(piece);
        } else if (step.kind == PreStep::kSplitLlama3) {
          parts = llama3_pretokenize(piece, step.max_digits);
        } else {
          if (step.add_prefix_space && piece[0] != ' ') piece.insert(0, 1, ' ');
          if (step.use_regex) {
            parts = gpt2_pretokenize(piece);
          } else {
            parts.push_back(std::move(piece));
          }
        }
        for (std::string& part : parts) next.push_back(std::move(part));
      }
      pieces.swap(next);
    }
    for (const std::string& piece : pieces) bpe_->encode(piece, ids);
  }

  std::string file_;
  std::vector<PreStep> pre_steps_;
  std::unique_ptr<ByteLevelBpe> bpe_;
  std::vector<Added> added_;
  std::array<std::vector<size_t>, 256> by_first_byte_;  // first byte -> added_ indices
  std::unordered_map<int64_t, std::string> added_by_id_;
  std::unordered_map<std::string, int64_t> added_by_content_;
  int64_t vocab_size_ = 0;
  int64_t eod_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) {
  return std::make_unique<HuggingFaceTokenizer>(path);
}

}  // namespace mfsdp
