// Tokenizers: text <-> token ids, for preprocessing (mfsdp-preprocess) and for printing samples.
//
// Four kinds, named as Megatron's --tokenizer-type:
//   ByteLevelTokenizer      ids 0..255 are the bytes of the UTF-8 text, 256 is the end of a
//                           document (EOD); vocabulary 257. No files.
//   SentencePieceTokenizer  a SentencePiece .model (--tokenizer-model); EOD is the model's eos
//                           piece (</s>), as Megatron's GPTSentencePieceTokenizer; no extra special
//                           tokens are added. "GPTSentencePieceTokenizer" is accepted as a synonym.
//   GPT2BPETokenizer        GPT-2's byte-level BPE from vocab.json + merges.txt (--vocab-file,
//                           --merge-file); EOD is "<|endoftext|>".
//   HuggingFaceTokenizer    a Hugging Face tokenizer.json holding a byte-level BPE (GPT-2, Llama-3,
//                           Qwen2 kind; --tokenizer-model is the file or its folder); EOD from
//                           tokenizer_config.json's eos_token (docs/data.md).
// Every tokenizer is immutable after construction and safe to use from several threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mfsdp {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text` (no EOD appended).
  virtual std::vector<int64_t> encode(std::string_view text) const = 0;
  // Text of `ids`; throws std::out_of_range on an id outside [0, vocab_size()). The EOD id
  // decodes to nothing for the byte-level and SentencePiece tokenizers (SentencePiece drops
  // control pieces) and to "<|endoftext|>" for GPT-2.
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  // Ids are in [0, vocab_size()). This is the tokenizer's own size; the trainer pads the
  // embedding to a multiple of --make-vocab-size-divisible-by.
  virtual int64_t vocab_size() const = 0;
  // The end-of-document id that --append-eod appends.
  virtual int64_t eod() const = 0;
  // The --tokenizer-type name.
  virtual std::string name() const = 0;
  // The id of the special token spelled `token` (e.g. "<|im_end|>"), or nullopt when the
  // tokenizer has no such token. Chat templates insert special tokens by this id rather than by
  // encoding their text. HuggingFaceTokenizer: its added tokens; GPT-2 BPE: "<|endoftext|>".
  virtual std::optional<int64_t> special_token_id(std::string_view token) const {
    (void)token;
    return std::nullopt;
  }
};

// ---- byte level ----------------------------------------------------------------------------------

class ByteLevelTokenizer : public Tokenizer {
 public:
  static constexpr int64_t kEod = 256;
  std::vector<int64_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override { return 257; }
  int64_t eod() const override { return kEod; }
  std::string name() const override { return "ByteLevelTokenizer"; }
};

// ---- SentencePiece -------------------------------------------------------------------------------

// Loads a SentencePiece model file; throws std::runtime_error naming the file when it cannot be
// read or parsed, or when the model has no eos piece (no EOD id).
std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::string& model_file);

struct SentencePieceTrainOptions {
  int64_t vocab_size = 8000;
  std::string model_type = "bpe";  // "bpe" or "unigram" (also "char", "word")
  // Unknown characters fall back to byte pieces <0x00>..<0xFF>, so every text round-trips
  // (as Llama's tokenizer); needs vocab_size > 256 + the pieces the corpus wants.
  bool byte_fallback = true;
  double character_coverage = 1.0;
  // "identity" keeps the text as is (decode(encode(t)) == t); "nmt_nfkc" is SentencePiece's
  // default, which normalises Unicode and collapses repeated whitespace.
  std::string normalization_rule_name = "identity";
  // Raw extra trainer options, e.g. {"max_sentence_length", "16384"}; they override the above.
  std::map<std::string, std::string> extra;
  bool verbose = false;  // SentencePiece's progress log on stderr
};

// Trains a SentencePiece model on `sentences` (one training sentence each; SentencePiece skips
// sentences longer than max_sentence_length, 4192 bytes by default) and writes
// `model_prefix`.model and `model_prefix`.vocab. Pieces: <unk>=0, <s>=1, </s>=2 (EOD).
// Throws std::runtime_error with SentencePiece's message on failure (e.g. a vocabulary larger
// than the corpus supports).
void train_sentencepiece(const std::vector<std::string>& sentences, const std::string& model_prefix,
                         const SentencePieceTrainOptions& options);

// ---- GPT-2 BPE -----------------------------------------------------------------------------------

// Loads vocab.json (piece -> id) and merges.txt (one "left right" merge per line, by rank, after
// an optional "#version" line). Throws std::runtime_error naming the file and line on malformed
// input, and when vocab.json has no "<|endoftext|>".
std::unique_ptr<Tokenizer> load_gpt2_bpe_tokenizer(const std::string& vocab_file,
                                                   const std::string& merge_file);

