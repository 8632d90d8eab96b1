// FlatLayout: where each parameter of a parameter group lives in the group's flat buffer, and
// which contiguous range of it every rank owns (docs/fully_shard.md). Pure arithmetic.
//
// Packing: parameters in registration order, each starting at a multiple of its row size
// (numel / shape[0]); the total is padded to world x shard, and the shard size is a multiple of
// `chunk`. When `chunk` is the lcm of all row sizes, every shard boundary falls on a row boundary
// of every parameter, so a rank's slice of a parameter is whole rows (viewable as
// (-1, *shape[1:])). When that lcm would pad more than `max_padding_fraction` of the group, the
// chunk falls back to 1 and slices are element ranges (still contiguous; checkpoints address
// element ranges either way).
//
// HFSDP (`outer` > 1): each rank's shard is split again into `outer` sub-shards, one per replica
// (main weights, main grads and optimizer state). The layout is packed as for world x outer
// ranks and then read as `world` shards of `outer` sub-shards each, so sub-shard boundaries fall
// on rows as shard boundaries do; (rank r, replica o) holds [r*shard + o*sub_shard, +sub_shard),
// Megatron-FSDP's order (the inner rank major).
//
// Worked example (pinned by tests/unit/layout_test.cpp): shapes (2,6), (4,4), (1,2), (3) on 3
// ranks; rows 6, 4, 2, 1 -> chunk 12; offsets 0, 12, 28, 30; 33 elements -> padded to 36,
// shard 12: rank 0 owns [0,12) = all of p0, rank 1 [12,24) = p1 rows 0-2, rank 2 [24,36) =
// p1 row 3, p2, p3 and 3 padding elements.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mfsdp {

struct FlatLayout {
  struct Entry {
    int64_t offset = 0;  // first element in the flat buffer
    int64_t numel = 0;
    int64_t row = 1;     // elements per row (numel / shape[0]; 1 for 0-D and 1-D tensors)
  };
  std::vector<Entry> entries;  // one per parameter, in the given order
  int64_t used = 0;            // end of the last parameter
  int64_t chunk = 1;           // shard sizes are multiples of this
  int64_t shard = 0;           // elements per rank
  int world = 1;
  int outer = 1;               // HFSDP: sub-shards per shard (replicas); 1 otherwise
  int64_t total() const { return shard * world; }  // padded flat size
  int64_t sub_shard() const { return shard / outer; }

  // This rank's range of the flat buffer.
  int64_t shard_begin(int rank) const { return shard * rank; }
  // The part of parameter `i` inside rank `rank`'s shard, as [begin, end) offsets relative to the
  // parameter (empty when begin == end).
  std::pair<int64_t, int64_t> slice_of(size_t i, int rank) const;

  static FlatLayout build(const std::vector<std::vector<int64_t>>& shapes, int world,
                          bool align_rows = true, double max_padding_fraction = 0.25, int outer = 1);
};

}  // namespace mfsdp
