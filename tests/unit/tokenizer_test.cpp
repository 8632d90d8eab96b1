// Tokenizers. GPT-2 BPE is checked against ids worked out by hand on a tiny vocab.json/merges.txt
// and against the splits GPT-2's regex makes; so is the Hugging Face tokenizer.json loader, on the
// same tiny model, and Llama-3's regex; SentencePiece is trained on a small corpus and must
// round-trip text; the byte-level tokenizer is checked byte by byte. (hf_tokenizer_test checks
// the tokenizer.json loader against the `tokenizers` library itself.)
#include <gtest/gtest.h>

#include "harness/expect_error.h"
#include "harness/temp_dir.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "mfsdp/data/tokenizer.h"

namespace mfsdp {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int64_t>;
using Pieces = std::vector<std::string>;

using mfsdp::testing::TempDir;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;


// ---- byte level ----------------------------------------------------------------------------------

TEST(ByteLevelTokenizer, IdsAreTheBytes) {
  ByteLevelTokenizer t;
  EXPECT_EQ(t.vocab_size(), 257);
  EXPECT_EQ(t.eod(), 256);
  EXPECT_EQ(t.encode("Hi\n"), (Ids{72, 105, 10}));
  EXPECT_EQ(t.encode("\xC3\xA9"), (Ids{0xC3, 0xA9}));  // "é" in UTF-8
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const Ids ids = t.encode(all);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(t.decode(ids), all);
  EXPECT_EQ(t.decode({72, 256, 105}), "Hi");  // EOD decodes to nothing
  expect_contains(error_of([&] { t.decode({257}); }), {"257"});
  expect_contains(error_of([&] { t.decode({-1}); }), {"-1"});
}

// ---- GPT-2 pre-tokenisation ----------------------------------------------------------------------

// Expected splits are what GPT-2's regex (Python `regex` module) gives; worked out by hand from
// the pattern 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
TEST(GPT2Pretokenize, SplitsLikeGPT2sRegex) {
  EXPECT_EQ(gpt2_pretokenize("Hello world's 123  end\n"),
            (Pieces{"Hello", " world", "'s", " 123", " ", " end", "\n"}));
  EXPECT_EQ(gpt2_pretokenize("I'm  ...ok?!"), (Pieces{"I", "'m", " ", " ...", "ok", "?!"}));
  EXPECT_EQ(gpt2_pretokenize("a\n\nb"), (Pieces{"a", "\n", "\n", "b"}));
  EXPECT_EQ(gpt2_pretokenize("x   "), (Pieces{"x", "   "}));
  EXPECT_EQ(gpt2_pretokenize("   x"), (Pieces{"  ", " x"}));
  EXPECT_EQ(gpt2_pretokenize("3.14abc123"), (Pieces{"3", ".", "14", "abc", "123"}));
  EXPECT_EQ(gpt2_pretokenize("'re'RE 'll they've"), (Pieces{"'re", "'", "RE", " '", "ll", " they", "'ve"}));
  EXPECT_EQ(gpt2_pretokenize("\t x"), (Pieces{"\t", " x"}));
  EXPECT_EQ(gpt2_pretokenize(""), (Pieces{}));
  // Latin-1 letters are letters; U+2019 (right single quote) is punctuation; emoji are symbols.
  EXPECT_EQ(gpt2_pretokenize("na\xC3\xAFve caf\xC3\xA9"), (Pieces{"na\xC3\xAFve", " caf\xC3\xA9"}));
  EXPECT_EQ(gpt2_pretokenize("don\xE2\x80\x99t"), (Pieces{"don", "\xE2\x80\x99", "t"}));
  EXPECT_EQ(gpt2_pretokenize("hi \xF0\x9F\x91\x8B!"), (Pieces{"hi", " \xF0\x9F\x91\x8B!"}));
  // Superscript two (U+00B2) is a number; a non-breaking space (U+00A0) is whitespace.
  EXPECT_EQ(gpt2_pretokenize("m\xC2\xB2\xC2\xA0x"), (Pieces{"m", "\xC2\xB2", "\xC2\xA0", "x"}));
  // Marks are no letters (Devanagari स्व: स, virama, व); Arabic-Indic digits are numbers.
  EXPECT_EQ(gpt2_pretokenize("\xE0\xA4\xB8\xE0\xA5\x8D\xE0\xA4\xB5"),
            (Pieces{"\xE0\xA4\xB8", "\xE0\xA5\x8D", "\xE0\xA4\xB5"}));
  EXPECT_EQ(gpt2_pretokenize("x \xD9\xA1\xD9\xA2"), (Pieces{"x", " \xD9\xA1\xD9\xA2"}));
  // An invalid UTF-8 byte stands alone as punctuation.
  EXPECT_EQ(gpt2_pretokenize("a\xFF" "b"), (Pieces{"a", "\xFF", "b"}));
}

TEST(GPT2Pretokenize, ByteToUnicodeIsGPT2sTable) {
  EXPECT_EQ(gpt2_byte_to_unicode('!'), 33u);
  EXPECT_EQ(gpt2_byte_to_unicode('~'), 126u);
  EXPECT_EQ(gpt2_byte_to_unicode(0xA1), 0xA1u);
  EXPECT_EQ(gpt2_byte_to_unicode(0xFF), 0xFFu);
  EXPECT_EQ(gpt2_byte_to_unicode(0), 0x100u);
  EXPECT_EQ(gpt2_byte_to_unicode('\n'), 0x10Au);  // 'Ċ'
  EXPECT_EQ(gpt2_byte_to_unicode(' '), 0x120u);   // 'Ġ'
  EXPECT_EQ(gpt2_byte_to_unicode(0x7F), 0x121u);
  EXPECT_EQ(gpt2_byte_to_unicode(0xAD), 0x143u);  // the last of the 68 remapped bytes
}

// ---- Llama-3 pre-tokenisation --------------------------------------------------------------------

// Expected splits worked out by hand from Llama-3's pattern
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// (alternatives tried in order at each position, the first that matches wins).
TEST(Llama3Pretokenize, SplitsLikeLlama3sRegex) {
  // A space before digits stands alone (only letters and punctuation take it); digits go by 3.
  EXPECT_EQ(llama3_pretokenize("Hello world's 123  end\n"),
            (Pieces{"Hello", " world", "'s", " ", "123", " ", " end", "\n"}));
  EXPECT_EQ(llama3_pretokenize("12345 1234567"), (Pieces{"123", "45", " ", "123", "456", "7"}));
  // Contractions match in any case.
  EXPECT_EQ(llama3_pretokenize("IT'S I'M WE'LL"), (Pieces{"IT", "'S", " I", "'M", " WE", "'LL"}));
  EXPECT_EQ(llama3_pretokenize("don't 'hello"), (Pieces{"don", "'t", " '", "hello"}));
  // Newline runs stay together, with the whitespace before them.
  EXPECT_EQ(llama3_pretokenize("a\n\nb"), (Pieces{"a", "\n\n", "b"}));
  EXPECT_EQ(llama3_pretokenize("x \r\n  y"), (Pieces{"x", " \r\n", " ", " y"}));
  // Punctuation runs take the newlines after them.
  EXPECT_EQ(llama3_pretokenize("...ok?!\n\n"), (Pieces{"...", "ok", "?!\n\n"}));
  // One non-newline, non-alphanumeric character may lead a word.
  EXPECT_EQ(llama3_pretokenize("!hello\thello\nhello"), (Pieces{"!hello", "\thello", "\n", "hello"}));
  EXPECT_EQ(llama3_pretokenize("a  \t"), (Pieces{"a", "  \t"}));
  EXPECT_EQ(llama3_pretokenize("hi \xF0\x9F\x91\x8B!"), (Pieces{"hi", " \xF0\x9F\x91\x8B!"}));
  EXPECT_EQ(llama3_pretokenize(""), (Pieces{}));
  // Devanagari स्वागत: स (Lo) ् (virama, Mn) व (Lo) ा (vowel sign, Mc) ग त (Lo): a mark is no
  // letter, and may lead the letters after it.
  EXPECT_EQ(llama3_pretokenize("\xE0\xA4\xB8\xE0\xA5\x8D\xE0\xA4\xB5\xE0\xA4\xBE\xE0\xA4\x97\xE0\xA4\xA4"),
            (Pieces{"\xE0\xA4\xB8", "\xE0\xA5\x8D\xE0\xA4\xB5", "\xE0\xA4\xBE\xE0\xA4\x97\xE0\xA4\xA4"}));
  // Qwen2: single digits.
  EXPECT_EQ(llama3_pretokenize("a123", 1), (Pieces{"a", "1", "2", "3"}));
}

// ---- GPT-2 BPE on a hand-made vocabulary --------------------------------------------------------

// "Ġ" is U+0120 (UTF-8 C4 A0), GPT-2's symbol for the space byte.
const char* kTinyVocab = R"({
  "h": 0, "e": 1, "l": 2, "o": 3, "\u0120": 4, "w": 5, "r": 6, "d": 7,
  "he": 8, "ll": 9, "hell": 10, "hello": 11, "\u0120w": 12, "or": 13, "\u0120wor": 14,
  "<|endoftext|>": 15
})";
const char* kTinyMerges =
    "#version: 0.2\n"
    "h e\n"       // rank 0
    "l l\n"       // rank 1
    "he ll\n"     // rank 2
    "hell o\n"    // rank 3
    "\xC4\xA0 w\n"  // rank 4: "Ġ w"
    "o r\n"       // rank 5
    "\xC4\xA0w or\n";  // rank 6: "Ġw or"

