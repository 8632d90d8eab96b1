// GradientReducer: one parameter group's gradients, from autograd's accumulation to the main
// grads the optimizer reads (FSDP2 splits its FSDPParamGroup the same way: the group's lifecycle
// in one place, foreach_reduce in another). It owns the gradient buffers:
//   main_grads      [S] or [P] grad dtype   what the optimizer reads; persistent
//   unsharded_grad  [P] compute             where autograd accumulates; from the unit's
//                                           pre-backward until its gradients are reduced
//   accumulated     [P] grad dtype          micro-batches without gradient sync, kept in the
//                                           main-grad dtype when compute is lower precision
//   synced          [S]                     ZeRO-1 under HSDP: this rank's region at the last sync
// and the collectives: reduce-scatter into sharded main grads, all-reduce into replicated ones,
// the HSDP all-reduce across replicas (HFSDP: a reduce-scatter into this replica's sub-shard),
// and ZeRO-1's deferred reduce-scatter at the end of a synced backward. The parameters' .grad are views of unsharded_grad.
#pragma once

#include <ATen/core/Tensor.h>

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
  // What the runtime is doing now (UnitState sets it in its forward and backward hooks, the root
  // after an optimizer step): a unit's path (a UnitState member, which outlives the counter's
  // use) and "forward", "backward" or "after_optimizer_step". The peak remembers what it was
  // doing when reached (plan_memory reports it).
  const std::string* unit = nullptr;
  const char* event = nullptr;
  const std::string* peak_unit = nullptr;
  const char* peak_event = nullptr;
  void label(const std::string& u, const char* e) {
    unit = &u;
    event = e;
  }
  void add(int64_t bytes) {
    now += bytes;
    if (now > peak) {
      peak = now;
      peak_unit = unit;
      peak_event = event;
    }
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

// What a group's reducer needs to know of it; every pointer outlives the reducer (the group
// owns it).
struct ReducerSetup {
  std::vector<GroupParam>* params = nullptr;
  const FlatLayout* layout = nullptr;
  std::shared_ptr<Communicator> comm;       // the shard group
  std::shared_ptr<Communicator> replicate;  // HSDP: the same shard on other replicas, or null
  int dp_size = 1;                          // shard group size x replicas
  int rank = 0;
  at::Device device = at::kCPU;
  at::ScalarType compute_dtype = at::kFloat, grad_dtype = at::kFloat, comm_dtype = at::kFloat;
  // How a bf16/fp16 comm_dtype is summed (MixedPrecisionPolicy::grad_reduce_sum).
  LowPrecisionSum low_precision_sum = LowPrecisionSum::kNative;
  // ZeRO-1: replicated main grads under sharded main weights, reduced once at the end of a
  // synced backward.
  bool deferred = false;
};

class GradientReducer {
 public:
  GradientReducer() = default;  // a frozen group's: no gradients
  GradientReducer(ReducerSetup setup, FlatBuffer main_grads);
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;
  GradientReducer(GradientReducer&&) = default;
  GradientReducer& operator=(GradientReducer&&) = default;

  // The root's transient-memory counter and allocator; `owner` keys the allocations.
  void attach(TransientCounter* transient, BufferAllocator* allocator, const void* owner);

  // Before the unit's backward: make sure the unsharded gradient buffer exists and every
  // parameter's .grad is a view into it, so autograd accumulates in place.
  void prepare();
  // After autograd accumulated into parameter `i`: fold a gradient autograd stored elsewhere.
  void adopt(size_t i);
  // Starts reducing the accumulated gradients into the main grads (divided by `divide_factor`)
  // and releases the unsharded gradient buffer once done. Under ZeRO-1 it only accumulates
  // locally here; finish_deferred() reduces.
  PendingReduction reduce(Communicator& comm, double divide_factor, bool average_in_collective);
  // After a backward without gradient sync: keep this micro-batch's gradients for the next
  // synced backward (moved to the main-grad dtype when the parameters are in lower precision).
  void stash();
  // ZeRO-1: reduce-scatter the full main grads into this rank's region (end of a synced backward).
  void finish_deferred();
  void drop_unsharded();
  void zero();

  bool defined() const { return main_grads_.defined(); }
  const FlatBuffer& main_grads() const { return main_grads_; }
  int64_t bytes() const { return main_grads_.nbytes() + (synced_.defined() ? synced_.nbytes() : 0); }

 private:
  // Frees the unsharded gradient buffer and detaches the parameters' .grad views of it.
  void release_unsharded();

  ReducerSetup s_;
  FlatBuffer main_grads_;
  TransientCounter* transient_ = nullptr;
  BufferAllocator* allocator_ = nullptr;
  const void* owner_ = nullptr;
  at::Tensor unsharded_grad_;  // [P] compute, transient
  at::Tensor accumulated_;     // [P] grad dtype: stashed micro-batches when compute != grad dtype
  at::Tensor synced_;          // [S] ZeRO-1 under HSDP: this rank's region as of the last sync
};

}  // namespace mfsdp::detail
