// make_tokenizer: --tokenizer-type and its files -> a Tokenizer.
#include <stdexcept>

#include "mfsdp/data/tokenizer.h"

namespace mfsdp {

std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerOptions& options) {
  const std::string& type = options.type;
  if (type == "ByteLevelTokenizer") return std::make_unique<ByteLevelTokenizer>();
  if (type == "SentencePieceTokenizer" || type == "GPTSentencePieceTokenizer") {
    if (options.model_file.empty()) {
      throw std::invalid_argument("--tokenizer-type " + type +
                                  " needs --tokenizer-model (a SentencePiece .model file)");
    }
    return load_sentencepiece_tokenizer(options.model_file);
  }
  if (type == "GPT2BPETokenizer") {
    if (options.vocab_file.empty() || options.merge_file.empty()) {
      throw std::invalid_argument(
          "--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file "
          "(merges.txt)" +
          std::string(options.vocab_file.empty() ? "; --vocab-file is missing" : "") +
          std::string(options.merge_file.empty() ? "; --merge-file is missing" : ""));
    }
    return load_gpt2_bpe_tokenizer(options.vocab_file, options.merge_file);
  }
  if (type == "HuggingFaceTokenizer") {
    if (options.model_file.empty()) {
      throw std::invalid_argument("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                                  "(a tokenizer.json or the folder holding one)");
    }
    return load_hf_tokenizer(options.model_file);
  }
  throw std::invalid_argument("--tokenizer-type: unknown tokenizer '" + type +
                              "' (known: ByteLevelTokenizer, SentencePieceTokenizer, "
                              "GPTSentencePieceTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer)");
}

}  // namespace mfsdp
