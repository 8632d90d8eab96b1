// FlatBuffer: one role's flat buffer of a parameter group (model weights, main weights or main
// gradients; docs/fully_shard.md): its layout, storage, dtype, device and placement.
//
// Sharded: this rank holds [shard_begin(rank), +shard) of the padded flat range, S elements.
// Outer-sharded (HFSDP): replica o of that shard holds its sub-shard o, S / R elements.
// Replicated: this rank holds all P elements. Which roles are sharded is the strategy's table
// (placements_of), so the code that moves data between roles asks the buffers, never the
// strategy. All slice arithmetic goes through FlatLayout::shard_begin / slice_of.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "fsdp/layout.h"
#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp::detail {

enum class Placement { kReplicated, kSharded, kOuterSharded };

// docs/fully_shard.md, as data:
//   strategy             model weights  main weights  main grads
//   no_shard             replicated     replicated    replicated
//   optim (ZeRO-1)       replicated     sharded       replicated (reduce-scattered at the end)
//   optim_grads (ZeRO-2) replicated     sharded       sharded
//   optim_grads_params   sharded        sharded       sharded
//   + outer optim (HFSDP) sharded        outer-sharded outer-sharded
struct RolePlacements {
  Placement model_weights, main_weights, main_grads;
};
RolePlacements placements_of(ShardingStrategy strategy, ShardingStrategy outer = ShardingStrategy::kNoShard);
// Elements a buffer of this placement holds on one rank.
int64_t elements_of(const FlatLayout& layout, Placement placement);

class FlatBuffer {
 public:
  FlatBuffer() = default;
  // A buffer over `data` ([S] when sharded, [S / R] outer-sharded, [P] replicated). `layout`
  // must outlive it (the ParamGroup owns both). `replica`: this rank's index among the replicas
  // (outer-sharded only).
  FlatBuffer(const FlatLayout* layout, int rank, Placement placement, at::Tensor data, int replica = 0);
  // Zero-filled.
  static FlatBuffer zeros(const FlatLayout* layout, int rank, Placement placement,
                          const at::TensorOptions& options, int replica = 0);
  // This rank's part of `full` ([P]), copied into a new buffer of `options`.
  static FlatBuffer from_full(const FlatLayout* layout, int rank, Placement placement,
                              const at::Tensor& full, const at::TensorOptions& options, int replica = 0);
  // First padded-flat element a buffer of this placement holds on (rank, replica).
  static int64_t begin_of(const FlatLayout& layout, int rank, Placement placement, int replica);

  bool defined() const { return data_.defined(); }
  // Sharded over the shard group (and maybe again over the replicas).
  bool sharded() const { return placement_ != Placement::kReplicated; }
  bool outer_sharded() const { return placement_ == Placement::kOuterSharded; }
  Placement placement() const { return placement_; }
  const at::Tensor& data() const { return data_; }
  at::ScalarType dtype() const { return data_.scalar_type(); }
  at::Device device() const { return data_.device(); }
  int64_t nbytes() const { return data_.defined() ? static_cast<int64_t>(data_.nbytes()) : 0; }
  // First element of the padded flat range this buffer holds (0 when replicated).
  int64_t begin() const;
  // This rank's shard range [shard_begin(rank), +shard) as a view (all of data() when sharded;
  // not held when outer-sharded).
  at::Tensor own() const;
  // `length` elements from padded-flat position `flat_offset` (which this buffer must hold).
  at::Tensor range(int64_t flat_offset, int64_t length) const;
  // True when both buffers view the same memory (one copy serving two roles).
  bool aliases(const FlatBuffer& other) const;

  // The part of parameter `i` this buffer holds: `param_offset` within the parameter,
  // `local_offset` within data(), `length` elements (0: none).
  struct ParamSlice {
    int64_t param_offset = 0, local_offset = 0, length = 0;
  };
  ParamSlice slice_of(size_t i) const;

 private:
  const FlatLayout* layout_ = nullptr;
  int rank_ = 0;
  int replica_ = 0;
  Placement placement_ = Placement::kReplicated;
  at::Tensor data_;
};

}  // namespace mfsdp::detail
