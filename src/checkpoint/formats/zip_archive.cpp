// Stored zip archives: see src/checkpoint/formats/zip_archive.h.
#include "checkpoint/formats/zip_archive.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace mfsdp::zip {
namespace {

std::string quote(const std::string& s) { return "'" + s + "'"; }

uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
const unsigned char* bytes(const std::string& s, size_t at = 0) {
  return reinterpret_cast<const unsigned char*>(s.data()) + at;
}

const char kLegacyMagic[] = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";  // PROTO 2, LONG1 magic

}  // namespace

// ---- FileWindow ----------------------------------------------------------------------------------

FileWindow::FileWindow(const std::string& path, const std::string& what) : what_(what) {
  open(path);
  struct stat st;
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    fail("not a regular file");
  }
  length_ = static_cast<uint64_t>(st.st_size);
}

FileWindow::FileWindow(const std::string& path, const std::string& what, uint64_t offset, uint64_t length)
    : FileWindow(path, what) {
  if (offset > length_ || length > length_ - offset) {
    const uint64_t file_size = length_;
    length_ = 0;
    fail("bytes [" + std::to_string(offset) + ", " + std::to_string(offset + length) + ") lie outside the " +
         std::to_string(file_size) + "-byte file (truncated?)");
  }
  offset_ = offset;
  length_ = length;
}

FileWindow::~FileWindow() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWindow::open(const std::string& path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(std::string("cannot open: ") + std::strerror(errno));
}

void FileWindow::fail(const std::string& detail) const { throw std::invalid_argument(what_ + ": " + detail); }

void FileWindow::check(uint64_t at, uint64_t n, const std::string& item) const {
  if (at > length_ || n > length_ - at)
    fail(item + " at bytes [" + std::to_string(at) + ", " + std::to_string(at + n) + ") lies outside the " +
         std::to_string(length_) + "-byte " + (offset_ == 0 ? "file" : "archive") + " (truncated?)");
}

