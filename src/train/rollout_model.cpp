#include "train/rollout_model.h"

#include <torch/torch.h>

#include <stdexcept>

namespace mfsdp {

RolloutModel::RolloutModel(const ModelConfig& config, const c10::Device& device, bool use_sdpa, MoeTraining moe)
    : config_(config), device_(device), use_sdpa_(use_sdpa), moe_(moe) {}

void RolloutModel::load_from(const FsdpHandle& root) { load_from(root.full_state_dict(/*all_ranks=*/true)); }

void RolloutModel::load_from(const std::map<std::string, at::Tensor>& state) {
  if (!model_) {
    // Built once (its initial values are overwritten below); released storage is given back
    // by set_data, which keeps each parameter's TensorImpl.
    ModelBuildOptions options;
    options.moe = moe_;
    model_ = config_.spec->build(config_, options);
    model_->set_use_sdpa(use_sdpa_);
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model_tensors(*model_)) {
    const auto it = state.find(name);
    if (it == state.end()) throw std::logic_error("rollout model: the policy has no tensor " + name);
    // Fresh storage (a released or deferred parameter has none) in the parameter's own TensorImpl.
    p.set_data(it->second.to(device_, at::kFloat, /*non_blocking=*/false, /*copy=*/true));
  }
  model_->eval();
  loaded_ = true;
}

void RolloutModel::release() {
  if (!model_) return;
  torch::NoGradGuard no_grad;
  for (auto& item : model_->named_parameters())
    item.value().set_data(at::empty({0}, item.value().options()));
  loaded_ = false;
}

CausalLM& RolloutModel::model() {
  if (!loaded_) throw std::logic_error("rollout model: used before load_from");
  return *model_;
}

}  // namespace mfsdp
