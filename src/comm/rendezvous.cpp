#include "mfsdp/comm/rendezvous.h"

#include <cstdlib>
#include <optional>
#include <sstream>
#include <stdexcept>

namespace mfsdp {
namespace {

class EnvReader {
 public:
  explicit EnvReader(const EnvLookup& lookup) : lookup_(lookup) {}

  std::optional<std::string> text(const char* name) const {
    const char* v = lookup_ ? lookup_(name) : std::getenv(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  }

  bool has(const char* name) const { return text(name).has_value(); }

  std::optional<long> number(const char* name) const {
    auto v = text(name);
    if (!v) return std::nullopt;
    return parse(name, *v);
  }

  long required_number(const char* name, const std::string& launcher) const {
    auto v = number(name);
    if (!v) {
      throw std::invalid_argument("rendezvous: " + launcher + " environment detected but " +
                                  name + " is not set");
    }
    return *v;
  }

  // Parses the leading integer of `v` ("2(x3)" -> 2 for Slurm's task counts is done by the caller).
  static long parse(const char* name, const std::string& v) {
    try {
      size_t used = 0;
      long x = std::stol(v, &used);
      if (used == v.size()) return x;
    } catch (const std::exception&) {
    }
    throw std::invalid_argument(std::string("rendezvous: ") + name + "='" + v +
                                "' is not an integer");
  }

 private:
  const EnvLookup& lookup_;
};

void check_consistent(const RendezvousInfo& info) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument("rendezvous (" + info.source + " variables): " + what);
  };
  if (info.world_size < 1) fail("world size " + std::to_string(info.world_size) + " < 1");
  if (info.rank < 0 || info.rank >= info.world_size)
    fail("rank " + std::to_string(info.rank) + " is outside [0, " +
         std::to_string(info.world_size) + ")");
  if (info.local_world_size < 1 || info.local_world_size > info.world_size)
    fail("local world size " + std::to_string(info.local_world_size) + " is outside [1, " +
         std::to_string(info.world_size) + "]");
  if (info.local_rank < 0 || info.local_rank >= info.local_world_size)
    fail("local rank " + std::to_string(info.local_rank) + " is outside [0, " +
         std::to_string(info.local_world_size) + ")");
  if (info.master_port < 1 || info.master_port > 65535)
    fail("master port " + std::to_string(info.master_port) + " is outside [1, 65535]");
  if (info.master_addr.empty()) fail("master address is empty");
}

RendezvousInfo from_torchrun(const EnvReader& env) {
  RendezvousInfo info;
  info.source = "torchrun";
  info.rank = env.required_number("RANK", "torchrun");
  info.world_size = env.required_number("WORLD_SIZE", "torchrun");
  info.local_rank = env.number("LOCAL_RANK").value_or(info.rank);
  info.local_world_size = env.number("LOCAL_WORLD_SIZE").value_or(info.world_size);
  if (info.world_size > 1 && !env.has("MASTER_ADDR") && info.local_world_size != info.world_size)
    throw std::invalid_argument("rendezvous: MASTER_ADDR is not set for a multi-node torchrun job");
  info.master_addr = env.text("MASTER_ADDR").value_or("127.0.0.1");
  if (info.world_size > 1 && !env.has("MASTER_PORT"))
    throw std::invalid_argument("rendezvous: MASTER_PORT is not set (RANK/WORLD_SIZE are)");
  info.master_port = env.number("MASTER_PORT").value_or(29500);
  return info;
}

RendezvousInfo from_slurm(const EnvReader& env) {
  RendezvousInfo info;
  info.source = "slurm";
  info.rank = env.required_number("SLURM_PROCID", "Slurm");
  info.world_size = env.required_number("SLURM_NTASKS", "Slurm");
  info.local_rank = env.required_number("SLURM_LOCALID", "Slurm");
  // SLURM_TASKS_PER_NODE looks like "2(x3),1"; the first count is this job's usual per-node count.
  std::optional<std::string> per_node = env.text("SLURM_NTASKS_PER_NODE");
  if (!per_node) per_node = env.text("SLURM_TASKS_PER_NODE");
  if (per_node) {
    std::string head = per_node->substr(0, per_node->find_first_not_of("0123456789"));
    info.local_world_size = EnvReader::parse("SLURM_NTASKS_PER_NODE", head);
  } else {
    info.local_world_size = info.world_size;
  }
  if (auto addr = env.text("MASTER_ADDR")) {
    info.master_addr = *addr;
  } else if (auto nodes = env.text("SLURM_JOB_NODELIST")) {
    info.master_addr = first_slurm_host(*nodes);
  } else if (info.local_world_size == info.world_size) {
    info.master_addr = "127.0.0.1";
  } else {
    throw std::invalid_argument(
        "rendezvous: Slurm job on several nodes but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set");
  }
  if (auto port = env.number("MASTER_PORT")) {
    info.master_port = *port;
  } else if (auto job = env.number("SLURM_JOB_ID")) {
    info.master_port = 20000 + static_cast<int>(*job % 20000);  // same on every rank of the job
  }
  return info;
}

RendezvousInfo from_openmpi(const EnvReader& env) {
  RendezvousInfo info;
  info.source = "openmpi";
  info.rank = env.required_number("OMPI_COMM_WORLD_RANK", "Open MPI");
  info.world_size = env.required_number("OMPI_COMM_WORLD_SIZE", "Open MPI");
  info.local_rank = env.required_number("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI");
  info.local_world_size = env.required_number("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI");
  if (auto addr = env.text("MASTER_ADDR")) {
    info.master_addr = *addr;
  } else if (info.local_world_size != info.world_size) {
    throw std::invalid_argument(
        "rendezvous: Open MPI job on several nodes needs MASTER_ADDR (the host of rank 0)");
  }
  info.master_port = env.number("MASTER_PORT").value_or(29500);
  return info;
}

// See rendezvous.h: the first job-wide identity the launcher's environment offers.
std::string job_token(const EnvReader& env) {
  std::string token;
  if (auto t = env.text("MFSDP_JOB_TOKEN")) {
    token = *t;
  } else if (auto run = env.text("TORCHELASTIC_RUN_ID"); run && *run != "none") {
    token = "torchrun:" + *run;
  } else if (auto job = env.text("SLURM_JOB_ID")) {
    token = "slurm:" + *job + "." + env.text("SLURM_STEP_ID").value_or("");
  }
  if (token.size() > kMaxJobTokenBytes)
    throw std::invalid_argument("rendezvous: the job token (MFSDP_JOB_TOKEN, TORCHELASTIC_RUN_ID or "
                                "SLURM_JOB_ID) has " + std::to_string(token.size()) +
                                " bytes, more than " + std::to_string(kMaxJobTokenBytes));
  return token;
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at the first ',' outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    char c = nodelist[end];
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
  }
  std::string first = nodelist.substr(0, end);
  size_t open = first.find('[');
  if (open == std::string::npos) return first;
  // "node[03-05,9]" -> prefix "node" + first range start "03" (keeps zero padding).
  std::string ranges = first.substr(open + 1);
  size_t stop = ranges.find_first_of("-,]");
  return first.substr(0, open) + ranges.substr(0, stop);
}