void FileWindow::read(uint64_t at, void* dst, uint64_t n, const std::string& item) const {
  check(at, n, item);
  auto* p = static_cast<char*>(dst);
  for (uint64_t done = 0; done < n;) {
    ssize_t r = ::pread(fd_, p + done, std::min<uint64_t>(n - done, 1u << 30),
                        static_cast<off_t>(offset_ + at + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) fail("reading " + item + " failed: " + (r == 0 ? "unexpected end of file" : std::strerror(errno)));
    done += static_cast<uint64_t>(r);
  }
}

std::string FileWindow::read(uint64_t at, uint64_t n, const std::string& item) const {
  check(at, n, item);
  std::string s(static_cast<size_t>(n), '\0');
  read(at, s.data(), n, item);
  return s;
}

// ---- ZipReader: the central directory (at the end) lists every entry ----------------------------

ZipReader::ZipReader(const std::string& path, const std::string& what) : file_(path, what) { read_directory(); }

ZipReader::ZipReader(const std::string& path, const std::string& what, uint64_t offset, uint64_t length)
    : file_(path, what, offset, length) {
  read_directory();
}

void ZipReader::read_directory() {
  const FileWindow& f = file_;
  const std::string head = f.read(0, std::min<uint64_t>(f.size(), 14), "the file header");
  if (head == std::string(kLegacyMagic, 14))
    f.fail("not a zip archive: the legacy (pre-1.6) torch.save format; re-save with torch>=1.6 "
           "(_use_new_zipfile_serialization=True, the default)");
  if (head.compare(0, 4, "PK\x03\x04") != 0) f.fail("not a zip archive (legacy torch.save format? re-save with torch>=1.6)");

  // The end-of-central-directory record: 22 bytes plus a comment of up to 64 KiB, which must
  // reach exactly to the end (so bytes inside stored data do not pass for one).
  const uint64_t tail_len = std::min<uint64_t>(f.size(), 22 + 0xffff);
  const uint64_t tail_at = f.size() - tail_len;
  const std::string tail = f.read(tail_at, tail_len, "the end of the zip archive");
  size_t eocd = std::string::npos;
  for (size_t i = tail.size() >= 22 ? tail.size() - 22 + 1 : 0; i-- > 0;)
    if (tail.compare(i, 4, "PK\x05\x06") == 0 && le(bytes(tail, i + 20), 2) == tail.size() - i - 22) {
      eocd = i;
      break;
    }
  if (eocd == std::string::npos) f.fail("truncated zip archive: no end-of-central-directory record");
  uint64_t count = le(bytes(tail, eocd + 10), 2), cd_size = le(bytes(tail, eocd + 12), 4),
           cd_at = le(bytes(tail, eocd + 16), 4);
  if (count == 0xffff || cd_size == 0xffffffff || cd_at == 0xffffffff) {  // zip64 (archives > 4 GiB)
    if (eocd < 20 || tail.compare(eocd - 20, 4, "PK\x06\x07") != 0) f.fail("zip64 archive without its locator");
    const std::string z = f.read(le(bytes(tail, eocd - 20 + 8), 8), 56, "the zip64 end-of-central-directory record");
    if (z.compare(0, 4, "PK\x06\x06") != 0) f.fail("bad zip64 end-of-central-directory record");
    count = le(bytes(z, 32), 8), cd_size = le(bytes(z, 40), 8), cd_at = le(bytes(z, 48), 8);
  }
  const std::string cd = f.read(cd_at, cd_size, "the zip central directory");

  size_t p = 0;
  for (uint64_t i = 0; i < count; ++i) {
    if (cd.size() - p < 46 || cd.compare(p, 4, "PK\x01\x02") != 0)
      f.fail("zip central directory entry " + std::to_string(i) + " is malformed");
    const unsigned char* h = bytes(cd, p);
    const uint64_t flags = le(h + 8, 2), method = le(h + 10, 2), name_len = le(h + 28, 2),
                   extra_len = le(h + 30, 2), comment_len = le(h + 32, 2);
    uint64_t csize = le(h + 20, 4), size = le(h + 24, 4), header = le(h + 42, 4);
    if (cd.size() - p - 46 < name_len + extra_len + comment_len)
      f.fail("zip central directory entry " + std::to_string(i) + " overruns the directory");
    const std::string name = cd.substr(p + 46, name_len);
    // The zip64 extra field holds the 8-byte values of those fields saturated at 0xffffffff.
    for (size_t x = p + 46 + name_len, end = x + extra_len; end - x >= 4;) {
      const uint64_t id = le(bytes(cd, x), 2), len = le(bytes(cd, x + 2), 2);
      if (end - x - 4 < len) f.fail("zip entry " + quote(name) + " has a malformed extra field");
      size_t v = x + 4;
      for (uint64_t* field : {&size, &csize, &header})
        if (id == 1 && *field == 0xffffffff) {
          if (v + 8 > x + 4 + len) f.fail("zip entry " + quote(name) + " has a short zip64 field");
          *field = le(bytes(cd, v), 8), v += 8;
        }
      x += 4 + len;
    }
    if (flags & 1) f.fail("zip entry " + quote(name) + " is encrypted");
    if (method != 0 || csize != size)
      f.fail("zip entry " + quote(name) + " is compressed (method " + std::to_string(method) +
             "); torch.save stores entries uncompressed");
    if (!entries_.emplace(name, Entry{header, size}).second) f.fail("zip entry " + quote(name) + " appears twice");
    p += 46 + name_len + extra_len + comment_len;
  }
}

std::vector<std::string> ZipReader::names() const {
  std::vector<std::string> out;
  for (const auto& kv : entries_) out.push_back(kv.first);
  return out;
}

const ZipReader::Entry& ZipReader::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) file_.fail("no zip entry " + quote(name));
  return it->second;
}

uint64_t ZipReader::size(const std::string& name) const { return entry(name).size; }

// After the local header, whose name and extra field (torch pads it to align storages to 64
// bytes) may differ in length from the central directory's.
uint64_t ZipReader::data_offset(const std::string& name) const {
  const Entry& e = entry(name);
  const std::string h = file_.read(e.header, 30, "the local header of zip entry " + quote(name));
  if (h.compare(0, 4, "PK\x03\x04") != 0) file_.fail("zip entry " + quote(name) + " has a bad local header");
  return e.header + 30 + le(bytes(h, 26), 2) + le(bytes(h, 28), 2);
}

