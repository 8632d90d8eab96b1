// mfsdp::Sequential: torch::nn::Sequential whose forward runs every child that is a unit through
// the runtime (torch::nn::Sequential calls each child's forward directly, which would bypass the
// unit's all-gather and hooks). Children that are not units run as they do in torch.
//
//   mfsdp::Sequential blocks(Block(...), Block(...));
//   for (auto& child : blocks->children()) mfsdp::fully_shard(*child, options);
//   x = blocks->forward(x);   // or blocks(x)
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp {

class SequentialImpl : public torch::nn::SequentialImpl {
 public:
  using torch::nn::SequentialImpl::SequentialImpl;
  // Tensor in, tensor out, through every child in order.
  at::Tensor forward(at::Tensor x);
};
TORCH_MODULE(Sequential);

}  // namespace mfsdp
