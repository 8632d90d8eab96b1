// Training a tensor-parallel CausalLM (ModelBuildOptions::tensor_parallel) under fully_shard:
// what a step adds after the backward, what the optimizer must know for the gradient norm, and
// whole parameters from the ranks' slices (for checking, export and checkpoints).
//
// TP-then-FSDP, Megatron-FSDP's order: each tensor-parallel rank's slices are sharded over its
// own data-parallel group. The ranks of one tensor-parallel group hold parameters of the same
// shapes, so their FSDP layouts, and so their optimizer shards, match element for element:
// the gradient sum below works on the flat main-gradient shards directly.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "mfsdp/models/causal_lm.h"
#include "mfsdp/optim/optim.h"

namespace mfsdp {

// True for a parameter every rank of the tensor-parallel group holds the same (not split, not a
// routed expert): counted once over the group (on its rank 0) by norms and checkpoints.
bool tensor_parallel_duplicate(const CausalLM& model, const std::string& name);

// Sums over the tensor-parallel group the main gradients of the parameters the model marks
// partial (CausalLM::tensor_parallel_partial_grad): after the step's last backward, before
// clipping, as Megatron's finalize_model_grads does. One all-reduce; nothing without tensor
// parallelism. Collective over the group.
void sum_partial_gradients(const CausalLM& model, const FsdpHandle& root);

// Gives `optimizer` the model-parallel groups (the tensor-parallel group, then `pipeline`, the
// pipeline stages; null: none) and the elements of its shards another rank of them counts
// (DistributedOptimizer::set_model_parallel): on tensor-parallel ranks but 0 the replicated
// parameters, on the last pipeline stage its copy of a tied embedding (CausalLM::embedding_copy).
// So the gradient norm counts every element of the model once. Nothing without either.
void set_model_parallel_norm(const CausalLM& model, const FsdpHandle& root, DistributedOptimizer& optimizer,
                             std::shared_ptr<Communicator> pipeline = nullptr);

// Whole parameters from every rank's whole slices `local` (its root's full_state_dict), each
// split one all-gathered over the group along its dim (tensor_parallel_split); replicated ones as
// they are. Collective over the group: every rank passes its map with the same names and gets
// the whole parameters.
std::map<std::string, at::Tensor> gather_tensor_parallel(const CausalLM& model,
                                                         std::map<std::string, at::Tensor> local);

// This rank's slices of whole parameters `full` (to load with load_full_state_dict). Throws
// std::invalid_argument naming the parameter when a split dim does not divide.
std::map<std::string, at::Tensor> tensor_parallel_slices(const CausalLM& model,
                                                         std::map<std::string, at::Tensor> full);

}  // namespace mfsdp
