// Megatron's non-persistent *local* checkpoints (--non-persistent-ckpt-type local): each rank
// writes what it holds (its main-weight shards, its optimizer state, the root's buffers, its
// generators) to a node-local folder (--non-persistent-local-ckpt-dir, /dev/shm by default) and
// keeps a replica of one other rank's file, that of the rank `jump` below it (jump = the ranks
// per node: a rank of another host, when there is one), so that losing one host's local files
// is survivable. Only the newest one is kept. See docs/checkpoints.md, "Non-persistent
// checkpoints".
//
//   DIR/<job>/iter_0000042/rank_00003.safetensors   rank 3's state (a safetensors file whose
//                                                   __metadata__ records iteration and layout)
//   DIR/<job>/iter_0000042/rank_00003.json          its manifest: size and CRC-32C, written
//                                                   last (atomically): no manifest, no checkpoint
//   DIR/<job>/iter_0000042/replica_00001.safetensors / .json   rank 1's state, held by rank 3
//
// <job> names the job by its --save folder, so another job's files in the same folder are never
// taken for this one's. A local checkpoint loads only into the same layout (world size and every
// rank's shard shapes, recorded as a layout checksum): a checkpoint of another layout, a missing
// or short file, a CRC mismatch are each "not valid" and skipped, never loaded.
//
// Why not the DCP format of --save: a DCP folder needs every rank's chunk list in one .metadata
// that one rank writes; here each rank's file must stand alone on its node.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"

namespace mfsdp {

struct LocalCheckpointOptions {
  std::string dir;        // --non-persistent-local-ckpt-dir
  std::string job;        // names the job (its --save folder); hashed into the folder name
  int replica_jump = 1;   // the replica of rank r is kept by rank (r + jump) % world
};

// What a local checkpoint records besides tensors.
struct LocalCheckpointProgress {
  int64_t iteration = 0;
  int64_t consumed_samples = 0;
  std::string extra;  // the caller's, stored and given back as it is (the trainer's LR schedule)
};

class LocalCheckpointer {
 public:
  LocalCheckpointer(LocalCheckpointOptions options, std::shared_ptr<Communicator> world);
  // Waits for a write in flight (it is not lost: the files are complete or have no manifest).
  ~LocalCheckpointer();
  LocalCheckpointer(const LocalCheckpointer&) = delete;
  LocalCheckpointer& operator=(const LocalCheckpointer&) = delete;

  // Collective. Waits for the previous write (settle()), copies this rank's state into one host
  // buffer (the stall training sees), swaps buffers with the replica peers, and returns while a
  // thread writes both files. A write that failed on any rank is thrown on every rank, naming it,
  // by the next save() or wait().
  void save(const LocalCheckpointProgress& progress, const FsdpHandle& model, const DistributedOptimizer& optimizer);
  // Collective: waits for the write in flight and throws, on every rank, any rank's error; once
  // every rank has written it, removes this rank's files of older iterations.
  void wait();

  // Collective: the newest iteration whose state every rank can have, its own file or the
  // replica another rank keeps, each verified against its manifest's CRC-32C and the current
  // layout; nullopt when there is none. `why_not` (if given) gets, on every rank, what was
  // skipped and why (for the log).
  std::optional<int64_t> newest_valid(const FsdpHandle& model, const DistributedOptimizer& optimizer,
                                      std::string* why_not = nullptr);
  // Collective: loads iteration `iteration` (found by newest_valid): a rank whose own file is
  // missing or invalid gets its replica from the rank that keeps it. Restores the model's main
  // weights (and model weights), buffers, optimizer state and step, and the generators.
  LocalCheckpointProgress load(int64_t iteration, FsdpHandle& model, DistributedOptimizer& optimizer);

  // The folder of this job's local checkpoints.
  const std::string& job_dir() const { return job_dir_; }
  // Bytes of this rank's last staged state.
  int64_t staged_bytes() const;

 private:
  struct Writer;
  void settle();  // wait()
  LocalCheckpointOptions options_;
  std::shared_ptr<Communicator> world_;
  std::string job_dir_;
  std::unique_ptr<Writer> writer_;
};

}  // namespace mfsdp
