#include "fsdp/flat_buffer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>

namespace mfsdp::detail {

RolePlacements placements_of(ShardingStrategy strategy, ShardingStrategy outer) {
  constexpr Placement R = Placement::kReplicated, S = Placement::kSharded, O = Placement::kOuterSharded;
  if (outer == ShardingStrategy::kOptim) {
    if (strategy != ShardingStrategy::kOptimGradsParams)
      throw std::invalid_argument("placements_of: sharding across replicas (outer optim) needs optim_grads_params");
    return {S, O, O};
  }
  if (outer != ShardingStrategy::kNoShard)
    throw std::invalid_argument("placements_of: across replicas only no_shard or optim");
  switch (strategy) {
    case ShardingStrategy::kNoShard: return {R, R, R};
    case ShardingStrategy::kOptim: return {R, S, R};
    case ShardingStrategy::kOptimGrads: return {R, S, S};
    case ShardingStrategy::kOptimGradsParams: return {S, S, S};
  }
  throw std::invalid_argument("placements_of: unknown sharding strategy");
}

int64_t elements_of(const FlatLayout& layout, Placement placement) {
  switch (placement) {
    case Placement::kReplicated: return layout.total();
    case Placement::kSharded: return layout.shard;
    case Placement::kOuterSharded: return layout.sub_shard();
  }
  return 0;
}

int64_t FlatBuffer::begin_of(const FlatLayout& layout, int rank, Placement placement, int replica) {
  switch (placement) {
    case Placement::kReplicated: return 0;
    case Placement::kSharded: return layout.shard_begin(rank);
    case Placement::kOuterSharded: return layout.shard_begin(rank) + replica * layout.sub_shard();
  }
  return 0;
}

FlatBuffer::FlatBuffer(const FlatLayout* layout, int rank, Placement placement, at::Tensor data, int replica)
    : layout_(layout), rank_(rank), replica_(replica), placement_(placement), data_(std::move(data)) {
  const int64_t expected = elements_of(*layout_, placement_);
  if (data_.dim() != 1 || data_.numel() != expected)
    throw std::logic_error("FlatBuffer: expected " + std::to_string(expected) + " elements, got " +
                           std::to_string(data_.numel()));
}

FlatBuffer FlatBuffer::zeros(const FlatLayout* layout, int rank, Placement placement,
                             const at::TensorOptions& options, int replica) {
  return FlatBuffer(layout, rank, placement, at::zeros({elements_of(*layout, placement)}, options), replica);
}

FlatBuffer FlatBuffer::from_full(const FlatLayout* layout, int rank, Placement placement,
                                 const at::Tensor& full, const at::TensorOptions& options, int replica) {
  at::Tensor part = full.narrow(0, begin_of(*layout, rank, placement, replica), elements_of(*layout, placement));
  return FlatBuffer(layout, rank, placement, part.to(options, /*non_blocking=*/false, /*copy=*/true), replica);
}

int64_t FlatBuffer::begin() const { return begin_of(*layout_, rank_, placement_, replica_); }

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
  // The part of [e.offset, +numel) inside [begin, +held), relative to the parameter.
  const int64_t lo = std::max<int64_t>(0, begin() - e.offset);
  const int64_t hi = std::min<int64_t>(e.numel, begin() + data_.numel() - e.offset);
  if (hi <= lo) return {};
  return {lo, e.offset + lo - begin(), hi - lo};
}

}  // namespace mfsdp::detail
