// The vocabulary size the trainer reads from a SentencePiece model's protobuf bytes (without
// libsentencepiece) equals what libsentencepiece itself reports; bad files are rejected.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "mfsdp/base/directory_tree.h"
#include "mfsdp/data/tokenizer.h"

namespace fs = std::filesystem;

TEST(TokenizerVocab, SentencePieceCountMatchesTheLibrary) {
  fs::path dir = fs::temp_directory_path() / ("mfsdp_spvocab_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::vector<std::string> corpus;
  for (int i = 0; i < 200; ++i)
    corpus.push_back("the quick brown fox " + std::to_string(i) + " jumps over the lazy dog");
  for (int64_t vocab : {300, 333}) {
    mfsdp::SentencePieceTrainOptions o;
    o.vocab_size = vocab;
    std::string prefix = (dir / ("m" + std::to_string(vocab))).string();
    mfsdp::train_sentencepiece(corpus, prefix, o);
    auto tok = mfsdp::load_sentencepiece_tokenizer(prefix + ".model");
    EXPECT_EQ(mfsdp::sentencepiece_model_vocab_size(prefix + ".model"), tok->vocab_size());
    mfsdp::TokenizerOptions t{"SentencePieceTokenizer", prefix + ".model", "", ""};
    EXPECT_EQ(mfsdp::tokenizer_vocab_size(t), tok->vocab_size());
  }
  std::ofstream(dir / "junk.model") << "\x0f\xff\xff\xff";
  EXPECT_THROW(mfsdp::sentencepiece_model_vocab_size((dir / "junk.model").string()),
               std::invalid_argument);
  EXPECT_THROW(mfsdp::sentencepiece_model_vocab_size((dir / "missing.model").string()),
               std::invalid_argument);
  EXPECT_EQ(mfsdp::tokenizer_vocab_size({"ByteLevelTokenizer", "", "", ""}), 257);
  EXPECT_THROW(mfsdp::tokenizer_vocab_size({"Nope", "", "", ""}), std::invalid_argument);
  mfsdp::remove_tree(dir);
}
