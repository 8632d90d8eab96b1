// SentencePiece tokenizer (libsentencepiece) and training (libsentencepiece_train).
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <stdexcept>
#include <unordered_map>

#include "mfsdp/data/tokenizer.h"

namespace mfsdp {
namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& model_file) : model_file_(model_file) {
    const auto status = processor_.Load(model_file);
    if (!status.ok()) {
      throw std::runtime_error(model_file + ": cannot load the SentencePiece model: " +
                               status.ToString());
    }
    vocab_size_ = processor_.GetPieceSize();
    eod_ = processor_.eos_id();
    if (eod_ < 0) {
      throw std::runtime_error(model_file + ": the SentencePiece model has no eos piece, so there " +
                               "is no end-of-document id (train it with eos_id >= 0)");
    }
  }

  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok()) {
      throw std::runtime_error(model_file_ + ": SentencePiece encode failed: " + status.ToString());
    }
    return std::vector<int64_t>(ids.begin(), ids.end());
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> narrow(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= vocab_size_) {
        throw std::out_of_range(model_file_ + ": id " + std::to_string(ids[i]) +
                                " is outside the vocabulary [0, " + std::to_string(vocab_size_) +
                                ")");
      }
      narrow[i] = static_cast<int>(ids[i]);
    }
    std::string text;
    const auto status = processor_.Decode(narrow, &text);
    if (!status.ok()) {
      throw std::runtime_error(model_file_ + ": SentencePiece decode failed: " + status.ToString());
    }
    return text;
  }

  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }
  std::string name() const override { return "SentencePieceTokenizer"; }

 private:
  std::string model_file_;
  sentencepiece::SentencePieceProcessor processor_;  // Encode/Decode are const and thread-safe
  int64_t vocab_size_ = 0;
  int64_t eod_ = -1;
};

// Feeds the in-memory sentences to the trainer.
class VectorSentenceIterator : public sentencepiece::SentenceIterator {
 public:
  explicit VectorSentenceIterator(const std::vector<std::string>& sentences)
      : sentences_(sentences) {}
  bool done() const override { return next_ >= sentences_.size(); }
  void Next() override { ++next_; }
  const std::string& value() const override { return sentences_[next_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string>& sentences_;
  size_t next_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::string& model_file) {
  return std::make_unique<SentencePieceTokenizer>(model_file);
}

void train_sentencepiece(const std::vector<std::string>& sentences, const std::string& model_prefix,
                         const SentencePieceTrainOptions& options) {
  if (sentences.empty()) {
    throw std::invalid_argument(model_prefix + ": no text to train a SentencePiece model on");
  }
  std::unordered_map<std::string, std::string> kwargs = {
      {"model_prefix", model_prefix},
      {"vocab_size", std::to_string(options.vocab_size)},
      {"model_type", options.model_type},
      {"character_coverage", std::to_string(options.character_coverage)},
      {"byte_fallback", options.byte_fallback ? "true" : "false"},
      {"normalization_rule_name", options.normalization_rule_name},
      // Keep whitespace as written so that decode(encode(text)) == text.
      {"remove_extra_whitespaces", "false"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"minloglevel", options.verbose ? "0" : "2"},
  };
  for (const auto& [key, value] : options.extra) kwargs[key] = value;

  VectorSentenceIterator it(sentences);
  const auto status = sentencepiece::SentencePieceTrainer::Train(kwargs, &it);
  if (!status.ok()) {
    throw std::runtime_error(model_prefix + ".model: SentencePiece training failed: " +
                             status.ToString());
  }
}

}  // namespace mfsdp
