// Vocabulary sizes without loading libsentencepiece: processes that link LibTorch must not load
// it (both carry protobuf, and libsentencepiece's copy breaks LibTorch's at start-up), so the
// trainer reads a SentencePiece model's piece count straight from the protobuf wire format.
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "mfsdp/data/tokenizer.h"

namespace mfsdp {
namespace {

uint64_t read_varint(const std::string& bytes, size_t& pos, const std::string& file) {
  uint64_t value = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (pos >= bytes.size()) throw std::invalid_argument(file + ": truncated SentencePiece model");
    const auto b = static_cast<uint8_t>(bytes[pos++]);
    value |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return value;
  }
  throw std::invalid_argument(file + ": malformed varint in SentencePiece model");
}

}  // namespace

int64_t sentencepiece_model_vocab_size(const std::string& model_file) {
  std::ifstream in(model_file, std::ios::binary);
  if (!in) throw std::invalid_argument("--tokenizer-model: cannot open '" + model_file + "'");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // ModelProto: `repeated SentencePiece pieces = 1;` Each piece is one length-delimited field 1.
  int64_t pieces = 0;
  for (size_t pos = 0; pos < bytes.size();) {
    const uint64_t key = read_varint(bytes, pos, model_file);
    const uint64_t field = key >> 3, wire = key & 7;
    if (wire == 0) {
      read_varint(bytes, pos, model_file);
    } else if (wire == 1 || wire == 5) {
      pos += wire == 1 ? 8 : 4;
    } else if (wire == 2) {
      const uint64_t length = read_varint(bytes, pos, model_file);
      if (length > bytes.size() - std::min(pos, bytes.size()))
        throw std::invalid_argument(model_file + ": truncated SentencePiece model");
      pos += length;
      if (field == 1) ++pieces;
    } else {
      throw std::invalid_argument(model_file + ": not a SentencePiece model (wire type " +
                                  std::to_string(wire) + ")");
    }
    if (pos > bytes.size()) throw std::invalid_argument(model_file + ": truncated SentencePiece model");
  }
  if (pieces == 0) throw std::invalid_argument(model_file + ": SentencePiece model without pieces");
  return pieces;
}

int64_t tokenizer_vocab_size(const TokenizerOptions& o) {
  if (o.type == "ByteLevelTokenizer") return ByteLevelTokenizer().vocab_size();
  if (o.type == "NullTokenizer") return 0;
  if (o.type == "SentencePieceTokenizer") {
    if (o.model_file.empty()) throw std::invalid_argument("--tokenizer-model: required by SentencePieceTokenizer");
    return sentencepiece_model_vocab_size(o.model_file);
  }
  if (o.type == "GPT2BPETokenizer") {
    if (o.vocab_file.empty()) throw std::invalid_argument("--vocab-file: required by GPT2BPETokenizer");
    if (o.merge_file.empty()) throw std::invalid_argument("--merge-file: required by GPT2BPETokenizer");
    return load_gpt2_bpe_tokenizer(o.vocab_file, o.merge_file)->vocab_size();
  }
  if (o.type == "HuggingFaceTokenizer") return make_torch_safe_tokenizer(o)->vocab_size();
  throw std::invalid_argument("--tokenizer-type: unknown tokenizer '" + o.type + "'");
}

}  // namespace mfsdp

namespace mfsdp {

std::unique_ptr<Tokenizer> make_torch_safe_tokenizer(const TokenizerOptions& o) {
  if (o.type == "ByteLevelTokenizer") return std::make_unique<ByteLevelTokenizer>();
  if (o.type == "GPT2BPETokenizer") {
    if (o.vocab_file.empty()) throw std::invalid_argument("--vocab-file: required by GPT2BPETokenizer");
    if (o.merge_file.empty()) throw std::invalid_argument("--merge-file: required by GPT2BPETokenizer");
    return load_gpt2_bpe_tokenizer(o.vocab_file, o.merge_file);
  }
  // Torch-free (nlohmann JSON only), unlike SentencePiece.
  if (o.type == "HuggingFaceTokenizer") {
    if (o.model_file.empty()) {
      throw std::invalid_argument(
          "--tokenizer-model: required by HuggingFaceTokenizer (tokenizer.json or its folder)");
    }
    return load_hf_tokenizer(o.model_file);
  }
  return nullptr;
}

}  // namespace mfsdp
