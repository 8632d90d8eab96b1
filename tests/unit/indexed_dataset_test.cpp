// Megatron's indexed dataset (.bin/.idx). The references are byte arrays written out by hand from
// the format description in include/mfsdp/data/indexed_dataset.h (and Megatron's indexed_dataset.py),
// never bytes produced by the writer under test.
#include <gtest/gtest.h>

#include "harness/expect_error.h"
#include "harness/temp_dir.h"

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mfsdp/base/crc32c.h"
#include "mfsdp/data/dataset_checksums.h"
#include "mfsdp/data/indexed_dataset.h"

namespace mfsdp {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

using mfsdp::testing::TempDir;

void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Little-endian encodings, written out from the format description.
void put(Bytes& b, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;


// ---- the header, byte for byte -----------------------------------------------------------------

TEST(IndexedDataset, WriterBytesMatchTheFormatByteForByte) {
  TempDir dir;
  const std::string prefix = dir.file("ds");
  {
    IndexedDatasetWriter w(prefix, TokenDType::kUInt16);
    w.add_document({1, 2, 3});  // document 0: one sequence
    w.add_document({});         // document 1: no sequence (empty text), as Megatron keeps it
    w.add_item({65535});        // document 2: two sequences
    w.add_item({7, 8});
    w.end_document();
    w.finalize();
  }
  const Bytes expected_idx = {
      'M', 'M', 'I', 'D', 'I', 'D', 'X', 0x00, 0x00,  // magic
      0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // version 1 (u64)
      0x08,                                            // dtype code 8 = uint16
      0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // 3 sequences
      0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // 4 document indices (3 documents + 1)
      0x03, 0x00, 0x00, 0x00,                          // lengths (i32): 3
      0x01, 0x00, 0x00, 0x00,                          //                1
      0x02, 0x00, 0x00, 0x00,                          //                2
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // pointers (i64, bytes): 0
      0x06, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  //                        6
      0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  //                        8
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // document indices (i64): 0
      0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  //                         1
      0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  //                         1
      0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  //                         3
  };
  const Bytes expected_bin = {0x01, 0x00, 0x02, 0x00, 0x03, 0x00, 0xFF, 0xFF, 0x07, 0x00, 0x08, 0x00};
  EXPECT_EQ(read_file(prefix + ".idx"), expected_idx);
  EXPECT_EQ(read_file(prefix + ".bin"), expected_bin);
  EXPECT_FALSE(fs::exists(prefix + ".idx.tmp"));
  EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
}

// ---- reading a hand-built pair -----------------------------------------------------------------

// int32 tokens; sequences placed out of order in the .bin with junk between them (the reader
// must follow the pointers); documents {seq 0, seq 1} and {seq 2}.
struct HandBuilt {
  Bytes idx, bin;
};

HandBuilt hand_built(uint64_t version = 1, uint8_t code = 4) {
  HandBuilt h;
  auto i32 = [&](int32_t v) { put(h.bin, static_cast<uint32_t>(v), 4); };
  i32(42);                      // bytes 0-3: sequence 1
  put(h.bin, 0xDEADBEEF, 4);    // bytes 4-7: junk
  i32(10); i32(-5); i32(70000);  // bytes 8-19: sequence 0
  i32(7); i32(8);               // bytes 20-27: sequence 2

  for (char c : {'M', 'M', 'I', 'D', 'I', 'D', 'X'}) h.idx.push_back(static_cast<uint8_t>(c));
  h.idx.push_back(0);
  h.idx.push_back(0);
  put(h.idx, version, 8);
  h.idx.push_back(code);
  put(h.idx, 3, 8);  // sequences
  put(h.idx, 3, 8);  // document indices
  put(h.idx, 3, 4); put(h.idx, 1, 4); put(h.idx, 2, 4);     // lengths
  put(h.idx, 8, 8); put(h.idx, 0, 8); put(h.idx, 20, 8);    // pointers
  put(h.idx, 0, 8); put(h.idx, 2, 8); put(h.idx, 3, 8);     // document indices
  return h;
}

std::string write_pair(const TempDir& dir, const HandBuilt& h, const std::string& name = "hb") {
  const std::string prefix = dir.file(name);
  write_file(prefix + ".idx", h.idx);
  write_file(prefix + ".bin", h.bin);
  return prefix;
}

TEST(IndexedDataset, ReadsAHandBuiltPair) {
  TempDir dir;
  IndexedDataset ds(write_pair(dir, hand_built()));
  EXPECT_EQ(ds.dtype(), TokenDType::kInt32);
  EXPECT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.num_documents(), 2);
  EXPECT_EQ(ds.num_tokens(), 6);
  EXPECT_EQ(ds.sequence_lengths(), (std::vector<int32_t>{3, 1, 2}));
  EXPECT_EQ(ds.sequence_pointers(), (std::vector<int64_t>{8, 0, 20}));
  EXPECT_EQ(ds.document_indices(), (std::vector<int64_t>{0, 2, 3}));
  EXPECT_TRUE(ds.sequence_modes().empty());
  EXPECT_EQ(ds.get(0), (std::vector<int64_t>{10, -5, 70000}));
  EXPECT_EQ(ds.get(1), (std::vector<int64_t>{42}));
  EXPECT_EQ(ds.get(2), (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(ds.get(0, 1), (std::vector<int64_t>{-5, 70000}));
  EXPECT_EQ(ds.get(0, 1, 1), (std::vector<int64_t>{-5}));
  EXPECT_EQ(ds.get(2, 2, 0), (std::vector<int64_t>{}));
  expect_contains(error_of([&] { ds.get(0, 2, 2); }), {"sequence 0", "outside"});
  expect_contains(error_of([&] { ds.get(3); }), {"sequence 3", "out of range"});
}

TEST(IndexedDataset, ReadsTheModesOfAMultimodalIndex) {
  TempDir dir;
  HandBuilt h = hand_built();
  for (uint8_t mode : {0, 1, 0}) h.idx.push_back(mode);
  IndexedDataset ds(write_pair(dir, h));
  EXPECT_EQ(ds.sequence_modes(), (std::vector<int8_t>{0, 1, 0}));
  EXPECT_EQ(ds.get(2), (std::vector<int64_t>{7, 8}));
}

// ---- errors name the file and what is wrong -----------------------------------------------------

TEST(IndexedDataset, TruncatedIndexIsAnErrorNamingTheFile) {
  TempDir dir;
  const HandBuilt good = hand_built();
  for (size_t keep : {size_t{0}, size_t{20}, size_t{33}, size_t{34}, size_t{50}, good.idx.size() - 1}) {
    HandBuilt h = good;
    h.idx.resize(keep);
    const std::string prefix = write_pair(dir, h, "t" + std::to_string(keep));
    expect_contains(error_of([&] { IndexedDataset ds(prefix); }), {prefix + ".idx", "truncated"});
  }
}

TEST(IndexedDataset, WrongMagicIsAnError) {
  TempDir dir;
  HandBuilt h = hand_built();
  h.idx[0] = 'X';
  const std::string prefix = write_pair(dir, h);
  expect_contains(error_of([&] { IndexedDataset ds(prefix); }),
                  {prefix + ".idx", "wrong magic", "58 4d 49 44"});
}

TEST(IndexedDataset, UnsupportedVersionIsAnError) {
  TempDir dir;
  const std::string prefix = write_pair(dir, hand_built(/*version=*/2));
  expect_contains(error_of([&] { IndexedDataset ds(prefix); }),
                  {prefix + ".idx", "unsupported version 2"});
}

TEST(IndexedDataset, UnknownDtypeCodeIsAnError) {
  TempDir dir;
  for (uint8_t code : {uint8_t{0}, uint8_t{9}}) {
    const std::string prefix = write_pair(dir, hand_built(1, code), "c" + std::to_string(code));
    expect_contains(error_of([&] { IndexedDataset ds(prefix); }),
                    {prefix + ".idx", "unknown dtype code " + std::to_string(code)});
  }
}

TEST(IndexedDataset, PointerBeyondTheBinIsAnError) {
  TempDir dir;
  HandBuilt h = hand_built();
  // Sequence 2's pointer (third i64 after the lengths) 20 -> 24: bytes [24, 32) of a 28-byte .bin.
  const size_t pointer2 = 34 + 3 * 4 + 2 * 8;
  h.idx[pointer2] = 24;
  const std::string prefix = write_pair(dir, h);
  expect_contains(error_of([&] { IndexedDataset ds(prefix); }),
                  {prefix + ".bin", "sequence 2", "beyond the end", "28 bytes"});
  // A .bin cut short is the same error.
  HandBuilt cut = hand_built();
  cut.bin.resize(27);
  const std::string prefix2 = write_pair(dir, cut, "cut");
  expect_contains(error_of([&] { IndexedDataset ds(prefix2); }), {prefix2 + ".bin", "sequence 2"});
}

TEST(IndexedDataset, InconsistentIndexIsAnError) {
  TempDir dir;
  HandBuilt extra = hand_built();
  extra.idx.insert(extra.idx.end(), 5, 0);  // neither 0 nor 3 (one mode per sequence) extra bytes
  const std::string p1 = write_pair(dir, extra, "extra");
  expect_contains(error_of([&] { IndexedDataset ds(p1); }), {p1 + ".idx", "5 unexpected bytes"});

  HandBuilt last = hand_built();
  last.idx[last.idx.size() - 8] = 2;  // document indices end at 2, not at the 3 sequences
  const std::string p2 = write_pair(dir, last, "last");
  expect_contains(error_of([&] { IndexedDataset ds(p2); }), {p2 + ".idx", "document indices"});

  HandBuilt no_bin = hand_built();
  const std::string p3 = write_pair(dir, no_bin, "nobin");
  fs::remove(p3 + ".bin");
  expect_contains(error_of([&] { IndexedDataset ds(p3); }), {p3 + ".bin", "cannot open"});
  EXPECT_FALSE(IndexedDataset::exists(p3));
  expect_contains(error_of([&] { IndexedDataset ds(dir.file("none")); }),
                  {dir.file("none") + ".idx", "cannot open"});
}

// ---- round trips -------------------------------------------------------------------------------

TEST(IndexedDataset, RoundTripsEveryDtype) {
  TempDir dir;
  struct Case { TokenDType dtype; int64_t lo, hi; size_t itemsize; };
  const Case cases[] = {
      {TokenDType::kUInt8, 0, 255, 1},           {TokenDType::kInt8, -128, 127, 1},
      {TokenDType::kInt16, -32768, 32767, 2},    {TokenDType::kInt32, INT32_MIN, INT32_MAX, 4},
      {TokenDType::kInt64, INT64_MIN, INT64_MAX, 8}, {TokenDType::kFloat64, -(1LL << 53), 1LL << 53, 8},
      {TokenDType::kFloat32, -(1 << 24), 1 << 24, 4}, {TokenDType::kUInt16, 0, 65535, 2},
  };
  std::mt19937_64 rng(7);
  for (const Case& c : cases) {
    const std::string prefix = dir.file(std::string("rt_") + token_dtype_name(c.dtype));
    std::vector<std::vector<int64_t>> docs;
    {
      IndexedDatasetWriter w(prefix, c.dtype);
      for (int d = 0; d < 5; ++d) {
        std::vector<int64_t> doc = {c.lo, c.hi};
        std::uniform_int_distribution<int64_t> dist(c.lo, c.hi);
        for (int k = 0; k < d * 3; ++k) doc.push_back(dist(rng));
        docs.push_back(doc);
        w.add_document(doc);
      }
      w.finalize();
    }
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.dtype(), c.dtype);
    EXPECT_EQ(token_dtype_size(ds.dtype()), c.itemsize);
    ASSERT_EQ(ds.size(), 5);
    ASSERT_EQ(ds.num_documents(), 5);
    int64_t total = 0;
    for (int d = 0; d < 5; ++d) {
      EXPECT_EQ(ds.get(d), docs[d]) << token_dtype_name(c.dtype) << " document " << d;
      total += static_cast<int64_t>(docs[d].size());
    }
    EXPECT_EQ(ds.num_tokens(), total);
    EXPECT_EQ(static_cast<int64_t>(fs::file_size(prefix + ".bin")),
              total * static_cast<int64_t>(c.itemsize));
    // The dtype code is byte 17 of the index.
    EXPECT_EQ(read_file(prefix + ".idx").at(17), static_cast<uint8_t>(c.dtype));
  }
}

TEST(IndexedDataset, OptimalDtypeFollowsMegatron) {
  EXPECT_EQ(optimal_token_dtype(257), TokenDType::kUInt16);
  EXPECT_EQ(optimal_token_dtype(65499), TokenDType::kUInt16);
  EXPECT_EQ(optimal_token_dtype(65500), TokenDType::kInt32);
  EXPECT_EQ(optimal_token_dtype(128256), TokenDType::kInt32);
  EXPECT_EQ(static_cast<int>(TokenDType::kFloat64), 6);
  EXPECT_EQ(static_cast<int>(TokenDType::kFloat32), 7);
  EXPECT_STREQ(token_dtype_name(TokenDType::kUInt16), "uint16");
}

TEST(IndexedDataset, MergesDatasetsLikeAddIndex) {
  TempDir dir;
  const std::string a = dir.file("a"), b = dir.file("b"), merged = dir.file("m");
  {
    IndexedDatasetWriter w(a, TokenDType::kUInt16);
    w.add_document({1, 2});
    w.add_document({3});
    w.finalize();
  }
  {
    IndexedDatasetWriter w(b, TokenDType::kUInt16);
    w.add_item({4});
    w.add_item({5, 6});
    w.end_document();
    w.finalize();
  }
  {
    IndexedDatasetWriter w(merged, TokenDType::kUInt16);
    w.add_document({9});
    w.add_index(a);
    w.add_index(b);
    w.finalize();
  }
  IndexedDataset ds(merged);
  EXPECT_EQ(ds.document_indices(), (std::vector<int64_t>{0, 1, 2, 3, 5}));
  EXPECT_EQ(ds.get(0), (std::vector<int64_t>{9}));
  EXPECT_EQ(ds.get(1), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ds.get(4), (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(ds.sequence_pointers(), (std::vector<int64_t>{0, 2, 6, 8, 10}));
}

// ---- writer contracts --------------------------------------------------------------------------

TEST(IndexedDatasetWriter, RejectsTokensTheDtypeCannotHold) {
  TempDir dir;
  IndexedDatasetWriter w(dir.file("w"), TokenDType::kUInt16);
  expect_contains(error_of([&] { w.add_item({1, 70000}); }), {"70000", "uint16"});
  expect_contains(error_of([&] { w.add_item({-1}); }), {"-1", "uint16"});
}

TEST(IndexedDatasetWriter, FinalizeNeedsTheLastDocumentClosed) {
  TempDir dir;
  IndexedDatasetWriter w(dir.file("w"), TokenDType::kInt32);
  w.add_item({1});
  expect_contains(error_of([&] { w.finalize(); }), {"end_document"});
  expect_contains(error_of([&] { w.add_document({1, 2}, {1}); }), {"sum to 1", "2 tokens"});
}

TEST(IndexedDatasetWriter, AnAbandonedWriterLeavesNoFiles) {
  TempDir dir;
  const std::string prefix = dir.file("gone");
  {
    IndexedDatasetWriter w(prefix, TokenDType::kInt32);
    w.add_document({1, 2, 3});
    EXPECT_TRUE(fs::exists(prefix + ".bin.tmp"));
  }
  EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
  EXPECT_FALSE(fs::exists(prefix + ".bin"));
  EXPECT_FALSE(fs::exists(prefix + ".idx"));
  expect_contains(error_of([&] { IndexedDatasetWriter w(dir.file("no/such/dir/x"), TokenDType::kInt32); }),
                  {"no/such/dir/x.bin.tmp", "cannot open"});
}

// ---- checksums (include/mfsdp/data/dataset_checksums.h) -----------------------------------------------

// Three documents of int32 tokens: 200,000 (bytes [0, 800000), block 0), 100,000 (bytes
// [800000, 1200000), across blocks 0 and 1) and 10 (block 1).
std::string write_checksummed(TempDir& dir, std::vector<std::vector<int64_t>>& docs) {
  const std::string prefix = dir.file("sums");
  docs = {std::vector<int64_t>(200000), std::vector<int64_t>(100000), std::vector<int64_t>(10)};
  int64_t k = 0;
  for (auto& d : docs)
    for (auto& t : d) t = (k++ * 7919) % 100000;
  IndexedDatasetWriter w(prefix, TokenDType::kInt32);
  for (const auto& d : docs) w.add_document(d);
  w.finalize();
  return prefix;
}

void flip(const std::string& path, size_t at) {
  Bytes b = read_file(path);
  b.at(at) ^= 0x01;
  write_file(path, b);
}

TEST(IndexedDatasetChecksums, WriterRecordsTheIndexAndEveryBlock) {
  TempDir dir;
  std::vector<std::vector<int64_t>> docs;
  const std::string prefix = write_checksummed(dir, docs);
  std::ifstream in(dataset_checksums_path(prefix));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const Bytes idx = read_file(prefix + ".idx"), bin = read_file(prefix + ".bin");
  ASSERT_EQ(bin.size(), 1200040u);
  // Each CRC where the format says, computed here from the file's bytes.
  EXPECT_NE(text.find("\"length\":" + std::to_string(idx.size()) + "}"), std::string::npos) << text;
  const uint32_t block0 = crc32c(bin.data(), 1 << 20), block1 = crc32c(bin.data() + (1 << 20), bin.size() - (1 << 20));
  EXPECT_NE(text.find("[" + std::to_string(block0) + "," + std::to_string(block1) + "]"), std::string::npos) << text;
  EXPECT_NE(text.find("\"crc32c\":" + std::to_string(crc32c(idx.data(), idx.size()))), std::string::npos) << text;
  IndexedDataset ds(prefix);
  for (size_t i = 0; i < docs.size(); ++i) EXPECT_EQ(ds.get(static_cast<int64_t>(i)), docs[i]);
}

TEST(IndexedDatasetChecksums, AChangedBinByteIsAnErrorWhenItsBlockIsRead) {
  TempDir dir;
  std::vector<std::vector<int64_t>> docs;
  const std::string prefix = write_checksummed(dir, docs);
  flip(prefix + ".bin", (1 << 20) + 100);  // in block 1: document 1's tokens
  IndexedDataset ds(prefix);
  EXPECT_EQ(ds.get(0), docs[0]);           // block 0 only
  EXPECT_EQ(ds.get(1, 0, 1000), std::vector<int64_t>(docs[1].begin(), docs[1].begin() + 1000));
  expect_contains(error_of([&] { ds.get(1); }),
                  {prefix + ".bin", "bytes [1048576, 1200040)", "checksum", prefix + ".checksums.json",
                   "tokens [0, 100000) of sequence 1", "changed or damaged"});
  expect_contains(error_of([&] { ds.get(2); }), {"bytes [1048576, 1200040)", "sequence 2"});
}

TEST(IndexedDatasetChecksums, AChangedIndexOrSizeIsAnErrorWhenOpening) {
  TempDir dir;
  std::vector<std::vector<int64_t>> docs;
  const std::string prefix = write_checksummed(dir, docs);
  const Bytes idx = read_file(prefix + ".idx"), bin = read_file(prefix + ".bin");
  flip(prefix + ".idx", 40);  // a sequence length: still a well-formed index
  expect_contains(error_of([&] { IndexedDataset ds(prefix); }),
                  {prefix + ".idx", "does not match its checksum", prefix + ".checksums.json"});
  write_file(prefix + ".idx", idx);
  Bytes longer = bin;
  longer.push_back(0);
  write_file(prefix + ".bin", longer);
  expect_contains(error_of([&] { IndexedDataset ds(prefix); }), {prefix + ".bin", "1200041 bytes", "1200040"});
  write_file(prefix + ".bin", bin);
  std::ofstream(dataset_checksums_path(prefix)) << "{\"format\": \"mfsdp.indexed_dataset_checksums\"";
  expect_contains(error_of([&] { IndexedDataset ds(prefix); }), {prefix + ".checksums.json", "malformed"});
  // Without the file (Megatron's tools write none) the dataset is read unverified, as before.
  fs::remove(dataset_checksums_path(prefix));
  flip(prefix + ".bin", 0);
  EXPECT_NE(IndexedDataset(prefix).get(0), docs[0]);
}

TEST(IndexedDatasetChecksums, AddedToADatasetWrittenByHand) {
  TempDir dir;
  const std::string prefix = write_pair(dir, hand_built());
  write_dataset_checksums(prefix);
  EXPECT_NO_THROW(IndexedDataset(prefix).get(0));
  flip(prefix + ".bin", 0);
  expect_contains(error_of([&] { IndexedDataset(prefix).get(0); }), {prefix + ".bin", "bytes [0, 28)", "checksum"});
}

}  // namespace
}  // namespace mfsdp
