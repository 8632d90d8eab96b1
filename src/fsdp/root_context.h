// RootContext: what every unit under one root shares (docs/fully_shard.md): the transient-memory
// counter and allocator, the gradient reductions in flight, the execution order, the
// end-of-backward callback and the step hooks. Beside it, the reduction communicators, which
// fully_shard makes per shard group (reduction_communicator below).
//
// Built once, by the root, on its first use (the first forward, or a handle call that needs it:
// optimizer shards, state dicts, memory), like FSDP2's lazy init: only then is it known which
// unit is the root. Every unit under the root holds the same shared_ptr.
//
// Lifetimes: `units` and the order vectors hold raw pointers to UnitStates. A UnitState is owned
// by its module (fully_shard.cpp), and the root module owns its submodules, so they live as long
// as the root; a unit that dies earlier (its module replaced) removes itself (~UnitState). The
// autograd callback holds the context by shared_ptr, so it outlives any backward in flight.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/buffer_allocator.h"
#include "fsdp/param_group.h"
#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp::detail {

class UnitState;

// Which communicator each kind of collective runs on. On CUDA the all-gathers (the shard group)
// and the gradient reductions (a second communicator over the same ranks) each have their own
// stream, so a reduce-scatter never queues behind the next unit's all-gather (FSDP2 and
// Megatron-FSDP do the same); NCCL orders each against the compute stream with events
// (src/comm/nccl_communicator.cpp). On the CPU both are the shard group itself: one comm thread.
//
// The second communicator is made by fully_shard (UnitState's constructor), where every rank of
// the shard group takes part in the same order, as new_group needs (it is collective over the
// whole parent: include/mfsdp/comm/comm.h); not in the first backward, at peak activation memory
// on autograd's thread, and not in RootContext, which may be built by a call on one rank only
// (memory(), events()). Every unit sharded over the same group shares one: made at the first
// fully_shard over that group, it lives while a unit holds it. Units under one root may shard
// over different groups (experts over their expert-data-parallel group, the rest over the
// data-parallel one): each shard group gets its own.
std::shared_ptr<Communicator> reduction_communicator(const std::shared_ptr<Communicator>& shard_group);

class RootContext {
 public:
  // `units`: every unit under the root, the root last. Not collective.
  RootContext(std::vector<UnitState*> units, const FullyShardOptions& root_options);

  std::vector<UnitState*> units;  // in creation order, the root last
  TransientCounter transient;
  std::shared_ptr<BufferAllocator> allocator;  // transient buffers of every unit under the root
  double divide_factor = 1.0;
  bool callback_queued = false;
  std::deque<PendingReduction> pending;  // gradient reductions in flight, oldest first
  // Lifecycle events ("block0:pre_forward", ...) recorded for tests and debugging when enabled.
  bool record_events = false;
  std::vector<std::string> events;
  void note(const std::string& unit, const char* event) {
    if (record_events) events.push_back(unit + ":" + event);
  }

  // Execution order recorded on the first step (first appearance), fixed at the end of the
  // first backward. Forward prefetching follows the order of pre-forwards; backward runs the
  // units in the reverse order of their post-forwards (the root, which encloses the others,
  // first), and its prefetching follows that.
  std::vector<UnitState*> forward_order;       // pre-forward order
  std::vector<UnitState*> post_forward_order;  // post-forward order (reverse backward order)
  bool order_fixed = false;
  void record_forward(UnitState* unit);
  void record_post_forward(UnitState* unit);
  UnitState* next_in_forward(const UnitState* unit) const;   // null: none or not known yet
  UnitState* next_in_backward(const UnitState* unit) const;  // null: none or not known yet
  // The first `count` units of the forward (backward) order contain `unit` (false until the
  // order is known).
  bool among_first_in_forward(const UnitState* unit, size_t count) const;
  bool among_first_in_backward(const UnitState* unit, size_t count) const;

  // Keeps at most `limit` reductions in flight (each holds an unsharded gradient buffer).
  void limit_pending(size_t limit);
  void finish_backward();
  // The root's next forward starts while the end-of-backward callback is still queued: the last
  // backward threw before it ended (autograd runs no callback then). Waits for the reductions it
  // left in flight without applying them, and returns every unit to idle and resharded, so that
  // one failed backward does not leave the model stuck (main grads keep what had already been
  // accumulated, as torch's .grad does: zero_grad() clears them).
  void abandon_backward();

  // After the main weights changed outside the optimizer (a checkpoint load): reshard what is
  // gathered and copy main weights into model weights. Starts nothing else.
  void refresh_model_weights();
  // The optimizer's after-step hook: refresh_model_weights(), then a new step for the buffer
  // allocator and (all_gather_in_start_param_sync) the first unit's all-gather.
  void after_optimizer_step();

  // A unit being destroyed before the root: forget it.
  void forget(UnitState* unit);

 private:
  bool start_param_sync_;
};

}  // namespace mfsdp::detail
