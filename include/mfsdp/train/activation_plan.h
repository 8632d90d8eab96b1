// The activations a training forward keeps for its backward, per rank, as --memory-plan prints
// them beside FSDP's buffers: what activation recompute (--recompute-granularity and friends)
// and the fused loss (--cross-entropy-loss-fusion) change.
//
// Per token, a dense decoder layer of this repository's Llama keeps (elements, measured with a
// counting CPU allocator and fitted over shapes: tests/dist/activation_plan_test.cpp checks the
// formula against what runs), with H hidden, A = heads x head_dim, K = kv heads x head_dim, F the
// MLP width and n the heads:
//   always            4H + 2A + 2K   (layer input, q/k/v projections' inputs and outputs, RoPE, o_proj's input)
//   core attention    n              (the softmax's log-sum-exp; SDPA matches grouped kv heads
//                                      itself on the trainer's causal path, so no expanded copy)
//   the two norms     2H + 2         (each normalised row and its reciprocal RMS)
//   the MLP           4F             (gate, up, silu(gate), their product)
// Selective recompute drops the pieces it recomputes; full recompute keeps a checkpoint's input
// (H) and holds one checkpoint's whole activations again while its backward runs.
#pragma once

#include <cstdint>
#include <ostream>

#include "mfsdp/fsdp/recompute.h"

namespace mfsdp {

struct PretrainArgs;
struct ParallelDims;

// One dense decoder layer's widths on this rank (under tensor parallelism: its heads and MLP
// columns; `hidden_split`: the ranks a hidden-sized activation is split over, sequence
// parallelism's tensor-parallel size, else 1).
struct LayerActivationShape {
  int64_t hidden = 0, ffn = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t hidden_split = 1;
};

// Elements per token one layer keeps after its forward: no recompute, or selective `recompute`
// (its core_attn, layernorm and mlp). Full recompute is plan_activations'.
double layer_activation_elements(const LayerActivationShape& shape, const RecomputeOptions& recompute);

struct ActivationPlan {
  int64_t kept_bytes = 0;       // every layer's, after the micro-batch's forward
  int64_t recompute_bytes = 0;  // held again while the backward of one full-recompute checkpoint runs
};

// `layers` decoder layers of `shape`, `tokens` per micro-batch on this rank, `element_bytes` per
// activation element (4 fp32, 2 bf16: the norms' fp32 statistics are then undercounted).
ActivationPlan plan_activations(const LayerActivationShape& shape, int64_t layers, int64_t tokens,
                                int64_t element_bytes, const RecomputeOptions& recompute);

// --memory-plan's activation lines for the flags (dense models without pipeline parallelism:
// other layouts are named as not planned).
void print_activation_plan(const PretrainArgs& args, const ParallelDims& dims, const RecomputeOptions& recompute,
                           std::ostream& log);

}  // namespace mfsdp
