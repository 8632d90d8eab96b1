// mfsdp-preprocess end to end: the built binary (path in MFSDP_PREPROCESS_BIN, set by CMake) runs on
// small text and JSONL files; its output is read back with IndexedDataset and compared with token
// ids worked out independently (the bytes of the text; hand-computed GPT-2 BPE ids).
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "harness/expect_error.h"
#include "harness/spawn_with_files.h"
#include "harness/temp_dir.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "mfsdp/data/indexed_dataset.h"
#include "mfsdp/data/tokenizer.h"

namespace mfsdp {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int64_t>;

using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
using mfsdp::testing::TempDir;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string tool_path() {
  const char* path = std::getenv("MFSDP_PREPROCESS_BIN");
  if (path == nullptr || *path == '\0') {
    throw std::runtime_error(
        "MFSDP_PREPROCESS_BIN is not set: it must name the built mfsdp-preprocess binary (ctest "
        "sets it; by hand: MFSDP_PREPROCESS_BIN=build/mfsdp-preprocess ./build/tests/plain_tests --gtest_filter='Preprocess*')");
  }
  return path;
}

struct Result {
  int exit_code = -1;
  std::string out, err;
};

// Runs mfsdp-preprocess with `args`, stdout and stderr captured through files.
Result run_tool(const TempDir& dir, const std::vector<std::string>& args) {
  const std::string out_path = dir.file("stdout.txt"), err_path = dir.file("stderr.txt");
  std::vector<std::string> argv = {tool_path()};
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = mfsdp::testing::spawn_with_files(argv, out_path, err_path);
  int status = 0;
  waitpid(pid, &status, 0);
  Result r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_file(out_path);
  r.err = read_file(err_path);
  return r;
}

Ids bytes_plus_eod(const std::string& text) {
  Ids ids;
  for (unsigned char c : text) ids.push_back(c);
  ids.push_back(256);
  return ids;
}

const char* kText =
    "First para\n"
    "line two\n"
    "\n"
    "\n"
    "Second\r\n"
    "  \n"
    "Third\n";

TEST(Preprocess, TextParagraphsWithTheByteTokenizer) {
  TempDir dir;
  write_text(dir.file("in.txt"), kText);
  const Result r = run_tool(dir, {"--input", dir.file("in.txt"), "--output-prefix", dir.file("out"),
                                  "--tokenizer-type", "ByteLevelTokenizer", "--append-eod"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_contains(r.out, {dir.file("out_text_document"), "3 documents"});
  IndexedDataset ds(dir.file("out_text_document"));
  EXPECT_EQ(ds.dtype(), TokenDType::kUInt16);  // vocabulary 257 < 65500
  EXPECT_EQ(ds.document_indices(), (Ids{0, 1, 2, 3}));
  EXPECT_EQ(ds.get(0), bytes_plus_eod("First para\nline two"));
  EXPECT_EQ(ds.get(1), bytes_plus_eod("Second"));
  EXPECT_EQ(ds.get(2), bytes_plus_eod("Third"));
}

TEST(Preprocess, TextLinesWithoutEod) {
  TempDir dir;
  write_text(dir.file("in.txt"), kText);
  const Result r = run_tool(dir, {"--input", dir.file("in.txt"), "--output-prefix", dir.file("out"),
                                  "--tokenizer-type", "ByteLevelTokenizer", "--split-lines"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  IndexedDataset ds(dir.file("out_text_document"));
  ASSERT_EQ(ds.size(), 4);
  auto bytes = [](const std::string& s) { return Ids(s.begin(), s.end()); };
  EXPECT_EQ(ds.get(0), bytes("First para"));
  EXPECT_EQ(ds.get(1), bytes("line two"));
  EXPECT_EQ(ds.get(2), bytes("Second"));
  EXPECT_EQ(ds.get(3), bytes("Third"));
}

// The tiny GPT-2 vocabulary of tokenizer_test.cpp; ids worked out by hand there.
const char* kTinyVocab = R"({
  "h": 0, "e": 1, "l": 2, "o": 3, "\u0120": 4, "w": 5, "r": 6, "d": 7,
  "he": 8, "ll": 9, "hell": 10, "hello": 11, "\u0120w": 12, "or": 13, "\u0120wor": 14,
  "<|endoftext|>": 15
})";
const char* kTinyMerges = "#version: 0.2\nh e\nl l\nhe ll\nhell o\n\xC4\xA0 w\no r\n\xC4\xA0w or\n";

TEST(Preprocess, JsonlWithGPT2BPEAndTwoKeys) {
  TempDir dir;
  write_text(dir.file("vocab.json"), kTinyVocab);
  write_text(dir.file("merges.txt"), kTinyMerges);
  write_text(dir.file("in.jsonl"),
             "{\"text\": \"hello world\", \"title\": \"hell\", \"id\": 1}\n"
             "{\"text\": \"\", \"title\": \"rod\"}\n"
             "\n"
             "{\"text\": \"lll\", \"title\": \"hello\"}\n"
             "{\"text\": [\"hell\", \"\", \"rod\"], \"title\": \"\"}\n");
  const Result r = run_tool(dir, {"--input", dir.file("in.jsonl"), "--json-keys", "text", "title",
                                  "--output-prefix", dir.file("out"), "--tokenizer-type",
                                  "GPT2BPETokenizer", "--vocab-file", dir.file("vocab.json"),
                                  "--merge-file", dir.file("merges.txt"), "--append-eod"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  IndexedDataset text(dir.file("out_text_document"));
  // Document 1 is empty text: a document with no sequence, as Megatron's preprocess_data.py.
  // Document 3 is a list of sentences: one sequence per non-empty sentence, EOD on the last.
  EXPECT_EQ(text.document_indices(), (Ids{0, 1, 1, 2, 4}));
  EXPECT_EQ(text.get(0), (Ids{11, 14, 2, 7, 15}));
  EXPECT_EQ(text.get(1), (Ids{9, 2, 15}));
  EXPECT_EQ(text.get(2), (Ids{10}));
  EXPECT_EQ(text.get(3), (Ids{6, 3, 7, 15}));
  IndexedDataset title(dir.file("out_title_document"));
  EXPECT_EQ(title.document_indices(), (Ids{0, 1, 2, 3, 3}));
  EXPECT_EQ(title.get(0), (Ids{10, 15}));
  EXPECT_EQ(title.get(1), (Ids{6, 3, 7, 15}));
  EXPECT_EQ(title.get(2), (Ids{11, 15}));
}

TEST(Preprocess, TrainsASentencePieceModelFirst) {
  TempDir dir;
  const std::vector<std::string> words = {"shard", "gather", "reduce", "scatter", "weights",
                                          "tokens", "the", "of", "and", "model", "step", "rank"};
  std::mt19937 rng(3);
  std::vector<std::string> docs;
  std::string input;
  for (int d = 0; d < 120; ++d) {
    std::string doc;
    for (int k = 0; k < 6 + static_cast<int>(rng() % 8); ++k) {
      if (k) doc += (k % 5 == 0) ? "\n" : " ";
      doc += words[rng() % words.size()];
    }
    docs.push_back(doc);
    input += doc + "\n\n";
  }
  write_text(dir.file("in.txt"), input);
  const Result r = run_tool(dir, {"--input", dir.file("in.txt"), "--output-prefix", dir.file("sp"),
                                  "--tokenizer-type", "SentencePieceTokenizer",
                                  "--train-tokenizer-vocab-size", "300", "--append-eod",
                                  "--workers", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(fs::exists(dir.file("sp.model")));
  auto tokenizer = load_sentencepiece_tokenizer(dir.file("sp.model"));
  EXPECT_EQ(tokenizer->vocab_size(), 300);
  IndexedDataset ds(dir.file("sp_text_document"));
  ASSERT_EQ(ds.num_documents(), 120);
  for (int d = 0; d < 120; ++d) {
    Ids ids = ds.get(d);
    ASSERT_EQ(ids.back(), tokenizer->eod());
    ids.pop_back();
    EXPECT_EQ(ids, tokenizer->encode(docs[d])) << "document " << d;
    EXPECT_EQ(tokenizer->decode(ids), docs[d]) << "document " << d;
  }
}

TEST(Preprocess, WorkersDoNotChangeTheOutput) {
  TempDir dir;
  std::string input;
  for (int d = 0; d < 2000; ++d) {
    input += "{\"text\": \"document " + std::to_string(d) + std::string(static_cast<size_t>(d % 17), 'x') + "\"}\n";
  }
  write_text(dir.file("in.jsonl"), input);
  for (const char* workers : {"1", "3"}) {
    const Result r = run_tool(dir, {"--input", dir.file("in.jsonl"), "--output-prefix",
                                    dir.file(std::string("w") + workers), "--tokenizer-type",
                                    "ByteLevelTokenizer", "--append-eod", "--workers", workers});
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  EXPECT_EQ(read_file(dir.file("w1_text_document.bin")), read_file(dir.file("w3_text_document.bin")));
  EXPECT_EQ(read_file(dir.file("w1_text_document.idx")), read_file(dir.file("w3_text_document.idx")));
  IndexedDataset ds(dir.file("w3_text_document"));
  EXPECT_EQ(ds.get(1234), bytes_plus_eod("document 1234" + std::string(1234 % 17, 'x')));
}

TEST(Preprocess, ErrorsNameTheFlagOrFile) {
  TempDir dir;
  write_text(dir.file("in.txt"), kText);
  Result r = run_tool(dir, {"--output-prefix", dir.file("o"), "--tokenizer-type", "ByteLevelTokenizer"});
  EXPECT_EQ(r.exit_code, 2);
  expect_contains(r.err, {"--input"});

  r = run_tool(dir, {"--input", dir.file("in.txt"), "--output-prefix", dir.file("o"),
                     "--tokenizer-type", "NoSuchTokenizer"});
  EXPECT_EQ(r.exit_code, 2);
  expect_contains(r.err, {"--tokenizer-type"});

  r = run_tool(dir, {"--input", dir.file("missing.txt"), "--output-prefix", dir.file("o"),
                     "--tokenizer-type", "ByteLevelTokenizer"});
  EXPECT_EQ(r.exit_code, 1);
  expect_contains(r.err, {dir.file("missing.txt")});

  r = run_tool(dir, {"--input", dir.file("in.txt"), "--output-prefix", dir.file("o"),
                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"});
  EXPECT_EQ(r.exit_code, 1);
  expect_contains(r.err, {"--merge-file"});

  r = run_tool(dir, {"--input", dir.file("in.txt"), "--output-prefix", dir.file("o"),
                     "--tokenizer-type", "ByteLevelTokenizer", "--train-tokenizer-vocab-size", "100"});
  EXPECT_EQ(r.exit_code, 1);
  expect_contains(r.err, {"--train-tokenizer-vocab-size", "SentencePieceTokenizer"});

  write_text(dir.file("bad.jsonl"), "{\"text\": \"ok\"}\n{\"text\": \n");
  r = run_tool(dir, {"--input", dir.file("bad.jsonl"), "--output-prefix", dir.file("o"),
                     "--tokenizer-type", "ByteLevelTokenizer"});
  EXPECT_EQ(r.exit_code, 1);
  expect_contains(r.err, {dir.file("bad.jsonl") + ":2", "invalid JSON"});

  write_text(dir.file("nokey.jsonl"), "{\"body\": \"ok\"}\n");
  r = run_tool(dir, {"--input", dir.file("nokey.jsonl"), "--output-prefix", dir.file("o"),
                     "--tokenizer-type", "ByteLevelTokenizer"});
  EXPECT_EQ(r.exit_code, 1);
  expect_contains(r.err, {dir.file("nokey.jsonl") + ":1", "\"text\"", "--json-keys"});
  // A failed run leaves no partial dataset behind.
  EXPECT_FALSE(fs::exists(dir.file("o_text_document.bin")));
  EXPECT_FALSE(fs::exists(dir.file("o_text_document.bin.tmp")));
}

// A dataset from another tool (here: ours with its checksums removed) gains them; a damaged one
// gains none; a bad prefix is named.
TEST(Preprocess, AddChecksumsToAnExistingDataset) {
  TempDir dir;
  write_text(dir.file("in.txt"), kText);
  ASSERT_EQ(run_tool(dir, {"--input", dir.file("in.txt"), "--output-prefix", dir.file("out"),
                           "--tokenizer-type", "ByteLevelTokenizer"}).exit_code, 0);
  const std::string prefix = dir.file("out_text_document");
  ASSERT_TRUE(fs::exists(prefix + ".checksums.json"));  // the tool writes them itself
  fs::remove(prefix + ".checksums.json");
  Result r = run_tool(dir, {"--add-checksums", prefix});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_contains(r.out, {prefix + ".checksums.json", "3 sequences"});
  std::string bin = read_file(prefix + ".bin");
  bin[0] = static_cast<char>(bin[0] ^ 1);
  write_text(prefix + ".bin", bin);
  expect_contains(error_of([&] { IndexedDataset(prefix).get(0); }), {prefix + ".bin", "checksum"});

  r = run_tool(dir, {"--add-checksums", dir.file("missing")});
  EXPECT_EQ(r.exit_code, 1);
  expect_contains(r.err, {dir.file("missing") + ".idx"});
  EXPECT_FALSE(fs::exists(dir.file("missing.checksums.json")));
  r = run_tool(dir, {"--add-checksums"});
  EXPECT_EQ(r.exit_code, 2);
  expect_contains(r.err, {"--add-checksums"});
}

}  // namespace
}  // namespace mfsdp
