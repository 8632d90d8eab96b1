// Built against an installed mfsdp (find_package(mfsdp), mfsdp::mfsdp): a one-rank communicator,
// a tiny two-block model sharded with ZeRO-3, a few AdamW steps through the sharded optimizer.
// Exits 0 when the loss went down; tests/install/install_test.sh builds and runs it.
#include <torch/torch.h>

#include <cstdio>
#include <iostream>

#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"

struct BlockImpl : mfsdp::ShardedModule<BlockImpl> {
  torch::nn::Linear fc{nullptr};
  explicit BlockImpl(int64_t width) { fc = register_module("fc", torch::nn::Linear(width, width)); }
  at::Tensor forward(at::Tensor x) { return x + torch::tanh(fc->forward(x)); }
};
TORCH_MODULE(Block);

struct TinyImpl : mfsdp::ShardedModule<TinyImpl> {
  Block a{nullptr}, b{nullptr};
  torch::nn::Linear head{nullptr};
  TinyImpl() {
    a = register_module("a", Block(8));
    b = register_module("b", Block(8));
    head = register_module("head", torch::nn::Linear(8, 1));
  }
  at::Tensor forward(at::Tensor x) { return head->forward(b->call(a->call(x))); }
};
TORCH_MODULE(Tiny);

int main() {
  try {
    torch::set_num_threads(1);
    auto comm = mfsdp::init_communicator(mfsdp::RendezvousInfo{});  // rank 0 of 1
    torch::manual_seed(0);
    Tiny model;

    mfsdp::FullyShardOptions options;
    options.comm = comm;
    options.strategy = mfsdp::parse_sharding_strategy("optim_grads_params");
    mfsdp::fully_shard(*model->a, options);
    mfsdp::fully_shard(*model->b, options);
    mfsdp::FsdpHandle root = mfsdp::fully_shard(*model, options);
    auto optimizer = mfsdp::make_adamw(root, mfsdp::AdamWOptions{});

    at::Tensor x = torch::randn({32, 8});
    at::Tensor y = torch::sin(x.sum(1, /*keepdim=*/true));
    float first = 0, last = 0;
    for (int step = 1; step <= 20; ++step) {
      at::Tensor loss = torch::mse_loss(model->call(x), y);
      loss.backward();
      optimizer->clip_grad_norm(1.0);
      optimizer->step(1e-2);
      root.zero_grad();
      (step == 1 ? first : last) = loss.item<float>();
    }
    std::printf("world %d: loss %.5f -> %.5f\n", comm->size(), first, last);
    return last < first ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "tiny_fsdp: " << e.what() << std::endl;
    return 1;
  }
}
