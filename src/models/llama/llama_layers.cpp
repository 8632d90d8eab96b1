// The building blocks: linear projection (a bias only for Qwen2's q/k/v), token embedding,
// RMSNorm, the MLP (SwiGLU, or Megatron's GeLU MLP without --swiglu); the embedding and the MLP
// tensor-parallel through the boundary a plan gives them (parallel_plan.h).
#include <ATen/ATen.h>

#include "mfsdp/comm/comm.h"
#include "mfsdp/models/llama.h"
#include "models/param_init.h"

namespace mfsdp {

int LlamaParallel::tp_size() const { return tensor ? tensor->size() : 1; }
int LlamaParallel::tp_rank() const { return tensor ? tensor->rank() : 0; }

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

at::Tensor LlamaEmbeddingImpl::forward(const at::Tensor& ids) {
  // The caller (the output layer's boundary) has entered the tensor-parallel region already.
  if (as_output) return at::linear(ids, weight);
  return parallel_boundary.embed(ids, weight);
}

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t dim, double eps_in, bool deferred) : eps(eps_in) {
  weight = register_parameter("weight", detail::new_parameter_tensor({dim}, deferred));
}

at::Tensor LlamaRMSNormImpl::forward(const at::Tensor& x) {
  // ATen's RMSNorm: on CUDA one fused kernel each way (_fused_rms_norm, keeping only the input
  // and a statistic per row for backward), elsewhere the composition transformers writes, in
  // fp32. It rounds once, after the weight, as Transformer Engine's fused norm does; transformers
  // rounds the normalised row to the input's dtype and again after the weight, so the two agree
  // in fp32 and differ by a rounding in bf16 (tests/unit/fused_ops_test.cpp).
  if (weight.scalar_type() == x.scalar_type()) return at::rms_norm(x, {weight.size(0)}, weight, eps);
  // Mixed dtypes: transformers' promotion (ATen's would return the input's dtype).
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c, bool deferred) {
  const int64_t intermediate = c.intermediate_size;
  if (c.swiglu) gate_proj = register_module("gate_proj", LlamaLinear(c.hidden_size, intermediate, deferred));
  up_proj = register_module("up_proj", LlamaLinear(c.hidden_size, intermediate, deferred));
  down_proj = register_module("down_proj", LlamaLinear(intermediate, c.hidden_size, deferred));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  // gate and up read one input: the region is entered once (one all-reduce of its gradient).
  const at::Tensor in = parallel_boundary.enter(x);
  return parallel_boundary.leave(gate_proj ? down_proj(at::silu(gate_proj(in)) * up_proj(in))
                                           : down_proj(at::gelu(up_proj(in))));  // Megatron's default F.gelu: the erf form
}

}  // namespace mfsdp
