// fully_shard: turns a torch::nn::Module into a sharded unit (docs/fully_shard.md).
//
//   auto comm = mfsdp::init_communicator();
//   mfsdp::FullyShardOptions opt;
//   opt.comm = comm;
//   for (auto& block : model->blocks) mfsdp::fully_shard(*block, opt);   // each unit first,
//   mfsdp::FsdpHandle root = mfsdp::fully_shard(*model, opt);            // then the root
//   auto optimizer = mfsdp::make_adamw(root, adamw);   // bound to the root's shards and hooks
//   loss = model->forward(x); loss.backward();  // the forward routes units through mfsdp::call
//   optimizer->step(lr); root.zero_grad();
//
// Devices: every buffer lives on the communicator's device (CPU for "gloo", the rank's GPU for
// "nccl"); parameters may start anywhere (CPU, the GPU) and are moved there by fully_shard.
//
// How a forward reaches the runtime. C++ modules have no forward hooks, so a unit's forward must
// be called through the runtime:
//   - modules you write derive from mfsdp::ShardedModule<Self> and are called as `block->call(x)`;
//   - modules you cannot change are called as `mfsdp::call(*linear, x)` (any module with forward);
//   - holders declared with MFSDP_MODULE(Name) instead of TORCH_MODULE(Name) route `block(x)`;
//   - mfsdp::Sequential routes every unit among its children (torch::nn::Sequential calls their
//     forward directly); for a ModuleList, call `mfsdp::call(*list[i]->as<Block>(), x)`.
// All of these run: unshard (all-gather) -> forward -> pre-backward hook on the outputs -> reshard.
// Calling `forward` directly bypasses the runtime: under optim_grads_params the unit's
// parameters are then empty views and the call fails.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "mfsdp/comm/comm.h"
#include "mfsdp/optim/optim.h"

