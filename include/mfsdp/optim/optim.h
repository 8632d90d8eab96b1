// Distributed optimizer over flat main-weight shards (docs/optimizer.md).
//
// The optimizer never sees modules: it sees flat shards, each a contiguous 1-D main-weight
// tensor (fp32 by default) with its main-grad tensor of the same length, cut into segments that
// carry their hyperparameter class (weight decay on or off). AdamW and SGD run a few large
// vectorised ops per shard, not a loop over parameters. Gradient clipping uses the global norm:
// the sum of squares over local shards, all-reduced over the data-parallel communicator unless
// the shard is replicated on every rank (no_shard), where the local sum already is the global one.
// Implemented in src/optim/: distributed_optimizer.cpp, adamw.cpp, sgd.cpp, grad_clip.cpp, lr_schedule.cpp;
// Muon is mfsdp/optim/muon.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"

namespace mfsdp {

// Elements [offset, offset + length) of one shard.
struct ElementRange {
  int64_t offset = 0;
  int64_t length = 0;
};

// A run of elements of a flat shard that share hyperparameters.
struct ShardSegment {
  int64_t offset = 0;         // element offset in the shard
  int64_t length = 0;         // elements
  bool weight_decay = true;   // false for biases, norm weights and other 1-D parameters
};

// Which parameter a run of a shard's elements belongs to. FsdpHandle::optimizer_shards() fills
// these; AdamW and SGD ignore them; Muon (mfsdp/optim/muon.h) needs them to put each weight
// matrix together from its pieces on every rank.
struct ShardParam {
  std::string name;             // FQN, the same on every rank that holds a piece of it
  std::vector<int64_t> shape;   // the whole parameter's shape (under tensor parallelism: this
                                // rank's slice, as the module holds it)
  int64_t shard_offset = 0;     // first element of the piece in this shard
  int64_t param_offset = 0;     // where the piece starts in the flattened parameter
  int64_t length = 0;           // elements of the piece (> 0)
};

// One flat shard the optimizer updates in place.
struct OptimizerShard {
  at::Tensor main_weight;              // [n], updated in place
  at::Tensor main_grad;                // [n], same dtype and length; read by step(), scaled in
                                       // place by clip_grad_norm()
  std::vector<ShardSegment> segments;  // cover the elements that belong to parameters; padding
                                       // elements outside every segment are never updated
  bool replicated = false;             // true when the shard is not sharded (no_shard)
  // Ranks holding this same replicated shard: the optimizer's whole communicator, or only a
  // sub-group of it (no_shard experts, replicated over their expert-data-parallel group while
  // other ranks hold other experts). 0: every rank of the optimizer's communicator.
  int copies = 0;
  // The parameter pieces this shard holds, ascending by shard_offset (empty: not known; only
  // Muon needs them).
  std::vector<ShardParam> params;
};

// The learning rate is not an option: step(lr) takes it (a schedule decides it per step).
struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  // decoupled (AdamW), applied to segments with weight_decay=true
  // false: op for op as torch::optim::AdamW, so a sharded run reproduces single-process LibTorch
  // training bit for bit. true: at::_fused_adamw_, the kernel of torch.optim.AdamW(fused=True)
  // (one pass over weights, gradients and moments instead of nine): the same update up to the
  // rounding of its fused arithmetic, which can differ by an ulp where a shard boundary moves.
  bool fused = false;
  // Megatron's precision-aware optimizer (--use-precision-aware-optimizer, --exp-avg-dtype,
  // --exp-avg-sq-dtype): the first and second moments stored in this dtype (at::kBFloat16) and
  // computed in the main weights' dtype a shard at a time (upcast, the same update, rounded back
  // to nearest), as Transformer Engine's FusedAdam stores them; 2 + 2 bytes a parameter instead
  // of 4 + 4. Unset: the main weights' dtype. fp16 and fp8 (which TE stores scaled) are refused.
  std::optional<at::ScalarType> exp_avg_dtype, exp_avg_sq_dtype;
};

struct SGDOptions {
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;  // L2 added to the gradient, as torch::optim::SGD
};

// Megatron's learning-rate schedule: linear warmup from 0 over `warmup_steps`, then `style`
// ("constant", "linear" or "cosine") from `max_lr` to `min_lr` at `decay_steps`, flat after.
struct LRSchedule {
  double max_lr = 1e-3;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t decay_steps = 0;  // 0: no decay
  std::string style = "constant";
  // The learning rate of step `step` (1-based: the first optimizer step is step 1).
  double lr_at(int64_t step) const;
};

class DistributedOptimizer {
 public:
  virtual ~DistributedOptimizer() = default;

  // Clips gradients to `max_norm` by global L2 norm (no-op when max_norm <= 0) and returns the
  // global norm before clipping: a 1-element fp64 tensor on the optimizer's device, not read, so
  // the host queues the optimizer step without waiting for the device (as torch's
  // clip_grad_norm_ and TorchTitan do; the trainer reads the norm at log steps). The clip factor
  // is computed on the device as on the host before (max_norm / (norm + 1e-6), applied when
  // below 1); a non-finite norm leaves the gradients unscaled. Collective over the communicator
  // (and the model-parallel group).
  virtual at::Tensor clip_grad_norm_on_device(double max_norm) = 0;
  // The same, the norm read on the host.
  double clip_grad_norm(double max_norm) { return clip_grad_norm_on_device(max_norm).item<double>(); }

  // Model parallelism: the shards hold this rank's part of the model (tensor-parallel slices, a
  // pipeline stage's layers), so the global norm also sums over each of `groups` in turn
  // (Megatron's model-parallel group: the tensor-parallel ranks, then the pipeline stages).
  // `not_counted[i]` lists the element ranges of shard i that another rank of those groups
  // counts instead: parameters every tensor-parallel rank holds whole (counted on its rank 0), the
  // last stage's copy of a tied embedding (counted on the first stage). Call once, before the
  // first clip_grad_norm.
  virtual void set_model_parallel(std::vector<std::shared_ptr<Communicator>> groups,
                                  std::vector<std::vector<ElementRange>> not_counted) = 0;

  // One update of every shard with learning rate `lr`; then runs the after-step callback
  // (the runtime's main-to-model weight copy).
  virtual void step(double lr) = 0;

  // Steps taken so far.
  virtual int64_t steps() const = 0;
  // Sets the step counter, when loading a checkpoint (the state tensors are loaded in place).
  virtual void set_steps(int64_t steps) = 0;
  // "AdamW" or "SGD": what the state tensors mean, recorded in checkpoints.
  virtual std::string name() const = 0;

  // Optimizer state tensors by name ("exp_avg", "exp_avg_sq", "momentum_buffer"), one flat tensor
  // per shard in shard order, for checkpoints and memory accounting.
  virtual std::vector<std::pair<std::string, std::vector<at::Tensor>>> state() const = 0;
};

// Over flat shards of your own; `after_step` runs at the end of every step. For a sharded model
// use make_adamw(root, options) / make_sgd(root, options) (mfsdp/fsdp/fully_shard.h).
std::unique_ptr<DistributedOptimizer> make_adamw(std::vector<OptimizerShard> shards,
                                                 std::shared_ptr<Communicator> comm,
                                                 const AdamWOptions& options,
                                                 std::function<void()> after_step = {});
std::unique_ptr<DistributedOptimizer> make_sgd(std::vector<OptimizerShard> shards,
                                               std::shared_ptr<Communicator> comm,
                                               const SGDOptions& options,
                                               std::function<void()> after_step = {});

}  // namespace mfsdp
