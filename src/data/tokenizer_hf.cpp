// Hugging Face tokenizer.json, encoded and decoded as the `tokenizers` library does
// (Tokenizer.encode(text, add_special_tokens=...), Tokenizer.decode(ids)):
//   1. added tokens that are not `normalized` (<|im_end|>, <s>, ...) are found in the raw text,
//      leftmost then longest first (lstrip / rstrip / single_word as the library applies them);
//      the text between them is processed on its own;
//   2. each such segment goes through the normalizer (Unicode's normal forms and case through
//      utf8proc, Precompiled, Prepend, Replace, Strip, ...: tokenizer_hf_text.cpp,
//      tokenizer_hf_unicode.cpp), then the `normalized` added tokens are found in it;
//   3. the pre-tokenizers cut the segments into pre-tokens: Split with the file's own regex (run
//      by PCRE2, tokenizer_hf_regex.cpp), ByteLevel, Metaspace, Digits, ... (tokenizer_hf_text.cpp);
//   4. the model (BPE with byte_fallback / ignore_merges, or Unigram: tokenizer_hf_bpe.cpp,
//      tokenizer_hf_unigram.cpp) turns each pre-token into ids; with add_special_tokens the
//      post-processor adds <|begin_of_text|>, <s>, ...
// decode maps ids to pieces and runs the decoders (ByteLevel, Metaspace, ByteFallback, Fuse,
// Strip, Replace: tokenizer_hf_decoders.cpp). This file holds the added tokens, the
// post-processors and the tokenizer that strings the steps together. Anything else is refused by
// its JSON path, so a tokenizer.json never loads into something that encodes differently
// (docs/data.md).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "mfsdp/base/json_parse.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/data/tokenizer_hf.h"
#include "tokenizer_hf_parts.h"

namespace mfsdp {
namespace {

namespace fs = std::filesystem;
using hf::describe;
using hf::Piece;
using hf::Regex;
using hf::RegexSyntax;
using nlohmann::json;

// Rust's regex \w, which single_word added tokens are checked with.
const char kRustWord[] = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control})";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json_file(const std::string& path) {
  try {
    return parse_json(read_file(path));  // nesting bounded (include/mfsdp/base/json_parse.h)
  } catch (const json::exception& e) {
    throw std::runtime_error(path + ": not valid JSON: " + e.what());
  }
}

// ---- post-processors -----------------------------------------------------------------------------

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void apply(std::vector<int64_t>& ids) const = 0;
  // Every id it can add, to check against the vocabulary.
  virtual std::vector<int64_t> added_ids() const = 0;
};

