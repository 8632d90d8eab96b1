// mfsdp-pretrain: pretrain a Llama-family model with fully_shard, taking Megatron-LM's flags.
//
//   mfsdp-run --nproc-per-node 2 mfsdp-pretrain --mock-data --vocab-size 256 --num-layers 2
//       --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4
//       --train-iters 100 --lr 1e-3 --data-parallel-sharding-strategy optim_grads_params
//
// Exit codes: 0 done, 2 bad flags (nothing was started), 1 failure during the run.
#include <torch/torch.h>

#include <cstdlib>

#include <cstdio>
#include <iostream>
#include <thread>

#include "mfsdp/comm.h"
#include "mfsdp/rendezvous.h"
#include "mfsdp/simulated_comm.h"
#include "mfsdp/tokenizer.h"
#include "train/pretrain_args.h"
#include "train/trainer.h"

int main(int argc, char** argv) {
  std::vector<std::string> args_text(argv, argv + argc);
  for (const auto& a : args_text)
    if (a == "--help" || a == "-h") {
      std::cout << mfsdp::pretrain_usage();
      return 0;
    }
  mfsdp::PretrainArgs args;
  mfsdp::RendezvousInfo info;
  at::Device device = at::kCPU;
  std::vector<std::string> notes;
  try {
    args = mfsdp::parse_pretrain_args(args_text);
    // A simulated run is one process on its own; it needs no launcher (but may have one).
    if (args.simulate_world_size == 0 || std::getenv("WORLD_SIZE") != nullptr)
      info = mfsdp::rendezvous_from_env();
    int64_t vocab = 0;
    if (!args.tokenizer_type.empty() && args.tokenizer_type != "NullTokenizer") {
      mfsdp::TokenizerOptions t{args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                                args.merge_file};
      vocab = mfsdp::tokenizer_vocab_size(t);
    }
    if (args.simulate_world_size > 0 && info.world_size != 1)
      throw std::invalid_argument("--simulate-world-size: run it as one process (mfsdp-run started " +
                                  std::to_string(info.world_size) + ")");
    const int dp = args.simulate_world_size > 0 ? static_cast<int>(args.simulate_world_size) : info.world_size;
    mfsdp::validate_pretrain_args(args, dp, vocab);
    // --device: CUDA puts every buffer on this rank's GPU and talks NCCL; CPU the CPU backend.
    device = mfsdp::resolve_device(args.device, info.local_rank, info.local_world_size);
    // Every rank checks (a refused flag must stop all of them); rank 0 prints the notes.
    notes = mfsdp::pretrain_inert_flag_notices(args, device.is_cuda());
  } catch (const std::exception& e) {
    std::cerr << "mfsdp-pretrain: error: " << e.what() << std::endl;
    return 2;
  }
  try {
    // ranks x threads <= cores on this node, unless OMP_NUM_THREADS says otherwise.
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    const char* omp = std::getenv("OMP_NUM_THREADS");
    const int threads = omp != nullptr && std::atoi(omp) > 0
                            ? std::atoi(omp)
                            : std::max<int>(1, static_cast<int>(cores) / info.local_world_size);
    at::set_num_threads(threads);
    mfsdp::CommOptions comm_options;
    comm_options.backend = mfsdp::backend_for(device);
    if (device.is_cuda()) comm_options.device_index = device.index();
    auto comm = args.simulate_world_size > 0
                    ? mfsdp::make_simulated_communicator(static_cast<int>(args.simulate_rank),
                                                         static_cast<int>(args.simulate_world_size), device)
                    : mfsdp::init_communicator(info, comm_options);
    if (comm->rank() == 0 || mfsdp::is_simulated(*comm)) {
      std::cout << " device: " << device.str() << " (" << comm->backend() << ")\n";
      for (const auto& note : notes) std::cout << "note: " << note << "\n";
    }
    mfsdp::pretrain(args, comm, std::cout);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "mfsdp-pretrain: " << e.what() << std::endl;
    return 1;
  }
}
