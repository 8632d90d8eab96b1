// A CPU allocator that counts the bytes it has handed out and not yet got back, for tests that
// measure what a forward keeps (tests/dist/recompute_modes_test.cpp, activation_plan_test.cpp).
// Header-only.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace mfsdp::testing {

// Counts the bytes the CPU allocator has handed out and not yet got back. Its DataPtrs keep the
// data pointer as their context (as the default CPU allocator's do: c10 asserts it in
// raw_deallocate and elsewhere), so the base allocator's DataPtr waits in a map until freed.
struct CountingCpuAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> live{0};
  std::mutex mutex;
  std::unordered_map<void*, std::pair<c10::DataPtr, int64_t>> blocks;

  static CountingCpuAllocator*& instance() {
    static CountingCpuAllocator* a = nullptr;
    return a;
  }
  static void release(void* p) {
    CountingCpuAllocator* self = instance();
    c10::DataPtr inner;
    {
      std::lock_guard<std::mutex> lock(self->mutex);
      auto it = self->blocks.find(p);
      if (it == self->blocks.end()) return;
      self->live -= it->second.second;
      inner = std::move(it->second.first);
      self->blocks.erase(it);
    }
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    live += static_cast<int64_t>(n);
    if (data == nullptr) return {nullptr, nullptr, &release, device};
    {
      std::lock_guard<std::mutex> lock(mutex);
      blocks.emplace(data, std::make_pair(std::move(inner), static_cast<int64_t>(n)));
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

inline CountingCpuAllocator& counting_allocator() {
  // Installed once per process and never removed: tensors it allocated may outlive any test.
  static CountingCpuAllocator* a = [] {
    auto* c = new CountingCpuAllocator;
    c->base = c10::GetCPUAllocator();
    CountingCpuAllocator::instance() = c;
    c10::SetCPUAllocator(c, /*priority=*/200);
    return c;
  }();
  return *a;
}

}  // namespace mfsdp::testing
