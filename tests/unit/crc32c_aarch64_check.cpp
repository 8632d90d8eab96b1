// Built for aarch64 and run under qemu by tests/unit/crc32c_aarch64_test.sh: the ARMv8 crc32c path
// (src/base/crc32c.cpp) against the published values (RFC 3720 B.4) and against the table path.
#include <cstdio>
#include <string>
#include <vector>
#include "mfsdp/base/crc32c.h"
int main() {
  int bad = 0;
  auto expect = [&](uint32_t got, uint32_t want, const char* what) {
    if (got != want) { std::printf("FAIL %s: %08x != %08x\n", what, got, want); ++bad; }
  };
  expect(mfsdp::crc32c("123456789", 9), 0xe3069283u, "check value");
  std::vector<unsigned char> z(32, 0), f(32, 0xff), up(32);
  for (int i = 0; i < 32; ++i) up[i] = i;
  expect(mfsdp::crc32c(z.data(), 32), 0x8a9136aau, "zeros");
  expect(mfsdp::crc32c(f.data(), 32), 0x62a8ab43u, "ones");
  expect(mfsdp::crc32c(up.data(), 32), 0x46dd794eu, "incrementing");
  std::string s(100003, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 2246822519u >> 25);
  for (size_t n : {size_t{0}, size_t{7}, size_t{8}, size_t{9}, size_t{24577}, s.size()})
    expect(mfsdp::crc32c(s.data(), n), mfsdp::crc32c_extend_portable(0, s.data(), n), "long input");
  std::printf("%s\n", bad ? "FAILED" : "aarch64 crc32c: all checks pass");
  return bad;
}
