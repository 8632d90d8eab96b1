// One Llama training step under each way of splitting it over the ranks of one job, for
// bench/parallel_llama.sh, which runs the modes round after round and prints them side by side:
//
//   dp             every rank its own micro-batch, FSDP (ZeRO-3) over all ranks: the baseline
//   tp, tp_sp      the ranks share one micro-batch, tensor-parallel (with sequence parallelism)
//   cp_allgather,  the ranks share one micro-batch's sequence, context-parallel attention by
//   cp_ring        all-gather of K/V or around a ring; FSDP (ZeRO-3) over the CP ranks
//
//   mfsdp-run --nproc-per-node 2 build/bench/parallel_llama --mode tp [--seq 512] [--hidden 512]
//       [--ffn 2048] [--heads 8] [--layers 2] [--vocab 4096] [--batch 2] [--steps 4]
//
// Prints one line on rank 0: the median step time (forward, backward, optimizer step) over the
// steps after the first, the job's tokens per second (dp counts every rank's tokens: the job
// trains world x batch sequences per step, the other modes batch sequences), the persistent bytes
// of rank 0 (model weights, main weights, main grads, AdamW state) and its peak RSS. The loss is
// printed so a broken mode shows. Last, cpu_s: the median CPU seconds rank 0's process used per
// timed step (CLOCK_PROCESS_CPUTIME_ID, all its threads): less sensitive than step_s to other
// programs sharing the cores, since time spent runnable but not running does not count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/context_parallel.h"
#include "mfsdp/models/lm_loss.h"
#include "mfsdp/models/model_spec.h"
#include "mfsdp/models/tensor_parallel.h"
#include "mfsdp/models/tensor_parallel_training.h"
#include "mfsdp/optim/optim.h"

namespace {

struct Args {
  std::string mode = "dp";
  int64_t seq = 512, hidden = 512, ffn = 2048, heads = 8, layers = 2, vocab = 4096, batch = 2, steps = 4;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--mode") {
      a.mode = v;
      continue;
    }
    int64_t* field = flag == "--seq"      ? &a.seq
                     : flag == "--hidden" ? &a.hidden
                     : flag == "--ffn"    ? &a.ffn
                     : flag == "--heads"  ? &a.heads
                     : flag == "--layers" ? &a.layers
                     : flag == "--vocab"  ? &a.vocab
                     : flag == "--batch"  ? &a.batch
                     : flag == "--steps"  ? &a.steps
                                          : nullptr;
    if (field == nullptr)
      throw std::invalid_argument("unknown flag " + flag +
                                  " (flags: --mode --seq --hidden --ffn --heads --layers --vocab --batch --steps)");
    *field = std::stoll(v);
    if (*field < 1) throw std::invalid_argument(flag + " must be >= 1");
  }
  const std::vector<std::string> modes = {"dp", "tp", "tp_sp", "cp_allgather", "cp_ring"};
  if (std::find(modes.begin(), modes.end(), a.mode) == modes.end())
    throw std::invalid_argument("--mode " + a.mode + ": expected dp, tp, tp_sp, cp_allgather or cp_ring");
  if (a.steps < 2) throw std::invalid_argument("--steps must be >= 2 (the first step is not timed)");
  return a;
}

