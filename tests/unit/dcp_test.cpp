// PyTorch Distributed Checkpoint directories (include/mfsdp/checkpoint/dcp.h): the box decomposition against
// element-by-element enumeration, reading what the pinned torch's dcp.save wrote
// (scripts/make_torch_save_fixtures.py), a write/read round trip, damaged files, and a fuzzed
// .metadata that must never crash, hang or load wrong values. (tests/reference/dcp_reference_test
// checks that torch loads what mfsdp writes.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "checkpoint/formats/zip_archive.h"
#include "harness/expect_error.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/checkpoint/torch_save.h"
#include "mfsdp/base/crc32c.h"
#include "mfsdp/base/directory_tree.h"

namespace {

using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
using mfsdp::testing::TempDir;
namespace dcp = mfsdp::dcp;
namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return std::string(MFSDP_FIXTURES_DIR) + "/torch_save/" + name; }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
void put(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Row-major flat index of a multi-index.
int64_t flat_index(const std::vector<int64_t>& shape, const std::vector<int64_t>& idx) {
  int64_t f = 0;
  for (size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + idx[d];
  return f;
}

TEST(DcpBoxes, CoverExactlyTheFlatRangeInOrder) {
  std::mt19937 rng(7);
  const std::vector<std::vector<int64_t>> shapes = {{10}, {3, 4}, {2, 3, 5}, {4, 1, 3}, {2, 2, 2, 3}, {}, {1}};
  for (const auto& shape : shapes) {
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    for (int trial = 0; trial < 200; ++trial) {
      int64_t a = std::uniform_int_distribution<int64_t>(0, numel)(rng);
      int64_t b = std::uniform_int_distribution<int64_t>(0, numel)(rng);
      if (a > b) std::swap(a, b);
      // Enumerate each box's elements in row-major order: they must be a, a+1, ..., b-1.
      int64_t next = a;
      for (const dcp::Box& box : dcp::flat_range_boxes(shape, a, b)) {
        ASSERT_EQ(box.offsets.size(), shape.size());
        ASSERT_GT(box.numel(), 0);
        std::vector<int64_t> idx(shape.size(), 0);
        for (int64_t k = 0; k < box.numel(); ++k) {
          int64_t rest = k;
          for (size_t d = shape.size(); d-- > 0;) {
            idx[d] = box.offsets[d] + rest % box.sizes[d];
            rest /= box.sizes[d];
          }
          ASSERT_EQ(flat_index(shape, idx), next++) << "shape " << shape.size() << "-d, range " << a << ".." << b;
        }
      }
      EXPECT_EQ(next, b);
    }
  }
  // A range inside one row of a matrix is one box; whole rows are one box.
  EXPECT_EQ(dcp::flat_range_boxes({3, 4}, 5, 7).size(), 1u);
  EXPECT_EQ(dcp::flat_range_boxes({3, 4}, 4, 12).size(), 1u);
  EXPECT_EQ(dcp::flat_range_boxes({3, 4}, 2, 10).size(), 3u);
}

TEST(DcpReader, ReadsWhatTorchWrote) {
  dcp::Reader r(fixture("dcp"));
  const auto& m = r.metadata();
  EXPECT_TRUE(at::equal(r.read("model.module.layer.w"), at::arange(12, at::kFloat).reshape({3, 4}) / 4));
  EXPECT_TRUE(at::equal(r.read("model.module.layer.b"), (at::arange(5, at::kFloat) - 2).to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(r.read("steps"), at::arange(6, at::kLong) * 3));
  at::Tensor step = r.read("optimizer.state.module.layer.w.step");
  EXPECT_EQ(step.dim(), 0);
  EXPECT_EQ(step.item<float>(), 2.5f);
  EXPECT_EQ(r.read_object("iteration"), 7);  // a torch.save'd int
  // An io.BytesIO is pickled as an object: refused, never constructed.
  expect_contains(error_of([&] { r.read_object("blob"); }), {"'blob'", "'_io.BytesIO'", "not allowed"});
  EXPECT_TRUE(m.bytes.count("blob"));
  EXPECT_EQ(m.paths.at("model.module.layer.w"), (std::vector<std::string>{"model", "module.layer.w"}));
  // A range that starts mid-row.
  at::Tensor part = at::empty({7});
  r.read_range("model.module.layer.w", 3, part);
  EXPECT_TRUE(at::equal(part, at::arange(3, 10, at::kFloat) / 4));
}

// A directory with two "ranks" writing uneven flat shards of the same tensors, as FSDP does.
struct Written {
  std::map<std::string, at::Tensor> tensors;
  dcp::Metadata meta;
};

Written write_sharded(const std::string& dir, int ranks) {
  Written w;
  w.tensors["model.module.a.weight"] = at::randn({5, 7});
  w.tensors["model.module.a.bias"] = at::randn({7}).to(at::kBFloat16);
  w.tensors["model.module.scalar"] = at::full({}, 3.0);
  w.tensors["optimizer.state.module.a.weight.exp_avg"] = at::randn({5, 7}, at::kDouble);
  w.tensors["count"] = at::arange(9, at::kLong).reshape({3, 3});
  for (int r = 0; r < ranks; ++r) {
    dcp::FileWriter file(dir, dcp::rank_file_name(r));
    for (const auto& [name, t] : w.tensors) {
      dcp::TensorEntry& e = w.meta.tensors[name];
      e.dtype = t.scalar_type();
      e.shape = t.sizes().vec();
      // Uneven: rank r holds [numel * r^2 / ranks^2, numel * (r+1)^2 / ranks^2).
      const int64_t n = t.numel();
      const int64_t b = n * r * r / (ranks * ranks), end = n * (r + 1) * (r + 1) / (ranks * ranks);
      int64_t flat = b;
      for (const dcp::Box& box : dcp::flat_range_boxes(e.shape, b, end)) {
        at::Tensor piece = t.reshape({-1}).narrow(0, flat, box.numel()).view(box.sizes);
        flat += box.numel();
        e.chunks.push_back({box, file.write_tensor(piece)});
      }
    }
    if (r == 0) w.meta.bytes["note"] = file.write_bytes("hello");
    file.close();
  }
  for (const auto& [name, t] : w.tensors) w.meta.paths[name] = {name};
  put(dir + "/" + dcp::kMetadataFile, dcp::encode_metadata(w.meta));
  return w;
}

TEST(DcpReader, RoundTripsUnevenShardsAndAnyRange) {
  TempDir dir;
  Written w = write_sharded(dir.path().string(), 3);
  dcp::Reader r(dir.path().string());
  ASSERT_EQ(r.metadata().tensors.size(), w.tensors.size());
  for (const auto& [name, t] : w.tensors) {
    EXPECT_TRUE(at::equal(r.read(name), t)) << name;
    EXPECT_EQ(r.tensor(name).dtype, t.scalar_type());
    if (t.numel() > 4) {  // another rank's cut: elements [2, numel - 1) into fp32
      at::Tensor part = at::empty({t.numel() - 3}, at::kDouble);
      r.read_range(name, 2, part);
      EXPECT_TRUE(at::equal(part, t.reshape({-1}).narrow(0, 2, t.numel() - 3).to(at::kDouble))) << name;
    }
  }
  EXPECT_EQ(r.read_bytes("note"), "hello");
}

TEST(DcpReader, DamagedFilesAreErrorsNamingFileOffsetAndKey) {
  TempDir dir;
  const std::string d = dir.path().string();
  Written w = write_sharded(d, 2);
  // A .distcp shorter than the metadata says: cut in the middle of a chunk of rank 1.
  const std::string file = d + "/" + dcp::rank_file_name(1);
  const dcp::TensorChunk& last = w.meta.tensors.at("model.module.a.weight").chunks.back();
  ASSERT_EQ(last.location.file, dcp::rank_file_name(1));
  put(file, slurp(file).substr(0, last.location.offset + last.location.length / 2));
  dcp::Reader r(d);
  const std::string err = error_of([&] { r.read("model.module.a.weight"); });
  expect_contains(err, {"__1_0.distcp", "model.module.a.weight", "bytes [", "truncated"});
  // Not a pickle, a foreign class, a missing file.
  put(d + "/" + dcp::kMetadataFile, "not a pickle");
  expect_contains(error_of([&] { dcp::Reader bad(d); }), {".metadata", "opcode"});
  put(d + "/" + dcp::kMetadataFile, std::string("\x80\x02" "cos\nsystem\n(X\x02\0\0\0lst" "R.", 22));
  expect_contains(error_of([&] { dcp::Reader bad(d); }), {".metadata", "'os.system'", "not allowed"});
  fs::remove(d + "/" + dcp::kMetadataFile);
  expect_contains(error_of([&] { dcp::Reader bad(d); }), {".metadata", "cannot be read"});
}

// Random byte mutations of a valid .metadata (ours and torch's): each one is refused with
// std::invalid_argument, or loads exactly the original tensors. Never a crash or a hang.
void fuzz(const std::string& dir, const std::map<std::string, at::Tensor>& expected, int rounds, unsigned seed) {
  const std::string original = slurp(dir + "/" + dcp::kMetadataFile);
  std::mt19937 rng(seed);
  int refused = 0, loaded = 0;
  for (int round = 0; round < rounds; ++round) {
    std::string m = original;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % m.size();
      switch (rng() % 4) {
        case 0: m[at] = static_cast<char>(rng()); break;                      // overwrite
        case 1: m[at] = static_cast<char>(m[at] ^ (1 << (rng() % 8))); break;  // flip a bit
        case 2: m.erase(at, 1 + rng() % 4); break;                              // delete
        default: m.insert(at, 1, static_cast<char>(rng())); break;              // insert
      }
      if (m.empty()) m = "x";
    }
    put(dir + "/" + dcp::kMetadataFile, m);
    try {
      dcp::Reader r(dir);
      for (const auto& [name, t] : expected) {
        at::Tensor got = r.read(name);
        ASSERT_TRUE(got.sizes() == t.sizes() && got.scalar_type() == t.scalar_type() && at::equal(got, t))
            << "round " << round << ": '" << name << "' loaded silently with other values";
      }
      ++loaded;
    } catch (const std::invalid_argument&) {
      ++refused;
    }
  }
  put(dir + "/" + dcp::kMetadataFile, original);
  EXPECT_GT(refused, rounds / 2);
  std::printf("fuzzed %d mutations: %d refused, %d loaded the original values\n", rounds, refused, loaded);
}

TEST(DcpFuzz, MutatedMetadataNeverLoadsWrongValues) {
  TempDir dir;
  Written w = write_sharded(dir.path().string(), 2);
  fuzz(dir.path().string(), w.tensors, 2000, 1);
}

TEST(DcpFuzz, MutatedTorchMetadataNeverLoadsWrongValues) {
  TempDir dir;
  mfsdp::copy_tree(fixture("dcp"), dir.path());
  std::map<std::string, at::Tensor> expected = {
      {"model.module.layer.w", at::arange(12, at::kFloat).reshape({3, 4}) / 4},
      {"steps", at::arange(6, at::kLong) * 3}};
  fuzz(dir.path().string(), expected, 1000, 2);
}

// ---- checksums ------------------------------------------------------------------------------------

// write_sharded's folder with the .checksums.json an mfsdp save writes.
Written write_checksummed(const std::string& dir) {
  Written w = write_sharded(dir, 2);
  put(dir + "/" + dcp::kChecksumsFile, dcp::encode_checksums(w.meta, slurp(dir + "/" + dcp::kMetadataFile)));
  return w;
}

// Where the tensor's raw bytes ("<archive>/data/0") start in the .distcp file.
uint64_t tensor_data_offset(const std::string& dir, const dcp::Location& l) {
  mfsdp::zip::ZipReader zip(dir + "/" + l.file, "chunk", l.offset, l.length);
  for (const std::string& name : zip.names())
    if (name.size() > 7 && name.compare(name.size() - 7, 7, "/data/0") == 0) return l.offset + zip.data_offset(name);
  ADD_FAILURE() << "no data/0 entry";
  return 0;
}

TEST(DcpChecksums, WrittenForEveryEntryAndVerifiedOnRead) {
  TempDir dir;
  const std::string d = dir.path().string();
  Written w = write_checksummed(d);
  const auto j = nlohmann::json::parse(slurp(d + "/" + dcp::kChecksumsFile));
  // Each recorded CRC is that of the entry's bytes in its file, computed here from the file.
  for (const auto& [name, e] : w.meta.tensors)
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      const dcp::Location& l = e.chunks[i].location;
      const std::string bytes = slurp(d + "/" + l.file).substr(l.offset, l.length);
      EXPECT_EQ(j["tensors"][name][i]["crc32c"].get<uint32_t>(), mfsdp::crc32c(bytes.data(), bytes.size())) << name;
    }
  const std::string meta = slurp(d + "/" + dcp::kMetadataFile);
  EXPECT_EQ(j["metadata"]["crc32c"].get<uint32_t>(), mfsdp::crc32c(meta.data(), meta.size()));
  dcp::Reader r(d);
  EXPECT_TRUE(r.has_checksums());
  for (const auto& [name, t] : w.tensors) EXPECT_TRUE(at::equal(r.read(name), t)) << name;
  EXPECT_EQ(r.read_bytes("note"), "hello");
  // DirectoryWriter (conversions) writes them too.
  TempDir out;
  dcp::DirectoryWriter dw(out.path().string());
  dw.tensor("x", at::arange(4.0));
  dw.finish();
  EXPECT_TRUE(dcp::Reader(out.path().string()).has_checksums());
  EXPECT_TRUE(at::equal(dcp::Reader(out.path().string()).read("x"), at::arange(4.0)));
}

// CRC-32 of zip (its polynomial, bit by bit): what zip tools check and torch.load does not.
uint32_t zip_crc32_bitwise(const char* p, size_t n) {
  uint32_t c = 0xffffffff;
  for (size_t i = 0; i < n; ++i) {
    c ^= static_cast<unsigned char>(p[i]);
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
  }
  return ~c;
}

uint32_t le32(const std::string& s, size_t at) {
  return static_cast<uint32_t>(static_cast<unsigned char>(s[at])) | static_cast<uint32_t>(static_cast<unsigned char>(s[at + 1])) << 8 |
         static_cast<uint32_t>(static_cast<unsigned char>(s[at + 2])) << 16 | static_cast<uint32_t>(static_cast<unsigned char>(s[at + 3])) << 24;
}

// FileWriter checksums a tensor's storage a 1 MiB block at a time as it writes it and fills the
// zip header's CRC in afterwards: the CRC in the local header and in the central directory of
// every chunk equal the storage's computed here bit by bit, and the chunk's CRC-32C that of its
// bytes in the file, for storages of no, a few, exactly 1 MiB and 3 MiB + 28 bytes.
TEST(DcpWriter, ZipAndChunkChecksumsHoldAcrossBlocks) {
  TempDir dir;
  const std::string d = dir.path().string();
  std::vector<at::Tensor> tensors;
  std::vector<dcp::Location> where;
  {
    dcp::FileWriter file(d, dcp::rank_file_name(0));
    for (int64_t numel : {int64_t{0}, int64_t{5}, int64_t{1} << 18, (int64_t{3} << 18) + 7}) {
      tensors.push_back(at::randn({numel}));
      where.push_back(file.write_tensor(tensors.back()));
    }
    file.close();
  }
  const std::string contents = slurp(d + "/" + dcp::rank_file_name(0));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const dcp::Location& l = where[i];
    const std::string chunk = contents.substr(l.offset, l.length);
    ASSERT_TRUE(l.crc32c.has_value());
    EXPECT_EQ(*l.crc32c, mfsdp::crc32c(chunk.data(), chunk.size())) << tensors[i].numel() << " elements";
    const uint32_t want = zip_crc32_bitwise(static_cast<const char*>(tensors[i].data_ptr()), tensors[i].nbytes());
    const std::string name = "/data/0";
    const size_t in_local = chunk.find(name), in_directory = chunk.find(name, in_local + 1);
    ASSERT_NE(in_directory, std::string::npos);
    const size_t local = chunk.rfind(std::string("PK\x03\x04", 4), in_local);
    const size_t central = chunk.rfind(std::string("PK\x01\x02", 4), in_directory);
    ASSERT_NE(local, std::string::npos);
    ASSERT_NE(central, std::string::npos);
    EXPECT_EQ(le32(chunk, local + 14), want) << tensors[i].numel() << " elements, local header";
    EXPECT_EQ(le32(chunk, central + 16), want) << tensors[i].numel() << " elements, central directory";
    EXPECT_TRUE(at::equal(mfsdp::read_torch_save_tensor(d + "/" + l.file, l.offset, l.length, "chunk"), tensors[i]));
  }
}

