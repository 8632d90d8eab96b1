#include "mfsdp/train/rollout_model.h"

#include <torch/torch.h>

#include <set>
#include <stdexcept>

namespace mfsdp {

RolloutModel::RolloutModel(const ModelConfig& config, const c10::Device& device, bool use_sdpa, MoeTraining moe)
    : config_(config), device_(device), use_sdpa_(use_sdpa), moe_(moe) {}

void RolloutModel::build_once() {
  if (model_) return;
  // Built once (its initial values are overwritten by each load); released storage is given
  // back by set_data, which keeps each parameter's TensorImpl.
  ModelBuildOptions options;
  options.moe = moe_;
  model_ = config_.spec->build(config_, options);
  model_->set_use_sdpa(use_sdpa_);
}

namespace {

// Fresh storage (a released or deferred tensor has none) in the tensor's own TensorImpl.
void put(at::Tensor& target, const at::Tensor& value, const c10::Device& device) {
  target.set_data(value.to(device, at::kFloat, /*non_blocking=*/false, /*copy=*/true));
}

}  // namespace

void RolloutModel::load_from(const FsdpHandle& root) {
  build_once();
  torch::NoGradGuard no_grad;
  loaded_ = false;
  std::map<std::string, at::Tensor> targets;
  for (auto& [name, t] : model_tensors(*model_)) targets.emplace(name, t);
  std::set<std::string> missing;
  for (const auto& item : targets) missing.insert(item.first);
  // Each full tensor is copied in while its group is the only one gathered (device to device),
  // so the device never holds a second full copy of the policy beside this one.
  root.for_each_full_tensor(
      [&](const std::string& name, const at::Tensor& full) {
        const auto it = targets.find(name);
        if (it == targets.end()) return;  // as the map form: the policy may hold more
        put(it->second, full, device_);
        missing.erase(name);
      },
      /*all_ranks=*/true);
  if (!missing.empty()) throw std::logic_error("rollout model: the policy has no tensor " + *missing.begin());
  model_->eval();
  loaded_ = true;
}

void RolloutModel::load_from(const std::map<std::string, at::Tensor>& state) {
  build_once();
  torch::NoGradGuard no_grad;
  loaded_ = false;
  for (auto& [name, p] : model_tensors(*model_)) {
    const auto it = state.find(name);
    if (it == state.end()) throw std::logic_error("rollout model: the policy has no tensor " + name);
    put(p, it->second, device_);
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
