// Where this process sits in the job and how ranks find each other, read from the environment
// that a launcher sets: torchrun/mfsdp-run, Slurm's srun, or Open MPI's mpirun.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace mfsdp {

// Longest job token the store accepts (it reads no more from a client that has not proved it).
constexpr size_t kMaxJobTokenBytes = 1024;

struct RendezvousInfo {
  int rank = 0;              // global rank, 0 <= rank < world_size
  int world_size = 1;
  int local_rank = 0;        // rank on this node, 0 <= local_rank < local_world_size
  int local_world_size = 1;  // ranks on this node
  std::string master_addr = "127.0.0.1";  // host of rank 0, where the store server listens
  int master_port = 29500;
  std::string source;        // "torchrun", "slurm", "openmpi" or "explicit"
  // The job's identity, which every rank proves to the store before it is served
  // (src/comm/store_server.h): the same on every rank of one job, different between jobs.
  // Empty: the job has none, and any process that reaches the store can join it.
  std::string job_token;
  // torchrun's agent serves a c10d TCPStore at master_addr:master_port and says so
  // (TORCHELASTIC_USE_AGENT_STORE=True, as torch's env:// rendezvous reads it): every rank is its
  // client, and the job token is not checked (the agent's store knows none).
  bool agent_store = false;
  // Which start of the job this is (TORCHELASTIC_RESTART_COUNT: 0 first, then one more per
  // restart) and how many restarts the launcher allows (TORCHELASTIC_MAX_RESTARTS). Keys of one
  // start are kept apart from an earlier start's in a store that outlives them.
  int restart_count = 0;
  int max_restarts = 0;

  // Every rank of the job runs on this node (then the loopback interface carries the traffic).
  bool single_node() const { return local_world_size == world_size; }
};

using EnvLookup = std::function<const char*(const char*)>;

// Reads, in this order of preference:
//   torchrun / mfsdp-run: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   Slurm:   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (or
//            SLURM_TASKS_PER_NODE); MASTER_ADDR (else the first host of SLURM_JOB_NODELIST);
//            MASTER_PORT (else 20000 + SLURM_JOB_ID % 20000)
//   Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
//            OMPI_COMM_WORLD_LOCAL_SIZE; MASTER_ADDR (required on several nodes), MASTER_PORT
// torchrun's agent store and restart count: TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT,
// TORCHELASTIC_MAX_RESTARTS (mfsdp-run sets the last two as well).
// The job token, whatever the launcher: MFSDP_JOB_TOKEN (mfsdp-run makes a random one on a single
// node), else TORCHELASTIC_RUN_ID (torchrun's --rdzv-id; --standalone makes a random one) unless
// it is "none", else "slurm:<SLURM_JOB_ID>.<SLURM_STEP_ID>" under Slurm, else empty.
// Throws std::invalid_argument naming the variable when a required one is missing, is not a
// number, or is inconsistent with the others (e.g. RANK >= WORLD_SIZE), or when the token is
// longer than 1024 bytes.
RendezvousInfo rendezvous_from_env(const EnvLookup& getenv_fn = nullptr);

// Which start of the job this process belongs to: TORCHELASTIC_RESTART_COUNT (torchrun, and
// mfsdp-run's restarts), 0 when unset. Throws std::invalid_argument naming the variable when it is
// not a non-negative integer.
int restart_count_from_env(const EnvLookup& getenv_fn = nullptr);

// First host name of a Slurm node list: "node[03-05,9],gpu1" -> "node03".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace mfsdp
