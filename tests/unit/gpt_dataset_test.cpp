// GPTDataset: train/valid/test split, packing, sample order and the data-parallel batch layout.
//
// Reference values marked "numpy" come from a port of Megatron-LM's index building
// (gpt_dataset.py: _build_document_index, _build_shuffle_index, _query_document_sample_shuffle_
// indices; helpers.cpp: build_sample_idx; blended_megatron_dataset_builder.py: split bounds) run
// with numpy 1.24's RandomState, i.e. with Megatron's own random draws:
//   rs = numpy.random.RandomState(1234); di = mgrid-built document index; rs.shuffle(di); ...
// The hand-checked tests below them do not depend on any random draw.
#include <gtest/gtest.h>

#include "harness/expect_error.h"
#include "harness/temp_dir.h"
#include <torch/torch.h>

#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "mfsdp/data/gpt_dataset.h"
#include "mfsdp/data/indexed_dataset.h"

namespace mfsdp {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int64_t>;
using Range = std::pair<int64_t, int64_t>;

using mfsdp::testing::TempDir;

using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;


// Sequences held in memory.
class VectorSource : public SequenceSource {
 public:
  explicit VectorSource(std::vector<Ids> seqs) : seqs_(std::move(seqs)) {}
  int64_t num_sequences() const override { return static_cast<int64_t>(seqs_.size()); }
  int64_t sequence_length(int64_t i) const override { return static_cast<int64_t>(seqs_.at(i).size()); }
  void read(int64_t i, int64_t offset, int64_t length, int64_t* out) const override {
    const Ids& s = seqs_.at(i);
    if (offset < 0 || length < 0 || offset + length > static_cast<int64_t>(s.size())) {
      throw std::out_of_range("VectorSource read out of range");
    }
    std::copy(s.begin() + offset, s.begin() + offset + length, out);
  }
  std::string describe() const override { return "vector source"; }