std::unique_ptr<Tokenizer> tiny_gpt2(const TempDir& dir) {
  write_text(dir.file("vocab.json"), kTinyVocab);
  write_text(dir.file("merges.txt"), kTinyMerges);
  return make_tokenizer({"GPT2BPETokenizer", "", dir.file("vocab.json"), dir.file("merges.txt")});
}

TEST(GPT2BPETokenizer, EncodesWithHandComputedIds) {
  TempDir dir;
  auto t = tiny_gpt2(dir);
  EXPECT_EQ(t->name(), "GPT2BPETokenizer");
  EXPECT_EQ(t->vocab_size(), 16);
  EXPECT_EQ(t->eod(), 15);
  // "hello": h e l l o -(he)-> he l l o -(ll)-> he ll o -(hell)-> hell o -(hello)-> hello = 11.
  // " world": Ġ w o r l d -(Ġw)-> Ġw o r l d -(or)-> Ġw or l d -(Ġwor)-> Ġwor l d = 14 2 7.
  EXPECT_EQ(t->encode("hello world"), (Ids{11, 14, 2, 7}));
  // The lowest rank wins wherever it is: "hell" merges to 10 via he, ll, hell.
  EXPECT_EQ(t->encode("hell"), (Ids{10}));
  // Occurrences of a pair merge left to right without overlap: l l l -> ll l.
  EXPECT_EQ(t->encode("lll"), (Ids{9, 2}));
  // Two spaces: "hello", " ", " world" (the regex leaves the last space to the word).
  EXPECT_EQ(t->encode("hello  world"), (Ids{11, 4, 14, 2, 7}));
  EXPECT_EQ(t->encode("rod"), (Ids{6, 3, 7}));
  EXPECT_EQ(t->decode({11, 14, 2, 7}), "hello world");
  EXPECT_EQ(t->decode({11, 4, 14, 2, 7}), "hello  world");
  EXPECT_EQ(t->decode({15}), "<|endoftext|>");
  EXPECT_EQ(t->special_token_id("<|endoftext|>"), std::optional<int64_t>(15));
  EXPECT_EQ(t->special_token_id("<|im_end|>"), std::nullopt);
  expect_contains(error_of([&] { t->decode({16}); }), {"16"});
  // A byte whose symbol is not in this vocabulary cannot be encoded ("\n" is "Ċ").
  expect_contains(error_of([&] { t->encode("hello\n"); }), {dir.file("vocab.json"), "\xC4\x8A"});
}

