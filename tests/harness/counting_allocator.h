// A CPU allocator that counts the bytes it has handed out and not yet got back, for tests that
// measure what a forward keeps (tests/dist/recompute_modes_test.cpp, activation_plan_test.cpp).
// Header-only.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>

namespace mfsdp::testing {

// Counts the bytes the CPU allocator has handed out and not yet got back.
struct CountingCpuAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> live{0};
  struct Block {
    c10::DataPtr inner;
    int64_t bytes;
    CountingCpuAllocator* owner;
  };
  static void release(void* p) {
    auto* b = static_cast<Block*>(p);
    b->owner->live -= b->bytes;
    delete b;
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    live += static_cast<int64_t>(n);
    return {data, new Block{std::move(inner), static_cast<int64_t>(n), this}, &release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

inline CountingCpuAllocator& counting_allocator() {
  // Installed once per process and never removed: tensors it allocated may outlive any test.
  static CountingCpuAllocator* a = [] {
    auto* c = new CountingCpuAllocator;
    c->base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(c, /*priority=*/200);
    return c;
  }();
  return *a;
}

}  // namespace mfsdp::testing
