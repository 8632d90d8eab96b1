// Data-parallel training with the mfsdp communicator alone (what exists before fully_shard):
// every rank holds a full copy of a small regression model and its own slice of the data; after
// each backward the gradients are averaged with one all_reduce, so all ranks take the same step
// and the model stays identical everywhere (checked at the end with a broadcast).
//
//   mfsdp-run --nproc-per-node 2 build/mfsdp-example-allreduce-sgd [--steps 200]
#include <torch/torch.h>

#include <cstdio>
#include <iostream>

#include "mfsdp/comm/comm.h"

int main(int argc, char** argv) {
  try {
    int steps = 200;
    for (int i = 1; i < argc; ++i) {
      std::string flag = argv[i];
      if (flag == "--steps" && i + 1 < argc) steps = std::stoi(argv[++i]);
      else throw std::invalid_argument("unknown argument '" + flag + "' (usage: [--steps N])");
    }
    torch::set_num_threads(1);
    auto comm = mfsdp::init_communicator();
    const int rank = comm->rank(), world = comm->size();

    // The same model on every rank (same seed); the data differs per rank.
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::Tanh(), torch::nn::Linear(32, 1));
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
    at::Tensor true_w = torch::linspace(-1, 1, 16).unsqueeze(1);
    torch::manual_seed(1 + rank);

    for (int step = 1; step <= steps; ++step) {
      at::Tensor x = torch::randn({64, 16});
      at::Tensor y = torch::sin(x.matmul(true_w));
      optimizer.zero_grad();
      at::Tensor loss = torch::mse_loss(model->forward(x), y);
      loss.backward();
      for (auto& p : model->parameters()) comm->all_reduce(p.grad(), {mfsdp::ReduceOp::kAvg});
      optimizer.step();
      at::Tensor global_loss = loss.detach().clone();
      comm->all_reduce(global_loss, {mfsdp::ReduceOp::kAvg});
      if (rank == 0 && (step == 1 || step % 20 == 0))
        std::printf("step %4d  loss %.5f  (mean over %d ranks)\n", step, global_loss.item<float>(), world);
    }
    // Replicas must be bit-identical: compare with rank 0's copy.
    for (auto& p : model->parameters()) {
      at::Tensor reference = p.detach().clone();
      comm->broadcast(reference, {0});
      if (!at::equal(reference, p.detach()))
        throw std::runtime_error("rank " + std::to_string(rank) + " diverged from rank 0");
    }
    if (rank == 0) std::printf("all %d replicas identical after %d steps\n", world, steps);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "allreduce_sgd: " << e.what() << std::endl;
    return 1;
  }
}