TEST(GPT2BPETokenizer, MalformedFilesAreErrorsNamingTheFile) {
  TempDir dir;
  write_text(dir.file("v.json"), R"({"a": 0})");
  write_text(dir.file("m.txt"), "a b\n");
  expect_contains(error_of([&] { load_gpt2_bpe_tokenizer(dir.file("v.json"), dir.file("m.txt")); }),
                  {dir.file("v.json"), "<|endoftext|>"});
  write_text(dir.file("bad.json"), "{\"a\": ");
  expect_contains(error_of([&] { load_gpt2_bpe_tokenizer(dir.file("bad.json"), dir.file("m.txt")); }),
                  {dir.file("bad.json"), "JSON"});
  write_text(dir.file("v2.json"), R"({"a": 0, "<|endoftext|>": 1})");
  write_text(dir.file("m2.txt"), "#version: 0.2\na b\na b c\n");
  expect_contains(error_of([&] { load_gpt2_bpe_tokenizer(dir.file("v2.json"), dir.file("m2.txt")); }),
                  {dir.file("m2.txt") + ":3"});
  expect_contains(error_of([&] { load_gpt2_bpe_tokenizer(dir.file("v2.json"), dir.file("none.txt")); }),
                  {dir.file("none.txt")});
}

// ---- Hugging Face tokenizer.json on the same hand-made model ------------------------------------

