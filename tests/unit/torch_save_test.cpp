// torch.save reader (src/checkpoint/formats/torch_save.cpp). The fixtures are real torch.save output,
// written by the pinned torch when ctest runs (scripts/make_torch_save_fixtures.py, the
// TorchSaveFixtures setup test); the expected tensors are recomputed here from the script's
// arange formulas, never read back through the code under test. Broken and unusual archives are
// built in this test with a minimal stored-zip writer and hand-written pickles.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "harness/expect_error.h"
#include "harness/file_bytes.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/torch_save.h"

namespace {

using mfsdp::read_torch_save;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
using mfsdp::testing::TempDir;
using Tensors = std::map<std::string, at::Tensor>;

std::string fixture(const std::string& name) { return std::string(MFSDP_FIXTURES_DIR) + "/torch_save/" + name; }

using mfsdp::testing::put;
using mfsdp::testing::slurp;

std::string le(uint64_t v, int n) {
  std::string s(n, '\0');
  for (int i = 0; i < n; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// CRC-32 (the zip polynomial, bit by bit); the reader does not check it, other zip tools do.
uint32_t crc32(const std::string& data) {
  uint32_t c = 0xffffffff;
  for (unsigned char b : data) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
  }
  return ~c;
}

// A zip archive of stored entries, written from the PKWARE APPNOTE layout. With zip64, every size
// and offset goes through the zip64 extra field and end records, as in torch.save files > 4 GiB.
std::string make_zip(const std::vector<std::pair<std::string, std::string>>& files, bool zip64 = false,
                     uint16_t method = 0) {
  std::string out, cd;
  for (const auto& [name, data] : files) {
    const uint64_t offset = out.size(), size = data.size(), crc = crc32(data);
    out += le(0x04034b50, 4) + le(45, 2) + le(0, 2) + le(method, 2) + le(0, 4) + le(crc, 4) + le(size, 4) +
           le(size, 4) + le(name.size(), 2) + le(0, 2) + name + data;
    const std::string extra = zip64 ? le(1, 2) + le(24, 2) + le(size, 8) + le(size, 8) + le(offset, 8) : "";
    const uint64_t size32 = zip64 ? 0xffffffff : size, offset32 = zip64 ? 0xffffffff : offset;
    cd += le(0x02014b50, 4) + le(45, 2) + le(45, 2) + le(0, 2) + le(method, 2) + le(0, 4) + le(crc, 4) + le(size32, 4) +
          le(size32, 4) + le(name.size(), 2) + le(extra.size(), 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 4) +
          le(offset32, 4) + name + extra;
  }
  const uint64_t cd_at = out.size(), n = files.size();
  out += cd;
  if (zip64) {
    const uint64_t record_at = out.size();
    out += le(0x06064b50, 4) + le(44, 8) + le(45, 2) + le(45, 2) + le(0, 4) + le(0, 4) + le(n, 8) + le(n, 8) +
           le(cd.size(), 8) + le(cd_at, 8);
    out += le(0x07064b50, 4) + le(0, 4) + le(record_at, 8) + le(1, 4);
  }
  const uint64_t n16 = zip64 ? 0xffff : n;
  out += le(0x06054b50, 4) + le(0, 2) + le(0, 2) + le(n16, 2) + le(n16, 2) + le(zip64 ? 0xffffffff : cd.size(), 4) +
         le(zip64 ? 0xffffffff : cd_at, 4) + le(0, 2);
  return out;
}

// Protocol-2 pickle pieces, as CPython's pickler writes them.
std::string str(const std::string& s) { return "X" + le(s.size(), 4) + s; }
std::string int1(uint8_t v) { return "K" + le(v, 1); }
std::string global(const std::string& module, const std::string& name) { return "c" + module + "\n" + name + "\n"; }
std::string small_tuple(const std::vector<uint8_t>& v) {
  std::string s = "(";
  for (uint8_t x : v) s += int1(x);
  return s + "t";
}

// data.pkl of {name: tensor}: _rebuild_tensor_v2(('storage', FloatStorage, key, 'cpu', numel),
// offset, size, stride, False, OrderedDict()).
std::string tensor_pickle(const std::string& name, const std::string& key, uint8_t numel, uint8_t offset,
                          const std::vector<uint8_t>& size, const std::vector<uint8_t>& stride) {
  return "\x80\x02}" + str(name) + global("torch._utils", "_rebuild_tensor_v2") + "((" + str("storage") +
         global("torch", "FloatStorage") + str(key) + str("cpu") + int1(numel) + "tQ" + int1(offset) +
         small_tuple(size) + small_tuple(stride) + "\x89" + global("collections", "OrderedDict") + ")RtRs.";
}

std::string floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// A tensor named `name` exists with exactly this dtype, shape and these values.
void expect_tensor(const Tensors& got, const std::string& name, const at::Tensor& want) {
  auto it = got.find(name);
  ASSERT_NE(it, got.end()) << name;
  const at::Tensor& t = it->second;
  EXPECT_EQ(t.scalar_type(), want.scalar_type()) << name;
  EXPECT_EQ(t.sizes(), want.sizes()) << name;
  EXPECT_TRUE(t.device().is_cpu()) << name;
  if (t.scalar_type() == want.scalar_type() && t.sizes() == want.sizes()) {
    EXPECT_TRUE(at::equal(t, want)) << name << ":\n" << t << "\nwant:\n" << want;
  }
}

std::set<std::string> names(const Tensors& t) {
  std::set<std::string> s;
  for (const auto& [k, v] : t) s.insert(k);
  return s;
}

at::Tensor arange(int64_t n, at::ScalarType dtype = at::kFloat) {
  return at::arange(n, at::TensorOptions().dtype(dtype));
}

TEST(TorchSave, StateDictOfLinearAndLayerNorm) {
  const Tensors t = read_torch_save(fixture("state_dict.pt"));  // OrderedDict + _metadata BUILD
  EXPECT_EQ(names(t), (std::set<std::string>{"proj.weight", "proj.bias", "norm.weight", "norm.bias"}));
  expect_tensor(t, "proj.weight", arange(12).reshape({3, 4}) / 8);
  expect_tensor(t, "proj.bias", arange(3) - 1);
  expect_tensor(t, "norm.weight", arange(3) * 0.5 + 1);
  expect_tensor(t, "norm.bias", -arange(3) / 4);
}

TEST(TorchSave, NestedDictDtypesViewsAndSkippedLeaves) {
  const Tensors t = read_torch_save(fixture("nested.pt"));
  // iteration, args, lr, none, done, big (> int64), names and optim.param_groups are not tensors.
  EXPECT_EQ(names(t), (std::set<std::string>{"model.bf16", "model.fp16", "model.i64", "model.i16", "model.i8",
                                             "model.u8", "model.flag", "model.one.only", "model.base", "model.row",
                                             "model.t_slice", "model.tied", "model.scalar", "model.empty",
                                             "optim.state.0.exp_avg"}));
  expect_tensor(t, "model.bf16", (arange(6).reshape({2, 3}) - 2.5).to(at::kBFloat16));
  expect_tensor(t, "model.fp16", (arange(8) / 4).reshape({2, 4}).to(at::kHalf));
  expect_tensor(t, "model.i64", arange(5, at::kLong) * (int64_t{1} << 40) + 3);
  expect_tensor(t, "model.i16", arange(3, at::kShort) * -300);
  expect_tensor(t, "model.i8", arange(4, at::kChar) - 2);
  expect_tensor(t, "model.u8", arange(4, at::kByte) + 250);
  expect_tensor(t, "model.flag", at::tensor(std::vector<uint8_t>{1, 0, 1}).to(at::kBool));
  expect_tensor(t, "model.one.only", arange(4, at::kInt));  // a one-entry dict (SETITEM)
  expect_tensor(t, "optim.state.0.exp_avg", arange(2) - 0.5);  // an int dict key
  expect_tensor(t, "model.scalar", at::scalar_tensor(3.25, at::kDouble));
  expect_tensor(t, "model.empty", at::zeros({0, 3}));

  // base, base[2] and base.t()[1:4, ::2] share one storage, and come back as views of one buffer.
  const at::Tensor base = arange(24).reshape({4, 6});
  expect_tensor(t, "model.base", base);
  expect_tensor(t, "model.tied", base);
  expect_tensor(t, "model.row", at::tensor(std::vector<float>{12, 13, 14, 15, 16, 17}));
  expect_tensor(t, "model.t_slice", at::tensor(std::vector<float>{1, 13, 2, 14, 3, 15}).reshape({3, 2}));
  const at::Tensor& slice = t.at("model.t_slice");
  EXPECT_FALSE(slice.is_contiguous());
  EXPECT_EQ(slice.strides().vec(), (std::vector<int64_t>{1, 12}));
  EXPECT_EQ(slice.storage_offset(), 1);
  EXPECT_EQ(t.at("model.row").storage_offset(), 12);
  EXPECT_TRUE(slice.is_alias_of(t.at("model.base")));
  EXPECT_TRUE(t.at("model.row").is_alias_of(t.at("model.base")));
  EXPECT_TRUE(t.at("model.tied").is_alias_of(t.at("model.base")));
  EXPECT_FALSE(t.at("model.bf16").is_alias_of(t.at("model.base")));
}

TEST(TorchSave, RejectsGlobalsOutsideTheAllowlist) {
  expect_contains(error_of([] { read_torch_save(fixture("evil.pt")); }),
                  {"evil.pt", "data.pkl uses global 'os.system', which is not allowed"});
  TempDir dir;
  // The same through STACK_GLOBAL (protocol 4), and a torch global that is not in the list.
  put(dir.file("stack.pt"), make_zip({{"a/data.pkl", "\x80\x04" + str("builtins") + str("eval") + "\x93N\x85R."}}));
  expect_contains(error_of([&] { read_torch_save(dir.file("stack.pt")); }), {"'builtins.eval'", "not allowed"});
  put(dir.file("bytes.pt"), make_zip({{"a/data.pkl", "\x80\x02" + global("torch.storage", "_load_from_bytes") + "."}}));
  expect_contains(error_of([&] { read_torch_save(dir.file("bytes.pt")); }), {"'torch.storage._load_from_bytes'"});
}

TEST(TorchSave, LegacyFormatAndNonZipFilesAreRejectedWithAHint) {
  expect_contains(error_of([] { read_torch_save(fixture("legacy.pt")); }),
                  {"legacy.pt", "not a zip archive", "legacy", "torch>=1.6"});
  TempDir dir;
  put(dir.file("text.pt"), "hello, not a checkpoint\n");
  expect_contains(error_of([&] { read_torch_save(dir.file("text.pt")); }), {"text.pt", "not a zip archive"});
  put(dir.file("empty.pt"), "");
  expect_contains(error_of([&] { read_torch_save(dir.file("empty.pt")); }), {"not a zip archive"});
  expect_contains(error_of([&] { read_torch_save(dir.file("missing.pt")); }), {"missing.pt", "cannot open"});
}

TEST(TorchSave, EveryTruncationIsAnError) {
  const std::string bytes = slurp(fixture("nested.pt"));
  TempDir dir;
  const std::string cut = dir.file("cut.pt");
  put(cut, bytes.substr(0, bytes.size() / 2));
  expect_contains(error_of([&] { read_torch_save(cut); }), {"cut.pt", "truncated zip archive"});
  for (size_t n = 0; n < bytes.size(); n += 37) {
    put(cut, bytes.substr(0, n));
    EXPECT_THROW(read_torch_save(cut), std::invalid_argument) << "cut at " << n;
  }
}

// Any single corrupted byte loads (e.g. inside tensor data) or is a std::invalid_argument: never a
// crash, an out-of-bounds read, or another exception type.
TEST(TorchSave, CorruptedBytesAreLoadedOrRejectedCleanly) {
  const std::string bytes = slurp(fixture("nested.pt"));
  TempDir dir;
  const std::string bad = dir.file("bad.pt");
  int rejected = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string b = bytes;
    b[i] = static_cast<char>(b[i] ^ 0xa5);
    put(bad, b);
    try {
      read_torch_save(bad);
    } catch (const std::invalid_argument&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "byte " << i << ": " << e.what();
    }
  }
  EXPECT_GT(rejected, 100);
}

TEST(TorchSave, HandWrittenArchiveAndZip64) {
  // {"w": storage[1:7] viewed as 2x3 with strides (1, 2)}: the storage holds 0..7. (Python's
  // torch.load reads both archives too.)
  const std::string pkl = tensor_pickle("w", "0", 8, 1, {2, 3}, {1, 2});
  const at::Tensor want = at::tensor(std::vector<float>{1, 3, 5, 2, 4, 6}).reshape({2, 3});
  TempDir dir;
  for (bool zip64 : {false, true}) {
    put(dir.file("w.pt"), make_zip({{"my_model/data.pkl", pkl},
                                    {"my_model/byteorder", "little"},
                                    {"my_model/version", "3\n"},
                                    {"my_model/data/0", floats({0, 1, 2, 3, 4, 5, 6, 7})}},
                                   zip64));
    expect_tensor(read_torch_save(dir.file("w.pt")), "w", want);
  }
}

TEST(TorchSave, MalformedArchivesNameTheProblem) {
  TempDir dir;
  auto error_for = [&](const std::vector<std::pair<std::string, std::string>>& files, uint16_t method = 0) {
    put(dir.file("x.pt"), make_zip(files, false, method));
    return error_of([&] { read_torch_save(dir.file("x.pt")); });
  };
  const std::string pkl = tensor_pickle("layer.w", "3", 100, 0, {100}, {1});
  expect_contains(error_for({{"archive/data.pkl", pkl}, {"archive/data/3", std::string(100, '\0')}}),
                  {"x.pt", "storage 'archive/data/3' is 100 bytes, tensor 'layer.w' needs 400"});
  expect_contains(error_for({{"archive/data.pkl", pkl}}), {"no zip entry 'archive/data/3'", "'layer.w'"});
  // A view reaching past what the persistent id declares (8 elements; offset 5 + 4 > 8).
  expect_contains(error_for({{"archive/data.pkl", tensor_pickle("v", "0", 8, 5, {4}, {1})},
                             {"archive/data/0", floats({0, 1, 2, 3, 4, 5, 6, 7, 8})}}),
                  {"tensor 'v' needs 36 bytes", "declares as 8 elements"});
  expect_contains(error_for({{"archive/version", "3\n"}}), {"x.pt", "data.pkl"});
  expect_contains(error_for({{"archive/data.pkl", pkl}, {"archive/byteorder", "big"}}), {"byteorder is 'big'"});
  expect_contains(error_for({{"archive/data.pkl", pkl}}, 8), {"'archive/data.pkl' is compressed"});
  expect_contains(error_for({{"archive/data.pkl", "\x80\x02(S'x'\n."}}), {"opcode 0x53"});
  expect_contains(error_for({{"archive/data.pkl", pkl.substr(0, pkl.size() - 1)}}), {"data.pkl ends early"});
  expect_contains(error_for({{"archive/data.pkl", "\x80\x02]."}}), {"holds a list, not a dict of tensors"});
}

}  // namespace
