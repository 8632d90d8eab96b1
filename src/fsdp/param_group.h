// ParamGroup: the parameters of one unit that share (dtype, requires_grad), their flat buffers
// per role, and the collectives that move between them (docs/fully_shard.md).
//
// Roles (P = padded flat size, S = P / world; "compute" = the model-weight dtype); each is a
// FlatBuffer whose placement comes from the strategy's table (flat_buffer.h):
//   model_weights_  [S] or [P] compute   the persistent model weights
//   main_weights_   [S] or [P] main      optimizer weights; the same memory as the model weights
//                                        when dtype and placement match. Undefined when frozen.
//   main grads      [S] or [P] grad      held by the group's GradientReducer (gradient_reducer.h,
//                                        with the gradient buffers and the reductions)
// Transient buffers:
//   unsharded_      [P] compute  parameters are views of it. Sharded model weights: storage
//                                exists only between unshard() and reshard(); otherwise it is
//                                the model weights' own memory.
// Every buffer lives on the communicator's device (FullyShardOptions::device). What the optimizer
// and checkpoints see of the buffers (shards, full values) is in shard_views.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/buffer_allocator.h"
#include "fsdp/flat_buffer.h"
#include "fsdp/gradient_reducer.h"
#include "fsdp/layout.h"
#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp::detail {

// Ranks that hold a share of the gradient: the shard group times the replicas (HSDP).
int data_parallel_size(const FullyShardOptions& options);

// Where a group's model weights are (sharded model weights only move; otherwise kUnsharded).
enum class ShardState { kSharded, kGathering, kUnsharded };
const char* to_string(ShardState s);

class ParamGroup {
 public:
  ParamGroup(std::vector<GroupParam> params, const FullyShardOptions& options);
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;
  ~ParamGroup();

  bool requires_grad() const { return requires_grad_; }
  std::vector<GroupParam>& params() { return params_; }
  const std::vector<GroupParam>& params() const { return params_; }
  // The root's transient-memory counter and the allocator transient buffers come from; the
  // unit's path names the group in errors. All three outlive the group (the root owns them).
  void attach(TransientCounter* transient, BufferAllocator* allocator, const std::string* unit_path);

  // Sharded model weights: starts all-gathering them into the unsharded buffer without waiting
  // (prefetch; no-op when gathered or gathering, or when the model weights are replicated).
  // Returns whether it started one.
  bool start_unshard();
  // Waits for an all-gather start_unshard() began (no-op otherwise).
  void wait_unshard();
  // Sharded model weights: free the unsharded buffer (after waiting for an all-gather into it).
  void reshard();
  ShardState shard_state() const { return state_; }
  // Throws naming the unit, the group, `when` and the state unless the weights are gathered.
  void expect_unsharded(const char* when) const;

  // The group's gradients: autograd's buffer, the micro-batch stash and the reductions into
  // the main grads.
  GradientReducer& gradients() { return gradients_; }
  const GradientReducer& gradients() const { return gradients_; }

  // After the main weights changed (optimizer step, checkpoint load): refresh the model weights
  // from them (ZeRO-1/2: all-gather every rank's updated region).
  void copy_main_to_model_weights();

  // The buffers, for the optimizer's and checkpoints' views of them (shard_views.h).
  const FlatLayout& layout() const { return layout_; }
  const FlatBuffer& model_weights() const { return model_weights_; }
  const FlatBuffer& main_weights() const { return main_weights_; }  // undefined when frozen
  Communicator& shard_group() const { return *comm_; }
  Communicator* replicas() const { return replicate_.get(); }  // HSDP; null otherwise
  // Overwrites the weights with the parameters' full values (group order, any dtype and device):
  // this rank's slice of each into the main and model weights, and the whole into the unsharded
  // buffer while gathered. Each slice is copied (and converted) straight from its value: no
  // full-size flat copy of the group is made. Padding keeps its zeros.
  void load_values(const std::vector<at::Tensor>& values);

  int64_t model_weight_bytes() const { return model_weights_.nbytes(); }
  int64_t main_weight_bytes() const;  // excluding memory shared with the model weights
  int64_t main_grad_bytes() const { return gradients_.bytes(); }

 private:
  void point_params_at_unsharded();
  void move_to(ShardState to);
  std::string describe() const;  // "unit 'layers.0' group 1 (bf16)"

  std::vector<GroupParam> params_;
  std::shared_ptr<Communicator> comm_;       // the shard group
  std::shared_ptr<Communicator> replicate_;  // HSDP: the same shard on other replicas, or null
  bool requires_grad_;
  int rank_;
  FlatLayout layout_;
  at::Device device_;
  at::ScalarType compute_dtype_;
  TransientCounter* transient_ = nullptr;
  BufferAllocator* allocator_ = nullptr;
  const std::string* unit_path_ = nullptr;

  FlatBuffer model_weights_, main_weights_;
  GradientReducer gradients_;
  at::Tensor unsharded_;       // [P] compute
  ShardState state_ = ShardState::kUnsharded;
  WorkHandle gathering_;       // the all-gather into unsharded_ in flight (kGathering)
};

}  // namespace mfsdp::detail
