#include "fsdp/buffer_allocator.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

namespace mfsdp::detail {
namespace {

constexpr size_t kAlign = 64;  // every placed buffer starts on a cache line
size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// c10::Allocator::allocate takes no device: CUDA's caching allocator uses the thread's current
// one. So `device` is made current around it; otherwise a rank whose thread still had cuda:0
// current got cuda:0 memory under tensors saying cuda:<rank>. (at::empty guards itself.) The
// device type is initialised first, as at::empty does: CUDA's caching allocator has no
// per-device state before it (an internal assert, "Allocator not initialized for device", on an
// H200 with torch 2.11 when a buffer was the process's first CUDA memory).
c10::DataPtr plain_allocation(size_t bytes, c10::Device device) {
  if (device.is_cuda()) at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  const c10::OptionalDeviceGuard guard(device.has_index() ? std::optional<c10::Device>(device) : std::nullopt);
  return c10::GetAllocator(device.type())->allocate(bytes);
}

// Memory handed out for one buffer; its deleter tells the allocator. `state` keeps the owner of
// reserved memory alive for as long as any buffer points into it; `owned` is memory of the
// buffer's own (tracing), freed with it.
template <class State>
struct Lease {
  std::shared_ptr<State> state;
  size_t slot;
  c10::DataPtr owned;
  static void release(void* ctx) {
    std::unique_ptr<Lease> lease(static_cast<Lease*>(ctx));
    lease->state->give_back(lease->slot);
  }
};

template <class State>
c10::DataPtr lease(const std::shared_ptr<State>& state, size_t slot, void* data, c10::Device device,
                   c10::DataPtr owned = c10::DataPtr()) {
  return c10::DataPtr(data, new Lease<State>{state, slot, std::move(owned)}, &Lease<State>::release, device);
}

class PlainAllocator final : public BufferAllocator {
 public:
  c10::DataPtr allocate(const void*, BufferRole, size_t bytes, at::ScalarType, c10::Device device) override {
    ++plain_;
    return plain_allocation(bytes, device);
  }
  BufferStats stats() const override { return {0, 0, plain_}; }

 private:
  int64_t plain_ = 0;
};

// Two persistent buffers per (dtype, role, bytes, device) class.
class DoubleBufferAllocator final : public BufferAllocator {
 public:
  struct State {
    std::mutex mutex;
    std::vector<at::Tensor> buffers;  // slot -> memory
    std::vector<bool> busy;
    void give_back(size_t slot) {
      std::lock_guard<std::mutex> lock(mutex);
      busy[slot] = false;
    }
  };

  c10::DataPtr allocate(const void*, BufferRole role, size_t bytes, at::ScalarType dtype,
                        c10::Device device) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto key = std::make_tuple(static_cast<int>(dtype), static_cast<int>(role), bytes, device.str());
    auto& slots = classes_[key];
    auto idle = std::find_if(slots.begin(), slots.end(), [&](size_t slot) { return !state_->busy[slot]; });
    if (idle == slots.end() && slots.size() < 2) {
      // A second buffer only once two of the class are alive together: a class only one unit
      // uses (the root, say) keeps a single buffer.
      slots.push_back(state_->buffers.size());
      state_->buffers.push_back(at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))},
                                          at::TensorOptions().dtype(at::kByte).device(device)));
      state_->busy.push_back(false);
      reserved_ += static_cast<int64_t>(bytes);
      idle = slots.end() - 1;
    }
    if (idle == slots.end()) {
      ++plain_;  // a third buffer of this class alive at once
      return plain_allocation(bytes, device);
    }
    state_->busy[*idle] = true;
    ++pooled_;
    return lease(state_, *idle, state_->buffers[*idle].data_ptr(), device);
  }
  BufferStats stats() const override { return {reserved_, pooled_, plain_}; }

 private:
  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::map<std::tuple<int, int, size_t, std::string>, std::vector<size_t>> classes_;
  int64_t reserved_ = 0, pooled_ = 0, plain_ = 0;
};

// Trace one step, plan offsets by interval colouring, replay.
class TracePoolAllocator final : public BufferAllocator {
 public:
  struct Event {  // one buffer of the traced step
    const void* owner;
    BufferRole role;
    size_t bytes;  // aligned
    at::ScalarType dtype;
    c10::Device device;
    int64_t begin, end;  // allocation and release time (event counter); end -1 while alive
    size_t offset = 0;   // planned place in its pool
  };
  struct State {
    std::mutex mutex;
    int64_t clock = 0;
    std::vector<Event> trace;       // while tracing
    std::vector<int64_t> live;      // replay: [slot] = 1 while the planned place is in use
    void give_back(size_t slot) {
      std::lock_guard<std::mutex> lock(mutex);
      ++clock;
      if (slot < trace.size() && trace[slot].end < 0) trace[slot].end = clock;  // tracing
      if (slot >= kReplayBase) live[slot - kReplayBase] = 0;
    }
  };
  static constexpr size_t kReplayBase = size_t(1) << 40;  // slots >= this are planned places

