#include "mfsdp/fsdp/recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <stdexcept>

namespace mfsdp {
namespace detail {
namespace {
thread_local int recompute_depth = 0;
thread_local int first_forward_depth = 0;

struct FnHolder : torch::CustomClassHolder {
  explicit FnHolder(RecomputeFn f) : fn(std::move(f)) {}
  RecomputeFn fn;
};

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                c10::intrusive_ptr<FnHolder> holder) {
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    at::NoGradGuard no_grad;  // activations inside fn are not kept
    ++first_forward_depth;
    try {
      auto outputs = holder->fn(inputs.vec());
      --first_forward_depth;
      return outputs;
    } catch (...) {
      --first_forward_depth;
      throw;
    }
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto holder =
        c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    std::vector<at::Tensor> inputs;
    for (const auto& saved : ctx->get_saved_variables())
      inputs.push_back(saved.detach().requires_grad_(saved.requires_grad()));
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode enable(true);
      ++recompute_depth;
      try {
        outputs = holder->fn(inputs);
      } catch (...) {
        --recompute_depth;
        throw;
      }
      --recompute_depth;
    }
    std::vector<at::Tensor> with_grad_out, with_grad_in;
    for (size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i].requires_grad() && grads[i].defined()) {
        with_grad_out.push_back(outputs[i]);
        with_grad_in.push_back(grads[i]);
      }
    if (!with_grad_out.empty()) torch::autograd::backward(with_grad_out, with_grad_in);
    torch::autograd::variable_list result;
    for (auto& in : inputs) result.push_back(in.requires_grad() ? in.grad() : at::Tensor());
    result.emplace_back();  // the function holder
    return result;
  }
};

}  // namespace

bool in_recompute() { return recompute_depth > 0; }
bool in_recompute_first_forward() { return first_forward_depth > 0; }

}  // namespace detail

RecomputeOptions RecomputeOptions::selective(const std::vector<std::string>& modules) {
  RecomputeOptions o;
  o.granularity = Granularity::kSelective;
  for (const std::string& m : modules) {
    bool* field = m == "core_attn"        ? &o.core_attn
                  : m == "layernorm"      ? &o.layernorm
                  : m == "mlp"            ? &o.mlp
                  : m == "moe"            ? &o.moe
                  : m == "moe_act"        ? &o.moe_act
                  : m == "mla_up_proj"    ? &o.mla_up_proj
                  : m == "shared_experts" ? &o.shared_experts
                                          : nullptr;
    if (field == nullptr)
      throw std::invalid_argument("recompute module '" + m +
                                  "' is not one of: core_attn, layernorm, mlp, moe, moe_act, mla_up_proj, "
                                  "shared_experts");
    *field = true;
  }
  return o;
}

std::vector<at::Tensor> recompute(const RecomputeFn& fn, const std::vector<at::Tensor>& inputs) {
  if (!at::GradMode::is_enabled()) return fn(inputs);
  return detail::RecomputeFunction::apply(at::TensorList(inputs),
                                          c10::make_intrusive<detail::FnHolder>(fn));
}

}  // namespace mfsdp
