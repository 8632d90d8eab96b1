// The small model the multi-rank tests shard: uneven parameter sizes (shards of every length,
// padding), a bias-free layer, a 1-element parameter (smaller than the world size), a frozen
// parameter and a 1-D norm-like weight. Units: each block, then the root.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp::testing {

struct UnevenBlockImpl : ShardedModule<UnevenBlockImpl> {
  UnevenBlockImpl(int d, int h) {
    fc1 = register_module("fc1", torch::nn::Linear(d, h));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(h, d).bias(false)));
    norm = register_parameter("norm", torch::ones({d}) + 0.1 * torch::randn({d}));
  }
  at::Tensor forward(at::Tensor x) { return x + fc2(torch::tanh(fc1(x * norm))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::Tensor norm;
};
TORCH_MODULE(UnevenBlock);

// 7 inputs -> 10 -> blocks (hidden 13, 5) -> 3 outputs.
struct UnevenNetImpl : torch::nn::Module {
  UnevenNetImpl() {
    embed = register_module("embed", torch::nn::Linear(7, 10));
    for (int h : {13, 5}) blocks.push_back(register_module("block" + std::to_string(blocks.size()), UnevenBlock(10, h)));
    head = register_module("head", torch::nn::Linear(10, 3));
    tiny = register_parameter("tiny", torch::ones({1}) * 1.5);
    frozen = register_parameter("frozen", torch::randn({10}) * 0.1, /*requires_grad=*/false);
  }
  // routed: blocks run through their units (sharded model); else plainly (reference model).
  at::Tensor forward(at::Tensor x, bool routed) {
    at::Tensor h = embed(x) + frozen;
    for (auto& b : blocks) h = routed ? b->call(h) : b->forward(h);
    return head(h) * tiny;
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  std::vector<UnevenBlock> blocks;
  at::Tensor tiny, frozen;
};
TORCH_MODULE(UnevenNet);

}  // namespace mfsdp::testing