class SequencePostProcessor : public PostProcessor {
 public:
  explicit SequencePostProcessor(std::vector<std::unique_ptr<PostProcessor>> steps)
      : steps_(std::move(steps)) {}
  void apply(std::vector<int64_t>& ids) const override {
    for (const auto& s : steps_) s->apply(ids);
  }
  std::vector<int64_t> added_ids() const override {
    std::vector<int64_t> all;
    for (const auto& s : steps_) {
      auto more = s->added_ids();
      all.insert(all.end(), more.begin(), more.end());
    }
    return all;
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

// TemplateProcessing's `single` template; RobertaProcessing and BertProcessing are the template
// cls $A sep.
class TemplatePostProcessor : public PostProcessor {
 public:
  // Each item: the ids of a special token, or nullopt for the sequence itself.
  explicit TemplatePostProcessor(std::vector<std::optional<std::vector<int64_t>>> items)
      : items_(std::move(items)) {}
  void apply(std::vector<int64_t>& ids) const override {
    std::vector<int64_t> out;
    for (const auto& item : items_) {
      if (item) {
        out.insert(out.end(), item->begin(), item->end());
      } else {
        out.insert(out.end(), ids.begin(), ids.end());
      }
    }
    ids.swap(out);
  }
  std::vector<int64_t> added_ids() const override {
    std::vector<int64_t> all;
    for (const auto& item : items_)
      if (item) all.insert(all.end(), item->begin(), item->end());
    return all;
  }

 private:
  std::vector<std::optional<std::vector<int64_t>>> items_;
};

// ---- added tokens --------------------------------------------------------------------------------

struct Added {
  std::string content;
  std::string match;  // what is looked for: the content, or for `normalized` ones its normalized form
  int64_t id = -1;
  bool single_word = false, lstrip = false, rstrip = false;
};

// One set of added tokens, found leftmost then longest first (the library's Aho-Corasick
// automaton with MatchKind::LeftmostLongest).
class AddedSet {
 public:
  void add(Added a) {
    if (a.match.empty()) return;
    by_first_byte_[static_cast<uint8_t>(a.match[0])].push_back(tokens_.size());
    tokens_.push_back(std::move(a));
  }
  void finish() {
    for (auto& candidates : by_first_byte_) {
      std::stable_sort(candidates.begin(), candidates.end(),
                       [&](size_t a, size_t b) { return tokens_[a].match.size() > tokens_[b].match.size(); });
    }
  }
  bool empty() const { return tokens_.empty(); }

  // Cuts `p` at the added tokens and appends the parts to `out`, as AddedVocabulary's
  // find_matches does.
  void split(Piece p, std::vector<Piece>& out) const {
    if (p.text.empty()) return;
    if (tokens_.empty()) {
      out.push_back(std::move(p));
      return;
    }
    const std::string& t = p.text;
    size_t start_offset = 0;
    for (size_t pos = 0; pos < t.size();) {
      const Added* a = nullptr;
      size_t at = pos;
      for (; at < t.size() && a == nullptr; ++at) {
        for (size_t k : by_first_byte_[static_cast<uint8_t>(t[at])]) {
          if (t.compare(at, tokens_[k].match.size(), tokens_[k].match) == 0) {
            a = &tokens_[k];
            break;
          }
        }
      }
      if (a == nullptr) break;
      size_t start = at - 1;
      size_t stop = start + a->match.size();
      pos = stop;  // the automaton goes on after the match it found, whatever becomes of it
      if (a->single_word) {
        const bool start_space = start == 0 || !ends_with_word(std::string_view(t).substr(0, start));
        const bool stop_space = stop == t.size() || !starts_with_word(std::string_view(t).substr(stop));
        if (!start_space || !stop_space) continue;
      }
      if (a->lstrip) {
        size_t s = start;
        while (s > 0) {
          size_t c = s - 1;
          while (c > 0 && (static_cast<unsigned char>(t[c]) & 0xC0) == 0x80) --c;
          if (hf::utf8_char_len(t, c) != s - c || !hf::is_white_space(hf::utf8_code_point(t, c))) break;
          s = c;
        }
        start = std::max(s, start_offset);
      }
      if (a->rstrip) {
        while (stop < t.size() && hf::is_white_space(hf::utf8_code_point(t, stop)))
          stop += hf::utf8_char_len(t, stop);
      }
      if (start_offset < start) {
        out.push_back(
            {t.substr(start_offset, start - start_offset), hf::head_of_slice(p, start_offset, start), -1});
      }
      out.push_back({t.substr(start, stop - start), 0, a->id});
      start_offset = stop;
    }
    if (start_offset < t.size()) {
      out.push_back({t.substr(start_offset), hf::head_of_slice(p, start_offset, t.size()), -1});
    }
  }

 private:
  static bool is_word(std::string_view c) {
    static const Regex word(std::string("[") + kRustWord + "]", RegexSyntax::kPcre2, "\\w");
    const auto m = word.find_all(c);
    return !m.empty() && m[0].first == 0 && m[0].second == c.size();
  }
  static bool ends_with_word(std::string_view s) {
    size_t c = s.size() - 1;
    while (c > 0 && (static_cast<unsigned char>(s[c]) & 0xC0) == 0x80) --c;
    return is_word(s.substr(c));
  }
  static bool starts_with_word(std::string_view s) { return is_word(s.substr(0, hf::utf8_char_len(s, 0))); }

  std::vector<Added> tokens_;
  std::array<std::vector<size_t>, 256> by_first_byte_;  // first byte -> tokens_ indices
};

// ---- the tokenizer -------------------------------------------------------------------------------

class HuggingFaceTokenizer : public Tokenizer {
 public:
  HuggingFaceTokenizer(const std::string& path, const HfTokenizerOptions& options)
      : file_(fs::is_directory(path) ? (fs::path(path) / "tokenizer.json").string() : path),
        add_special_tokens_(options.add_special_tokens),
        reader_(file_) {
    if (!fs::exists(file_)) {
      throw std::runtime_error(file_ +
                               ": no such file (--tokenizer-model of HuggingFaceTokenizer "
                               "is a tokenizer.json or the folder holding one)");
    }
    const json root = parse_json_file(file_);
    if (!root.is_object()) unsupported("", "expected a JSON object");
    // truncation and padding are ignored, as transformers ignores them unless asked to truncate
    // or pad (it clears them before each call).
    normalizer_ = hf::load_normalizer(reader_, root.value("normalizer", json()), "normalizer");
    pre_tokenizer_ = hf::load_pre_tokenizer(reader_, root.value("pre_tokenizer", json()), "pre_tokenizer");
    decoder_ = hf::load_decoder(reader_, root.value("decoder", json()), "decoder");
    load_model(root);
    load_added_tokens(root);
    vocab_size_ = model_->max_id() + 1;
    for (const auto& [id, content] : added_by_id_) vocab_size_ = std::max(vocab_size_, id + 1);
    post_processor_ = load_post_processor(root.value("post_processor", json()), "post_processor");
    eod_ = find_eod();
  }

  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<Piece> raw;
    if (!text.empty()) raw_added_.split({std::string(text), hf::utf8_char_len(text, 0), -1}, raw);
    std::vector<Piece> pieces;
    for (Piece& p : raw) {
      if (p.id >= 0) {
        pieces.push_back(std::move(p));
        continue;
      }
      if (normalizer_) normalizer_->apply(p, hf::normalized_size_limit(p.text.size()));
      normalized_added_.split(std::move(p), pieces);
    }
    if (pre_tokenizer_) pre_tokenizer_->apply(pieces);
    std::vector<int64_t> ids;
    for (const Piece& p : pieces) {
      if (p.id >= 0) {
        ids.push_back(p.id);
      } else {
        model_->encode(p.text, ids);
      }
    }
    if (add_special_tokens_ && post_processor_) post_processor_->apply(ids);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size_) {
        throw std::out_of_range(file_ + ": id " + std::to_string(id) + " is outside [0, " +
                                std::to_string(vocab_size_) + ")");
      }
      auto added = added_by_id_.find(id);
      if (added != added_by_id_.end()) {
        tokens.push_back(added->second);
      } else if (const std::string* piece = model_->piece(id)) {
        tokens.push_back(*piece);
      } else {
        throw std::out_of_range(file_ + ": id " + std::to_string(id) + " is not in the vocabulary");
      }
    }
    // Added tokens go through the decoders too, as in the library.
    std::string text;
    if (decoder_) {
      decoder_->apply(tokens);
      for (const std::string& t : tokens) text += t;
    } else {
      for (size_t k = 0; k < tokens.size(); ++k) text += (k ? " " : "") + tokens[k];
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
  [[noreturn]] void unsupported(const std::string& json_path, const std::string& what) const {
    throw std::invalid_argument(file_ + ": " + (json_path.empty() ? "" : json_path + ": ") + what);
  }
  std::string where(const std::string& json_path) const { return file_ + ": " + json_path; }

  // ---- loading -----------------------------------------------------------------------------------

  void load_model(const json& root) {
    const auto model_it = root.find("model");
    if (model_it == root.end() || !model_it->is_object()) unsupported("model", "missing or not an object");
    const json type = model_it->value("type", json());
    if (type == "BPE") {
      model_ = hf::load_bpe_model(*model_it, file_);
    } else if (type == "Unigram") {
      model_ = hf::load_unigram_model(*model_it, file_);
    } else {
      unsupported("model.type", "unsupported model type " + describe(type) +
                                    " (supported: BPE, Unigram; WordPiece and WordLevel are "
                                    "encoder-only models' vocabularies)");
    }
  }

  void load_added_tokens(const json& root) {
    if (!root.contains("added_tokens")) return;
    const json& list = root["added_tokens"];
    if (!list.is_array()) unsupported("added_tokens", "expected an array");
    for (size_t k = 0; k < list.size(); ++k) {
      const std::string at = "added_tokens[" + std::to_string(k) + "]";
      const json& t = list[k];
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || t["id"].get<int64_t>() < 0 ||
          t["id"].get<int64_t>() > std::numeric_limits<int32_t>::max() || !t.contains("content") ||
          !t["content"].is_string() || t["content"].get<std::string>().empty()) {
        unsupported(at, "expected {\"id\": integer in [0, 2^31), \"content\": non-empty string}");
      }
      Added a;
      a.content = t["content"].get<std::string>();
      a.id = t["id"].get<int64_t>();
      a.single_word = reader_.bool_field(t, "single_word", at, false);
      a.lstrip = reader_.bool_field(t, "lstrip", at, false);
      a.rstrip = reader_.bool_field(t, "rstrip", at, false);
      const bool normalized = reader_.bool_field(t, "normalized", at, false);
      a.match = a.content;
      if (normalized && normalizer_) {
        // Matched in the normalized text by its normalized form.
        Piece p{a.content, 0, -1};
        normalizer_->apply(p, hf::normalized_size_limit(p.text.size()));
        a.match = p.text;
      }
      // Decoding starts from the normalized form, so that the decoders undo the normalizer.
      added_by_id_[a.id] = a.match;
      added_by_content_[a.content] = a.id;
      (normalized ? normalized_added_ : raw_added_).add(std::move(a));
    }
    raw_added_.finish();
    normalized_added_.finish();
  }

