// mfsdp-sft's data pieces (include/mfsdp/train/sft_data.h) against hand-made sequences: truncation keeps
// the side it says, packing places sequences by first-fit decreasing with positions restarting
// and labels never crossing a packed boundary, padding is never a target, per_sequence splits a
// packed row into its sequences, and the sampler visits every row once per epoch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "mfsdp/data/tokenizer.h"
#include "mfsdp/train/sft_data.h"

namespace {

mfsdp::SftExample conversation(const std::string& user, const std::string& assistant) {
  return {{{"user", user}, {"assistant", assistant}}};
}

at::Tensor floats(std::vector<float> values) { return torch::tensor(values); }

}  // namespace

TEST(SftData, MaskAndTruncation) {
  mfsdp::ByteLevelTokenizer tok;
  mfsdp::SftTokenizeOptions o;
  o.max_length = 64;
  // plain: "User: hi\n" (9 tokens) "Assistant: " (11) "yo" EOD: targets are y, o, EOD.
  auto s = mfsdp::tokenize_sft_examples({conversation("hi", "yo")}, tok, o, "f.jsonl")[0];
  ASSERT_EQ(s.ids.size(), 23u);
  std::vector<uint8_t> want(23, 0);
  want[20] = want[21] = want[22] = 1;
  EXPECT_EQ(s.loss_mask, want);
  EXPECT_EQ(s.ids[20], 'y');
  EXPECT_EQ(s.ids[22], mfsdp::ByteLevelTokenizer::kEod);

  o.max_length = 10;
  try {
    mfsdp::tokenize_sft_examples({conversation("hi", "yo")}, tok, o, "f.jsonl");
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("f.jsonl: example 1 has 23 tokens"), std::string::npos) << e.what();
  }
  o.truncation = "left";
  auto left = mfsdp::tokenize_sft_examples({conversation("hi", "yo")}, tok, o, "f.jsonl")[0];
  EXPECT_EQ(left.ids, std::vector<int64_t>(s.ids.end() - 10, s.ids.end()));
  EXPECT_EQ(left.loss_mask[9], 1);
  o.truncation = "right";  // keeps "User: hi\nA": nothing to train on
  EXPECT_THROW(mfsdp::tokenize_sft_examples({conversation("hi", "yo")}, tok, o, "f.jsonl"), std::invalid_argument);
  o.max_length = 64;
  o.truncation = "error";
  o.loss_on_all = true;
  auto all = mfsdp::tokenize_sft_examples({conversation("hi", "yo")}, tok, o, "f.jsonl")[0];
  EXPECT_EQ(std::count(all.loss_mask.begin(), all.loss_mask.end(), 1), 22);
}

TEST(SftData, PackingAndCollation) {
  std::vector<mfsdp::SftSequence> seqs = {{{1, 2, 3}, {0, 1, 1}}, {{4, 5, 6, 7, 8}, {0, 0, 1, 1, 1}}, {{9, 10}, {0, 1}}};
  auto rows = mfsdp::make_sft_rows(seqs, 8, /*packing=*/true);
  // First-fit decreasing: [5-token] then [3-token] fits (8), [2-token] opens a second row.
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].ids, (std::vector<int64_t>{4, 5, 6, 7, 8, 1, 2, 3}));
  EXPECT_EQ(rows[0].position_ids, (std::vector<int64_t>{0, 1, 2, 3, 4, 0, 1, 2}));
  EXPECT_EQ(rows[0].segment_ids, (std::vector<int64_t>{0, 0, 0, 0, 0, 1, 1, 1}));
  EXPECT_EQ(rows[1].ids, (std::vector<int64_t>{9, 10}));
  auto batch = mfsdp::collate_sft_rows({&rows[0], &rows[1]}, 99);
  // Row 0: labels are the next token within a segment; the last token of a segment predicts
  // nothing (not the next segment's first token).
  EXPECT_TRUE(torch::equal(batch.labels[0], torch::tensor({5, 6, 7, 8, 99, 2, 3, 99}, torch::kLong)));
  EXPECT_TRUE(torch::equal(batch.label_mask[0], floats({0, 1, 1, 1, 0, 1, 1, 0})));
  EXPECT_TRUE(torch::equal(batch.label_mask[1], floats({1, 0, 0, 0, 0, 0, 0, 0})));
  EXPECT_TRUE(torch::equal(batch.attention_mask[1], torch::tensor({1, 1, 0, 0, 0, 0, 0, 0}, torch::kLong)));
  EXPECT_TRUE(torch::equal(batch.segment_ids[1], torch::tensor({0, 0, -1, -1, -1, -1, -1, -1}, torch::kLong)));
  // per_sequence: row 0 becomes two sequences, row 1 one (and an empty one).
  auto split = mfsdp::per_sequence(batch.label_mask, batch.segment_ids);
  ASSERT_EQ(split.size(0), 4);
  EXPECT_TRUE(torch::equal(split[0], floats({0, 1, 1, 1, 0, 0, 0, 0})));
  EXPECT_TRUE(torch::equal(split[1], floats({0, 0, 0, 0, 0, 1, 1, 0})));
  EXPECT_TRUE(torch::equal(split[2], floats({1, 0, 0, 0, 0, 0, 0, 0})));
  EXPECT_EQ(split[3].sum().item<float>(), 0.f);
}

TEST(SftData, SamplerVisitsEveryRowOncePerEpoch) {
  // 12 rows, global batch 2 x 2 ranks x 1 micro-batch... 3 global batches per epoch.
  mfsdp::SftSampler sampler(12, 2, 2, 1, 5);
  std::multiset<int64_t> seen;
  for (int64_t it = 1; it <= 3; ++it)
    for (int64_t row : sampler.global_batch(it)) seen.insert(row);
  for (int64_t r = 0; r < 12; ++r) EXPECT_EQ(seen.count(r), 1u) << r;
  // Rank r's micro-batch is its slice of the global batch.
  auto global = sampler.global_batch(2);
  EXPECT_EQ(sampler.rows(2, 0, 1), (std::vector<int64_t>{global[2], global[3]}));
  // Another epoch, another order (for this seed).
  EXPECT_NE(sampler.global_batch(4), sampler.global_batch(1));
}
