// The policy's full weights in a plain (unsharded) model on this rank's device, for generation:
// GRPO's rollout and the trainers' greedy evaluation. load_from(root) streams every tensor from
// the shards (FsdpHandle::for_each_full_tensor on every rank, a collective), one parameter group
// gathered at a time and copied in on the device, so no second full copy of the policy is ever
// on the device; release() frees the copy until the next load (verl's "update_weights" and the
// offload after it).
#pragma once

#include <c10/core/Device.h>

#include <map>
#include <memory>

#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/model_spec.h"

namespace mfsdp {

class RolloutModel {
 public:
  // `moe`: an MoE model routes as in training (the capacity factor drops tokens here too).
  RolloutModel(const ModelConfig& config, const c10::Device& device, bool use_sdpa = true, MoeTraining moe = {});
  // Collective over the ranks of `root`. Needs the whole model under `root`: not under tensor or
  // expert parallelism, where the map form below takes TrainingRun::gather_full_weights.
  void load_from(const FsdpHandle& root);
  // From full weights by name on any device (TrainingRun::gather_full_weights, which also joins
  // the tensor-parallel slices and collects the experts of the other expert-parallel ranks).
  void load_from(const std::map<std::string, at::Tensor>& state);
  void release();
  bool loaded() const { return loaded_; }
  // Throws std::logic_error when not loaded.
  CausalLM& model();

 private:
  void build_once();

  ModelConfig config_;
  c10::Device device_;
  bool use_sdpa_;
  MoeTraining moe_;
  std::shared_ptr<CausalLM> model_;
  bool loaded_ = false;
};

}  // namespace mfsdp
