// Checkpoint save and load throughput of mfsdp's fsdp_dtensor format, the mfsdp side of
// bench/ckpt_throughput.sh (which runs bench/ckpt_throughput_torch.py, PyTorch DCP, on the same
// model beside it). The model: `--layers` units of Linear(width, width) (no bias) plus an output
// Linear, ZeRO-3 over every rank, AdamW after one step: the checkpoint holds the fp32 weights and
// both moments, 12 bytes per parameter.
//
//   mfsdp-run --nproc-per-node 2 build/bench/ckpt_throughput --dir D --op save [--layers 8] [--width 2048] [--reps 3]
//   mfsdp-run --nproc-per-node 1 build/bench/ckpt_throughput --dir D --op load ...   (any world size)
//
// Each rep is timed from a barrier to the slowest rank's end (the collective save includes the
// commit). Prints one JSON line per rep on rank 0: {"impl", "op", "ranks", "bytes", "seconds"}; the
// bytes are those of the checkpoint's tensor data (12 x parameters), the same count the torch side
// reports. `--drop-cache-cmd CMD` runs CMD on rank 0 before every load rep (page cache). Each save
// rep writes into an emptied folder: rank 0 removes the previous rep's checkpoint before the timed
// region, as a training job saves a new iteration each time (deleting old checkpoints, where a job
// does, is not part of its saves); the torch side does the same.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/base/directory_tree.h"
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
    for (int i = 0; i < layers; ++i) blocks.push_back(register_module("layer" + std::to_string(i), Layer(w)));
    out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(w, w).bias(false)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b->call(x);
    return out(x);
  }
  std::vector<Layer> blocks;
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Model);

double slowest(mfsdp::Communicator& comm, double seconds) {
  at::Tensor t = at::full({1}, seconds, at::kDouble);
  comm.all_reduce(t, {mfsdp::ReduceOp::kMax});
  return t.item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int layers = 8, reps = 3;
    int64_t width = 2048;
    std::string dir, op, drop_cache;
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
        return argv[++i];
      };
      if (flag == "--layers") layers = std::stoi(value());
      else if (flag == "--width") width = std::stoll(value());
      else if (flag == "--reps") reps = std::stoi(value());
      else if (flag == "--dir") dir = value();
      else if (flag == "--op") op = value();
      else if (flag == "--drop-cache-cmd") drop_cache = value();
      else throw std::invalid_argument("unknown argument '" + flag + "'");
    }
    if (dir.empty() || (op != "save" && op != "load"))
      throw std::invalid_argument("usage: ckpt_throughput --dir D --op save|load [--layers N --width W --reps R]");
    at::set_num_threads(1);
    auto comm = mfsdp::init_communicator();
    torch::manual_seed(0);
    Model model(layers, width);
    mfsdp::FullyShardOptions o;
    o.comm = comm;
    for (auto& b : model->blocks) mfsdp::fully_shard(*b, o);
    auto root = mfsdp::fully_shard(*model, o);
    auto opt = mfsdp::make_adamw(root, {});
    mfsdp::call(*model, torch::randn({4, width})).pow(2).mean().backward();
    opt->step(1e-4);
    root.zero_grad();
    const int64_t params = (layers + 1) * width * width;
    const int64_t bytes = 12 * params;
    for (int rep = 0; rep < reps; ++rep) {
      if (op == "load" && !drop_cache.empty() && comm->rank() == 0 && std::system(drop_cache.c_str()) != 0)
        throw std::runtime_error("--drop-cache-cmd failed: " + drop_cache);
      // Loads both ways: into the shards (the trainers', "mfsdp") and staged, all or nothing.
      for (const bool all_or_nothing : op == "save" ? std::vector<bool>{false} : std::vector<bool>{false, true}) {
        if (op == "save" && comm->rank() == 0) mfsdp::remove_tree(dir);
        comm->barrier();
        const auto start = std::chrono::steady_clock::now();
        if (op == "save") {
          mfsdp::CheckpointInfo info;
          info.iteration = 1;
          mfsdp::save_checkpoint(dir, comm, root, opt.get(), info);
        } else {
          mfsdp::CheckpointLoadOptions options;
          options.all_or_nothing = all_or_nothing;
          mfsdp::load_checkpoint(dir, comm, root, opt.get(), options);
        }
        const double seconds =
            slowest(*comm, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        if (comm->rank() == 0)
          std::printf("{\"impl\": \"%s\", \"op\": \"%s\", \"ranks\": %d, \"bytes\": %lld, \"seconds\": %.6f}\n",
                      all_or_nothing ? "mfsdp all-or-nothing" : "mfsdp", op.c_str(), comm->size(),
                      static_cast<long long>(bytes), seconds);
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_throughput: %s\n", e.what());
    return 1;
  }
}
