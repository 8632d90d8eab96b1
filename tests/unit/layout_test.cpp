#include <gtest/gtest.h>

#include "fsdp/layout.h"

using Range = std::pair<int64_t, int64_t>;

using mfsdp::FlatLayout;

// The worked example of src/fsdp/layout.h.
TEST(FlatLayout, WorkedExampleFromTheHeader) {
  auto l = FlatLayout::build({{2, 6}, {4, 4}, {1, 2}, {3}}, 3);
  EXPECT_EQ(l.chunk, 12);
  ASSERT_EQ(l.entries.size(), 4u);
  EXPECT_EQ(l.entries[0].offset, 0);
  EXPECT_EQ(l.entries[1].offset, 12);
  EXPECT_EQ(l.entries[2].offset, 28);
  EXPECT_EQ(l.entries[3].offset, 30);
  EXPECT_EQ(l.used, 33);
  EXPECT_EQ(l.shard, 12);
  EXPECT_EQ(l.total(), 36);
  EXPECT_EQ(l.slice_of(0, 0), Range(0, 12));   // all of p0
  EXPECT_EQ(l.slice_of(1, 1), Range(0, 12));   // p1 rows 0-2
  EXPECT_EQ(l.slice_of(1, 2), Range(12, 16));  // p1 row 3
  EXPECT_EQ(l.slice_of(0, 2), Range(0, 0));    // nothing of p0
}

// Every shard boundary falls on a row boundary of every parameter it cuts.
TEST(FlatLayout, ShardBoundariesFallOnWholeRows) {
  std::vector<std::vector<int64_t>> shapes = {{5, 6}, {7, 4}, {3}, {2, 3}, {1}, {9, 2}};
  for (int world = 1; world <= 5; ++world) {
    auto l = FlatLayout::build(shapes, world);
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto& e = l.entries[i];
      for (int r = 0; r < world; ++r) {
        auto [lo, hi] = l.slice_of(i, r);
        EXPECT_EQ(lo % e.row, 0) << "param " << i << " rank " << r << " world " << world;
        EXPECT_EQ(hi % e.row == 0 || hi == e.numel, true) << "param " << i << " rank " << r;
      }
      if (i > 0) {
        EXPECT_GE(e.offset, l.entries[i - 1].offset + l.entries[i - 1].numel);
      }
    }
    EXPECT_EQ(l.total() % world, 0);
    EXPECT_GE(l.total(), l.used);
  }
}

// A parameter smaller than the world size leaves some ranks with an empty slice.
TEST(FlatLayout, TinyParameterGivesEmptySlices) {
  auto l = FlatLayout::build({{1}}, 4);
  EXPECT_EQ(l.shard, 1);
  EXPECT_EQ(l.slice_of(0, 0), Range(0, 1));
  for (int r = 1; r < 4; ++r) EXPECT_EQ(l.slice_of(0, r).second - l.slice_of(0, r).first, 0);
}

// When whole-row alignment would mostly pad (lcm of coprime row sizes), fall back to elements.
TEST(FlatLayout, ExplodingLcmFallsBackToElementGranularity) {
  auto l = FlatLayout::build({{2, 97}, {2, 89}, {2, 83}}, 4);
  EXPECT_EQ(l.chunk, 1);
  EXPECT_EQ(l.used, 2 * (97 + 89 + 83));
  EXPECT_LT(l.total() - l.used, 4);
}

// HFSDP: packed for world x outer ranks and read as `world` shards of `outer` sub-shards, so
// every sub-shard boundary falls on a row as well (the worked example, 3 shards x 2 replicas:
// packed for 6 ranks the rows would pad too much, so elements; shard 12 = 2 sub-shards of 6).
TEST(FlatLayout, SubShardsForReplicasFallOnRows) {
  auto l = FlatLayout::build({{2, 6}, {4, 4}, {1, 2}, {3}}, 3, true, 0.25, 2);
  EXPECT_EQ(l.world, 3);
  EXPECT_EQ(l.outer, 2);
  EXPECT_EQ(l.shard, 12);
  EXPECT_EQ(l.sub_shard(), 6);
  EXPECT_EQ(l.total(), 36);
  std::vector<std::vector<int64_t>> shapes = {{5, 6}, {7, 4}, {3}, {2, 3}, {1}, {9, 2}};
  for (int outer = 1; outer <= 3; ++outer)
    for (int world = 1; world <= 4; ++world) {
      auto l2 = FlatLayout::build(shapes, world, true, 1.0, outer);  // padding allowed: rows kept
      const auto packed = FlatLayout::build(shapes, world * outer, true, 1.0);
      EXPECT_EQ(l2.total(), packed.total()) << world << " x " << outer;
      EXPECT_EQ(l2.sub_shard(), packed.shard) << world << " x " << outer;
      EXPECT_EQ(l2.sub_shard() % l2.chunk, 0) << world << " x " << outer;
    }
}
