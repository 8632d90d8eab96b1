// Corruption is caught, never loaded: the indexed dataset with its checksums, fuzzed like the
// checkpoints of corruption_fuzz_test.cpp (tests/harness/fork_fuzz.h). Torch-free, in plain_tests:
// each mutated copy is read in a forked child, and forking a process that has LibTorch loaded
// costs ~15-30 ms against ~0.5 ms without it, which was most of this test's time.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "harness/fork_fuzz.h"
#include "harness/temp_dir.h"
#include "mfsdp/data/dataset_checksums.h"
#include "mfsdp/data/indexed_dataset.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::describe;
using mfsdp::testing::FuzzCounts;
using mfsdp::testing::fuzz_files;
using mfsdp::testing::harmless_examples;
using mfsdp::testing::TempDir;

// 3 blocks of checksummed .bin (uint16 tokens), sequences of many lengths, some across blocks.
TEST(CorruptionFuzz, IndexedDatasetWithChecksums) {
  TempDir dir("mfsdp-fuzz-data");
  const std::string prefix = dir.file("corpus");
  std::mt19937 rng(5);
  std::vector<std::vector<int64_t>> docs;
  {
    mfsdp::IndexedDatasetWriter w(prefix, mfsdp::TokenDType::kUInt16);
    int64_t tokens = 0;
    while (tokens < 1'300'000) {
      std::vector<int64_t> d(1 + rng() % 40000);
      for (auto& t : d) t = rng() % 50000;
      tokens += static_cast<int64_t>(d.size());
      w.add_document(d);
      docs.push_back(std::move(d));
    }
    w.finalize();
  }
  ASSERT_TRUE(fs::exists(mfsdp::dataset_checksums_path(prefix)));
  auto load = [&] {
    mfsdp::IndexedDataset ds(prefix);
    if (ds.size() != static_cast<int64_t>(docs.size()) || ds.num_documents() != static_cast<int64_t>(docs.size()))
      return false;
    for (size_t i = 0; i < docs.size(); ++i)
      if (ds.get(static_cast<int64_t>(i)) != docs[i]) return false;
    return true;
  };
  ASSERT_TRUE(load());
  const FuzzCounts c = fuzz_files({prefix + ".bin", prefix + ".idx", mfsdp::dataset_checksums_path(prefix)}, 1500, 13, load);
  std::printf("indexed dataset (%zu sequences, %ju .bin bytes): %s\n%s\n", docs.size(),
              static_cast<uintmax_t>(fs::file_size(prefix + ".bin")), describe(c).c_str(),
              harmless_examples(c).c_str());
  EXPECT_EQ(c.silent, 0) << "first: " << c.first_silent;
  EXPECT_EQ(c.crashed, 0);
  EXPECT_EQ(c.hung, 0);
  EXPECT_GT(c.refused, 1500 * 9 / 10);
}

}  // namespace