 private:
  std::vector<Ids> seqs_;
};

// Ten sequences; token 100*d + p is position p of sequence d, so a sample shows where it came from.
const std::vector<int64_t> kLengths = {5, 3, 8, 1, 6, 4, 7, 2, 9, 5};
std::vector<Ids> corpus() {
  std::vector<Ids> seqs;
  for (size_t d = 0; d < kLengths.size(); ++d) {
    Ids s;
    for (int64_t p = 0; p < kLengths[d]; ++p) s.push_back(100 * static_cast<int64_t>(d) + p);
    seqs.push_back(s);
  }
  return seqs;
}
std::shared_ptr<const SequenceSource> corpus_source() {
  return std::make_shared<VectorSource>(corpus());
}

Ids to_ids(const at::Tensor& t) {
  EXPECT_EQ(t.scalar_type(), at::kLong);
  EXPECT_EQ(t.dim(), 1);
  auto c = t.contiguous();
  return Ids(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// ---- split -------------------------------------------------------------------------------------

TEST(GPTDatasetSplit, RangesMatchMegatron) {  // numpy: split_indices()
  using Opt = std::optional<Range>;
  using R3 = std::array<Opt, 3>;
  EXPECT_EQ(split_ranges(parse_split("8,1,1"), 10), (R3{Range{0, 8}, Range{8, 9}, Range{9, 10}}));
  EXPECT_EQ(split_ranges(parse_split("1,1,1"), 7), (R3{Range{0, 2}, Range{2, 5}, Range{5, 7}}));
  // 0.5 * 5 = 2.5 rounds half to even (Python's round), to 2.
  EXPECT_EQ(split_ranges(parse_split("1,1"), 5), (R3{Range{0, 2}, Range{2, 5}, std::nullopt}));
  EXPECT_EQ(split_ranges(parse_split("949,50,1"), 1000),
            (R3{Range{0, 949}, Range{949, 999}, Range{999, 1000}}));
  EXPECT_EQ(split_ranges(parse_split("949,50,1"), 2000),
            (R3{Range{0, 1898}, Range{1898, 1998}, Range{1998, 2000}}));
  EXPECT_EQ(split_ranges(parse_split("0.9 0.1 0"), 10), (R3{Range{0, 9}, Range{9, 10}, std::nullopt}));
  EXPECT_EQ(split_ranges(parse_split("0,1,0"), 10), (R3{std::nullopt, Range{0, 10}, std::nullopt}));
}

TEST(GPTDatasetSplit, BadSplitsNameTheFlag) {
  expect_contains(error_of([] { parse_split(""); }), {"--split"});
  expect_contains(error_of([] { parse_split("1,2,3,4"); }), {"--split", "three"});
  expect_contains(error_of([] { parse_split("0,0,0"); }), {"--split", "0"});
  expect_contains(error_of([] { parse_split("1..2"); }), {"--split", "1..2"});
}

// ---- pinned against Megatron's draws (numpy) ----------------------------------------------------

// 20 samples of 4 (+1) tokens from the 36-token train split [0, 8) take 3 epochs; the last epoch
// would contribute 3 < int(0.8 * 8) samples, so it is shuffled separately.
TEST(GPTDataset, ThreeEpochsMatchMegatronsIndices) {
  GPTDataset ds(corpus_source(), 0, 8, /*num_samples=*/20, /*seq_length=*/4, /*seed=*/1234);
  EXPECT_EQ(ds.num_epochs(), 3);
  ASSERT_EQ(ds.size(), 26);  // (3 * 36 - 1) / 4
  EXPECT_EQ(ds.document_index(),
            (std::vector<int32_t>{5, 3, 0, 4, 6, 2, 2, 7, 1, 1, 0, 4, 5, 6, 3, 7, 5, 1, 3, 4, 0, 7, 6, 2}));
  EXPECT_EQ(ds.shuffle_index(),
            (Ids{7, 10, 4, 1, 12, 8, 3, 15, 14, 13, 5, 11, 0, 2, 6, 9, 16, 17, 22, 25, 23, 24, 18, 21, 20, 19}));
  const std::vector<Ids> expected = {
      {205, 206, 207, 200, 201}, {701, 100, 101, 102, 100}, {600, 601, 602, 603, 604},
      {300, 0, 1, 2, 3},         {1, 2, 3, 4, 400},         {201, 202, 203, 204, 205},
      {402, 403, 404, 405, 600}, {502, 503, 600, 601, 602}, {404, 405, 500, 501, 502},
      {400, 401, 402, 403, 404}, {604, 605, 606, 200, 201}, {100, 101, 102, 0, 1},
      {500, 501, 502, 503, 300}, {3, 4, 400, 401, 402},     {201, 202, 203, 204, 205},
      {205, 206, 207, 700, 701}, {602, 603, 604, 605, 606}, {606, 300, 700, 701, 500},
      {2, 3, 4, 700, 701},       {200, 201, 202, 203, 204}, {701, 600, 601, 602, 603},
      {603, 604, 605, 606, 200}, {500, 501, 502, 503, 100}, {404, 405, 0, 1, 2},
      {400, 401, 402, 403, 404}, {100, 101, 102, 300, 400}};
  for (int64_t i = 0; i < ds.size(); ++i) EXPECT_EQ(to_ids(ds.sample(i)), expected[i]) << "sample " << i;
}

TEST(GPTDataset, OneEpochMatchesMegatron) {
  GPTDataset ds(corpus_source(), 0, 8, /*num_samples=*/-1, 4, 1234);
  EXPECT_EQ(ds.num_epochs(), 1);
  EXPECT_EQ(ds.document_index(), (std::vector<int32_t>{2, 1, 6, 0, 4, 5, 3, 7}));
  EXPECT_EQ(ds.shuffle_index(), (Ids{5, 0, 3, 4, 2, 6, 1, 7}));
  const std::vector<Ids> expected = {
      {2, 3, 4, 400, 401},       {200, 201, 202, 203, 204}, {601, 602, 603, 604, 605},
      {605, 606, 0, 1, 2},       {100, 101, 102, 600, 601}, {401, 402, 403, 404, 405},
      {204, 205, 206, 207, 100}, {405, 500, 501, 502, 503}};
  ASSERT_EQ(ds.size(), 8);
  for (int64_t i = 0; i < ds.size(); ++i) EXPECT_EQ(to_ids(ds.sample(i)), expected[i]) << "sample " << i;
}

// One 9-token sequence, 5 samples: 3 epochs, and the last one is not separated.
TEST(GPTDataset, ValidSplitMatchesMegatron) {
  GPTDataset ds(corpus_source(), 8, 9, 5, 4, 1234, "valid");
  EXPECT_EQ(ds.num_epochs(), 3);
  EXPECT_EQ(ds.shuffle_index(), (Ids{3, 2, 1, 0, 5, 4}));
  EXPECT_EQ(to_ids(ds.sample(0)), (Ids{803, 804, 805, 806, 807}));
  EXPECT_EQ(to_ids(ds.sample(1)), (Ids{808, 800, 801, 802, 803}));
  EXPECT_EQ(to_ids(ds.sample(5)), (Ids{807, 808, 800, 801, 802}));
}

// numpy.random.RandomState(seed).shuffle(numpy.arange(n)) for n past 2^16 (wider rejection masks):
// the document index of a one-epoch dataset over n one-token sequences is exactly that shuffle.
TEST(GPTDataset, DocumentShuffleIsNumpysDrawForDraw) {
  auto weighted = [](const std::vector<int32_t>& a) {
    int64_t s = 0;
    for (size_t i = 0; i < a.size(); ++i) s = (s + static_cast<int64_t>(i) * a[i]) % 1000000007;
    return s;
  };
  {
    GPTDataset ds(std::make_shared<VectorSource>(std::vector<Ids>(1000, Ids{1})), 0, 1000, -1, 1, 1234);
    const auto& di = ds.document_index();
    EXPECT_EQ(std::vector<int32_t>(di.begin(), di.begin() + 10),
              (std::vector<int32_t>{681, 990, 155, 768, 438, 363, 688, 555, 620, 99}));
    EXPECT_EQ(std::vector<int32_t>(di.end() - 10, di.end()),
              (std::vector<int32_t>{279, 689, 655, 664, 372, 204, 53, 294, 723, 815}));
    EXPECT_EQ(weighted(di), 251398022);
  }
  {
    GPTDataset ds(std::make_shared<VectorSource>(std::vector<Ids>(70000, Ids{1})), 0, 70000, -1, 1, 7);
    const auto& di = ds.document_index();
    EXPECT_EQ(std::vector<int32_t>(di.begin(), di.begin() + 8),
              (std::vector<int32_t>{7653, 66274, 9119, 10760, 43166, 24247, 3682, 37283}));
    EXPECT_EQ(weighted(di), 885597686);
  }
}

// ---- packing, by hand --------------------------------------------------------------------------

// Whatever the order, sample i is S + 1 consecutive tokens of the documents concatenated in
// document_index() order, starting at S * shuffle_index()[i]: documents are packed across their
// boundaries, consecutive samples overlap by one token, and every token of the stream but the
// tail is in some sample.
TEST(GPTDataset, SamplesAreWindowsOfThePackedStream) {
  const auto seqs = corpus();
  for (uint32_t seed : {1u, 99u, 1234u}) {
    for (int64_t S : {1, 3, 4, 7}) {
      GPTDataset ds(corpus_source(), 0, 8, 30, S, seed);
      Ids stream;
      for (int32_t d : ds.document_index()) stream.insert(stream.end(), seqs[d].begin(), seqs[d].end());
      const int64_t epochs = ds.num_epochs();
      EXPECT_EQ(static_cast<int64_t>(stream.size()), 36 * epochs);
      EXPECT_GE(ds.size(), 30);
      EXPECT_EQ(ds.size(), (36 * epochs - 1) / S);
      // Every document appears once per epoch.
      for (int32_t d = 0; d < 8; ++d) {
        EXPECT_EQ(std::count(ds.document_index().begin(), ds.document_index().end(), d), epochs);
      }
      // The shuffle is a permutation of the samples.
      Ids sorted = ds.shuffle_index();
      std::sort(sorted.begin(), sorted.end());
      Ids iota(static_cast<size_t>(ds.size()));
      std::iota(iota.begin(), iota.end(), 0);
      EXPECT_EQ(sorted, iota);
      for (int64_t i = 0; i < ds.size(); ++i) {
        const int64_t j = ds.shuffle_index()[static_cast<size_t>(i)];
        const Ids window(stream.begin() + j * S, stream.begin() + j * S + S + 1);
        ASSERT_EQ(to_ids(ds.sample(i)), window) << "seed " << seed << " S " << S << " sample " << i;
      }
    }
  }
}

// Fixed order by hand: two one-epoch documents {0,1,2} and {10,11}, S = 2, so the stream is
// 0 1 2 10 11 (or 10 11 0 1 2) and the unshuffled samples are [0 1 2] and [2 10 11]: the second
// starts on the first's last token and crosses into the next document.
TEST(GPTDataset, PackingAcrossADocumentBoundaryByHand) {
  auto source = std::make_shared<VectorSource>(std::vector<Ids>{{0, 1, 2}, {10, 11}});
  GPTDataset ds(source, 0, 2, -1, 2, 1234);
  ASSERT_EQ(ds.size(), 2);  // (5 - 1) / 2
  std::set<Ids> got = {to_ids(ds.sample(0)), to_ids(ds.sample(1))};
  const bool first_is_zero = ds.document_index()[0] == 0;
  const std::set<Ids> expected = first_is_zero ? std::set<Ids>{{0, 1, 2}, {2, 10, 11}}
                                               : std::set<Ids>{{10, 11, 0}, {0, 1, 2}};
  EXPECT_EQ(got, expected);
  // A partial last sample is dropped: S = 3 gives (5 - 1) / 3 = 1 sample.
  EXPECT_EQ(GPTDataset(source, 0, 2, -1, 3, 1234).size(), 1);
}

TEST(GPTDataset, EmptySequencesAreSkipped) {
  auto source = std::make_shared<VectorSource>(std::vector<Ids>{{}, {1, 2}, {}, {3}, {}});
  GPTDataset ds(source, 0, 5, -1, 2, 5);
  ASSERT_EQ(ds.size(), 1);
  const Ids s = to_ids(ds.sample(0));
  EXPECT_TRUE(s == (Ids{1, 2, 3}) || s == (Ids{3, 1, 2})) << s[0] << s[1] << s[2];
}

TEST(GPTDataset, SameSeedSameSamplesOtherSeedOtherOrder) {
  GPTDataset a(corpus_source(), 0, 8, 20, 4, 1234), b(corpus_source(), 0, 8, 20, 4, 1234);
  GPTDataset c(corpus_source(), 0, 8, 20, 4, 4321);
  EXPECT_EQ(a.document_index(), b.document_index());
  EXPECT_EQ(a.shuffle_index(), b.shuffle_index());
  for (int64_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a.sample(i), b.sample(i)));
  EXPECT_NE(a.shuffle_index(), c.shuffle_index());
}

TEST(GPTDataset, ErrorsSayWhatIsWrong) {
  expect_contains(error_of([] { GPTDataset(corpus_source(), 0, 8, 1, 0, 1); }), {"--seq-length"});
  expect_contains(error_of([] { GPTDataset(corpus_source(), 0, 11, 1, 4, 1); }), {"[0, 11)"});
  expect_contains(error_of([] { GPTDataset(corpus_source(), 3, 4, 1, 4, 1); }), {"1 tokens", "--split"});
  GPTDataset ds(corpus_source(), 0, 8, -1, 4, 1);
  expect_contains(error_of([&] { ds.sample(8); }), {"train", "sample 8"});
  // 10 sequences with --split 98,1,1: valid and test are empty and cannot give samples.
  expect_contains(error_of([] { build_gpt_datasets(corpus_source(), "98,1,1", 4, 1, {10, 5, 5}); }),
                  {"--split", "valid", "empty"});
  auto only_train = build_gpt_datasets(corpus_source(), "98,1,1", 4, 1, {10, 0, 0});
  EXPECT_TRUE(only_train.train && !only_train.valid && !only_train.test);
}

// ---- data-parallel batches ---------------------------------------------------------------------

TEST(BatchLayout, EveryGlobalBatchIsCoveredExactlyOnce) {
  for (int64_t mbs : {1, 2, 3}) {
    for (int64_t dp : {1, 2, 4}) {
      for (int64_t nmb : {1, 3}) {
        const BatchLayout layout{mbs, dp, nmb};
        const int64_t G = layout.global_batch_size();
        EXPECT_EQ(G, mbs * dp * nmb);
        for (int64_t b = 0; b < 3; ++b) {
          std::vector<int> hits(static_cast<size_t>(G), 0);
          for (int64_t m = 0; m < nmb; ++m) {
            for (int64_t r = 0; r < dp; ++r) {
              const int64_t first = micro_batch_first_sample(layout, b, m, r);
              for (int64_t s = first; s < first + mbs; ++s) {
                ASSERT_GE(s, b * G);
                ASSERT_LT(s, (b + 1) * G);
                ++hits[static_cast<size_t>(s - b * G)];
              }
            }
          }
          for (int64_t s = 0; s < G; ++s) EXPECT_EQ(hits[static_cast<size_t>(s)], 1) << "sample " << s;
        }
      }
    }
  }
}

TEST(BatchLayout, OrderIsMicroStepThenRank) {
  const BatchLayout layout{2, 3, 2};  // G = 12
  // Micro-step 0 takes samples 0..5 (rank 0: 0-1, rank 1: 2-3, rank 2: 4-5), micro-step 1 6..11.
  EXPECT_EQ(micro_batch_first_sample(layout, 0, 0, 0), 0);
  EXPECT_EQ(micro_batch_first_sample(layout, 0, 0, 2), 4);
  EXPECT_EQ(micro_batch_first_sample(layout, 0, 1, 0), 6);
  EXPECT_EQ(micro_batch_first_sample(layout, 1, 1, 2), 22);
  expect_contains(error_of([&] { micro_batch_first_sample(layout, 0, 2, 0); }), {"micro-batch 2"});
  expect_contains(error_of([&] { micro_batch_first_sample(layout, 0, 0, 3); }), {"rank 3"});

  GPTDataset ds(corpus_source(), 0, 8, 24, 4, 1234);
  const at::Tensor mb = ds.micro_batch(layout, 1, 1, 2);
  ASSERT_EQ(mb.sizes(), (at::IntArrayRef{2, 5}));
  EXPECT_TRUE(torch::equal(mb[0], ds.sample(22)));
  EXPECT_TRUE(torch::equal(mb[1], ds.sample(23)));
}

// ---- from files and mock -----------------------------------------------------------------------

// corpus() as an indexed dataset in `dir`; returns its prefix.
std::string write_corpus(const TempDir& dir) {
  const std::string prefix = dir.file("corpus_text_document");
  IndexedDatasetWriter w(prefix, TokenDType::kUInt16);
  for (const Ids& doc : corpus()) w.add_document(doc);
  w.finalize();
  return prefix;
}

TEST(GPTDataset, BuildsFromAnIndexedDataset) {
  TempDir dir;
  const std::string prefix = write_corpus(dir);
  GPTDatasetOptions options;
  options.data_prefix = prefix;
  options.split = "8,1,1";
  options.seq_length = 4;
  options.seed = 1234;
  const GPTDatasets sets = build_gpt_datasets(options, {20, 5, -1});
  ASSERT_TRUE(sets.train && sets.valid && sets.test);
  EXPECT_EQ(sets.train->size(), 26);
  EXPECT_EQ(to_ids(sets.train->sample(0)), (Ids{205, 206, 207, 200, 201}));  // numpy, as above
  EXPECT_EQ(to_ids(sets.train->sample(25)), (Ids{100, 101, 102, 300, 400}));
  EXPECT_EQ(to_ids(sets.valid->sample(1)), (Ids{808, 800, 801, 802, 803}));
  EXPECT_EQ(sets.test->size(), 1);  // one epoch of the 5-token sequence 9
  EXPECT_EQ(to_ids(sets.test->sample(0)), (Ids{900, 901, 902, 903, 904}));

  options.data_prefix = dir.file("missing");
  expect_contains(error_of([&] { build_gpt_datasets(options, {1, 1, 1}); }), {"--data-path", "missing"});
}

// Token ids are checked against the vocabulary as they are read, naming the file, the sequence,
// the position and the id (without the check an id past the embedding fails inside LibTorch with
// no name, and one below the padded size trains silently).
TEST(GPTDataset, TokenIdsOutsideTheVocabularyNameFileSequenceAndPosition) {
  TempDir dir;
  const std::string prefix = write_corpus(dir);
  GPTDatasetOptions options;
  options.data_prefix = prefix;
  options.split = "8,1,1";
  options.seq_length = 4;
  options.vocab_size = 905;  // the corpus's largest id is 904
  GPTDatasets sets = build_gpt_datasets(options, {20, 5, -1});
  for (const auto& set : {sets.train, sets.valid, sets.test})
    for (int64_t i = 0; i < set->size(); ++i) set->sample(i);

  options.vocab_size = 904;
  sets = build_gpt_datasets(options, {20, 5, -1});
  EXPECT_NO_THROW(sets.train->sample(0));  // ids 200-207
  expect_contains(error_of([&] { sets.test->sample(0); }),
                  {prefix, "token id 904", "position 4 of sequence 9", "[0, 904)"});
}

TEST(MockData, IsDeterministicAndLearnable) {
  MockDataOptions o;
  o.num_sequences = 50;
  o.vocab_size = 100;
  o.eod = 0;
  o.min_length = 3;
  o.max_length = 40;
  o.seed = 3;
  MockSequences a(o), b(o);
  o.seed = 4;
  MockSequences c(o);
  bool differs = false;
  for (int64_t i = 0; i < 50; ++i) {
    const int64_t n = a.sequence_length(i);
    ASSERT_GE(n, 3);
    ASSERT_LE(n, 40);
    Ids x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
    a.read(i, 0, n, x.data());
    b.read(i, 0, n, y.data());
    EXPECT_EQ(x, y);
    EXPECT_EQ(x.back(), 0);  // EOD last
    // Within a sequence, t[k+1] - t[k] is one constant step modulo the 99 non-EOD ids
    // (ids above the EOD are shifted by one to skip it).
    auto value = [&](int64_t t) { return t > o.eod ? t - 1 : t; };
    for (int64_t k = 0; k + 2 < n - 1; ++k) {
      EXPECT_NE(x[k], 0);
      EXPECT_EQ((value(x[k + 1]) - value(x[k]) + 99) % 99, (value(x[k + 2]) - value(x[k + 1]) + 99) % 99);
    }
    // Reading a window gives the same tokens as reading all.
    Ids w(2);
    a.read(i, 1, 2, w.data());
    EXPECT_EQ(w, Ids(x.begin() + 1, x.begin() + 3));
    const int64_t nc = c.sequence_length(i);
    Ids z(static_cast<size_t>(nc));
    c.read(i, 0, nc, z.data());
    differs = differs || z != x;
  }
  EXPECT_TRUE(differs);

  GPTDatasetOptions options;
  options.mock = true;
  options.mock_options = MockDataOptions{};
  options.seq_length = 32;
  const GPTDatasets sets = build_gpt_datasets(options, {100, 10, 10});
  ASSERT_TRUE(sets.train);
  EXPECT_GE(sets.train->size(), 100);
  const Ids s = to_ids(sets.train->sample(7));
  EXPECT_EQ(s.size(), 33u);
  for (int64_t t : s) {
    EXPECT_GE(t, 0);
    EXPECT_LT(t, 257);
  }
}

}  // namespace
}  // namespace mfsdp
