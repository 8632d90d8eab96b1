#include "fsdp/flat_buffer.h"

#include <ATen/ATen.h>

#include <stdexcept>

namespace mfsdp::detail {

RolePlacements placements_of(ShardingStrategy strategy) {
  constexpr Placement R = Placement::kReplicated, S = Placement::kSharded;
  switch (strategy) {
    case ShardingStrategy::kNoShard: return {R, R, R};
    case ShardingStrategy::kOptim: return {R, S, R};
    case ShardingStrategy::kOptimGrads: return {R, S, S};
    case ShardingStrategy::kOptimGradsParams: return {S, S, S};
  }
  throw std::invalid_argument("placements_of: unknown sharding strategy");
}

FlatBuffer::FlatBuffer(const FlatLayout* layout, int rank, Placement placement, at::Tensor data)
    : layout_(layout), rank_(rank), placement_(placement), data_(std::move(data)) {
  const int64_t expected = sharded() ? layout_->shard : layout_->total();
  if (data_.dim() != 1 || data_.numel() != expected)
    throw std::logic_error("FlatBuffer: expected " + std::to_string(expected) + " elements, got " +
                           std::to_string(data_.numel()));
}

FlatBuffer FlatBuffer::zeros(const FlatLayout* layout, int rank, Placement placement,
                             const at::TensorOptions& options) {
  const int64_t n = placement == Placement::kSharded ? layout->shard : layout->total();
  return FlatBuffer(layout, rank, placement, at::zeros({n}, options));
}

FlatBuffer FlatBuffer::from_full(const FlatLayout* layout, int rank, Placement placement,
                                 const at::Tensor& full, const at::TensorOptions& options) {
  at::Tensor part =
      placement == Placement::kSharded ? full.narrow(0, layout->shard_begin(rank), layout->shard) : full;
  return FlatBuffer(layout, rank, placement, part.to(options, /*non_blocking=*/false, /*copy=*/true));
}

int64_t FlatBuffer::begin() const { return sharded() ? layout_->shard_begin(rank_) : 0; }

at::Tensor FlatBuffer::own() const { return range(layout_->shard_begin(rank_), layout_->shard); }

at::Tensor FlatBuffer::range(int64_t flat_offset, int64_t length) const {
  const int64_t local = flat_offset - begin();
  if (local < 0 || local + length > data_.numel())
    throw std::logic_error("FlatBuffer: range [" + std::to_string(flat_offset) + ", +" +
                           std::to_string(length) + ") is not held by this rank");
  return data_.narrow(0, local, length);
}

bool FlatBuffer::aliases(const FlatBuffer& other) const {
  return defined() && other.defined() && data_.is_alias_of(other.data_);
}

FlatBuffer::ParamSlice FlatBuffer::slice_of(size_t i) const {
  const FlatLayout::Entry& e = layout_->entries.at(i);
  if (!sharded()) return {0, e.offset, e.numel};
  const auto [lo, hi] = layout_->slice_of(i, rank_);
  if (hi <= lo) return {};
  return {lo, e.offset + lo - begin(), hi - lo};
}

}  // namespace mfsdp::detail
