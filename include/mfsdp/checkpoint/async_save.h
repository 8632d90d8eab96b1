// Asynchronous sharded saves (--async-save, Megatron's flag; docs/checkpoints.md, "Asynchronous
// saves"). save() copies this rank's shards of the model and optimizer state into staging CPU
// buffers (pinned when the shards are on CUDA) and returns: training goes on while a writer
// thread writes, checksums and fsyncs this rank's file into SAVE/iter_N.tmp. The writer never
// communicates (the communicators are training's); the commit, which needs every rank's chunk
// list, runs on the caller's thread in finish() or try_finish(), and is the same crash-safe
// commit as save_checkpoint's: until it, `latest` names the previous checkpoint.
//
//   mfsdp::AsyncCheckpointSaver saver;
//   for (step...) {
//     train_step();
//     saver.try_finish(world);                        // commits a finished save (cheap, collective)
//     if (step % 100 == 0) saver.save("ckpt", world, root, opt.get(), info);  // waits for the last
//   }
//   saver.finish(world);                              // before exit: the last save commits
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "mfsdp/checkpoint/checkpoint.h"

namespace mfsdp {

class AsyncCheckpointSaver {
 public:
  AsyncCheckpointSaver();
  // Waits for a writer still running and commits nothing (no communication is possible here):
  // like a crash, the save in flight stays an unfinished iter_N.tmp, which the next save removes.
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  // Collective over `world`, as save_checkpoint. First finishes the save in flight (finish(),
  // which throws if it failed); then rank 0 prepares SAVE/iter_<info.iteration>.tmp, every rank
  // stages its shards and starts its writer, and the call returns. The fsdp_dtensor format only.
  void save(const std::string& save_dir, const std::shared_ptr<Communicator>& world, const FsdpHandle& model,
            const DistributedOptimizer* optimizer, const CheckpointInfo& info, const TensorSlices& slices = {});

  // Collective: waits for this rank's writer, then commits the save in flight. A write that
  // failed on any rank throws on every rank, naming that rank and its error (the file), removes
  // the unfinished folder and leaves `latest` as it was. Returns the iteration committed, or
  // nullopt when no save was in flight.
  std::optional<int64_t> finish(const std::shared_ptr<Communicator>& world);

  // Collective and non-blocking (Megatron's maybe_finalize_async_save): one small all-reduce of
  // whether each rank's writer is done; when all are, commits as finish() does. Every rank gets
  // the same answer, so all or none of them commit. Returns the iteration committed, if any.
  std::optional<int64_t> try_finish(const std::shared_ptr<Communicator>& world);

  bool in_flight() const;
  // The iteration of the save in flight (-1: none).
  int64_t iteration_in_flight() const;
  // Bytes of this rank's staging buffer (kept between saves, so later saves allocate nothing;
  // replaced, the old one freed first, only when a save needs more): exactly what it holds.
  int64_t staging_bytes() const;
  // Of those, the page-locked host memory this saver holds: all of them when the shards are on
  // CUDA (taken from CUDA at exactly that size, not from PyTorch's caching pinned allocator,
  // which rounds up to a power of two), else 0.
  int64_t pinned_bytes() const;
  // The staging buffer's first byte (nullptr: none yet), e.g. to ask CUDA what memory it is.
  const void* staging_data() const;

 private:
  struct Pending;
  std::unique_ptr<Pending> pending_;
  at::Tensor staging_;  // one byte buffer, every piece a view of it
  bool staging_pinned_ = false;
};

}  // namespace mfsdp
