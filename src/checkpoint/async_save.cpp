// AsyncCheckpointSaver: stage on the caller's thread, write on a writer thread, commit on the
// caller's thread (include/mfsdp/checkpoint/async_save.h).
#include "mfsdp/checkpoint/async_save.h"

#include <ATen/ATen.h>

#include <atomic>
#include <stdexcept>
#include <thread>

#include "checkpoint/save_steps.h"

namespace mfsdp {

struct AsyncCheckpointSaver::Pending {
  std::string save_dir, tmp;
  int64_t iteration = 0;
  nlohmann::json meta;
  std::vector<checkpoint::TensorPiece> pieces;  // views of the staging buffer
  nlohmann::json report;                        // the writer's outcome; read once `done`
  std::atomic<bool> done{false};
  std::thread writer;
};

namespace {

// Offsets in the staging buffer are multiples of this, so every piece can be viewed as its dtype.
constexpr int64_t kAlign = 64;

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

AsyncCheckpointSaver::AsyncCheckpointSaver() = default;

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  if (pending_ && pending_->writer.joinable()) pending_->writer.join();
}

bool AsyncCheckpointSaver::in_flight() const { return pending_ != nullptr; }

int64_t AsyncCheckpointSaver::iteration_in_flight() const { return pending_ ? pending_->iteration : -1; }

int64_t AsyncCheckpointSaver::staging_bytes() const { return staging_.defined() ? staging_.numel() : 0; }

void AsyncCheckpointSaver::save(const std::string& save_dir, const std::shared_ptr<Communicator>& world,
                                const FsdpHandle& model, const DistributedOptimizer* optimizer,
                                const CheckpointInfo& info, const TensorSlices& slices) {
  if (!world) throw std::invalid_argument("AsyncCheckpointSaver::save: the communicator is null");
  if (info.iteration < 0) throw std::invalid_argument("AsyncCheckpointSaver::save: negative iteration");
  finish(world);  // one save in flight at a time: the next waits for the previous
  at::NoGradGuard no_grad;
  const int rank = world->rank();
  auto pending = std::make_unique<Pending>();
  pending->save_dir = save_dir;
  pending->iteration = info.iteration;
  pending->tmp = checkpoint::begin_save(save_dir, *world, info.iteration);
  pending->meta = checkpoint::save_metadata(info, world->size(), optimizer);
  // A staging failure (out of memory) becomes this rank's report, as a failed write would, so
  // every rank still has a save in flight and the ranks agree on the outcome when it commits.
  try {
    std::vector<checkpoint::TensorPiece> live = checkpoint::pieces_to_save(model, optimizer, rank, world->size(), slices);
    int64_t total = 0;
    bool on_cuda = false;
    for (const auto& p : live) {
      total += aligned(p.data.numel() * static_cast<int64_t>(p.data.element_size()));
      on_cuda = on_cuda || p.data.is_cuda();
    }
    // Pinned host memory lets the device copy run at full speed; CPU shards need plain memory.
    if (!staging_.defined() || staging_.numel() < total || staging_.is_pinned() != on_cuda)
      staging_ = at::empty({total}, at::TensorOptions().dtype(at::kByte).pinned_memory(on_cuda));
    int64_t offset = 0;
    for (auto& p : live) {
      const int64_t bytes = p.data.numel() * static_cast<int64_t>(p.data.element_size());
      at::Tensor staged = staging_.narrow(0, offset, bytes).view(p.data.scalar_type()).view({p.data.numel()});
      staged.copy_(p.data);  // blocking: the values are those of this iteration when it returns
      offset += aligned(bytes);
      pending->pieces.push_back(
          {std::move(p.tensor), std::move(p.shape), p.offset, staged, std::move(p.slice_shape), std::move(p.origin)});
    }
  } catch (const std::exception& e) {
    pending->report = {{"error", "staging iteration " + std::to_string(info.iteration) + " for '" + pending->tmp +
                                     "' failed: " + e.what()}};
    pending->done = true;
    pending_ = std::move(pending);
    return;
  }
  Pending* job = pending.get();
  job->writer = std::thread([job, rank] {
    try {
      job->report = checkpoint::write_rank_report(job->tmp, rank, job->pieces, job->meta,
                                                  CheckpointFormat::kFsdpDtensor);
    } catch (...) {  // write_rank_report reports what it can; anything else must not be lost either
      job->report = {{"error", "the checkpoint writer of '" + job->tmp + "' failed"}};
    }
    job->done.store(true, std::memory_order_release);
  });
  pending_ = std::move(pending);
}

std::optional<int64_t> AsyncCheckpointSaver::finish(const std::shared_ptr<Communicator>& world) {
  if (!pending_) return std::nullopt;
  if (!world) throw std::invalid_argument("AsyncCheckpointSaver::finish: the communicator is null");
  std::unique_ptr<Pending> job = std::move(pending_);  // whatever happens, it is no longer in flight
  if (job->writer.joinable()) job->writer.join();
  checkpoint::finish_save(job->save_dir, *world, job->tmp, job->iteration, job->report, job->meta,
                          CheckpointFormat::kFsdpDtensor);
  return job->iteration;
}

std::optional<int64_t> AsyncCheckpointSaver::try_finish(const std::shared_ptr<Communicator>& world) {
  if (!pending_) return std::nullopt;
  if (!world) throw std::invalid_argument("AsyncCheckpointSaver::try_finish: the communicator is null");
  const bool mine_done = pending_->done.load(std::memory_order_acquire);
  at::Tensor busy = at::full({1}, mine_done ? 0.0 : 1.0, at::TensorOptions().dtype(at::kFloat).device(world->device()));
  world->all_reduce(busy, {ReduceOp::kMax});
  if (busy.item<float>() != 0) return std::nullopt;
  return finish(world);
}

}  // namespace mfsdp
