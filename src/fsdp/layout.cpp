#include "fsdp/layout.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace mfsdp {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int64_t row_size(const std::vector<int64_t>& shape) {
  if (shape.size() < 2) return 1;
  int64_t r = 1;
  for (size_t d = 1; d < shape.size(); ++d) r *= shape[d];
  return std::max<int64_t>(r, 1);
}

FlatLayout pack(const std::vector<std::vector<int64_t>>& shapes, int world, bool align) {
  FlatLayout layout;
  layout.world = world;
  int64_t offset = 0, chunk = 1;
  for (const auto& shape : shapes) {
    FlatLayout::Entry e;
    e.numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    e.row = align ? row_size(shape) : 1;
    offset = round_up(offset, e.row);
    e.offset = offset;
    offset += e.numel;
    if (e.numel > 0) chunk = std::lcm(chunk, e.row);
    layout.entries.push_back(e);
  }
  layout.used = offset;
  layout.chunk = chunk;
  layout.shard = round_up((offset + world - 1) / world, chunk);
  return layout;
}

}  // namespace

std::pair<int64_t, int64_t> FlatLayout::slice_of(size_t i, int rank) const {
  const Entry& e = entries.at(i);
  int64_t lo = std::max(e.offset, shard_begin(rank));
  int64_t hi = std::min(e.offset + e.numel, shard_begin(rank) + shard);
  if (hi <= lo) return {0, 0};
  return {lo - e.offset, hi - e.offset};
}

FlatLayout FlatLayout::build(const std::vector<std::vector<int64_t>>& shapes, int world,
                             bool align_rows, double max_padding_fraction, int outer) {
  if (world < 1) throw std::invalid_argument("FlatLayout: world size must be >= 1");
  if (outer < 1) throw std::invalid_argument("FlatLayout: sub-shards per shard must be >= 1");
  // Packed for world x outer ranks, then read as `world` shards of `outer` sub-shards.
  auto regroup = [&](FlatLayout l) {
    l.world = world;
    l.shard *= outer;
    l.outer = outer;
    return l;
  };
  if (align_rows) {
    FlatLayout aligned = pack(shapes, world * outer, true);
    const double padding = static_cast<double>(aligned.total() - aligned.used);
    if (aligned.used == 0 || padding <= max_padding_fraction * static_cast<double>(aligned.used))
      return regroup(aligned);
  }
  return regroup(pack(shapes, world * outer, false));
}

}  // namespace mfsdp
