// Internal to src/checkpoint: the three steps of a sharded save (docs/checkpoints.md, "Atomic
// saves"). save_checkpoint runs them back to back; AsyncCheckpointSaver (async_save.h) runs the
// first and the last, which talk to the other ranks, on the caller's thread, and the middle one,
// which only writes this rank's file, on a writer thread: the communicators belong to training
// and are never used from two threads at once.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/dcp_checkpoint.h"
#include "mfsdp/checkpoint/checkpoint.h"

namespace mfsdp::checkpoint {

// Step 1, collective: rank 0 removes what unfinished saves left in `save_dir` and creates
// `save_dir`/iter_N.tmp; every rank throws if that failed. Returns the .tmp folder.
std::string begin_save(const std::string& save_dir, Communicator& world, int64_t iteration);

// What this rank writes: its shards of the model and optimizer state (views of the live
// tensors, so they must be written or copied before training changes them) and its generators.
// `slices`: its tensor-parallel slices (TensorSlice), each a box of the whole tensor.
std::vector<TensorPiece> pieces_to_save(const FsdpHandle& model, const DistributedOptimizer* optimizer,
                                        int world_rank, int world_size, const TensorSlices& slices = {});

// The "mfsdp_metadata" record of a save: progress, world size, optimizer name, step and keys.
nlohmann::json save_metadata(const CheckpointInfo& info, int world_size, const DistributedOptimizer* optimizer);

// Step 2, this rank alone: writes its file into `tmp` (fsync) and returns its report (chunk
// list); a failure is returned as {"error": message naming the file}, never thrown, so that the
// ranks agree on the outcome in step 3.
nlohmann::json write_rank_report(const std::string& tmp, int rank, const std::vector<TensorPiece>& pieces,
                                 const nlohmann::json& metadata, CheckpointFormat format);

// Step 3, collective: every rank's report to every rank. If any rank failed, rank 0 removes
// `tmp` and every rank throws naming the failing rank and its error; otherwise rank 0 writes the
// metadata and commits (`tmp` becomes iter_N, then `latest` names it).
void finish_save(const std::string& save_dir, Communicator& world, const std::string& tmp, int64_t iteration,
                 const nlohmann::json& report, const nlohmann::json& metadata, CheckpointFormat format);

}  // namespace mfsdp::checkpoint
