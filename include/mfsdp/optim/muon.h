// Muon over flat FSDP shards (docs/optimizer.md, "Muon"): Newton-Schulz orthogonalised momentum
// for the 2-D weight matrices, AdamW for every other parameter. Implemented in src/optim/muon.cpp.
//
// Semantics are torch.optim.Muon's (torch 2.15, torch/optim/_muon.py) per matrix:
//   buf = momentum * buf + (1 - momentum) * g            (buf.lerp_(g, 1 - momentum))
//   u   = nesterov ? (1 - momentum) * g + momentum * buf : buf
//   O   = NewtonSchulz(u)                                (in ns_dtype, on the whole matrix)
//   p  *= 1 - lr * weight_decay;  p -= lr * scale(rows, cols) * extra_scale_factor * O
// with Megatron-LM's options beside torch's (--muon-scale-mode, --muon-extra-scale-factor,
// --muon-coefficient-type, --muon-tp-mode). Megatron's decay is p -= lr*wd*p, the same update.
//
// Distributed: the momentum is updated where the elements are; each matrix is put together on
// one owner rank of the optimizer's communicator (owners round-robin over the matrices), which
// orthogonalises it and sends each rank back its elements: two all_to_all_single per step for
// all matrices together. Replicated shards (no_shard) are orthogonalised where they are.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mfsdp/optim/optim.h"

namespace mfsdp {

struct MuonOptions {
  // torch.optim.Muon's default 0.95; Megatron's --muon-momentum default 0.9.
  double momentum = 0.95;
  // torch's default true; Megatron's --muon-nesterov is off unless given.
  bool nesterov = true;
  // Newton-Schulz iterations: 5 for both (torch ns_steps, Megatron --muon-num-ns-steps).
  int ns_steps = 5;
  // Coefficients per iteration, by Megatron's --muon-coefficient-type names:
  //  "simple": (3.4445, -4.7750, 2.0315) every step, torch.optim.Muon's only set (our default);
  //  "quintic" (Megatron's default), "polar_express", "aol": Megatron's per-step tables
  //  (emerging_optimizers muon_utils), with its rules for ns_steps (a multiple of the table's
  //  length; polar_express at least 8 steps, the last set repeated).
  std::string coefficient_type = "simple";
  // Floor of the Frobenius norm the matrix is divided by first: 1e-7 for both.
  double eps = 1e-7;
  // Decoupled, p *= 1 - lr * weight_decay, on every Muon matrix. torch's default 0.1; Megatron
  // uses --weight-decay (default 0.01).
  double weight_decay = 0.1;
  // The update's scale by the matrix's shape [rows, cols] (under tensor parallelism the whole
  // matrix's, except in tp_mode "blockwise"). torch's adjust_lr_fn names and Megatron's
  // --muon-scale-mode names:
  //  "original" = "shape_scaling": sqrt(max(1, rows / cols))   (torch's default)
  //  "match_rms_adamw":            0.2 * sqrt(max(rows, cols))  (torch; = Megatron "spectral"
  //                                                              with extra_scale_factor 0.2)
  //  "spectral":                   sqrt(max(rows, cols))        (Megatron's default)
  //  "spectral_unclamped" = "unit_rms_norm": sqrt(rows / cols)
  // Anything else: std::invalid_argument naming it.
  std::string scale_mode = "original";
  // Megatron's --muon-extra-scale-factor: multiplies the scale above (default 1).
  double extra_scale_factor = 1.0;
  // Precision of the Newton-Schulz iteration: at::kBFloat16 (torch always; Megatron's
  // --muon-fp32-matmul-prec medium, its default) or at::kFloat (Megatron's high/highest).
  at::ScalarType ns_dtype = at::kBFloat16;
  // Parameters whose name contains any of these go to AdamW although they are 2-D: the
  // embedding and the output layer (Muon's rule and Megatron's is_embedding_or_output_parameter).
  std::vector<std::string> exclude = {"embed_tokens", "lm_head"};
  // Every parameter that is not a Muon matrix (not 2-D, or excluded): AdamW with these options
  // and the step's lr (Megatron's --muon-scalar-optimizer adam). Its weight decay applies to the
  // decay segments as in make_adamw.
  AdamWOptions adamw;

  // Tensor parallelism. Null (or a group of one): the shards' matrices are whole matrices.
  // Otherwise the tensor-parallel group; the matrices named in tensor_parallel_split are this
  // rank's slices of a matrix cut along that dim (0: column-parallel, rows split; 1: row-parallel),
  // in TP-rank order and equal sizes; other matrices are whole on every TP rank.
  std::shared_ptr<Communicator> tensor_parallel;
  std::map<std::string, int> tensor_parallel_split;
  // Megatron's --muon-tp-mode: "duplicated" (default; the owner all-gathers the slices over the
  // TP group, orthogonalises the whole matrix, keeps its slice), "distributed" (Megatron splits the
  // iteration's matmuls over the group; the same function, computed here as "duplicated"), or
  // "blockwise" (each slice orthogonalised and scaled on its own; no TP traffic).
  std::string tp_mode = "duplicated";
};

// Muon over flat shards of your own: the shards must carry `params` (what FsdpHandle's
// optimizer_shards() gives). Collective over `comm` (the pieces' layout is exchanged once). The
// state is "momentum_buffer" (Muon matrices' elements), "exp_avg" and "exp_avg_sq" (AdamW's
// elements), one flat tensor per shard each, zero elsewhere; name() is "Muon". For a sharded
// model: make_muon(root.optimizer_shards(), root.optimizer_comm(), options,
// root.optimizer_step_hook()).
std::unique_ptr<DistributedOptimizer> make_muon(std::vector<OptimizerShard> shards,
                                                std::shared_ptr<Communicator> comm,
                                                const MuonOptions& options,
                                                std::function<void()> after_step = {});

// One Newton-Schulz orthogonalisation of a matrix [rows, cols] as MuonOptions configure it
// (transposed to the wide side, divided by its norm, the iterations in ns_dtype); the result is
// in ns_dtype. Exposed for tests and tools.
at::Tensor muon_orthogonalize(const at::Tensor& matrix, const MuonOptions& options);
// The scale of MuonOptions::scale_mode times extra_scale_factor for a [rows, cols] matrix.
double muon_update_scale(int64_t rows, int64_t cols, const MuonOptions& options);

}  // namespace mfsdp
