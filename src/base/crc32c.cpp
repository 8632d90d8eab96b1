// CRC-32C (include/mfsdp/base/crc32c.h): the SSE4.2 crc32 instruction 8 bytes at a time, three
// streams at once, or ARMv8's crc32c instructions, where the CPU has them (checked once at run
// time, so one binary runs everywhere), else tables, 8 bytes at a time.
#include "mfsdp/base/crc32c.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
#include <nmmintrin.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <arm_acle.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace mfsdp {
namespace {

// Slicing by 8 (Intel's method, as in zlib): eight tables, one per byte position of a 64-bit
// word, so one lookup per byte without the byte-serial dependency (~4x the one-table loop).
struct SliceTables {
  uint32_t t[8][256];
};

SliceTables make_slice_tables() {
  SliceTables s{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;  // reflected 0x1EDC6F41
    s.t[0][i] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (uint32_t i = 0; i < 256; ++i) s.t[k][i] = (s.t[k - 1][i] >> 8) ^ s.t[0][s.t[k - 1][i] & 0xff];
  return s;
}

uint32_t extend_table(uint32_t crc, const unsigned char* p, size_t n) {
  static const SliceTables s = make_slice_tables();
  for (; n >= 8; p += 8, n -= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = s.t[7][lo & 0xff] ^ s.t[6][(lo >> 8) & 0xff] ^ s.t[5][(lo >> 16) & 0xff] ^ s.t[4][lo >> 24] ^
          s.t[3][hi & 0xff] ^ s.t[2][(hi >> 8) & 0xff] ^ s.t[1][(hi >> 16) & 0xff] ^ s.t[0][hi >> 24];
  }
  for (; n > 0; ++p, --n) crc = s.t[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint64_t extend_words(uint64_t c, const unsigned char* p, size_t words) {
  for (size_t i = 0; i < words; ++i, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  return c;
}

// The crc32 instruction has a latency of 3 cycles and a throughput of 1: three independent
// streams over three consecutive segments of kStride bytes run about 3x faster than one. Their
// CRCs are joined with the linear map "append kStride zero bytes" (for the raw, uninverted CRC,
// crc(s, A || B) = shift(s, |B|) ^ crc(0, B)), applied through four byte tables.
constexpr size_t kStride = 8192;

struct ShiftTables {
  uint32_t t[4][256];
};

__attribute__((target("sse4.2"))) ShiftTables make_shift_tables() {
  static const unsigned char zeros[kStride] = {};
  uint32_t basis[32];
  for (int b = 0; b < 32; ++b) basis[b] = static_cast<uint32_t>(extend_words(1u << b, zeros, kStride / 8));
  ShiftTables s{};
  for (int k = 0; k < 4; ++k)
    for (uint32_t v = 0; v < 256; ++v)
      for (int b = 0; b < 8; ++b)
        if (v & (1u << b)) s.t[k][v] ^= basis[8 * k + b];
  return s;
}

uint32_t shift_stride(const ShiftTables& s, uint32_t crc) {
  return s.t[0][crc & 0xff] ^ s.t[1][(crc >> 8) & 0xff] ^ s.t[2][(crc >> 16) & 0xff] ^ s.t[3][crc >> 24];
}

__attribute__((target("sse4.2"))) uint32_t extend_sse42(uint32_t crc, const unsigned char* p, size_t n) {
  static const ShiftTables tables = make_shift_tables();
  uint64_t c = crc;
  for (; n >= 3 * kStride; p += 3 * kStride, n -= 3 * kStride) {
    uint64_t c1 = 0, c2 = 0;
    const unsigned char* q = p;
    for (size_t i = 0; i < kStride / 8; ++i, q += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, q, 8);
      std::memcpy(&w1, q + kStride, 8);
      std::memcpy(&w2, q + 2 * kStride, 8);
      c = _mm_crc32_u64(c, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    c = shift_stride(tables, static_cast<uint32_t>(c)) ^ c1;
    c = shift_stride(tables, static_cast<uint32_t>(c)) ^ c2;
  }
  c = extend_words(c, p, n / 8);
  p += n / 8 * 8;
  n %= 8;
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; ++p, --n) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

bool has_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

#if defined(__aarch64__) && defined(__linux__)
// ARMv8's crc32c instructions (optional in v8.0, so checked at run time through HWCAP).
__attribute__((target("+crc"))) uint32_t extend_arm(uint32_t crc, const unsigned char* p, size_t n) {
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    crc = __crc32cd(crc, word);
  }
  for (; n > 0; ++p, --n) crc = __crc32cb(crc, *p);
  return crc;
}

bool has_arm_crc() {
  static const bool yes = (::getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
  return yes;
}
#endif

}  // namespace

namespace {

constexpr uint32_t kReflectedPolynomial = 0x82f63b78u;  // 0x1EDC6F41, bit-reversed

// a * b modulo the polynomial, both in the reflected representation (bit 31 is x^0).
uint32_t multiply_mod(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kReflectedPolynomial : b >> 1;
  }
  return product;
}

// x^(8 n) modulo the polynomial: the factor that moves a CRC past n zero bytes. Square and
// multiply over the bits of 8 n.
uint32_t x_to_8n(uint64_t n) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t power = 1u << 23;   // x^8
  for (; n != 0; n >>= 1) {
    if (n & 1) result = multiply_mod(power, result);
    power = multiply_mod(power, power);
  }
  return result;
}

}  // namespace

// The pre- and post-inversion of both CRCs cancel (CRC is affine), so appending B to A is
// crc(A) shifted over |B| zero bytes, xor crc(B).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return multiply_mod(x_to_8n(length_b), crc_a) ^ crc_b;
}

uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t size) {
  return ~extend_table(~crc, static_cast<const unsigned char*>(data), size);
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (has_sse42()) return ~extend_sse42(crc, p, size);
#elif defined(__aarch64__) && defined(__linux__)
  if (has_arm_crc()) return ~extend_arm(crc, p, size);
#endif
  return ~extend_table(crc, p, size);
}

uint32_t crc32c_of_file_range(const std::string& path, uint64_t offset, uint64_t length) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("'" + path + "' cannot be read: " + std::strerror(errno));
  std::vector<unsigned char> block(std::min<uint64_t>(length, 4u << 20));
  uint32_t crc = 0;
  for (uint64_t done = 0; done < length;) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(block.size(), length - done));
    const ssize_t n = ::pread(fd, block.data(), want, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "the file ends at byte " + std::to_string(offset + done);
      ::close(fd);
      throw std::runtime_error("'" + path + "': cannot read bytes [" + std::to_string(offset) + ", " +
                               std::to_string(offset + length) + "): " + why);
    }
    crc = crc32c_extend(crc, block.data(), static_cast<size_t>(n));
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return crc;
}

std::string crc32c_hex(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", crc);
  return buf;
}

}  // namespace mfsdp
