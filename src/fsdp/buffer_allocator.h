// Where a root's transient buffers get their memory (docs/fully_shard.md, allocators): the
// unsharded weights of ZeRO-3 units and every unit's unsharded gradient buffer.
//
//   plain          a fresh allocation per use, returned when the buffer is released;
//   double buffer  up to two persistent buffers per (dtype, role, size) class (the second made
//                  when two are alive at once), handed out while idle (--fsdp-double-buffer); a
//                  third concurrent request gets a plain allocation;
//   trace pool     the second step's allocations and frees are recorded (the first runs without
//                  prefetch), then placed by interval colouring (greedy first fit in order of
//                  allocation) at fixed offsets of one pool per dtype; later steps get the same
//                  offsets. A request that does not match the trace, or whose planned place is
//                  still in use (an evaluation pass in between, a changed schedule), gets a plain
//                  allocation instead, and the step goes on safely.
//
// Memory comes back through the DataPtr's deleter: a buffer is released exactly when the last
// tensor viewing it is gone, so no caller can hand back memory that is still referenced.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>

#include "mfsdp/fsdp/fully_shard.h"

namespace mfsdp::detail {

enum class BufferRole { kWeights = 0, kGradients = 1 };

struct BufferStats {
  int64_t reserved_bytes = 0;  // held persistently (double buffers, the pool)
  int64_t pooled = 0;          // requests served from reserved memory
  int64_t plain = 0;           // requests served by a plain allocation (fallbacks, or all)
};

class BufferAllocator {
 public:
  virtual ~BufferAllocator() = default;
  // Memory for `bytes` bytes of buffer (`owner`, `role`) on `device`.
  virtual c10::DataPtr allocate(const void* owner, BufferRole role, size_t bytes, at::ScalarType dtype,
                                c10::Device device) = 0;
  // The optimizer step ended: a new step (of the same shape, usually) begins.
  virtual void step_boundary() {}
  virtual BufferStats stats() const = 0;
};

std::shared_ptr<BufferAllocator> make_buffer_allocator(BufferAllocatorKind kind);

}  // namespace mfsdp::detail