std::string ZipReader::read(const std::string& name) const {
  return file_.read(data_offset(name), entry(name).size, "zip entry " + quote(name));
}

// ---- CRC-32 -------------------------------------------------------------------------------------

namespace {

// zip's CRC-32 (reflected 0xEDB88320), eight bytes per step ("slicing-by-8", as zlib's
// portable code): a byte-at-a-time table loop made this checksum nearly half of a checkpoint
// save's time (bench/ckpt_throughput.sh). Little-endian loads; torch.save is little-endian only.
// `c` is the register (the inverted CRC).
uint32_t crc32_tables(uint32_t c, const unsigned char* p, size_t left) {
  static const auto tables = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[0][n] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t n = 0; n < 256; ++n) t[k][n] = (t[k - 1][n] >> 8) ^ t[0][t[k - 1][n] & 0xff];
    return t;
  }();
  for (; left >= 8; p += 8, left -= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = tables[7][lo & 0xff] ^ tables[6][(lo >> 8) & 0xff] ^ tables[5][(lo >> 16) & 0xff] ^ tables[4][lo >> 24] ^
        tables[3][hi & 0xff] ^ tables[2][(hi >> 8) & 0xff] ^ tables[1][(hi >> 16) & 0xff] ^ tables[0][hi >> 24];
  }
  for (; left > 0; ++p, --left) c = tables[0][(c ^ *p) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
// Folding with carry-less multiplication (Intel, "Fast CRC Computation for Generic Polynomials
// Using PCLMULQDQ Instruction", 2009), four 128-bit lanes, then Barrett reduction; the constants
// are that paper's for the reflected CRC-32 (as in Linux's crc32-pclmul and Chromium's zlib).
// `n` >= 64 and a multiple of 16; `c` is the register. ~10x the tables.
__attribute__((target("sse4.2,pclmul"))) inline __m128i clmul_fold(__m128i acc, __m128i next, __m128i k) {
  const __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00);
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, k, 0x11), next), lo);
}

__attribute__((target("sse4.2,pclmul"))) uint32_t crc32_clmul(uint32_t c, const unsigned char* p, size_t n) {
  alignas(16) static const uint64_t k1k2[] = {0x0154442bd4ull, 0x01c6e41596ull};
  alignas(16) static const uint64_t k3k4[] = {0x01751997d0ull, 0x00ccaa009eull};
  alignas(16) static const uint64_t k5k0[] = {0x0163cd6124ull, 0x0000000000ull};
  alignas(16) static const uint64_t poly[] = {0x01db710641ull, 0x01f7011641ull};
  auto load = [](const unsigned char* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  __m128i x1 = load(p), x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(k1k2));
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    const __m128i x5 = _mm_clmulepi64_si128(x1, k, 0x00), x6 = _mm_clmulepi64_si128(x2, k, 0x00),
                  x7 = _mm_clmulepi64_si128(x3, k, 0x00), x8 = _mm_clmulepi64_si128(x4, k, 0x00);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k, 0x11), x5), load(p));
    x2 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x2, k, 0x11), x6), load(p + 16));
    x3 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x3, k, 0x11), x7), load(p + 32));
    x4 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x4, k, 0x11), x8), load(p + 48));
  }
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));
  x1 = clmul_fold(clmul_fold(clmul_fold(x1, x2, k), x3, k), x4, k);
  for (; n >= 16; p += 16, n -= 16) x1 = clmul_fold(x1, load(p), k);
  // 128 -> 64 bits, then 64 -> 32 with Barrett's reduction.
  x2 = _mm_clmulepi64_si128(x1, k, 0x10);
  x3 = _mm_setr_epi32(~0, 0, ~0, 0);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
  k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5k0));
  x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, x3), k, 0x00), x2);
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(poly));
  x2 = _mm_clmulepi64_si128(_mm_and_si128(x1, x3), k, 0x10);
  x2 = _mm_clmulepi64_si128(_mm_and_si128(x2, x3), k, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x1, x2), 1));
}

