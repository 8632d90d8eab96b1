// The building blocks: linear projection (a bias only for Qwen2's q/k/v), token embedding,
// RMSNorm, the MLP (SwiGLU, or Megatron's GeLU MLP without --swiglu).
#include <ATen/ATen.h>

#include "mfsdp/models/llama.h"
#include "models/param_init.h"

namespace mfsdp {

LlamaLinearImpl::LlamaLinearImpl(int64_t in_features, int64_t out_features, bool deferred, bool with_bias) {
  // Registered weight first, then bias: the order of transformers' nn.Linear state dict.
  weight = register_parameter("weight",
                              detail::new_parameter_tensor({out_features, in_features}, deferred));
  if (with_bias) bias = register_parameter("bias", detail::new_parameter_tensor({out_features}, deferred));
}

at::Tensor LlamaLinearImpl::forward(const at::Tensor& x) {
  return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
}

LlamaEmbeddingImpl::LlamaEmbeddingImpl(int64_t num_embeddings, int64_t dim, bool deferred) {
  weight = register_parameter("weight", detail::new_parameter_tensor({num_embeddings, dim}, deferred));
}

at::Tensor LlamaEmbeddingImpl::forward(const at::Tensor& ids) { return at::embedding(weight, ids); }

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t dim, double eps_in, bool deferred) : eps(eps_in) {
  weight = register_parameter("weight", detail::new_parameter_tensor({dim}, deferred));
}

at::Tensor LlamaRMSNormImpl::forward(const at::Tensor& x) {
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(x.scalar_type());
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c, bool deferred) {
  if (c.swiglu) gate_proj = register_module("gate_proj", LlamaLinear(c.hidden_size, c.intermediate_size, deferred));
  up_proj = register_module("up_proj", LlamaLinear(c.hidden_size, c.intermediate_size, deferred));
  down_proj = register_module("down_proj", LlamaLinear(c.intermediate_size, c.hidden_size, deferred));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  if (!gate_proj) return down_proj(at::gelu(up_proj(x)));  // Megatron's default F.gelu: the erf form
  return down_proj(at::silu(gate_proj(x)) * up_proj(x));
}

}  // namespace mfsdp