namespace mfsdp {

// Which roles are sharded (Megatron-FSDP's --data-parallel-sharding-strategy).
enum class ShardingStrategy {
  kNoShard,           // "no_shard": nothing sharded, gradients all-reduced (DDP)
  kOptim,             // "optim": ZeRO-1, main weights + optimizer state sharded
  kOptimGrads,        // "optim_grads": ZeRO-2, + main gradients sharded
  kOptimGradsParams,  // "optim_grads_params": ZeRO-3, + model weights sharded
};
ShardingStrategy parse_sharding_strategy(const std::string& name);  // throws naming the value
const char* to_string(ShardingStrategy s);

struct MixedPrecisionPolicy {
  // Dtype of the model weights used in forward/backward; unset: each parameter keeps its dtype.
  std::optional<at::ScalarType> param_dtype;
  at::ScalarType main_params_dtype = at::kFloat;  // the optimizer's weights
  at::ScalarType main_grads_dtype = at::kFloat;   // accumulated gradients the optimizer reads
  // Dtype gradients are reduced in (bf16 with --grad-reduce-in-bf16); unset: main_grads_dtype.
  std::optional<at::ScalarType> grad_comm_dtype;
  // How a bf16/fp16 grad_comm_dtype is summed: NCCL's native kernels (the default, as Megatron
  // and FSDP2), or in fp32 in rank order for reproducible bits (--grad-reduce-rank-order-fp32).
  LowPrecisionSum grad_reduce_sum = LowPrecisionSum::kNative;
};

enum class GradientScaling {
  kDivideByWorld,         // averaged over data-parallel ranks: scaled by 1/dp before reducing
  kNone,                  // summed: the loss is already normalised globally (per-token loss)
  kAverageInCollective,   // averaged by the collective itself (ReduceOp::kAvg) after summing
};

class DeviceMesh;

// FsdpHandle::full_state_dict's options.
struct FullStateDictOptions {
  bool all_ranks = false;    // every rank gets the map, not only rank 0 of the job
  bool cpu_offload = false;  // tensors on the CPU, each moved there as it is gathered
};

// Where unsharded weights and gradients get their memory (docs/fully_shard.md, allocators).
enum class BufferAllocatorKind {
  kPlain,         // a fresh allocation per use
  kDoubleBuffer,  // two persistent buffers per size class (--fsdp-double-buffer)
  kTracePool,     // trace the second step, plan one pool per dtype, replay (--fsdp-trace-pool)
};

struct FullyShardOptions {
  std::shared_ptr<Communicator> comm;  // the data-parallel communicator (this or `mesh`)
  // Where every flat buffer, transient buffer and optimizer state lives. Unset: the
  // communicator's device(); set, it must be that device (NCCL needs CUDA tensors, the CPU
  // communicator CPU tensors).
  std::optional<c10::Device> device;
  // Instead of `comm`: a 1-D mesh (shard over it), or a 2-D mesh (replicate dim, shard dim),
  // e.g. {"dp_outer", "dp_shard"}, for HSDP: buffers are sharded within a shard group and
  // replicated across groups; gradients are reduce-scattered in the shard group, then
  // all-reduced across replicas. Pass optimizer_comm() to the optimizer.
  std::shared_ptr<DeviceMesh> mesh;
  ShardingStrategy strategy = ShardingStrategy::kOptimGradsParams;
  // With a 2-D mesh, what is sharded across the replicas as well: kNoShard, nothing (HSDP: every
  // replica holds the same shards); kOptim, main weights, main grads and optimizer state
  // (Megatron-FSDP's HFSDP, outer_dp_sharding_strategy "optim"; needs kOptimGradsParams): a
  // replica holds 1/R of its shard's, gradients are reduce-scattered across the replicas and the
  // updated weights all-gathered back. optimizer_comm() is then the whole mesh.
  ShardingStrategy outer_strategy = ShardingStrategy::kNoShard;
  MixedPrecisionPolicy mixed_precision;
  bool reshard_after_forward = true;   // optim_grads_params only: free weights after forward
  GradientScaling gradient_scaling = GradientScaling::kDivideByWorld;
  bool align_rows = true;              // chunk-size alignment of shards to whole rows
  // Overlap (ZeRO-3): all-gather the next unit's weights while this one computes; the order is
  // recorded on the first step (forward), and reversed in backward.
  bool prefetch = true;
  // Start the first unit's all-gather when the optimizer step ends (the optimizer_step_hook()), so it
  // overlaps whatever precedes the next forward (Megatron's fsdp_all_gather_in_start_param_sync).
  // Off: nothing is in flight between steps.
  bool all_gather_in_start_param_sync = true;
  // The root's choice applies to every unit under it.
  BufferAllocatorKind buffer_allocator = BufferAllocatorKind::kPlain;
};

// One parameter's piece on this rank (for checkpoints and diagnostics).
struct LocalShard {
  std::string name;                 // FQN relative to the root module
  std::vector<int64_t> global_shape;
  int64_t offset = 0;               // first element of the parameter this rank holds
  at::Tensor local;                 // 1-D view of the main weight slice (numel may be 0)
  bool requires_grad = true;
  // Where the slice lies in optimizer_shards() (and so in every optimizer state tensor):
  // shard index and element offset; -1 for frozen parameters, which have no optimizer state.
  int shard_index = -1;
  int64_t shard_offset = 0;
  // How many ranks hold this same slice (no_shard, frozen unsharded weights, HSDP replicas) and
  // which of them this rank is: a checkpoint writes each element once.
  int replicas = 1;
  int replica = 0;
};

// Bytes the runtime holds on this rank, per role (docs/fully_shard.md).
struct MemoryReport {
  int64_t model_weights = 0;     // persistent model-weight buffers (sharded under ZeRO-3)
  int64_t main_weights = 0;      // main weights not aliasing model weights
  int64_t optimizer_state = 0;   // filled in by the caller from DistributedOptimizer::state()
  int64_t main_grads = 0;        // persistent main-gradient buffers
  int64_t transient_now = 0;     // unsharded weights and gradients alive now
  int64_t transient_peak = 0;    // high-water mark of transient_now since reset_peak()
  int64_t buffer_pool = 0;       // persistent memory of the double buffers or the trace pool
  int64_t pooled_buffers = 0;    // transient buffers served from that memory so far
  int64_t plain_buffers = 0;     // transient buffers served by a plain allocation so far
};

namespace detail {
class UnitState;
UnitState* find_unit(const torch::nn::Module& module);  // null when not a unit
at::Tensor run_forward(UnitState& unit, const std::function<at::Tensor()>& forward);
std::vector<at::Tensor> run_forward(UnitState& unit,
                                    const std::function<std::vector<at::Tensor>()>& forward);
// Floating-point inputs are cast to the unit's param_dtype (FSDP2's cast_forward_inputs). In a
// unit with frozen parameters, an input that needs a gradient also gets an identity node whose
// backward tells the unit its whole backward is done (FSDP2's RegisterPostBackwardFunction), so
// that frozen weights stay gathered for every backward node that reads them.
at::Tensor cast_forward_input(const UnitState& unit, const at::Tensor& input);
template <class T>
decltype(auto) cast_forward_input(const UnitState& unit, T&& arg) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return cast_forward_input(unit, static_cast<const at::Tensor&>(arg));
  } else {
    return std::forward<T>(arg);
  }
}
}  // namespace detail

