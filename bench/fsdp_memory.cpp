// Per-rank memory of fully_shard by role and strategy, measured (FsdpHandle::memory() plus the
// optimizer state) against the formula, and the total as a ratio of no_shard (plain data
// parallelism) measured in the same run.
//
//   mfsdp-run --nproc-per-node 2 build/bench/fsdp_memory [--layers 8] [--width 1024] [--bf16]
//
// Model: `layers` units, each one width x width bias-free Linear (so a unit's padded flat size
// is round_up(width^2, N * width) elements), plus a root holding one more such Linear.
// Formula per rank, P = padded elements of all units, N ranks, AdamW (2 fp32 states):
//   no_shard  model P  + main 0   + grads P   + states 2P
//   optim     model P  + main 0   + grads P   + states 2P/N
//   optim_grads        model P  + grads P/N + states 2P/N
//   optim_grads_params model P/N + grads P/N + states 2P/N
// (fp32 params: main weights alias model weights. --bf16: model weights bf16 and separate fp32
// main weights of P/N, or P for no_shard.)
#include <torch/torch.h>

#include <cstdio>
#include <iostream>

#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"

namespace {

struct LayerImpl : mfsdp::ShardedModule<LayerImpl> {
  explicit LayerImpl(int64_t w) {
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(w, w).bias(false)));
  }
  at::Tensor forward(at::Tensor x) { return torch::relu(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Layer);

struct ModelImpl : torch::nn::Module {
  ModelImpl(int layers, int64_t w) {
    out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(w, w).bias(false)));
    for (int i = 0; i < layers; ++i) blocks.push_back(register_module("layer" + std::to_string(i), Layer(w)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b->call(x);
    return out(x);
  }
  torch::nn::Linear out{nullptr};
  std::vector<Layer> blocks;
};
TORCH_MODULE(Model);

double mib(int64_t bytes) { return bytes / 1048576.0; }

}  // namespace

int main(int argc, char** argv) {
  try {
    int layers = 8;
    int64_t width = 1024;
    bool bf16 = false;
    for (int i = 1; i < argc; ++i) {
      std::string flag = argv[i];
      if (flag == "--layers" && i + 1 < argc) layers = std::stoi(argv[++i]);
      else if (flag == "--width" && i + 1 < argc) width = std::stoll(argv[++i]);
      else if (flag == "--bf16") bf16 = true;
      else throw std::invalid_argument("unknown argument '" + flag + "' (--layers N --width W --bf16)");
    }
    at::set_num_threads(1);
    auto comm = mfsdp::init_communicator();
    const int n = comm->size();
    const int64_t grid = n * width;
    const int64_t per_unit = (width * width + grid - 1) / grid * grid;
    const int64_t P = per_unit * (layers + 1);
    const int64_t model_elem_bytes = bf16 ? 2 : 4;

    if (comm->rank() == 0) {
      std::printf("# fully_shard memory per rank: %d x Linear(%lld, %lld) units + root, %d ranks, %s, AdamW\n",
                  layers, (long long)width, (long long)width, n, bf16 ? "bf16 params / fp32 main" : "fp32");
      std::printf("# MiB; 'formula' from the header of bench/fsdp_memory.cpp; ratio = total / no_shard total\n");
      std::printf("%-19s | %9s %9s | %9s %9s | %9s %9s | %9s %9s | %9s %6s | %9s\n", "strategy", "model",
                  "formula", "main", "formula", "grads", "formula", "states", "formula", "total", "ratio",
                  "peak tmp");
    }
    double baseline_total = 0;
    for (auto s : {mfsdp::ShardingStrategy::kNoShard, mfsdp::ShardingStrategy::kOptim,
                   mfsdp::ShardingStrategy::kOptimGrads, mfsdp::ShardingStrategy::kOptimGradsParams}) {
      torch::manual_seed(0);
      Model model(layers, width);
      mfsdp::FullyShardOptions o;
      o.comm = comm;
      o.strategy = s;
      if (bf16) o.mixed_precision.param_dtype = at::kBFloat16;
      for (auto& b : model->blocks) mfsdp::fully_shard(*b, o);
      auto root = mfsdp::fully_shard(*model, o);
      auto opt = mfsdp::make_adamw(root, {});
      root.reset_peak();
      mfsdp::call(*model, torch::randn({8, width})).pow(2).mean().backward();
      opt->step(1e-4);
      root.zero_grad();

      auto m = root.memory();
      int64_t states = 0;
      for (auto& [name, ts] : opt->state())
        for (auto& t : ts) states += t.nbytes();
      const bool params_sharded = s == mfsdp::ShardingStrategy::kOptimGradsParams;
      const bool grads_sharded = params_sharded || s == mfsdp::ShardingStrategy::kOptimGrads;
      const bool main_sharded = s != mfsdp::ShardingStrategy::kNoShard;
      const int64_t f_model = (params_sharded ? P / n : P) * model_elem_bytes;
      const int64_t f_main = bf16 ? (main_sharded ? P / n : P) * 4 : 0;
      const int64_t f_grads = (grads_sharded ? P / n : P) * 4;
      const int64_t f_states = 2 * (main_sharded ? P / n : P) * 4;
      const int64_t total = m.model_weights + m.main_weights + m.main_grads + states;
      if (s == mfsdp::ShardingStrategy::kNoShard) baseline_total = total;
      if (comm->rank() == 0) {
        std::printf("%-19s | %9.2f %9.2f | %9.2f %9.2f | %9.2f %9.2f | %9.2f %9.2f | %9.2f %6.3f | %9.2f\n",
                    mfsdp::to_string(s), mib(m.model_weights), mib(f_model), mib(m.main_weights),
                    mib(f_main), mib(m.main_grads), mib(f_grads), mib(states), mib(f_states),
                    mib(total), total / baseline_total, mib(m.transient_peak));
      }
      bool exact = m.model_weights == f_model && m.main_weights == f_main &&
                   m.main_grads == f_grads && states == f_states;
      if (!exact) throw std::runtime_error(std::string("measured memory differs from the formula for ") +
                                           mfsdp::to_string(s));
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "fsdp_memory: " << e.what() << std::endl;
    return 1;
  }
}