int restart_count_from_env(const EnvLookup& getenv_fn) {
  const long count = EnvReader(getenv_fn).number("TORCHELASTIC_RESTART_COUNT").value_or(0);
  if (count < 0 || count > 1000000)
    throw std::invalid_argument("rendezvous: TORCHELASTIC_RESTART_COUNT=" + std::to_string(count) +
                                " is outside [0, 1000000]");
  return static_cast<int>(count);
}

RendezvousInfo rendezvous_from_env(const EnvLookup& getenv_fn) {
  EnvReader env(getenv_fn);
  RendezvousInfo info;
  if (env.has("RANK") || env.has("WORLD_SIZE")) {
    info = from_torchrun(env);
  } else if (env.has("SLURM_PROCID")) {
    info = from_slurm(env);
  } else if (env.has("OMPI_COMM_WORLD_RANK")) {
    info = from_openmpi(env);
  } else {
    throw std::invalid_argument(
        "rendezvous: no launcher environment found: set RANK and WORLD_SIZE (and MASTER_ADDR, "
        "MASTER_PORT), or start the program with mfsdp-run, torchrun, srun or mpirun");
  }
  check_consistent(info);
  info.job_token = job_token(env);
  info.agent_store = env.text("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  info.restart_count = restart_count_from_env(getenv_fn);
  const long max_restarts = env.number("TORCHELASTIC_MAX_RESTARTS").value_or(0);
  if (max_restarts < 0 || max_restarts > 1000000)
    throw std::invalid_argument("rendezvous: TORCHELASTIC_MAX_RESTARTS=" + std::to_string(max_restarts) +
                                " is outside [0, 1000000]");
  info.max_restarts = static_cast<int>(max_restarts);
  return info;
}

}  // namespace mfsdp