  c10::DataPtr allocate(const void* owner, BufferRole role, size_t bytes, at::ScalarType dtype,
                        c10::Device device) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    ++state_->clock;
    if (phase_ == Phase::kTracing) {
      // Plain memory, but its release is recorded too.
      const size_t slot = state_->trace.size();
      state_->trace.push_back({owner, role, aligned(bytes), dtype, device, state_->clock, -1});
      c10::DataPtr memory = plain_allocation(bytes, device);
      void* data = memory.get();
      ++plain_;
      return lease(state_, slot, data, device, std::move(memory));
    }
    if (phase_ == Phase::kReplaying && in_sync_ && next_ < plan_.size()) {
      const Event& e = plan_[next_];
      if (e.owner == owner && e.role == role && e.bytes == aligned(bytes) && e.dtype == dtype &&
          e.device == device && place_is_free(next_)) {
        state_->live[next_] = 1;
        const size_t slot = kReplayBase + next_++;
        ++pooled_;
        return lease(state_, slot, static_cast<char*>(pools_.at(pool_key(e)).data_ptr()) + e.offset, device);
      }
    }
    in_sync_ = false;  // off the plan for the rest of this step
    ++plain_;
    return plain_allocation(bytes, device);
  }

  void step_boundary() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    switch (phase_) {
      case Phase::kWaiting:  // the first step ran without prefetch: trace the second
        phase_ = Phase::kTracing;
        break;
      case Phase::kTracing:
        plan();
        break;
      case Phase::kReplaying:
      case Phase::kPlain:
        break;
    }
    next_ = 0;
    in_sync_ = true;
  }

  BufferStats stats() const override { return {reserved_, pooled_, plain_}; }

 private:
  enum class Phase { kWaiting, kTracing, kReplaying, kPlain };

  static std::string pool_key(const Event& e) {
    return std::string(c10::toString(e.dtype)) + "@" + e.device.str();
  }

  // Interval colouring: each buffer at the lowest offset of its pool where no buffer already
  // placed whose lifetime overlaps it lies. Larger buffers are placed first (ties: earlier
  // allocation first): for equal sizes this is the greedy left-edge colouring, which is optimal
  // for intervals, and the smaller buffers then fill the gaps; allocation order alone left a
  // root-sized gap once units stayed gathered across phases.
  void plan() {
    std::vector<Event> events = std::move(state_->trace);
    state_->trace.clear();
    for (const Event& e : events)
      if (e.end < 0) {  // alive across the step boundary: no fixed plan can hold it
        phase_ = Phase::kPlain;
        return;
      }
    std::vector<size_t> order(events.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return events[a].bytes > events[b].bytes; });
    std::map<std::string, size_t> pool_bytes;
    std::vector<const Event*> placed;
    for (size_t i : order) {
      Event& e = events[i];
      std::vector<std::pair<size_t, size_t>> taken;  // [offset, offset + bytes) of overlapping ones
      for (const Event* o : placed)
        if (pool_key(*o) == pool_key(e) && o->begin < e.end && e.begin < o->end)
          taken.emplace_back(o->offset, o->offset + o->bytes);
      std::sort(taken.begin(), taken.end());
      size_t offset = 0;
      for (const auto& [lo, hi] : taken) {
        if (offset + e.bytes <= lo) break;
        offset = std::max(offset, hi);
      }
      e.offset = offset;
      placed.push_back(&e);
      size_t& size = pool_bytes[pool_key(e)];
      size = std::max(size, offset + e.bytes);
    }
    for (const auto& [key, bytes] : pool_bytes) {
      const Event& any = *std::find_if(events.begin(), events.end(), [&](const Event& e) { return pool_key(e) == key; });
      pools_[key] = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(any.device));
      reserved_ += static_cast<int64_t>(bytes);
    }
    plan_ = std::move(events);
    state_->live.assign(plan_.size(), 0);
    phase_ = Phase::kReplaying;
  }

  // No buffer still in use overlaps the planned place of plan_[i] (e.g. one released later than
  // in the traced step).
  bool place_is_free(size_t i) const {
    const Event& e = plan_[i];
    for (size_t j = 0; j < plan_.size(); ++j) {
      if (!state_->live[j] || pool_key(plan_[j]) != pool_key(e)) continue;
      if (plan_[j].offset < e.offset + e.bytes && e.offset < plan_[j].offset + plan_[j].bytes) return false;
    }
    return true;
  }

  std::shared_ptr<State> state_ = std::make_shared<State>();
  Phase phase_ = Phase::kWaiting;
  std::vector<Event> plan_;
  std::map<std::string, at::Tensor> pools_;
  size_t next_ = 0;
  bool in_sync_ = true;
  int64_t reserved_ = 0, pooled_ = 0, plain_ = 0;
};

}  // namespace

std::shared_ptr<BufferAllocator> make_buffer_allocator(BufferAllocatorKind kind) {
  switch (kind) {
    case BufferAllocatorKind::kPlain: return std::make_shared<PlainAllocator>();
    case BufferAllocatorKind::kDoubleBuffer: return std::make_shared<DoubleBufferAllocator>();
    case BufferAllocatorKind::kTracePool: return std::make_shared<TracePoolAllocator>();
  }
  return std::make_shared<PlainAllocator>();
}

}  // namespace mfsdp::detail