// Handle to a unit (and, for the root, to the whole sharded model).
class FsdpHandle {
 public:
  FsdpHandle() = default;
  explicit FsdpHandle(std::shared_ptr<detail::UnitState> unit) : unit_(std::move(unit)) {}

  // Manual all-gather / free of this unit's weights (not recursive).
  void unshard();
  void reshard();
  // Off: backward accumulates gradients locally without communication (micro-batches but the
  // last); on again: the next backward reduces everything accumulated. `recurse`: this unit and
  // every unit under it (FSDP2's default), else this unit only.
  void set_requires_gradient_sync(bool sync, bool recurse = true);
  // `recurse`: this unit and every unit under it, else this unit only.
  void set_reshard_after_forward(bool reshard, bool recurse = true);
  // Off: this unit (not those below it) is not all-gathered for its backward, for units whose
  // backward reads no weight (an embedding: its gradient needs only the token ids); FSDP2's
  // set_unshard_in_backward. A backward that does read the weights then reads freed memory, so
  // only for such units. Activation recompute still gathers (the forward runs again).
  void set_unshard_in_backward(bool unshard);
  // Gradients of every unit under this unit's root are divided by this factor in the reduction
  // (default: world size, or 1 with GradientScaling::kNone; not used with kAverageInCollective).
  void set_gradient_divide_factor(double factor);

  // The communicator the optimizer reduces the gradient norm over: the shard group, or under
  // HFSDP (outer_strategy kOptim) the whole mesh.
  std::shared_ptr<Communicator> optimizer_comm() const;
  // Every flat shard under this unit's root, for the distributed optimizer (make_adamw(root, ...)
  // binds them with the after-step hook; this is for optimizers of your own).
  std::vector<OptimizerShard> optimizer_shards() const;
  // What an optimizer runs after each step: the model weights refreshed from the main weights,
  // a new step for the buffer allocator, and (all_gather_in_start_param_sync) the first unit's
  // all-gather started.
  std::function<void()> optimizer_step_hook() const;
  // After main weights changed outside the optimizer (a checkpoint load): model weights
  // refreshed from them, nothing gathered ahead.
  void refresh_model_weights();
  // Root only: zeroes the main gradients and drops leftover unsharded gradients.
  void zero_grad();

  std::vector<LocalShard> local_shards() const;
  // The root module's buffers by FQN: not sharded, every rank holds each whole (a routing bias);
  // state dicts and checkpoints carry them beside the parameters.
  std::vector<std::pair<std::string, at::Tensor>> buffers() const;
  // Full parameters and buffers by FQN (gathered from all ranks; every rank gets them when all_ranks, else
  // only rank 0 and the others get an empty map). Collective.
  std::map<std::string, at::Tensor> full_state_dict(bool all_ranks = false) const;
  // The same, with `options.cpu_offload`: each tensor copied to host memory as it is gathered,
  // so the device holds at most one parameter group's full values at a time (FSDP2's
  // StateDictOptions(full_state_dict=True, cpu_offload=True)). Collective.
  std::map<std::string, at::Tensor> full_state_dict(const FullStateDictOptions& options) const;
  // Streams the full state dict: gathers one parameter group at a time and hands each full
  // parameter, then each buffer, to `visit` before the next group is gathered. `full` is on the
  // device, in the parameter's original dtype, and valid only during the call (a view of a
  // gather buffer the next group reuses, or of the live weights when nothing is sharded): copy
  // it to keep it. Called on rank 0 of the job (every rank with `all_ranks`), not on the others.
  // Collective: every rank calls it. An exception from `visit` is rethrown after the last
  // group, so the ranks' collectives stay matched.
  void for_each_full_tensor(const std::function<void(const std::string& name, const at::Tensor& full)>& visit,
                            bool all_ranks = false) const;
  // Loads full parameters and buffers (every rank passes the same map) into the shards. Throws
  // naming the missing, unexpected or mis-shaped tensor before changing anything.
  void load_full_state_dict(const std::map<std::string, at::Tensor>& state);

