// AsyncCheckpointSaver: stage on the caller's thread, write on a writer thread, commit on the
// caller's thread (include/mfsdp/checkpoint/async_save.h).
#include "mfsdp/checkpoint/async_save.h"

#include <ATen/ATen.h>

#include <atomic>
#include <stdexcept>
#include <thread>

#ifdef MFSDP_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

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

// `bytes` of staging: plain memory for CPU shards; page-locked for shards on CUDA (`cuda`), so
// the device copies run at full speed, taken from CUDA at exactly that size and handed back when
// the tensor dies. Not PyTorch's pinned allocator (pinned_memory(true)): it rounds every block up
// to a power of two and keeps freed blocks cached, so 17 GiB of staging would pin 32 GiB, and a
// buffer that grows would leave the old one pinned as well.
at::Tensor staging_buffer(int64_t bytes, std::optional<at::Device> cuda) {
  const auto bytes_type = at::TensorOptions().dtype(at::kByte);
  if (!cuda || bytes == 0) return at::empty({bytes}, bytes_type);
#ifdef MFSDP_WITH_CUDA
  c10::cuda::CUDAGuard guard(*cuda);
  void* data = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&data, static_cast<size_t>(bytes), cudaHostAllocDefault));
  return at::from_blob(data, {bytes}, [](void* p) { cudaFreeHost(p); }, bytes_type);
#else
  // Without mfsdp's CUDA path (MFSDP_CUDA=OFF over a CUDA LibTorch) only PyTorch's allocator.
  return at::empty({bytes}, bytes_type.pinned_memory(true));
#endif
}

}  // namespace

AsyncCheckpointSaver::AsyncCheckpointSaver() = default;

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  if (pending_ && pending_->writer.joinable()) pending_->writer.join();
}

bool AsyncCheckpointSaver::in_flight() const { return pending_ != nullptr; }

int64_t AsyncCheckpointSaver::iteration_in_flight() const { return pending_ ? pending_->iteration : -1; }

int64_t AsyncCheckpointSaver::staging_bytes() const { return staging_.defined() ? staging_.numel() : 0; }

int64_t AsyncCheckpointSaver::pinned_bytes() const { return staging_pinned_ ? staging_bytes() : 0; }

const void* AsyncCheckpointSaver::staging_data() const { return staging_.defined() ? staging_.data_ptr() : nullptr; }

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
    std::optional<at::Device> cuda;
    for (const auto& p : live) {
      total += aligned(p.data.numel() * static_cast<int64_t>(p.data.element_size()));
      if (!cuda && p.data.is_cuda()) cuda = p.data.device();
    }
    if (!staging_.defined() || staging_.numel() < total || staging_pinned_ != cuda.has_value()) {
      staging_ = at::Tensor();  // the old buffer goes back first: never both at once
      staging_pinned_ = false;
      staging_ = staging_buffer(total, cuda);
      staging_pinned_ = cuda.has_value();
    }
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
