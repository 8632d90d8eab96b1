// CRC-32C (Castagnoli, the polynomial of iSCSI, ext4 and TFRecord framing): the checksum that
// checkpoint chunks (docs/checkpoints.md) and indexed-dataset blocks (docs/data.md) carry, and
// that TensorBoard event records use. Uses the CPU's crc32 instructions where there are some
// (x86-64 SSE4.2, three streams: about memcpy speed; ARMv8 crc32c), else tables (slicing by 8:
// about 1-2 GB/s).
//
//   uint32_t c = mfsdp::crc32c(bytes.data(), bytes.size());
//   c = mfsdp::crc32c_extend(c, more.data(), more.size());   // == crc32c of bytes + more
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mfsdp {

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size);
inline uint32_t crc32c(const void* data, size_t size) { return crc32c_extend(0, data, size); }
// The CRC-32C of bytes A followed by bytes B, from crc32c(A), crc32c(B) and B's length, in
// O(log length) steps (multiplication by x^(8 length) modulo the polynomial) without the bytes:
// for writers that learn A's final bytes only after B went by (dcp::FileWriter's zip header).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);
// The table path alone, whatever the CPU has (what other CPUs run; tests compare the two).
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t size);

// The CRC-32C of bytes [offset, offset + length) of the file at `path`, read in blocks. Throws
// std::runtime_error naming the file when it cannot be opened or holds fewer bytes.
uint32_t crc32c_of_file_range(const std::string& path, uint64_t offset, uint64_t length);

// "0x1a2b3c4d": how files and messages write a CRC.
std::string crc32c_hex(uint32_t crc);

}  // namespace mfsdp