// kTinyVocab/kTinyMerges as a tokenizer.json; <|endoftext|> (15) and <|im_end|> (16) are added
// tokens. PRE is the pre_tokenizer, MERGES the merges array.
std::string tiny_hf_json(const std::string& pre, const std::string& merges,
                         const std::string& model_type = "BPE") {
  return std::string(R"({"version": "1.0", "normalizer": null, "post_processor": null,
    "added_tokens": [
      {"id": 15, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
       "rstrip": false, "normalized": false, "special": true},
      {"id": 16, "content": "<|im_end|>", "single_word": false, "lstrip": false,
       "rstrip": false, "normalized": false, "special": true}],
    "pre_tokenizer": )") + pre + R"(,
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": ")" + model_type + R"(", "dropout": null, "unk_token": null,
      "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
      "byte_fallback": false, "ignore_merges": false,
      "vocab": )" + kTinyVocab + R"(,
      "merges": )" + merges + "}}";
}
const char* kByteLevelPre = R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";
const char* kPairMerges =
    R"([["h", "e"], ["l", "l"], ["he", "ll"], ["hell", "o"], ["\u0120", "w"], ["o", "r"], ["\u0120w", "or"]])";
const char* kStringMerges =
    R"(["h e", "l l", "he ll", "hell o", "\u0120 w", "o r", "\u0120w or"])";

TEST(HuggingFaceTokenizer, EncodesWithHandComputedIds) {
  TempDir dir;
  for (const char* merges : {kPairMerges, kStringMerges}) {
    write_text(dir.file("tokenizer.json"), tiny_hf_json(kByteLevelPre, merges));
    // The folder works as well as the file.
    auto t = make_tokenizer({"HuggingFaceTokenizer", dir.path().string(), "", ""});
    EXPECT_EQ(t->name(), "HuggingFaceTokenizer");
    EXPECT_EQ(t->vocab_size(), 17);  // max id (16, <|im_end|>) + 1
    EXPECT_EQ(t->eod(), 15);         // <|endoftext|>, no tokenizer_config.json
    // Same merges as EncodesWithHandComputedIds above; added tokens cut the text first, so
    // "world" after <|endoftext|> has no leading space.
    EXPECT_EQ(t->encode("hello world"), (Ids{11, 14, 2, 7}));
    EXPECT_EQ(t->encode("hello<|endoftext|> world<|im_end|>hell"), (Ids{11, 15, 14, 2, 7, 16, 10}));
    EXPECT_EQ(t->decode({11, 15, 14, 2, 7, 16}), "hello<|endoftext|> world<|im_end|>");
    EXPECT_EQ(t->special_token_id("<|im_end|>"), std::optional<int64_t>(16));
    EXPECT_EQ(t->special_token_id("hello"), std::nullopt);
    expect_contains(error_of([&] { t->decode({17}); }), {"17"});
    EXPECT_EQ(tokenizer_vocab_size({"HuggingFaceTokenizer", dir.file("tokenizer.json"), "", ""}), 17);
    ASSERT_NE(make_torch_safe_tokenizer({"HuggingFaceTokenizer", dir.path().string(), "", ""}), nullptr);
  }
  // add_prefix_space: every segment between added tokens gets a leading space.
  write_text(dir.file("tokenizer.json"),
             tiny_hf_json(R"({"type": "ByteLevel", "add_prefix_space": true, "use_regex": true})",
                          kPairMerges));
  auto p = load_hf_tokenizer(dir.file("tokenizer.json"));
  EXPECT_EQ(p->encode("world<|im_end|>hello"), (Ids{14, 2, 7, 16, 4, 11}));
}

