#include "harness/dist_test.h"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>

#include "mfsdp/launch/rank_processes.h"
#include "mfsdp/comm/rendezvous.h"
#include "mfsdp/base/directory_tree.h"

namespace mfsdp::testing {
namespace {

constexpr const char* kRankFlag = "MFSDP_TEST_RANK_PROCESS";
constexpr const char* kSharedDir = "MFSDP_TEST_SHARED_DIR";
constexpr const char* kPhase = "MFSDP_TEST_PHASE";

std::string self_executable() {
  return std::filesystem::read_symlink("/proc/self/exe").string();
}

std::string current_test_name() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

void run_as_rank(const DistOptions& options, const std::function<void(Communicator&)>& body) {
  at::set_num_threads(1);  // ranks x threads <= cores
  CommOptions comm_options;
  comm_options.timeout = options.comm_timeout;
  comm_options.backend = options.backend;  // nccl: device_index -1 picks LOCAL_RANK's GPU
  comm_options.shared_memory = options.shared_memory;
  auto comm = init_communicator(comm_options);
  body(*comm);
}

// True when rank 0 could not serve the store because another process took the picked port
// between pick_free_port and its bind: the job never started, so running it again is safe.
bool store_port_was_taken(const std::map<int, std::vector<std::string>>& output) {
  auto rank0 = output.find(0);
  if (rank0 == output.end()) return false;
  for (const std::string& line : rank0->second) {
    if (line.find("cannot serve the store") != std::string::npos && line.find("is in use") != std::string::npos) {
      return true;
    }
  }
  return false;
}

void run_world(const DistOptions& options, int world, int attempt = 1) {
  const std::string test = current_test_name();
  const int port = launch::pick_free_port();
  const bool own_dir = options.shared_dir.empty();
  const std::string dir =
      own_dir ? (std::filesystem::temp_directory_path() / ("mfsdp-test-" + std::to_string(getpid()) + "-" +
                                                           std::to_string(port)))
                    .string()
              : options.shared_dir;
  std::filesystem::create_directories(dir);

  std::vector<launch::RankProcessSpec> specs;
  for (int r = 0; r < world; ++r) {
    launch::RankProcessSpec spec;
    spec.rank = r;
    spec.argv = {self_executable(), "--gtest_filter=" + test, "--gtest_color=no"};
    spec.env = launch::rank_environment(0, 1, world, r, "127.0.0.1", port);
    spec.env[kRankFlag] = "1";
    spec.env[kSharedDir] = dir;
    spec.env[kPhase] = options.phase;
    spec.env["OMP_NUM_THREADS"] = "1";
    specs.push_back(std::move(spec));
  }
  std::map<int, std::vector<std::string>> output;
  launch::SuperviseOptions supervise;
  supervise.deadline = options.deadline;
  supervise.kill_grace = std::chrono::milliseconds(2000);
  supervise.on_line = [&](int rank, launch::OutputStream, const std::string& line) {
    output[rank].push_back(line);
  };
  launch::SuperviseResult result = launch::run_rank_processes(specs, supervise);
  if (own_dir) mfsdp::remove_tree(dir);
  if (result.ok()) return;
  if (attempt < 3 && store_port_was_taken(output)) return run_world(options, world, attempt + 1);

  std::ostringstream report;
  report << test << " with world size " << world << ": " << result.summary() << "\n";
  for (const auto& exit : result.exits) report << "  " << exit.describe() << "\n";
  for (auto& [rank, lines] : output) {
    report << "---- output of rank " << rank << " ----\n";
    size_t first = lines.size() > 80 ? lines.size() - 80 : 0;
    for (size_t i = first; i < lines.size(); ++i) report << "[rank" << rank << "] " << lines[i] << "\n";
  }
  ADD_FAILURE() << report.str();
}

}  // namespace

bool is_rank_process() { return std::getenv(kRankFlag) != nullptr; }

std::string shared_temp_dir() {
  const char* dir = std::getenv(kSharedDir);
  if (dir == nullptr) throw std::logic_error("shared_temp_dir() outside a harness rank process");
  return dir;
}

void run_distributed(const DistOptions& options, const std::function<void(Communicator&)>& body) {
  if (is_rank_process()) {
    const char* phase = std::getenv(kPhase);
    if (options.phase == (phase != nullptr ? phase : "")) run_as_rank(options, body);
    return;
  }
  for (int world : options.world_sizes) {
    SCOPED_TRACE("world size " + std::to_string(world));
    run_world(options, world);
  }
}

}  // namespace mfsdp::testing
