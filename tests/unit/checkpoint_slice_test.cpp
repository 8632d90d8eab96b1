// CheckpointReader::read_slice_range (include/mfsdp/checkpoint/checkpoint.h): what a
// tensor-parallel rank reads of the whole tensors a checkpoint holds, element ranges of its slice,
// against slicing the tensor itself (at::narrow), in both formats: fsdp_dtensor reads DCP boxes,
// the earlier format the runs of each box. Slices along rows, columns and a middle dimension, at
// every origin, ranges that start and end inside rows; a slice outside the tensor is an error
// naming it. The trainer's TP checkpoints are tested end to end in
// tests/e2e/pretrain_checkpoint_test.cpp (PretrainCheckpoint.TensorParallelResumesAndReshards).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"

using mfsdp::testing::TempDir;

TEST(CheckpointSlice, ReadsAnyRangeOfASliceInBothFormats) {
  TempDir dir("mfsdp-slice");
  const at::Tensor matrix = at::arange(6 * 10, at::kFloat).view({6, 10});
  const at::Tensor cube = at::arange(4 * 6 * 5, at::kDouble).view({4, 6, 5});
  for (auto format : {mfsdp::CheckpointFormat::kFsdpDtensor, mfsdp::CheckpointFormat::kMfsdp}) {
    const std::string path = dir.file(format == mfsdp::CheckpointFormat::kMfsdp ? "mfsdp" : "dcp");
    mfsdp::CheckpointInfo info;
    mfsdp::write_checkpoint(path, {{"m", matrix}, {"c", cube}}, info, format);
    const mfsdp::CheckpointReader reader(path);
    struct Case {
      std::string name;
      at::Tensor whole;
      int64_t dim, parts;
    };
    for (const Case& c : {Case{"model.m", matrix, 0, 2}, Case{"model.m", matrix, 1, 2}, Case{"model.m", matrix, 1, 5},
                          Case{"model.c", cube, 1, 3}, Case{"model.c", cube, 2, 5}}) {
      const int64_t size = c.whole.size(c.dim) / c.parts;
      for (int64_t part = 0; part < c.parts; ++part) {
        const at::Tensor slice = c.whole.narrow(c.dim, part * size, size).contiguous().view({-1});
        std::vector<int64_t> origin(static_cast<size_t>(c.whole.dim()), 0);
        origin[static_cast<size_t>(c.dim)] = part * size;
        const int64_t n = slice.numel();
        for (auto [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, n}, {1, n - 1}, {n / 3, n / 2}, {n, n}}) {
          at::Tensor got = at::full({end - begin}, -1.0, at::kFloat);
          reader.read_slice_range(c.name, c.whole.narrow(c.dim, 0, size).sizes().vec(), origin, begin, got);
          EXPECT_TRUE(at::equal(got, slice.narrow(0, begin, end - begin).to(at::kFloat)))
              << path << " " << c.name << " dim " << c.dim << " part " << part << " [" << begin << ", " << end << ")";
        }
      }
    }
    at::Tensor dst = at::empty({4});
    try {
      reader.read_slice_range("model.m", {3, 10}, {4, 0}, 0, dst);
      ADD_FAILURE() << "a slice past the tensor's end was read";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("cannot read elements [0, 4) of its slice [3, 10] at [4, 0]"),
                std::string::npos)
          << e.what();
    }
  }
}
