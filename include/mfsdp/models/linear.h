// The linear projection every model family builds from (its own type, so parameters can be
// deferred: see llama.h "Initialisation").
// Header-only.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

namespace mfsdp {

// y = x @ weight^T (+ bias). Its own type (not torch::nn::Linear, which allocates and
// kaiming-initialises at construction) so parameters can be deferred.
class LlamaLinearImpl : public torch::nn::Module {
 public:
  LlamaLinearImpl(int64_t in_features, int64_t out_features, bool deferred, bool bias = false);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;  // [out, in]
  at::Tensor bias;    // [out]; undefined (not a parameter) without bias
};
TORCH_MODULE(LlamaLinear);

}  // namespace mfsdp