// GPT-2's pre-tokenisation: splits UTF-8 text into the pieces that the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// matches, implemented by hand over utf8proc's character classes (tokenizer_gpt2_bpe.cpp,
// [Note: Unicode classes]). Exposed for tests.
std::vector<std::string> gpt2_pretokenize(std::string_view text);

// GPT-2's bytes_to_unicode(): the printable code point standing for each byte in vocab.json.
// Exposed for tests.
uint32_t gpt2_byte_to_unicode(uint8_t byte);

// Llama-3's pre-tokenisation: the pieces that the regex
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// matches, implemented by hand with the character classes of gpt2_pretokenize. Qwen2's regex is
// the same with \p{N} in place of \p{N}{1,3}: max_digits = 1. Exposed for tests.
std::vector<std::string> llama3_pretokenize(std::string_view text, int max_digits = 3);

// The byte-level BPE model that GPT2BPETokenizer and HuggingFaceTokenizer share: pieces are
// strings of bytes_to_unicode symbols, merges apply by rank. Thread-safe (a locked cache).
class ByteLevelBpe {
 public:
  // `vocab`: piece -> id (ids >= 0); `merges`: (left, right) pieces, highest priority first.
  // ignore_merges: a pre-token that is itself a piece of the vocabulary is that one token, as
  // the tokenizers library's BPE option (Llama-3). `source` names the file in errors.
  ByteLevelBpe(const std::vector<std::pair<std::string, int64_t>>& vocab,
               const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges,
               std::string source);
  ~ByteLevelBpe();
  ByteLevelBpe(const ByteLevelBpe&) = delete;
  ByteLevelBpe& operator=(const ByteLevelBpe&) = delete;
  // Appends the ids of one pre-token, given as raw UTF-8 bytes. Throws std::runtime_error naming
  // the source when a resulting piece is not in the vocabulary.
  void encode(std::string_view pretoken, std::vector<int64_t>& out) const;
  // Appends the bytes that token `id` stands for; false when no piece has that id.
  bool decode(int64_t id, std::string& out) const;
  // The id of `piece` (in symbols, e.g. "\u0120the" for " the"), if any.
  std::optional<int64_t> id_of(const std::string& piece) const;
  // The largest id of the vocabulary, -1 when it is empty.
  int64_t max_id() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- Hugging Face tokenizer.json -----------------------------------------------------------------

// Loads a tokenizer.json (`path` is the file or a folder holding one) with model.type "BPE" over
// bytes: pre-tokenizer ByteLevel (use_regex, add_prefix_space) or a Sequence of Split with
// GPT-2's, Llama-3's or Qwen2's regex (behavior Isolated) then ByteLevel; decoder ByteLevel;
// normalizer null or NFC (text is taken as already NFC); added tokens are matched in the text
// before pre-tokenisation, longest first. The post-processor is not applied (encode() is
// `add_special_tokens=False`). EOD: tokenizer_config.json's eos_token when that file is next to
// it, else the first of <|endoftext|>, <|end_of_text|>, </s>, <|im_end|> among the added tokens.
// Throws std::runtime_error naming the file when it cannot be read or parsed, and
// std::invalid_argument naming the file and the JSON path of anything unsupported or missing.
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path);

// ---- factory -------------------------------------------------------------------------------------

// Megatron's tokenizer flags.
struct TokenizerOptions {
  std::string type;        // --tokenizer-type
  std::string model_file;  // --tokenizer-model (SentencePiece .model; HF tokenizer.json or folder)
  std::string vocab_file;  // --vocab-file (GPT-2 BPE)
  std::string merge_file;  // --merge-file (GPT-2 BPE)
};

// Builds the tokenizer `options.type` names. Throws std::invalid_argument naming the flag when
// the type is unknown or a file the type needs is not given.
std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerOptions& options);

// make_tokenizer and the SentencePiece tokenizer live in the `mfsdp_sentencepiece` library,
// which processes linking LibTorch must not load (libsentencepiece's bundled protobuf breaks
// LibTorch's at start-up). These two work without it (library `mfsdp_data`):
// the vocabulary size of the tokenizer `options` names (0 for NullTokenizer) ...
int64_t tokenizer_vocab_size(const TokenizerOptions& options);
// ... the number of pieces of a SentencePiece .model file, read from its protobuf bytes ...
int64_t sentencepiece_model_vocab_size(const std::string& model_file);
// ... and the byte-level, GPT-2 or Hugging Face tokenizer for text in/out of LibTorch programs
// (null for SentencePieceTokenizer and NullTokenizer: use token ids there).
std::unique_ptr<Tokenizer> make_torch_safe_tokenizer(const TokenizerOptions& options);

}  // namespace mfsdp
