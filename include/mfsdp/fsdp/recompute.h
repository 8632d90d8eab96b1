// Full activation recompute (Megatron's --recompute-granularity full): run a piece of the
// forward without keeping its activations, and run it again in backward to get them.
//
// Works with fully_shard units called inside `fn`: the recomputing forward unshards the unit and
// leaves it unsharded for its backward, so a unit costs the same all-gathers as without
// recompute (one in forward, one in backward). The RNG state is not replayed: `fn` must be
// deterministic (no dropout), as in Llama pretraining.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace mfsdp {

using RecomputeFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Returns fn(inputs); in backward, fn is called again on the saved inputs with grad enabled.
std::vector<at::Tensor> recompute(const RecomputeFn& fn, const std::vector<at::Tensor>& inputs);

namespace detail {
// True while recompute() is re-running a forward inside backward (on this thread).
bool in_recompute();
// True while recompute() runs `fn` the first time, in a training forward (grad off inside).
bool in_recompute_first_forward();
}  // namespace detail

}  // namespace mfsdp