TEST(DcpChecksums, AFlippedTensorByteIsAnErrorNamingFileTensorAndRange) {
  TempDir dir;
  const std::string d = dir.path().string();
  Written w = write_checksummed(d);
  const dcp::TensorChunk& c = w.meta.tensors.at("model.module.a.weight").chunks.back();
  const std::string file = d + "/" + c.location.file;
  std::string bytes = slurp(file);
  const uint64_t at = tensor_data_offset(d, c.location) + 2;  // a float's middle byte: still a float
  bytes[at] = static_cast<char>(bytes[at] ^ 0x04);
  put(file, bytes);
  dcp::Reader r(d);
  const std::string range = "bytes [" + std::to_string(c.location.offset) + ", " +
                            std::to_string(c.location.offset + c.location.length) + ")";
  expect_contains(error_of([&] { r.read("model.module.a.weight"); }),
                  {c.location.file, range, "'model.module.a.weight'", "checksum", "changed or damaged"});
  EXPECT_TRUE(at::equal(r.read("model.module.a.bias"), w.tensors.at("model.module.a.bias")));  // other chunks read
  // Without the checksums the same byte loads silently: what the file is for.
  fs::remove(d + "/" + dcp::kChecksumsFile);
  EXPECT_FALSE(at::equal(dcp::Reader(d).read("model.module.a.weight"), w.tensors.at("model.module.a.weight")));
}

