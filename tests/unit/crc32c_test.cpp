// CRC-32C against published values: RFC 3720 (iSCSI) appendix B.4 and the "123456789" check
// value of the Castagnoli CRC catalogue, on both sides of the 8-byte step of the hardware path.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "harness/temp_dir.h"
#include "mfsdp/base/crc32c.h"

namespace {

uint32_t of(const std::vector<uint8_t>& v) { return mfsdp::crc32c(v.data(), v.size()); }
uint32_t portable(const std::vector<uint8_t>& v) { return mfsdp::crc32c_extend_portable(0, v.data(), v.size()); }

TEST(Crc32c, MatchesPublishedValues) {
  EXPECT_EQ(mfsdp::crc32c("123456789", 9), 0xe3069283u);
  EXPECT_EQ(mfsdp::crc32c("", 0), 0u);
  EXPECT_EQ(of(std::vector<uint8_t>(32, 0x00)), 0x8a9136aau);
  EXPECT_EQ(of(std::vector<uint8_t>(32, 0xff)), 0x62a8ab43u);
  std::vector<uint8_t> up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<uint8_t>(i);
    down[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(of(up), 0x46dd794eu);
  EXPECT_EQ(of(down), 0x113fdb5cu);
  // The table path (other CPUs) on the same values.
  EXPECT_EQ(mfsdp::crc32c_extend_portable(0, "123456789", 9), 0xe3069283u);
  EXPECT_EQ(portable(std::vector<uint8_t>(32, 0x00)), 0x8a9136aau);
  EXPECT_EQ(portable(std::vector<uint8_t>(32, 0xff)), 0x62a8ab43u);
  EXPECT_EQ(portable(up), 0x46dd794eu);
  EXPECT_EQ(portable(down), 0x113fdb5cu);
  EXPECT_EQ(mfsdp::crc32c_hex(0xe3069283u), "0xe3069283");
}

TEST(Crc32c, ExtendingEqualsOneCallAtEverySplit) {
  std::string s;
  for (int i = 0; i < 100; ++i) s += static_cast<char>(i * 37 + 11);
  const uint32_t whole = mfsdp::crc32c(s.data(), s.size());
  for (size_t split = 0; split <= s.size(); ++split)
    EXPECT_EQ(mfsdp::crc32c_extend(mfsdp::crc32c(s.data(), split), s.data() + split, s.size() - split), whole);
}

// crc32c_combine against the CRC of the joined bytes computed directly: every split of a short
// input (an empty A or B included) and a few megabyte-long B's (the square-and-multiply over
// many bits of the length).
TEST(Crc32c, CombiningEqualsTheCrcOfTheJoinedBytes) {
  std::string s(3 << 20, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 2654435761u >> 24);
  for (size_t split = 0; split <= 100; ++split)
    EXPECT_EQ(mfsdp::crc32c_combine(mfsdp::crc32c(s.data(), split), mfsdp::crc32c(s.data() + split, 100 - split), 100 - split),
              mfsdp::crc32c(s.data(), 100))
        << "split at " << split;
  for (size_t length_b : {size_t{1} << 20, (size_t{1} << 20) + 3, s.size() - 77}) {
    const size_t length_a = s.size() - length_b;
    EXPECT_EQ(mfsdp::crc32c_combine(mfsdp::crc32c(s.data(), length_a), mfsdp::crc32c(s.data() + length_a, length_b), length_b),
              mfsdp::crc32c(s.data(), s.size()))
        << length_b << " bytes of B";
  }
}

// Long inputs take the three-stream path (24 KiB steps); 7-byte pieces never do. Both must agree,
// at lengths around the step.
TEST(Crc32c, LongInputsEqualTheSamePiecesFedSevenBytesAtATime) {
  std::string s(3 * 24576 + 1000, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 2246822519u >> 25);
  for (size_t n : {size_t{24575}, size_t{24576}, size_t{24577}, size_t{2 * 24576 + 9}, s.size()}) {
    uint32_t piecewise = 0;
    for (size_t at = 0; at < n; at += 7) piecewise = mfsdp::crc32c_extend(piecewise, s.data() + at, std::min<size_t>(7, n - at));
    EXPECT_EQ(mfsdp::crc32c(s.data(), n), piecewise) << n << " bytes";
    EXPECT_EQ(mfsdp::crc32c_extend_portable(0, s.data(), n), piecewise) << n << " bytes, table path";
  }
}

TEST(Crc32c, FileRangesAndTheirErrors) {
  mfsdp::testing::TempDir dir;
  const std::string path = dir.file("f");
  std::string s(10'000'000, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 2654435761u >> 24);
  std::ofstream(path, std::ios::binary) << s;
  EXPECT_EQ(mfsdp::crc32c_of_file_range(path, 0, s.size()), mfsdp::crc32c(s.data(), s.size()));  // several blocks
  EXPECT_EQ(mfsdp::crc32c_of_file_range(path, 12345, 5'000'001), mfsdp::crc32c(s.data() + 12345, 5'000'001));
  EXPECT_EQ(mfsdp::crc32c_of_file_range(path, 7, 0), 0u);
  try {
    mfsdp::crc32c_of_file_range(path, s.size() - 3, 10);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("ends at byte 10000000"), std::string::npos) << e.what();
  }
  EXPECT_THROW(mfsdp::crc32c_of_file_range(dir.file("missing"), 0, 1), std::runtime_error);
}

}  // namespace