  MemoryReport memory() const;
  void reset_peak();

  // Records lifecycle events ("block0:pre_forward", "block0:all_gather", "<unit>:post_backward",
  // ":end_of_backward"; the root's path is "") from now on, for tests and debugging; off clears.
  void record_events(bool on);
  std::vector<std::string> events() const;

  detail::UnitState& state() const;

 private:
  std::shared_ptr<detail::UnitState> unit_;
};

// Makes `module` a unit: its parameters not already in a unit are grouped by (dtype,
// requires_grad), packed into flat buffers and sharded per `options.strategy`. Apply bottom-up;
// the last call on the outermost module makes the root. A parameter shared between two units is
// rejected (tie the modules into one unit instead).
FsdpHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& options);

// The handle of a module fully_shard was applied to; throws std::invalid_argument otherwise.
FsdpHandle handle_of(const torch::nn::Module& module);

// A distributed optimizer over every shard under `root`, run over its communicator, with the
// root's after-step hook (optimizer_step_hook()).
std::unique_ptr<DistributedOptimizer> make_adamw(const FsdpHandle& root, const AdamWOptions& options);
std::unique_ptr<DistributedOptimizer> make_sgd(const FsdpHandle& root, const SGDOptions& options);

// Calls module.forward(args...) through the unit's hooks (see the top of this file).
template <class M, class... Args>
auto call(M& module, Args&&... args) {
  detail::UnitState* unit = detail::find_unit(module);
  using Out = decltype(module.forward(std::forward<Args>(args)...));
  if (unit == nullptr) return module.forward(std::forward<Args>(args)...);
  return detail::run_forward(*unit, std::function<Out()>([&]() -> Out {
                               return module.forward(detail::cast_forward_input(*unit, args)...);
                             }));
}

// Runs `fn(input)` through module's unit hooks as call() runs forward, for an entry point other
// than forward (a model's fused loss reads its output layer's weight without calling its
// forward): `input` is cast as forward's inputs are, and the outputs get the unit's backward
// hooks. `fn` returns the outputs (undefined ones allowed).
template <class M, class F>
std::vector<at::Tensor> call_as_forward(M& module, const at::Tensor& input, F&& fn) {
  detail::UnitState* unit = detail::find_unit(module);
  if (unit == nullptr) return fn(input);
  return detail::run_forward(*unit, std::function<std::vector<at::Tensor>()>([&]() -> std::vector<at::Tensor> {
                               return fn(detail::cast_forward_input(*unit, input));
                             }));
}

// Base for modules you write: `block->call(x)` runs forward through the unit's hooks.
template <class Derived>
class ShardedModule : public torch::nn::Module {
 public:
  template <class... Args>
  auto call(Args&&... args) {
    return mfsdp::call(static_cast<Derived&>(*this), std::forward<Args>(args)...);
  }
};

}  // namespace mfsdp

// Like TORCH_MODULE(Name), for a NameImpl you shard: the holder's call operator, `block(x)`, runs
// forward through the runtime (mfsdp::call) instead of calling it directly.
#define MFSDP_MODULE(Name)                                                       \
  class Name : public ::torch::nn::ModuleHolder<Name##Impl> {                    \
   public:                                                                       \
    using ::torch::nn::ModuleHolder<Name##Impl>::ModuleHolder;                   \
    using Impl = Name##Impl;                                                     \
    template <class... Args>                                                     \
    auto operator()(Args&&... args) {                                            \
      return ::mfsdp::call(*get(), std::forward<Args>(args)...);                 \
    }                                                                            \
  }