TEST(HuggingFaceTokenizer, EodFromTokenizerConfig) {
  TempDir dir;
  write_text(dir.file("tokenizer.json"), tiny_hf_json(kByteLevelPre, kPairMerges));
  write_text(dir.file("tokenizer_config.json"), R"({"eos_token": "<|im_end|>"})");
  EXPECT_EQ(load_hf_tokenizer(dir.path().string())->eod(), 16);
  write_text(dir.file("tokenizer_config.json"), R"({"eos_token": {"content": "hello"}})");
  EXPECT_EQ(load_hf_tokenizer(dir.path().string())->eod(), 11);
  write_text(dir.file("tokenizer_config.json"), R"({"eos_token": "</s>"})");
  expect_contains(error_of([&] { load_hf_tokenizer(dir.path().string()); }),
                  {dir.file("tokenizer_config.json"), "eos_token", "</s>"});
}

TEST(HuggingFaceTokenizer, UnsupportedThingsAreErrorsNamingFileAndJsonPath) {
  TempDir dir;
  const std::string file = dir.file("tokenizer.json");
  auto error_for = [&](const std::string& json) {
    write_text(file, json);
    return error_of([&] { load_hf_tokenizer(file); });
  };
  expect_contains(error_of([&] { load_hf_tokenizer(dir.file("missing.json")); }),
                  {dir.file("missing.json")});
  expect_contains(error_of([&] { load_hf_tokenizer(dir.file("nested")); }), {"nested"});
  expect_contains(error_for("{\"model\": "), {file, "JSON"});
  expect_contains(error_for(tiny_hf_json(kByteLevelPre, kPairMerges, "WordPiece")),
                  {file, "model.type", "WordPiece"});
  const std::string split =
      R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "[a&&b]"},
         "behavior": "Isolated", "invert": false}, {"type": "ByteLevel", "use_regex": false}]})";
  expect_contains(error_for(tiny_hf_json(split, kPairMerges)),
                  {file, "pre_tokenizer.pretokenizers[0].pattern.Regex", "[a&&b]"});
  expect_contains(error_for(tiny_hf_json(R"({"type": "UnicodeScripts"})", kPairMerges)),
                  {file, "pre_tokenizer.type", "UnicodeScripts"});
  std::string unknown = tiny_hf_json(kByteLevelPre, kPairMerges);
  unknown.replace(unknown.find("\"normalizer\": null"), 18, R"("normalizer": {"type": "Uppercase"})");
  expect_contains(error_for(unknown), {file, "normalizer.type", "Uppercase"});
  std::string bert = tiny_hf_json(kByteLevelPre, kPairMerges);
  bert.replace(bert.find("\"normalizer\": null"), 18,
               R"("normalizer": {"type": "BertNormalizer", "lowercase": "yes"})");
  expect_contains(error_for(bert), {file, "normalizer.lowercase", "true or false"});
  expect_contains(error_for(tiny_hf_json(kByteLevelPre, R"([["h", "e", "x"]])")),
                  {file, "model.merges[0]"});
  std::string lstrip = tiny_hf_json(kByteLevelPre, kPairMerges);
  lstrip.replace(lstrip.find("\"lstrip\": false"), 15, R"("lstrip": 1)");
  expect_contains(error_for(lstrip), {file, "added_tokens[0].lstrip"});
  // No end-of-document token among the added tokens.
  std::string no_eod = tiny_hf_json(kByteLevelPre, kPairMerges);
  no_eod.replace(no_eod.find("\"<|endoftext|>\", \"single"), 15, "\"<|other|>\"");
  no_eod.replace(no_eod.find("\"<|im_end|>\""), 12, "\"<|other2|>\"");
  expect_contains(error_for(no_eod), {file, "end-of-document"});
  expect_contains(error_of([] { make_tokenizer({"HuggingFaceTokenizer", "", "", ""}); }),
                  {"--tokenizer-model"});
}

