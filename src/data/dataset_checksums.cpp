// Indexed-dataset checksums: include/mfsdp/data/dataset_checksums.h.
#include "mfsdp/data/dataset_checksums.h"

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <sys/stat.h>

#include "mfsdp/base/crc32c.h"
#include "mfsdp/base/json_parse.h"
#include "mfsdp/data/indexed_dataset.h"

namespace mfsdp {
namespace {

constexpr const char* kFormat = "mfsdp.indexed_dataset_checksums";

uint64_t file_size(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) throw std::runtime_error(path + ": cannot be read");
  return static_cast<uint64_t>(st.st_size);
}

std::string range(uint64_t begin, uint64_t end) {
  return "bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

}  // namespace

std::string dataset_checksums_path(const std::string& path_prefix) { return path_prefix + ".checksums.json"; }

void write_dataset_checksums(const std::string& idx_path, const std::string& bin_path, const std::string& out_path) {
  const uint64_t idx_length = file_size(idx_path), bin_length = file_size(bin_path);
  nlohmann::json blocks = nlohmann::json::array();
  for (uint64_t at = 0; at < bin_length; at += DatasetChecksums::kBlockBytes)
    blocks.push_back(crc32c_of_file_range(bin_path, at, std::min(DatasetChecksums::kBlockBytes, bin_length - at)));
  const nlohmann::json j = {
      {"format", kFormat}, {"version", 1}, {"algorithm", "crc32c"},
      {"idx", {{"length", idx_length}, {"crc32c", crc32c_of_file_range(idx_path, 0, idx_length)}}},
      {"bin", {{"length", bin_length}, {"block_bytes", DatasetChecksums::kBlockBytes}, {"crc32c", blocks}}}};
  const std::string tmp = out_path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << j.dump() << "\n";
    out.flush();
    if (!out) throw std::runtime_error(tmp + ": write failed");
  }
  if (std::rename(tmp.c_str(), out_path.c_str()) != 0) throw std::runtime_error(tmp + ": cannot rename to " + out_path);
}

void write_dataset_checksums(const std::string& path_prefix) {
  write_dataset_checksums(index_file_path(path_prefix), data_file_path(path_prefix), dataset_checksums_path(path_prefix));
}

std::unique_ptr<DatasetChecksums> DatasetChecksums::load(const std::string& path_prefix) {
  const std::string path = dataset_checksums_path(path_prefix);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return nullptr;
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) throw std::runtime_error(path + ": cannot be read");
  std::unique_ptr<DatasetChecksums> c(new DatasetChecksums(path_prefix));
  try {
    const nlohmann::json j = parse_json(text.str());
    if (!j.is_object() || j.value("format", "") != kFormat || j.value("algorithm", "") != "crc32c")
      throw std::runtime_error(path + ": not an mfsdp dataset checksums file (format '" + std::string(kFormat) +
                               "', algorithm crc32c)");
    if (j.at("version").get<int>() != 1)
      throw std::runtime_error(path + ": version " + j.at("version").dump() + "; this build reads version 1 (update mfsdp)");
    c->idx_length_ = j.at("idx").at("length").get<uint64_t>();
    c->idx_crc_ = j.at("idx").at("crc32c").get<uint32_t>();
    const nlohmann::json& bin = j.at("bin");
    c->bin_length_ = bin.at("length").get<uint64_t>();
    if (bin.at("block_bytes").get<uint64_t>() != kBlockBytes)
      throw std::runtime_error(path + ": block_bytes " + bin.at("block_bytes").dump() + " (this build uses " +
                               std::to_string(kBlockBytes) + ")");
    c->blocks_ = bin.at("crc32c").get<std::vector<uint32_t>>();
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": malformed (" + e.what() + ")");
  }
  const uint64_t want = (c->bin_length_ + kBlockBytes - 1) / kBlockBytes;
  if (c->blocks_.size() != want)
    throw std::runtime_error(path + ": " + std::to_string(c->blocks_.size()) + " block checksums for a " +
                             std::to_string(c->bin_length_) + "-byte .bin (" + std::to_string(want) + " expected)");
  c->verified_.reset(new std::atomic<bool>[c->blocks_.size()]);
  for (size_t b = 0; b < c->blocks_.size(); ++b) c->verified_[b] = false;
  return c;
}

void DatasetChecksums::verify_index(const std::string& idx_bytes) const {
  const uint32_t found = crc32c(idx_bytes.data(), idx_bytes.size());
  if (idx_bytes.size() != idx_length_ || found != idx_crc_)
    throw std::runtime_error(index_file_path(path_prefix_) + ": does not match its checksum in " +
                             dataset_checksums_path(path_prefix_) + " (" + std::to_string(idx_length_) +
                             " bytes with CRC-32C " + crc32c_hex(idx_crc_) + " saved; " +
                             std::to_string(idx_bytes.size()) + " bytes with " + crc32c_hex(found) +
                             " now): the file was changed or damaged after it was written");
}

void DatasetChecksums::verify_data_size(uint64_t size) const {
  if (size != bin_length_)
    throw std::runtime_error(data_file_path(path_prefix_) + ": " + std::to_string(size) + " bytes, but " +
                             dataset_checksums_path(path_prefix_) + " was written for " + std::to_string(bin_length_) +
                             " (truncated or extended?)");
}

void DatasetChecksums::verify_data(const unsigned char* data, uint64_t begin, uint64_t end, int64_t sequence,
                                   int64_t first_token, int64_t tokens) const {
  if (end <= begin) return;
  for (uint64_t b = begin / kBlockBytes; b <= (end - 1) / kBlockBytes; ++b) {
    if (verified_[b].load(std::memory_order_acquire)) continue;
    const uint64_t at = b * kBlockBytes, n = std::min(kBlockBytes, bin_length_ - at);
    const uint32_t found = crc32c(data + at, n);
    if (found != blocks_[b])
      throw std::runtime_error(data_file_path(path_prefix_) + ": " + range(at, at + n) +
                               " do not match their checksum in " + dataset_checksums_path(path_prefix_) +
                               " (CRC-32C " + crc32c_hex(blocks_[b]) + " saved, " + crc32c_hex(found) +
                               " read) while reading tokens [" + std::to_string(first_token) + ", " +
                               std::to_string(first_token + tokens) + ") of sequence " + std::to_string(sequence) +
                               ": the file was changed or damaged after it was written");
    verified_[b].store(true, std::memory_order_release);
  }
}

}  // namespace mfsdp
