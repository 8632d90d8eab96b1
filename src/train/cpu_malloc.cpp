#include "mfsdp/train/cpu_malloc.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace mfsdp {

bool keep_freed_cpu_memory(std::optional<bool> keep) {
  const char* setting = std::getenv("MFSDP_KEEP_FREED_MEMORY");
  if (!keep.value_or(!(setting != nullptr && std::strcmp(setting, "0") == 0))) return false;
#if defined(__GLIBC__)
  // Blocks below 32 MiB (glibc's largest mmap threshold; setting it also stops glibc from moving
  // it) come from the heap, where free() keeps them for the next step. Larger ones stay mmap'ed
  // and go back to the kernel when freed: kept in the heap, blocks of hundreds of MiB (gathered
  // embeddings, logits) fragment it, and a simulated 64-rank Llama-3-8B step grew past 24 GB
  // (OOM) where glibc's defaults peaked at 11.2 GB (docs/PERFORMANCE.md).
  const bool threshold = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  // Never shrink the heap top back to the kernel.
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, 0x7fffffff) == 1;
  return threshold && no_trim;
#else
  return false;
#endif
}

}  // namespace mfsdp