// CPU seconds this process has used, all threads.
double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Peak resident set of this process (VmHWM).
double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmHWM:") {
      double kib = 0;
      status >> kib;
      return kib / 1024.0;
    }
    status.ignore(1 << 20, '\n');
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse_args(argc, argv);
    at::set_num_threads(1);  // one core per rank
    const std::shared_ptr<mfsdp::Communicator> world = mfsdp::init_communicator();
    const bool tp_mode = a.mode.rfind("tp", 0) == 0, cp_mode = a.mode.rfind("cp", 0) == 0;
    const mfsdp::ModelConfig config = mfsdp::model_config_from_megatron({{"num_layers", a.layers},
                                                                         {"hidden_size", a.hidden},
                                                                         {"ffn_hidden_size", a.ffn},
                                                                         {"num_attention_heads", a.heads},
                                                                         {"padded_vocab_size", a.vocab},
                                                                         {"max_position_embeddings", a.seq},
                                                                         {"seq_length", a.seq},
                                                                         {"swiglu", true},
                                                                         {"normalization", "RMSNorm"},
                                                                         {"untie_embeddings_and_output_weights", true}});
    mfsdp::ModelBuildOptions build;
    build.init_seed = 1;
    build.deferred_init = true;
    if (tp_mode) {
      build.tensor_parallel = world;
      build.sequence_parallel = a.mode == "tp_sp";
    }
    if (cp_mode) {
      build.context_parallel = world;
      build.context_parallel_algorithm = a.mode == "cp_ring" ? mfsdp::context_parallel::CpAlgorithm::kRing
                                                             : mfsdp::context_parallel::CpAlgorithm::kAllGather;
    }
    std::shared_ptr<mfsdp::CausalLM> model = config.spec->build(config, build);
    mfsdp::FullyShardOptions shard;
    // TP: the whole job is one tensor-parallel group, so FSDP has one rank and nothing to shard.
    const mfsdp::DeviceMesh mesh(world, {1, world->size()}, {"dp", "tp"});
    shard.comm = tp_mode ? mesh.get("dp") : world;
    shard.strategy = mfsdp::ShardingStrategy::kOptimGradsParams;
    mfsdp::FsdpHandle root = mfsdp::shard_model(*model, shard);
    std::unique_ptr<mfsdp::DistributedOptimizer> opt = mfsdp::make_adamw(root, {});
    mfsdp::set_model_parallel_norm(*model, root, *opt);

    const int world_size = world->size(), rank = world->rank();
    std::vector<double> times, cpu_times;
    double loss_value = 0;
    for (int64_t step = 0; step < a.steps; ++step) {
      // dp: each rank its own sequences; tp and cp: one shared batch.
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + (a.mode == "dp" ? rank : 0));
      at::Tensor tokens = at::randint(a.vocab, {a.batch, a.seq + 1}, gen);
      at::Tensor ids = tokens.narrow(1, 0, a.seq), labels = tokens.narrow(1, 1, a.seq);
      if (cp_mode) {
        ids = mfsdp::context_parallel::shard_sequence(ids, 1, world_size, rank);
        labels = mfsdp::context_parallel::shard_sequence(labels, 1, world_size, rank);
      }
      world->barrier();
      const auto start = std::chrono::steady_clock::now();
      const double cpu_start = process_cpu_s();
      at::Tensor logits = model->call(ids);
      at::Tensor loss = tp_mode ? mfsdp::tensor_parallel::vocab_parallel_lm_loss(logits, labels, *world)
                                : mfsdp::lm_loss(logits, labels);
      loss.backward();
      mfsdp::sum_partial_gradients(*model, root);
      opt->clip_grad_norm(1.0);
      opt->step(1e-4);
      root.zero_grad();
      world->barrier();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double cpu_seconds = process_cpu_s() - cpu_start;
      if (step > 0) {
        times.push_back(seconds);
        cpu_times.push_back(cpu_seconds);
      }
      loss_value = loss.item<double>();
    }
    std::sort(times.begin(), times.end());
    std::sort(cpu_times.begin(), cpu_times.end());
    const double median = times[times.size() / 2], cpu_median = cpu_times[cpu_times.size() / 2];
    const int64_t tokens_per_step = a.batch * a.seq * (a.mode == "dp" ? world_size : 1);
    mfsdp::MemoryReport m = root.memory();
    int64_t state = 0;
    for (const auto& [name, tensors] : opt->state())
      for (const auto& t : tensors) state += t.nbytes();
    const double persistent = (m.model_weights + m.main_weights + m.main_grads + state) / 1048576.0;
    if (rank == 0)
      std::printf("mode %s ranks %d step_s %.4f tokens_per_s %.1f persistent_mib %.2f peak_rss_mib %.1f loss %.4f "
                  "cpu_s %.4f\n",
                  a.mode.c_str(), world_size, median, tokens_per_step / median, persistent, peak_rss_mib(),
                  loss_value, cpu_median);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "parallel_llama: " << e.what() << std::endl;
    return 1;
  }
}
