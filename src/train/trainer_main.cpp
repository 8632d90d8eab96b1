#include "mfsdp/train/trainer_main.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "mfsdp/comm/rendezvous.h"
#include "mfsdp/train/rerun_validation.h"
#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/train/cpu_malloc.h"

namespace mfsdp {

int trainer_main(int argc, char** argv, const TrainerTool& tool) {
  std::vector<std::string> args_text(argv, argv + argc);
  for (const auto& a : args_text)
    if (a == "--help" || a == "-h") {
      std::cout << tool.usage();
      return 0;
    }
  RendezvousInfo info;
  at::Device device = at::kCPU;
  std::vector<std::string> notes;
  PretrainArgs* args = nullptr;
  try {
    args = &tool.parse(args_text);
    // A simulated run is one process on its own; it needs no launcher (but may have one).
    if (args->simulate_world_size == 0 || std::getenv("WORLD_SIZE") != nullptr) info = rendezvous_from_env();
    int64_t vocab = 0;
    if (!args->tokenizer_type.empty() && args->tokenizer_type != "NullTokenizer")
      vocab = tokenizer_vocab_size({args->tokenizer_type, args->tokenizer_model, args->vocab_file, args->merge_file});
    if (args->simulate_world_size > 0 && info.world_size != 1)
      throw std::invalid_argument("--simulate-world-size: run it as one process (mfsdp-run started " +
                                  std::to_string(info.world_size) + ")");
    const int dp = args->simulate_world_size > 0 ? static_cast<int>(args->simulate_world_size) : info.world_size;
    tool.validate(*args, dp, vocab);
    // --device: CUDA puts every buffer on this rank's GPU and talks NCCL; CPU the CPU backend.
    device = resolve_device(args->device, info.local_rank, info.local_world_size);
    // Every rank checks (a refused flag must stop all of them); rank 0 prints the notes.
    notes = pretrain_inert_flag_notices(*args, device.is_cuda());
  } catch (const std::exception& e) {
    std::cerr << tool.program << ": error: " << e.what() << std::endl;
    return 2;
  }
  try {
    // "on" / "off" / unset (the environment variable decides).
    auto on_off = [](const std::string& v) { return v.empty() ? std::nullopt : std::optional<bool>(v == "on"); };
    // Steps reuse freed CPU blocks instead of faulting in fresh pages.
    keep_freed_cpu_memory(on_off(args->keep_freed_cpu_memory));
    // ranks x threads <= cores on this node, unless OMP_NUM_THREADS says otherwise.
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    const char* omp = std::getenv("OMP_NUM_THREADS");
    const int threads = omp != nullptr && std::atoi(omp) > 0
                            ? std::atoi(omp)
                            : std::max<int>(1, static_cast<int>(cores) / info.local_world_size);
    at::set_num_threads(threads);
    CommOptions comm_options;
    comm_options.backend = backend_for(device);
    // --distributed-timeout-minutes: every collective's timeout (a silent peer is named after
    // this long). Start-up may take as long, but never less than the default rendezvous timeout
    // (include/mfsdp/comm/comm.h): a short timeout must not fail ranks that start slowly.
    comm_options.timeout =
        std::chrono::milliseconds(std::llround(args->distributed_timeout_minutes * 60000.0));
    comm_options.rendezvous_timeout = std::max(comm_options.rendezvous_timeout, comm_options.timeout);
    if (device.is_cuda()) comm_options.device_index = device.index();
    comm_options.shared_memory = on_off(args->cpu_comm_shared_memory);
    comm_options.socket_ifname = args->socket_ifname;
    auto comm = args->simulate_world_size > 0
                    ? make_simulated_communicator(static_cast<int>(args->simulate_rank),
                                                  static_cast<int>(args->simulate_world_size), device)
                    : init_communicator(info, comm_options);
    if (comm->rank() == 0 || is_simulated(*comm)) {
      std::cout << " device: " << device.str() << " (" << comm->backend() << ")\n";
      if (info.agent_store)
        std::cout << " rendezvous: torchrun's store at " << info.master_addr << ":" << info.master_port
                  << " (TORCHELASTIC_USE_AGENT_STORE; no mfsdp job token)\n";
      if (info.restart_count > 0 || info.max_restarts > 0)
        std::cout << " restart " << info.restart_count << " of at most " << info.max_restarts
                  << " (TORCHELASTIC_RESTART_COUNT)\n";
      for (const auto& note : notes) std::cout << "note: " << note << "\n";
    }
    tool.run(comm);
    return 0;
  } catch (const ResultValidationExit& e) {
    // Megatron's exit code for result validation, so a scheduler can tell it from a crash.
    std::cerr << tool.program << ": " << e.what() << std::endl;
    return e.exit_code;
  } catch (const c10::Error& e) {
    // LibTorch's message without its C++ backtrace, which names nothing a user can act on.
    std::cerr << tool.program << ": " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << tool.program << ": " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace mfsdp
