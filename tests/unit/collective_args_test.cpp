#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/collective_args.h"

TEST(CollectiveArgs, EvenSlicesDifferByAtMostOne) {
  auto s = mfsdp::even_slices(10, 4);
  EXPECT_EQ(s.counts, (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(s.offsets, (std::vector<int64_t>{0, 3, 6, 8}));
  EXPECT_EQ(s.total, 10);
  EXPECT_EQ(s.max_count(), 3);
  auto z = mfsdp::even_slices(1, 3);
  EXPECT_EQ(z.counts, (std::vector<int64_t>{1, 0, 0}));
}

TEST(CollectiveArgs, AccumulationDtype) {
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kBFloat16), at::kFloat);
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kHalf), at::kFloat);
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kFloat), at::kFloat);
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kDouble), at::kDouble);
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kLong), at::kLong);
}

TEST(CollectiveArgs, UnevenReduceScatterLayout) {
  mfsdp::ReduceScatterOptions o;
  o.counts = {2, 0, 5};
  auto s = mfsdp::reduce_scatter_layout(at::empty({5}), at::empty({7}), o, 2, 3, c10::kCPU);
  EXPECT_EQ(s.offsets, (std::vector<int64_t>{0, 2, 2}));
  EXPECT_THROW(mfsdp::reduce_scatter_layout(at::empty({4}), at::empty({7}), o, 2, 3, c10::kCPU),
               std::invalid_argument);
  o.counts = {2, -1, 6};
  EXPECT_THROW(mfsdp::reduce_scatter_layout(at::empty({6}), at::empty({7}), o, 2, 3, c10::kCPU),
               std::invalid_argument);
}