TEST(DcpChecksums, AChangedMetadataOrChecksumsFileIsAnErrorWhenOpening) {
  TempDir dir;
  const std::string d = dir.path().string();
  Written w = write_checksummed(d);
  const std::string sums = slurp(d + "/" + dcp::kChecksumsFile), meta = slurp(d + "/" + dcp::kMetadataFile);
  // Two chunks trade places in .metadata: it still parses.
  dcp::Metadata swapped = w.meta;
  auto& chunks = swapped.tensors.at("model.module.a.weight").chunks;
  ASSERT_GE(chunks.size(), 2u);
  std::swap(chunks[0].location, chunks[1].location);
  put(d + "/" + dcp::kMetadataFile, dcp::encode_metadata(swapped));
  expect_contains(error_of([&] { dcp::Reader r(d); }), {".metadata", "does not match its checksum", ".checksums.json"});
  put(d + "/" + dcp::kMetadataFile, meta);
  // The checksums file itself: cut, another version, a record placing a chunk elsewhere.
  put(d + "/" + dcp::kChecksumsFile, sums.substr(0, sums.size() / 2));
  expect_contains(error_of([&] { dcp::Reader r(d); }), {".checksums.json", "not valid JSON"});
  auto j = nlohmann::json::parse(sums);
  j["version"] = 2;
  put(d + "/" + dcp::kChecksumsFile, j.dump());
  expect_contains(error_of([&] { dcp::Reader r(d); }), {".checksums.json", "version 2", "update mfsdp"});
  j = nlohmann::json::parse(sums);
  j["tensors"]["count"][0]["offset"] = 1;
  put(d + "/" + dcp::kChecksumsFile, j.dump());
  expect_contains(error_of([&] { dcp::Reader r(d); }), {".checksums.json", "tensor 'count'", "elsewhere"});
  j = nlohmann::json::parse(sums);
  j["bytes"]["note"]["crc32c"] = j["bytes"]["note"]["crc32c"].get<uint32_t>() ^ 1u;
  put(d + "/" + dcp::kChecksumsFile, j.dump());
  expect_contains(error_of([&] { dcp::Reader(d).read_bytes("note"); }), {"bytes entry 'note'", "checksum"});
}

}  // namespace