  std::unique_ptr<PostProcessor> load_post_processor(const json& p, const std::string& at) const {
    if (p.is_null()) return nullptr;
    if (!p.is_object()) unsupported(at, "expected an object, found " + describe(p));
    const json type = p.value("type", json());
    std::unique_ptr<PostProcessor> made;
    if (type == "Sequence") {
      made = std::make_unique<SequencePostProcessor>(reader_.list_field<PostProcessor>(
          p, "processors", at,
          [&](const json& s, const std::string& a) { return load_post_processor(s, a); }));
    } else if (type == "ByteLevel") {
      return nullptr;  // it only trims offsets
    } else if (type == "TemplateProcessing") {
      made = load_template(p, at);
    } else if (type == "RobertaProcessing" || type == "BertProcessing") {
      auto token = [&](const char* key) {
        const json v = p.value(key, json());
        if (!v.is_array() || v.size() != 2 || !v[0].is_string() || !v[1].is_number_integer()) {
          unsupported(at + "." + key, "expected [token, id], found " + describe(v));
        }
        return std::vector<int64_t>{v[1].get<int64_t>()};
      };
      std::vector<std::optional<std::vector<int64_t>>> items{token("cls"), std::nullopt, token("sep")};
      made = std::make_unique<TemplatePostProcessor>(std::move(items));
    } else {
      unsupported(at + ".type", "unsupported post-processor " + describe(type) +
                                    " (supported: TemplateProcessing, RobertaProcessing, BertProcessing, "
                                    "ByteLevel, Sequence)");
    }
    for (int64_t id : made->added_ids()) {
      if (id < 0 || id >= vocab_size_) {
        unsupported(at, "adds id " + std::to_string(id) + ", outside the vocabulary [0, " +
                            std::to_string(vocab_size_) + ")");
      }
    }
    return made;
  }

