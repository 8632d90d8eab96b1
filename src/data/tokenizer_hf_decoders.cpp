// The decoders of tokenizer.json files, as the tokenizers library runs them (decoders/*.rs and
// the Decoder side of ByteLevel, Metaspace and Replace): each takes the list of token strings and
// returns a new one; decode joins the last list. Bytes that are not UTF-8 become U+FFFD, as the
// library's from_utf8_lossy makes them.
#include <algorithm>
#include <optional>
#include <string>

#include "tokenizer_hf_parts.h"

namespace mfsdp::hf {

using nlohmann::json;

namespace {

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (const auto& s : steps_) s->apply(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

class ByteLevelDecoder : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      // A token with a character outside the table (an added token such as "<|im_end|>" is all
      // table characters; one with a space is not) stands for its own UTF-8.
      std::string mine;
      bool all = true;
      for (size_t i = 0; i < t.size() && all; i += utf8_char_len(t, i)) {
        auto it = byte_level_bytes().find(utf8_code_point(t, i));
        all = it != byte_level_bytes().end();
        if (all) mine.push_back(static_cast<char>(it->second));
      }
      bytes += all ? mine : t;
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(uint32_t replacement, PrependScheme scheme) : replacement_(replacement), scheme_(scheme) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t k = 0; k < tokens.size(); ++k) {
      std::string out;
      const std::string& t = tokens[k];
      for (size_t i = 0; i < t.size();) {
        const size_t len = utf8_char_len(t, i);
        if (utf8_code_point(t, i) != replacement_) {
          out.append(t, i, len);
        } else if (k != 0 || scheme_ == PrependScheme::kNever) {
          out += ' ';
        }
        i += len;
      }
      tokens[k] = std::move(out);
    }
  }

 private:
  uint32_t replacement_;
  PrependScheme scheme_;
};

class ByteFallbackDecoder : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string pending;  // consecutive <0xNN> bytes
    size_t pending_count = 0;
    auto flush = [&] {
      if (pending_count == 0) return;
      if (utf8_lossy(pending) == pending) {
        out.push_back(pending);
      } else {
        for (size_t k = 0; k < pending_count; ++k) out.push_back("\xEF\xBF\xBD");
      }
      pending.clear();
      pending_count = 0;
    };
    for (std::string& t : tokens) {
      if (auto byte = byte_of(t)) {
        pending.push_back(static_cast<char>(*byte));
        ++pending_count;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens.swap(out);
  }

 private:
  // "<0xNN>" -> NN, as the library reads it (Rust's u8::from_str_radix, which takes a "+").
  static std::optional<uint8_t> byte_of(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return std::nullopt;
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int lo = hex(t[4]);
    if (lo < 0) return std::nullopt;
    if (t[3] == '+') return static_cast<uint8_t>(lo);
    const int hi = hex(t[3]);
    if (hi < 0) return std::nullopt;
    return static_cast<uint8_t>(hi * 16 + lo);
  }
};

class FuseDecoder : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(uint32_t content, size_t start, size_t stop) : content_(content), start_(start), stop_(stop) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      std::vector<size_t> starts;  // byte offset of each character
      for (size_t i = 0; i < t.size(); i += utf8_char_len(t, i)) starts.push_back(i);
      size_t begin = 0;
      while (begin < std::min(start_, starts.size()) && utf8_code_point(t, starts[begin]) == content_)
        ++begin;
      size_t end = starts.size();
      for (size_t k = 0; k < stop_ && end > 0 && utf8_code_point(t, starts[end - 1]) == content_; ++k) --end;
      if (end < begin) end = begin;
      const size_t from = begin < starts.size() ? starts[begin] : t.size();
      const size_t to = end < starts.size() ? starts[end] : t.size();
      t = t.substr(from, to - from);
    }
  }

 private:
  uint32_t content_;
  size_t start_, stop_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(Regex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      Piece p{std::move(t), 0, -1};
      replace_spans(p, pattern_.find_all(p.text), content_);
      t = std::move(p.text);
    }
  }

 private:
  Regex pattern_;
  std::string content_;
};

class BpeDecoder : public Decoder {
 public:
  explicit BpeDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t k = 0; k < tokens.size(); ++k) {
      const std::string with = k + 1 == tokens.size() ? "" : " ";
      std::string out;
      const std::string& t = tokens[k];
      size_t prev = 0;
      for (size_t i = t.find(suffix_); i != std::string::npos; i = t.find(suffix_, prev)) {
        out.append(t, prev, i - prev);
        out += with;
        prev = i + suffix_.size();
      }
      out.append(t, prev, std::string::npos);
      tokens[k] = std::move(out);
    }
  }

 private:
  std::string suffix_;
};

}  // namespace

std::unique_ptr<Decoder> load_decoder(const JsonReader& r, const json& d, const std::string& at) {
  if (d.is_null()) return nullptr;
  if (!d.is_object()) r.refuse(at, "expected an object, found " + describe(d));
  const json type = d.value("type", json());
  if (type == "Sequence") {
    return std::make_unique<SequenceDecoder>(r.list_field<Decoder>(
        d, "decoders", at, [&](const json& s, const std::string& a) { return load_decoder(r, s, a); }));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    return std::make_unique<MetaspaceDecoder>(r.char_field(d, "replacement", at),
                                              r.prepend_scheme_field(d, at));
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    auto count = [&](const char* key) {
      const json v = d.value(key, json(0));
      if (!v.is_number_unsigned()) r.refuse(at + "." + key, "expected a count, found " + describe(v));
      return v.get<size_t>();
    };
    return std::make_unique<StripDecoder>(r.char_field(d, "content", at), count("start"), count("stop"));
  }
  if (type == "Replace")
    return std::make_unique<ReplaceDecoder>(r.pattern_field(d, at), r.string_field(d, "content", at));
  if (type == "BPEDecoder") {
    const std::string suffix = r.string_field(d, "suffix", at, "</w>");
    if (suffix.empty()) r.refuse(at + ".suffix", "an empty suffix");
    return std::make_unique<BpeDecoder>(suffix);
  }
  r.refuse(at + ".type", "unsupported decoder " + describe(type) +
                             " (supported: Sequence, ByteLevel, Metaspace, ByteFallback, Fuse, "
                             "Strip, Replace, BPEDecoder)");
}

}  // namespace mfsdp::hf
