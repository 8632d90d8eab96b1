// Internal to src/checkpoint/formats: uncompressed ("stored") zip archives, the container of
// torch.save files, which PyTorch Distributed Checkpoints embed in their .distcp files.
//
//   ZipReader zip(path, "torch.save file 'x.pt'");            // a whole file, or
//   ZipReader zip(path, what, offset, length);                 // an archive inside a file
//   std::string pkl = zip.read("archive/data.pkl");
//
//   std::string bytes = write_stored_zip({{"archive/data.pkl", pkl}, {"archive/data/0", data}});
//
// Reading checks every offset and length against the window before allocating for it; errors
// are std::invalid_argument starting with `what`. Compressed or encrypted entries are refused
// (torch.save never writes them).
//
// Why not LibTorch's caffe2::serialize::PyTorchStreamReader/Writer (miniz), checked 2026-11-27
// with torch 2.15 (torch._C.PyTorchFileReader on torch.save files cut at 40 lengths and with a
// flipped central-directory byte):
// - It refuses every damaged file, but says only "PytorchStreamReader failed reading zip
//   archive: failed finding central directory. This is an internal miniz error ...". That
//   message names no file, record or offset. The checkpoint contract here is an error naming
//   the file, the entry and the offset (tests/unit/torch_save_test.cpp, dcp_test.cpp).
// - DCP's .distcp files hold torch.save archives at offsets inside a larger file. The reader
//   wants a whole stream, or an adapter per window; this reader takes the window directly.
// - Its writer adds records of its own (version, alignment padding), and the tests pin
//   torch.load's view of the archives written here.
// So this reader and writer (zip_archive.cpp, ~280 lines) stay ours.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace mfsdp::zip {

// A read-only window [offset, offset + length) of a file, read with pread.
class FileWindow {
 public:
  FileWindow(const std::string& path, const std::string& what);  // the whole file
  FileWindow(const std::string& path, const std::string& what, uint64_t offset, uint64_t length);
  ~FileWindow();
  FileWindow(const FileWindow&) = delete;
  FileWindow& operator=(const FileWindow&) = delete;

  uint64_t size() const { return length_; }
  const std::string& what() const { return what_; }
  [[noreturn]] void fail(const std::string& detail) const;
  // Throws unless [at, at + n) lies in the window (`item` names what is read there).
  void check(uint64_t at, uint64_t n, const std::string& item) const;
  void read(uint64_t at, void* dst, uint64_t n, const std::string& item) const;
  std::string read(uint64_t at, uint64_t n, const std::string& item) const;

 private:
  void open(const std::string& path);
  std::string what_;
  int fd_ = -1;
  uint64_t offset_ = 0, length_ = 0;
};

class ZipReader {
 public:
  ZipReader(const std::string& path, const std::string& what);
  ZipReader(const std::string& path, const std::string& what, uint64_t offset, uint64_t length);

  const FileWindow& window() const { return file_; }
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  std::vector<std::string> names() const;
  uint64_t size(const std::string& name) const;
  // Where the entry's bytes start in the window (after its local header).
  uint64_t data_offset(const std::string& name) const;
  std::string read(const std::string& name) const;

 private:
  void read_directory();
  struct Entry {
    uint64_t header = 0;  // offset of the local file header
    uint64_t size = 0;
  };
  const Entry& entry(const std::string& name) const;
  FileWindow file_;
  std::map<std::string, Entry> entries_;
};

// A zip archive of `entries` (name, bytes), stored, each entry's data aligned to 64 bytes as
// torch.save aligns storages. Throws std::invalid_argument past the non-zip64 limits (4 GiB).
std::string write_stored_zip(const std::vector<std::pair<std::string, std::string>>& entries);

// The same archive without copying the entries' data: frame[i] precedes entry i's bytes and
// frame.back() (central directory, end record) follows the last, so frame[0] + data0 + frame[1]
// + data1 + ... + frame.back() == write_stored_zip(entries). A checkpoint writes a tensor's
// storage from where it lies this way (src/checkpoint/formats/dcp.cpp).
struct StoredEntry {
  std::string name;
  uint64_t size = 0;
  uint32_t crc32 = 0;  // crc32(0, data, size)
};
std::vector<std::string> stored_zip_frame(const std::vector<StoredEntry>& entries);

// zip's CRC-32 (zlib's crc32(crc, data, n): start from 0, continue from a previous result). Folds
// 64 bytes a step with carry-less multiplies (PCLMULQDQ) where the CPU has them (checked at run
// time), else slicing by 8.
uint32_t crc32(uint32_t crc, const void* data, size_t n);
uint32_t crc32_portable(uint32_t crc, const void* data, size_t n);  // the table path alone (tests)

}  // namespace mfsdp::zip