  std::unique_ptr<PostProcessor> load_template(const json& p, const std::string& at) const {
    const json single = p.value("single", json());
    if (!single.is_array()) unsupported(at + ".single", "expected an array, found " + describe(single));
    const json specials = p.value("special_tokens", json::object());
    std::vector<std::optional<std::vector<int64_t>>> items;
    for (size_t k = 0; k < single.size(); ++k) {
      const std::string item_at = at + ".single[" + std::to_string(k) + "]";
      const json& item = single[k];
      if (item.is_object() && item.contains("Sequence") && item["Sequence"].is_object()) {
        if (item["Sequence"].value("id", json()) != "A") {
          unsupported(item_at + ".Sequence.id", "a single sequence's template can only hold \"A\", found " +
                                                    describe(item["Sequence"].value("id", json())));
        }
        items.emplace_back(std::nullopt);
      } else if (item.is_object() && item.contains("SpecialToken") && item["SpecialToken"].is_object() &&
                 item["SpecialToken"].value("id", json()).is_string()) {
        const std::string name = item["SpecialToken"]["id"].get<std::string>();
        const json entry = specials.is_object() ? specials.value(name, json()) : json();
        const json ids = entry.is_object() ? entry.value("ids", json()) : json();
        if (!ids.is_array()) {
          unsupported(at + ".special_tokens", "has no \"ids\" for " + describe(json(name)));
        }
        std::vector<int64_t> values;
        for (const json& id : ids) {
          if (!id.is_number_integer())
            unsupported(at + ".special_tokens." + name + ".ids", "expected integers");
          values.push_back(id.get<int64_t>());
        }
        items.emplace_back(std::move(values));
      } else {
        unsupported(item_at,
                    "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, found " + describe(item));
      }
    }
    return std::make_unique<TemplatePostProcessor>(std::move(items));
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
        if (auto id = model_->id_of(token)) return *id;
        throw std::invalid_argument(config.string() + ": eos_token: \"" + token + "\" is not a token of " +
                                    file_);
      }
      if (!eos.is_null()) {
        throw std::invalid_argument(config.string() +
                                    ": eos_token: expected a string or "
                                    "{\"content\": ...}, found " +
                                    describe(eos));
      }
    }
    for (const char* token : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>"}) {
      if (auto id = special_token_id(token)) return *id;
    }
    throw std::invalid_argument(
        file_ +
        ": added_tokens: no end-of-document token (none of <|endoftext|>, "
        "<|end_of_text|>, </s>, <|im_end|>, and no tokenizer_config.json with eos_token "
        "next to it)");
  }

  std::string file_;
  bool add_special_tokens_ = false;
  hf::JsonReader reader_;
  std::unique_ptr<hf::Normalizer> normalizer_;
  std::unique_ptr<hf::PreTokenizer> pre_tokenizer_;
  std::unique_ptr<hf::Decoder> decoder_;
  std::unique_ptr<hf::Model> model_;
  std::unique_ptr<PostProcessor> post_processor_;
  AddedSet raw_added_;                                    // not `normalized`: found in the raw text
  AddedSet normalized_added_;                             // `normalized`: found in the normalized text
  std::unordered_map<int64_t, std::string> added_by_id_;  // id -> what decode starts from
  std::unordered_map<std::string, int64_t> added_by_content_;
  int64_t vocab_size_ = 0;
  int64_t eod_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) {
  return std::make_unique<HuggingFaceTokenizer>(path, HfTokenizerOptions{});
}

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path, const HfTokenizerOptions& options) {
  return std::make_unique<HuggingFaceTokenizer>(path, options);
}

}  // namespace mfsdp
