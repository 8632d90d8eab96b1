// ParamGroup: the parameters of one unit that share (dtype, requires_grad), their flat buffers
// per role, and the collectives that move between them (docs/fully_shard.md).
//
// Roles (P = padded flat size, S = P / world; "compute" = the model-weight dtype); each is a
// FlatBuffer whose placement comes from the strategy's table (flat_buffer.h):
//   model_weights_  [S] or [P] compute   the persistent model weights
//   main_weights_   [S] or [P] main      optimizer weights; the same memory as the model weights
//                                        when dtype and placement match. Undefined when frozen.
//   main_grads_     [S] or [P] grad      Undefined when frozen.
// Transient buffers:
//   unsharded_      [P] compute  parameters are views of it. Sharded model weights: storage
//                                exists only between unshard() and reshard(); otherwise it is
//                                the model weights' own memory.
//   unsharded_grad_ [P] compute  where autograd accumulates; exists from the unit's pre-backward
//                                until its gradients are reduced.
// Every buffer lives on the communicator's device (FullyShardOptions::device).
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/buffer_allocator.h"
#include "fsdp/flat_buffer.h"
#include "fsdp/layout.h"
#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp::detail {

struct GroupParam {
  std::string name;                   // FQN relative to the root (updated when a root adopts)
  at::Tensor param;                   // the module's parameter (identity preserved)
  std::vector<int64_t> shape;
  at::ScalarType original_dtype;
};

// Bytes of transient buffers, tracked across all units of one root.
struct TransientCounter {
  int64_t now = 0;
  int64_t peak = 0;
  void add(int64_t bytes) {
    now += bytes;
    if (now > peak) peak = now;
  }
  void sub(int64_t bytes) { now -= bytes; }
};

// A gradient reduction in flight; finish() waits for it and accumulates into the main grads.
struct PendingReduction {
  WorkHandle work;
  std::function<void()> finish_fn;
  void finish() {
    if (work) work->wait();
    if (finish_fn) finish_fn();
  }
  // Waits for it without accumulating its result (the backward it belongs to was abandoned).
  void discard() {
    if (work) work->wait();
  }
};

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

  // Before the unit's backward: make sure the unsharded gradient buffer exists and every
  // parameter's .grad is a view into it, so autograd accumulates in place.
  void prepare_gradients();
  // After autograd accumulated into parameter `i`: fold a gradient autograd stored elsewhere.
  void adopt_gradient(size_t i);
  // Starts reducing the accumulated gradients into the main grads (divided by `divide_factor`)
  // and releases the unsharded gradient buffer once done. Replicated main grads under sharded
  // main weights (ZeRO-1) only accumulate locally here; finish_deferred_reduction() reduces.
  PendingReduction reduce_gradients(Communicator& comm, double divide_factor,
                                    bool average_in_collective);
  // After a backward without gradient sync: keep this micro-batch's gradients for the next
  // synced backward (moved to the main-grad dtype when the parameters are in lower precision).
  void stash_gradients();
  // ZeRO-1: reduce-scatter the full main grads into this rank's region (end of a synced backward).
  void finish_deferred_reduction();
  void drop_unsharded_gradients();

  void zero_main_grads();
  // After the main weights changed (optimizer step, checkpoint load): refresh the model weights
  // from them (ZeRO-1/2: all-gather every rank's updated region).
  void copy_main_to_model_weights();

  OptimizerShard optimizer_shard() const;
  std::vector<LocalShard> local_shards() const;
  // Full value of every parameter, gathered from the main weights (or model weights if frozen).
  std::vector<at::Tensor> gather_full_parameters() const;
  // Copies full values (in group order) into this rank's shards and the model weights.
  void load_full_parameters(const std::vector<at::Tensor>& values);

  int64_t model_weight_bytes() const { return model_weights_.nbytes(); }
  int64_t main_weight_bytes() const;  // excluding memory shared with the model weights
  int64_t main_grad_bytes() const { return main_grads_.nbytes() + (synced_.defined() ? synced_.nbytes() : 0); }

 private:
  // ZeRO-1: replicated main grads reduced once, at the end of a synced backward.
  bool deferred_reduction() const { return !main_grads_.sharded() && main_weights_.sharded(); }
  void point_params_at_unsharded();
  // Frees the unsharded gradient buffer and detaches the parameters' .grad views of it.
  void release_unsharded_grad();
  void move_to(ShardState to);
  std::string describe() const;  // "unit 'layers.0' group 1 (bf16)"

  std::vector<GroupParam> params_;
  std::shared_ptr<Communicator> comm_;       // the shard group
  std::shared_ptr<Communicator> replicate_;  // HSDP: the same shard on other replicas, or null
  int dp_size_;                              // shard group size x replicas
  bool requires_grad_;
  int rank_;
  FlatLayout layout_;
  at::Device device_;
  at::ScalarType compute_dtype_, grad_dtype_, comm_dtype_;
  TransientCounter* transient_ = nullptr;
  BufferAllocator* allocator_ = nullptr;
  const std::string* unit_path_ = nullptr;

  FlatBuffer model_weights_, main_weights_, main_grads_;
  at::Tensor unsharded_;       // [P] compute
  ShardState state_ = ShardState::kUnsharded;
  WorkHandle gathering_;       // the all-gather into unsharded_ in flight (kGathering)
  at::Tensor unsharded_grad_;  // [P] compute, transient
  at::Tensor accumulated_;     // [P] grad dtype: stashed micro-batches when compute != grad dtype
  at::Tensor synced_;          // [S] ZeRO-1 under HSDP: this rank's region as of the last sync
};

}  // namespace mfsdp::detail
