// The MoE block (include/mfsdp/models/moe.h): route, sort the (token, expert) pairs by expert,
// run each expert over its contiguous tokens (or all of them as one grouped GEMM), weight and
// scatter back; the shared expert beside; the balancing losses into the gradient.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>

#include "mfsdp/models/moe.h"

namespace mfsdp {
namespace {

// Megatron's MoEAuxLossAutoScaler: the output passes unchanged, and its backward gives the
// attached loss the gradient `scale`, so the loss trains the router without the trainer seeing
// it, and within this block's backward (inside its FSDP unit's gradient window).
struct AttachLoss : public torch::autograd::Function<AttachLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& output, const at::Tensor& loss,
                            double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["loss_dtype"] = static_cast<int64_t>(loss.scalar_type());
    return output.view_as(output);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["loss_dtype"].toInt());
    return {grad[0], at::full({}, scale, grad[0].options().dtype(dtype)), at::Tensor()};
  }
};

}  // namespace

ExpertMlpImpl::ExpertMlpImpl(int64_t hidden, int64_t intermediate, bool mixtral_names, bool deferred) {
  // Registered in Hugging Face's order of the three (gate, up, down).
  gate = register_module(mixtral_names ? "w1" : "gate_proj", LlamaLinear(hidden, intermediate, deferred));
  up = register_module(mixtral_names ? "w3" : "up_proj", LlamaLinear(hidden, intermediate, deferred));
  down = register_module(mixtral_names ? "w2" : "down_proj", LlamaLinear(intermediate, hidden, deferred));
}

at::Tensor ExpertMlpImpl::forward(const at::Tensor& x) { return down(at::silu(gate(x)) * up(x)); }

MoeBlockImpl::MoeBlockImpl(int64_t hidden, const MoeConfig& config, bool deferred) : config_(config) {
  gate = register_module("gate", LlamaLinear(hidden, config.num_experts, deferred));
  experts = register_module("experts", torch::nn::ModuleList());
  for (int64_t j = 0; j < config.num_experts; ++j)
    experts->push_back(ExpertMlp(hidden, config.ffn_hidden_size, config.mixtral_names, deferred));
  if (config.shared_expert_intermediate_size > 0) {
    shared_expert = register_module(
        "shared_expert", ExpertMlp(hidden, config.shared_expert_intermediate_size, /*mixtral_names=*/false, deferred));
    if (config.shared_expert_gate) shared_expert_gate = register_module("shared_expert_gate", LlamaLinear(hidden, 1, deferred));
  }
}

at::Tensor MoeBlockImpl::run_experts(const at::Tensor& tokens, const Routing& r) {
  const int64_t experts_n = config_.num_experts;
  // (expert, token) of every routed pair, sorted by expert, then token.
  at::Tensor pairs = r.map.t().nonzero();
  at::Tensor expert_of = pairs.select(1, 0), token_of = pairs.select(1, 1);
  at::Tensor counts = at::bincount(expert_of, {}, experts_n);
  at::Tensor sorted = tokens.index_select(0, token_of);
  at::Tensor weight = r.probs.index({token_of, expert_of}).to(tokens.scalar_type()).unsqueeze(-1);
  at::Tensor out;
  if (training_options.grouped_gemm) {
    // One GEMM over every expert's rows: the weights stacked [E, H, I] per call.
    std::vector<at::Tensor> g, u, d;
    for (int64_t j = 0; j < experts_n; ++j) {
      auto& e = *experts->ptr<ExpertMlpImpl>(j);
      g.push_back(e.gate->weight.t());
      u.push_back(e.up->weight.t());
      d.push_back(e.down->weight.t());
    }
    at::Tensor offsets = counts.cumsum(0).to(at::kInt);
    at::Tensor h = at::silu(at::_grouped_mm(sorted, at::stack(g), offsets)) * at::_grouped_mm(sorted, at::stack(u), offsets);
    out = at::_grouped_mm(h, at::stack(d), offsets);
  } else {
    // One GEMM per expert (Megatron's SequentialMLP). An expert without tokens still runs on its
    // empty slice, so every expert has a gradient (zero) each step.
    at::Tensor host_counts = counts.to(at::kCPU);
    std::vector<at::Tensor> parts;
    int64_t start = 0;
    for (int64_t j = 0; j < experts_n; ++j) {
      const int64_t n = host_counts[j].item<int64_t>();
      parts.push_back(experts->ptr<ExpertMlpImpl>(j)->forward(sorted.narrow(0, start, n)));
      start += n;
    }
    out = at::cat(parts);
  }
  tally_.counts = tally_.counts.defined() ? tally_.counts + counts : counts;
  return at::zeros_like(tokens).index_add(0, token_of, out * weight);
}

at::Tensor MoeBlockImpl::forward(const at::Tensor& x) {
  const int64_t hidden = x.size(-1);
  at::Tensor tokens = x.reshape({-1, hidden});
  Routing r = route(gate(tokens), config_, training_options.capacity_factor);
  at::Tensor y = run_experts(tokens, r);
  if (shared_expert) {
    at::Tensor s = shared_expert(tokens);
    if (shared_expert_gate) s = at::sigmoid(shared_expert_gate(tokens)) * s;
    y = y + s;
  }
  y = y.view(x.sizes());
  // The balancing losses, for the log always, for the gradient when their coefficient is set.
  at::Tensor balance;
  if (training_options.balancing == MoeTraining::Balancing::kAuxLoss) {
    balance = load_balancing_loss(r, config_.top_k);
  } else if (training_options.balancing == MoeTraining::Balancing::kSeqAuxLoss) {
    balance = sequence_load_balancing_loss(r, config_.top_k, x.dim() == 3 ? x.size(0) : 1);
  }
  at::Tensor z = z_loss(r.logits);
  {
    // Kept on the device until take_stats: no host synchronisation per forward.
    at::NoGradGuard no_grad;
    if (balance.defined())
      tally_.balance = tally_.balance.defined() ? tally_.balance + balance.detach() : balance.detach().clone();
    tally_.z = tally_.z.defined() ? tally_.z + z.detach() : z.detach().clone();
    ++tally_.forwards;
  }
  if (at::GradMode::is_enabled() && is_training()) {
    at::Tensor loss;
    if (balance.defined() && training_options.aux_loss_coeff > 0) loss = balance * training_options.aux_loss_coeff;
    if (training_options.z_loss_coeff > 0) {
      at::Tensor zl = z * training_options.z_loss_coeff;
      loss = loss.defined() ? loss + zl : zl;
    }
    if (loss.defined()) y = AttachLoss::apply(y, loss, aux_loss_scale);
  }
  return y;
}

RouterStats MoeBlockImpl::take_stats() {
  RouterStats s;
  s.forwards = tally_.forwards;
  if (tally_.balance.defined()) s.load_balancing_loss = tally_.balance.item<double>();
  if (tally_.z.defined()) s.z_loss = tally_.z.item<double>();
  if (tally_.counts.defined()) {
    at::Tensor c = tally_.counts.to(at::kCPU, at::kLong).contiguous();
    s.tokens_per_expert.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  }
  tally_ = Tally{};
  return s;
}

}  // namespace mfsdp
