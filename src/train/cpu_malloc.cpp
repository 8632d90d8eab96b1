#include "mfsdp/cpu_malloc.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace mfsdp {

bool keep_freed_cpu_memory() {
  const char* setting = std::getenv("MFSDP_KEEP_FREED_MEMORY");
  if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
#if defined(__GLIBC__)
  // No mmap'ed blocks: large blocks come from the heap too, where free() keeps them. If the heap
  // cannot grow (brk fails), glibc still falls back to mmap for it, so nothing fails for want of
  // address space.
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  // Never shrink the heap top back to the kernel.
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, 0x7fffffff) == 1;
  return no_mmap && no_trim;
#else
  return false;
#endif
}

}  // namespace mfsdp
