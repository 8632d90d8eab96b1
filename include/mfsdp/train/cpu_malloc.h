// Keeping freed CPU memory in the process instead of returning it to the kernel.
//
// LibTorch's CPU tensors come from glibc malloc. glibc hands blocks above its mmap threshold
// (and the heap top above its trim threshold) back to the kernel when they are freed, so every
// training step maps its activations and temporaries again and the kernel zeroes each page on
// first touch: on a 12-layer d=768 Llama that was ~15% of a bf16 step on CPU (docs/PERFORMANCE.md).
// After keep_freed_cpu_memory() freed blocks below 32 MiB stay in malloc's free lists and the
// next step reuses them, as a caching allocator does on a GPU; larger blocks are still mapped
// per use and returned when freed (kept, they fragmented the heap: a large model's peak RSS more
// than doubled). The heap is returned only when the process exits.
#pragma once

#include <optional>

namespace mfsdp {

// Sets glibc's M_MMAP_THRESHOLD to 32 MiB (its maximum) and M_TRIM_THRESHOLD to its maximum. Returns false (and changes
// nothing) when `keep` is false (unset: the environment's MFSDP_KEEP_FREED_MEMORY=0 says false; the
// tools' --keep-freed-cpu-memory sets it) or the C library is not glibc.
bool keep_freed_cpu_memory(std::optional<bool> keep = std::nullopt);

}  // namespace mfsdp
