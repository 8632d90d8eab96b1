// Checksums of an indexed dataset (indexed_dataset.h): PREFIX.checksums.json holds the CRC-32C
// (crc32c.h) of PREFIX.idx and of every 1 MiB block of PREFIX.bin. IndexedDatasetWriter writes
// it; IndexedDataset checks the .idx when opening and each .bin block the first time a read
// touches it, so a changed byte is an error naming the file and byte range, never other tokens.
// Megatron's tools neither write nor read the file (datasets without it are read unverified);
// write_dataset_checksums adds one to such a dataset (mfsdp-preprocess --add-checksums PREFIX).
//
//   {"format": "mfsdp.indexed_dataset_checksums", "version": 1, "algorithm": "crc32c",
//    "idx": {"length": 60042, "crc32c": 1609686051},
//    "bin": {"length": 5100146, "block_bytes": 1048576, "crc32c": [140467384, ...one per block]}}
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mfsdp {

// PREFIX + ".checksums.json".
std::string dataset_checksums_path(const std::string& path_prefix);

// Computes the checksums of `idx_path` and `bin_path` and writes them to `out_path` (through a
// temporary file and a rename). Throws std::runtime_error naming a file that cannot be read.
void write_dataset_checksums(const std::string& idx_path, const std::string& bin_path, const std::string& out_path);
// The same for the dataset at PREFIX, into dataset_checksums_path(PREFIX).
void write_dataset_checksums(const std::string& path_prefix);

class DatasetChecksums {
 public:
  static constexpr uint64_t kBlockBytes = 1 << 20;

  // The checksums of the dataset at PREFIX, or null when it has none. Throws std::runtime_error
  // naming the file when it is malformed.
  static std::unique_ptr<DatasetChecksums> load(const std::string& path_prefix);

  // Throw std::runtime_error naming the file, unless it matches what was saved.
  void verify_index(const std::string& idx_bytes) const;
  void verify_data_size(uint64_t size) const;
  // Bytes [begin, end) of the mapped .bin `data`, tokens [first_token, first_token + tokens) of
  // `sequence` (named in the error): every block they touch is checked, once per block for the
  // life of this object (thread-safe).
  void verify_data(const unsigned char* data, uint64_t begin, uint64_t end, int64_t sequence, int64_t first_token,
                   int64_t tokens) const;

 private:
  explicit DatasetChecksums(std::string path_prefix) : path_prefix_(std::move(path_prefix)) {}
  std::string path_prefix_;
  uint64_t idx_length_ = 0, bin_length_ = 0;
  uint32_t idx_crc_ = 0;
  std::vector<uint32_t> blocks_;
  std::unique_ptr<std::atomic<bool>[]> verified_;
};

}  // namespace mfsdp