// ---- SentencePiece ------------------------------------------------------------------------------

std::vector<std::string> small_corpus() {
  const std::vector<std::string> words = {
      "the", "model", "learns", "to", "predict", "next", "token", "from", "data", "shards",
      "every", "rank", "gathers", "weights", "before", "forward", "and", "reduces", "gradients",
      "after", "backward", "optimizer", "steps", "on", "flat", "buffers", "quickly", "with",
      "mixed", "precision", "training", "runs", "for", "many", "iterations"};
  std::mt19937 rng(11);
  std::vector<std::string> lines;
  for (int i = 0; i < 400; ++i) {
    std::string line;
    const int n = 4 + static_cast<int>(rng() % 10);
    for (int k = 0; k < n; ++k) {
      if (k) line += ' ';
      line += words[rng() % words.size()];
    }
    line += (i % 3 == 0) ? "." : (i % 3 == 1 ? ", 42 times!" : "?");
    lines.push_back(line);
  }
  return lines;
}

TEST(SentencePieceTokenizer, TrainsAndRoundTrips) {
  TempDir dir;
  const auto corpus = small_corpus();
  for (const std::string type : {"bpe", "unigram"}) {
    SentencePieceTrainOptions options;
    options.vocab_size = 320;
    options.model_type = type;
    const std::string prefix = dir.file("sp_" + type);
    train_sentencepiece(corpus, prefix, options);
    ASSERT_TRUE(fs::exists(prefix + ".model")) << type;
    auto t = make_tokenizer({"SentencePieceTokenizer", prefix + ".model", "", ""});
    EXPECT_EQ(t->vocab_size(), 320) << type;
    EXPECT_EQ(t->eod(), 2) << type;  // </s>
    for (int i = 0; i < 20; ++i) {
      const Ids ids = t->encode(corpus[i]);
      EXPECT_LT(ids.size(), corpus[i].size()) << type << ": pieces should be longer than a byte";
      for (int64_t id : ids) {
        EXPECT_GE(id, 0);
        EXPECT_LT(id, 320);
      }
      EXPECT_EQ(t->decode(ids), corpus[i]) << type;
    }
    // Unseen characters fall back to bytes and still round-trip; whitespace is kept as written.
    const std::string unseen = "Z\xC3\xBCrich  \xE2\x9C\x93 gradients\tX";
    EXPECT_EQ(t->decode(t->encode(unseen)), unseen) << type;
    expect_contains(error_of([&] { t->decode({320}); }), {"320"});
  }
}

TEST(SentencePieceTokenizer, ErrorsNameTheFileOrFlag) {
  TempDir dir;
  expect_contains(error_of([&] { load_sentencepiece_tokenizer(dir.file("missing.model")); }),
                  {dir.file("missing.model")});
  write_text(dir.file("junk.model"), "not a model");
  expect_contains(error_of([&] { load_sentencepiece_tokenizer(dir.file("junk.model")); }),
                  {dir.file("junk.model")});
  SentencePieceTrainOptions options;
  options.vocab_size = 100000;  // far more than the corpus supports
  expect_contains(error_of([&] { train_sentencepiece(small_corpus(), dir.file("big"), options); }),
                  {dir.file("big"), "training failed"});
}

// ---- factory -------------------------------------------------------------------------------------

TEST(MakeTokenizer, ErrorsNameTheFlag) {
  expect_contains(error_of([] { make_tokenizer({"NoSuchTokenizer", "", "", ""}); }),
                  {"--tokenizer-type", "NoSuchTokenizer"});
  expect_contains(error_of([] { make_tokenizer({"SentencePieceTokenizer", "", "", ""}); }),
                  {"--tokenizer-model"});
  expect_contains(error_of([] { make_tokenizer({"GPT2BPETokenizer", "", "v.json", ""}); }),
                  {"--merge-file"});
  expect_contains(error_of([] { make_tokenizer({"GPT2BPETokenizer", "", "", "m.txt"}); }),
                  {"--vocab-file"});
  EXPECT_EQ(make_tokenizer({"ByteLevelTokenizer", "", "", ""})->vocab_size(), 257);
}

}  // namespace
}  // namespace mfsdp
