// ParamGroup: the parameters of one unit that share (dtype, requires_grad), their flat buffers
// per role, and the collectives that move between them (DESIGN.md section 4).
//
// Buffers (P = padded flat size, S = P / world; "compute" = the model-weight dtype):
//   unsharded_   [P] compute   parameters are views of it. ZeRO-3: storage exists only between
//                              unshard() and reshard(); other strategies: the persistent model weights.
//   model_shard_ [S] compute   ZeRO-3 only: this rank's model weights (aliases main_weight_ when
//                              the dtypes match).
//   main_weight_ [S] main      optimizer weights ([P] for no_shard); aliases the model weights
//                              when the dtypes match. Undefined for frozen groups.
//   main_grad_   [S] grad      ZeRO-2/3; [P] for no_shard and ZeRO-1. Undefined when frozen.
//   unsharded_grad_ [P] compute  where autograd accumulates; transient (exists from the unit's
//                              pre-backward until its gradients are reduced).
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/buffer_allocator.h"
#include "fsdp/layout.h"
#include "mfsdp/fully_shard.h"

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
};

// Ranks that hold a share of the gradient: the shard group times the replicas (HSDP).
int data_parallel_size(const FullyShardOptions& options);

class ParamGroup {
 public:
  ParamGroup(std::vector<GroupParam> params, const FullyShardOptions& options,
             TransientCounter* transient);
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  bool requires_grad() const { return requires_grad_; }
  std::vector<GroupParam>& params() { return params_; }
  const std::vector<GroupParam>& params() const { return params_; }
  const FlatLayout& layout() const { return layout_; }
  // The root's transient-memory counter and the allocator transient buffers come from.
  void set_memory(TransientCounter* t, BufferAllocator* allocator) {
    transient_ = t;
    allocator_ = allocator;
  }

  ~ParamGroup();

  // ZeRO-3: starts all-gathering the model weights into the unsharded buffer without waiting
  // (prefetch; no-op when already there or started, or when the model weights are not sharded).
  // Returns whether it started one.
  bool start_unshard();
  // Waits for an all-gather start_unshard() began (no-op otherwise).
  void wait_unshard();
  // start_unshard() + wait_unshard(). Returns whether it all-gathered.
  bool unshard();
  // ZeRO-3: free the unsharded buffer (after waiting for an all-gather in flight into it).
  void reshard();
  bool is_unsharded() const;

  // Before the unit's backward: make sure the unsharded gradient buffer exists and every
  // parameter's .grad is a view into it, so autograd accumulates in place.
  void prepare_gradients();
  // After autograd accumulated into parameter `i`: fold a gradient autograd stored elsewhere.
  void adopt_gradient(size_t i);
  // Starts reducing the accumulated gradients into the main grads (divided by `divide_factor`)
  // and releases the unsharded gradient buffer once done. ZeRO-1 only accumulates locally here;
  // its reduce-scatter runs in finish_optim_sync().
  PendingReduction reduce_gradients(double divide_factor, bool average_in_collective);
  // After a backward without gradient sync: keep this micro-batch's gradients for the next
  // synced backward (moved to the main-grad dtype when the parameters are in lower precision).
  void stash_gradients();
  // ZeRO-1: reduce-scatter the full main grads into this rank's region (end of a synced backward).
  void finish_optim_sync();
  bool has_unsharded_gradients() const {
    return unsharded_grad_.defined() || accumulated_.defined();
  }
  void drop_unsharded_gradients();

  void zero_main_grads();
  // After the optimizer updated the main weights: refresh the model weights from them.
  void copy_main_to_model_weights();

  OptimizerShard optimizer_shard() const;
  std::vector<LocalShard> local_shards() const;
  // Full value of every parameter, gathered from the main weights (or model weights if frozen).
  std::vector<at::Tensor> gather_full_parameters() const;
  // Copies full values (in group order) into this rank's shards and the model weights.
  void load_full_parameters(const std::vector<at::Tensor>& values);

  int64_t model_weight_bytes() const;
  int64_t main_weight_bytes() const;  // excluding aliases of model weights
  int64_t main_grad_bytes() const;

 private:
  bool sharded_model() const { return strategy_ == ShardingStrategy::kOptimGradsParams; }
  bool sharded_main() const { return strategy_ != ShardingStrategy::kNoShard; }
  bool sharded_grads() const {
    return strategy_ == ShardingStrategy::kOptimGrads ||
           strategy_ == ShardingStrategy::kOptimGradsParams;
  }
  int64_t main_begin() const { return sharded_main() ? layout_.shard_begin(rank_) : 0; }
  void point_params_at_unsharded();
  // Frees the unsharded gradient buffer and detaches the parameters' .grad views of it.
  void release_unsharded_grad();

  std::vector<GroupParam> params_;
  std::shared_ptr<Communicator> comm_;       // the shard group
  std::shared_ptr<Communicator> replicate_;  // HSDP: the same shard on other replicas, or null
  int dp_size_;                              // shard group size x replicas
  ShardingStrategy strategy_;
  bool requires_grad_;
  int rank_;
  FlatLayout layout_;
  at::ScalarType compute_dtype_, main_dtype_, grad_dtype_, comm_dtype_;
  TransientCounter* transient_;
  BufferAllocator* allocator_ = nullptr;

  at::Tensor unsharded_;       // [P] compute
  WorkHandle gathering_;       // an all-gather into unsharded_ in flight (prefetch), or null
  at::Tensor model_shard_;     // [S] compute, ZeRO-3
  at::Tensor main_weight_;     // [S] or [P] main
  bool main_aliases_model_ = false;
  at::Tensor main_grad_;       // [S] or [P] grad dtype
  at::Tensor unsharded_grad_;  // [P] compute, transient
  at::Tensor accumulated_;     // [P] grad dtype: stashed micro-batches when compute != grad dtype
  at::Tensor synced_;          // [S] ZeRO-1 under HSDP: this rank's region as of the last sync
};

}  // namespace mfsdp::detail
