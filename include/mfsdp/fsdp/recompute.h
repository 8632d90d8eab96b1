// Full activation recompute (Megatron's --recompute-granularity full): run a piece of the
// forward without keeping its activations, and run it again in backward to get them.
//
// Works with fully_shard units called inside `fn`: the recomputing forward unshards the unit and
// leaves it unsharded for its backward, so a unit costs the same all-gathers as without
// recompute (one in forward, one in backward). The RNG state is not replayed: `fn` must be
// deterministic (no dropout), as in Llama pretraining.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mfsdp {

// Activation recompute as Megatron-LM's TransformerConfig defines it (recompute_granularity,
// recompute_method, recompute_num_layers, recompute_modules; docs/model.md "Recompute"):
//   none:      every activation is kept;
//   selective: in every layer, the pieces named by the modules are checkpointed (recompute());
//   full:      whole decoder layers are checkpointed: kUniform, the layers of each pipeline
//              chunk in consecutive groups of num_layers, each group one checkpoint (the last
//              group may be shorter); kBlock, the first num_layers layers of each chunk one by
//              one, the rest not at all (all of them when num_layers >= the chunk's layers).
// Applied only while a backward can follow (grad mode on, no KV cache).
struct RecomputeOptions {
  enum class Granularity { kNone, kSelective, kFull };
  enum class Method { kUniform, kBlock };
  Granularity granularity = Granularity::kNone;
  Method method = Method::kUniform;
  int64_t num_layers = 1;  // full only, >= 1
  // Selective only (Megatron's recompute_modules, whose default is core_attn alone):
  bool core_attn = false;       // softmax(q k^T) v after the q/k/v projections and RoPE
  bool layernorm = false;       // input_layernorm and post_attention_layernorm (pre-MLP norm)
  bool mlp = false;             // the dense MLP (not an MoE layer's block: Megatron's "mlp")
  bool moe = false;             // the whole MoE block
  bool moe_act = false;         // each expert's activation, silu(gate) * up
  bool mla_up_proj = false;     // MLA's query/key-value up projections and RoPE
  bool shared_experts = false;  // an MoE block's shared expert (with its gate)

  // Full recompute by `method` in groups (uniform) or of the first (block) `num_layers` layers.
  static RecomputeOptions full_layers(Method method, int64_t num_layers) {
    RecomputeOptions o;
    o.granularity = Granularity::kFull;
    o.method = method;
    o.num_layers = num_layers;
    return o;
  }
  // Full recompute of every layer, one checkpoint each (the former recompute_layers = true).
  static RecomputeOptions every_layer() { return full_layers(Method::kUniform, 1); }
  // Selective recompute of Megatron's module names; throws std::invalid_argument naming the first
  // name that is not one of the seven above.
  static RecomputeOptions selective(const std::vector<std::string>& modules);
  bool full() const { return granularity == Granularity::kFull; }
  bool is_selective() const { return granularity == Granularity::kSelective; }
};

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