bool has_clmul() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

uint32_t crc32_portable(uint32_t crc, const void* data, size_t n) {
  return ~crc32_tables(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (n >= 64 && has_clmul()) {
    const size_t whole = n & ~size_t{15};
    c = crc32_clmul(c, p, whole);
    p += whole;
    n -= whole;
  }
#endif
  return ~crc32_tables(c, p, n);
}

// ---- writing ---------------------------------------------------------------------------------------

namespace {

void put(std::string& out, uint64_t v, int n) {
  for (int k = 0; k < n; ++k) out.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

}  // namespace

std::vector<std::string> stored_zip_frame(const std::vector<StoredEntry>& entries) {
  constexpr uint64_t kAlign = 64, kLimit = 0xfffffffeull;
  std::vector<std::string> frame(entries.size() + 1);
  std::string directory;
  uint64_t at = 0;  // archive bytes so far
  for (size_t i = 0; i < entries.size(); ++i) {
    const StoredEntry& e = entries[i];
    const std::string& name = e.name;
    if (e.size > kLimit || at > kLimit || name.size() > 0xffff)
      throw std::invalid_argument("zip: entry '" + name + "' is beyond the 4 GiB limit of this writer (no zip64)");
    std::string& out = frame[i];
    const uint64_t header_at = at;
    // The extra field ("FB", as torch.save writes it) pads the data to a 64-byte boundary.
    const uint64_t unpadded = header_at + 30 + name.size() + 4;
    const uint64_t extra = 4 + (kAlign - unpadded % kAlign) % kAlign;
    put(out, 0x04034b50, 4);
    put(out, 20, 2);  // version needed: 2.0
    put(out, 0, 2);   // flags
    put(out, 0, 2);   // method: stored
    put(out, 0, 4);   // time, date
    put(out, e.crc32, 4);
    put(out, e.size, 4);
    put(out, e.size, 4);
    put(out, name.size(), 2);
    put(out, extra, 2);
    out += name;
    put(out, 0x4246, 2);  // "FB"
    put(out, extra - 4, 2);
    out.append(extra - 4, 'Z');
    at += out.size() + e.size;

    put(directory, 0x02014b50, 4);
    put(directory, 0x031e, 2);  // made by: unix, 3.0
    put(directory, 20, 2);
    put(directory, 0, 2);
    put(directory, 0, 2);
    put(directory, 0, 4);
    put(directory, e.crc32, 4);
    put(directory, e.size, 4);
    put(directory, e.size, 4);
    put(directory, name.size(), 2);
    put(directory, 0, 2);  // extra
    put(directory, 0, 2);  // comment
    put(directory, 0, 2);  // disk
    put(directory, 0, 2);  // internal attributes
    put(directory, 0, 4);  // external attributes
    put(directory, header_at, 4);
    directory += name;
  }
  if (at > kLimit || entries.size() > 0xfffe)
    throw std::invalid_argument("zip: archive beyond the 4 GiB limit of this writer (no zip64)");
  std::string& out = frame.back();
  out = std::move(directory);
  const uint64_t directory_size = out.size();
  put(out, 0x06054b50, 4);
  put(out, 0, 2);
  put(out, 0, 2);
  put(out, entries.size(), 2);
  put(out, entries.size(), 2);
  put(out, directory_size, 4);
  put(out, at, 4);
  put(out, 0, 2);
  return frame;
}

std::string write_stored_zip(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::vector<StoredEntry> described;
  for (const auto& [name, data] : entries) described.push_back({name, data.size(), crc32(0, data.data(), data.size())});
  const std::vector<std::string> frame = stored_zip_frame(described);
  std::string out;
  size_t total = 0;
  for (const std::string& f : frame) total += f.size();
  for (const auto& e : entries) total += e.second.size();
  out.reserve(total);
  for (size_t i = 0; i < entries.size(); ++i) out += frame[i], out += entries[i].second;
  out += frame.back();
  return out;
}

}  // namespace mfsdp::zip
