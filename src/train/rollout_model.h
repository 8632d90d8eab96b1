// The policy's full weights in a plain (unsharded) model on this rank's device, for generation:
// GRPO's rollout and the trainers' greedy evaluation. load_from() gathers every parameter from
// the shards (FsdpHandle::full_state_dict on every rank, a collective) and copies them in;
// release() frees the copy until the next load (verl's "update_weights" and the offload after it).
#pragma once

#include <c10/core/Device.h>

#include "mfsdp/fsdp/fully_shard.h"
#include <map>
#include <memory>

#include "mfsdp/models/model_spec.h"

namespace mfsdp {

class RolloutModel {
 public:
  // `moe`: an MoE model routes as in training (the capacity factor drops tokens here too).
  RolloutModel(const ModelConfig& config, const c10::Device& device, bool use_sdpa = true, MoeTraining moe = {});
  // Collective over the shard group of `root`.
  void load_from(const FsdpHandle& root);
  // From full weights by name (TrainingRun::gather_full_weights, which also collects the experts
  // of the other expert-parallel ranks).
  void load_from(const std::map<std::string, at::Tensor>& state);
  void release();
  bool loaded() const { return loaded_; }
  // Throws std::logic_error when not loaded.
  CausalLM& model();

 private:
  ModelConfig config_;
  c10::Device device_;
  bool use_sdpa_;
  MoeTraining moe_;
  std::shared_ptr<CausalLM> model_;
  bool loaded_ = false;
};

}  // namespace mfsdp
