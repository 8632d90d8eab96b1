// Megatron's MMIDIDX indexed dataset: reader and writer (format in include/mfsdp/data/indexed_dataset.h
// and docs/data.md).
#include "mfsdp/data/indexed_dataset.h"

#include "mfsdp/data/dataset_checksums.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace mfsdp {
namespace {

// The first 9 bytes of every .idx (Megatron's _INDEX_HEADER).
constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
// magic (9) + version (8) + dtype code (1) + sequence count (8) + document-index count (8).
constexpr size_t kHeaderSize = 34;

static_assert(sizeof(int32_t) == 4 && sizeof(int64_t) == 8, "fixed-width integers");

// The format is little-endian; so is every machine we build for.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the .idx/.bin format is little-endian");

std::string errno_text() { return std::strerror(errno); }

std::string hex_bytes(const unsigned char* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    if (i) s += ' ';
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

bool valid_code(uint8_t code) { return code >= 1 && code <= 8; }

// Reads token `k` of dtype `dtype` at `p` as an int64. Float dtypes must hold integral values.
int64_t token_at(TokenDType dtype, const unsigned char* p, const std::string& where) {
  switch (dtype) {
    case TokenDType::kUInt8: return load<uint8_t>(p);
    case TokenDType::kInt8: return load<int8_t>(p);
    case TokenDType::kInt16: return load<int16_t>(p);
    case TokenDType::kInt32: return load<int32_t>(p);
    case TokenDType::kInt64: return load<int64_t>(p);
    case TokenDType::kUInt16: return load<uint16_t>(p);
    case TokenDType::kFloat32:
    case TokenDType::kFloat64: {
      double v = dtype == TokenDType::kFloat32 ? load<float>(p) : load<double>(p);
      if (!std::isfinite(v) || v != std::floor(v) || std::fabs(v) > 9.007199254740992e15) {
        std::ostringstream msg;
        msg << where << ": token value " << v << " (" << token_dtype_name(dtype)
            << ") is not an integral token id";
        throw std::runtime_error(msg.str());
      }
      return static_cast<int64_t>(v);
    }
  }
  throw std::invalid_argument(where + ": unknown dtype code " +
                              std::to_string(static_cast<int>(dtype)));
}

// Whether `v` fits `dtype` exactly.
bool representable(TokenDType dtype, int64_t v) {
  switch (dtype) {
    case TokenDType::kUInt8: return v >= 0 && v <= 255;
    case TokenDType::kInt8: return v >= -128 && v <= 127;
    case TokenDType::kInt16: return v >= -32768 && v <= 32767;
    case TokenDType::kUInt16: return v >= 0 && v <= 65535;
    case TokenDType::kInt32:
      return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max();
    case TokenDType::kInt64: return true;
    case TokenDType::kFloat32: return v >= -(int64_t{1} << 24) && v <= (int64_t{1} << 24);
    case TokenDType::kFloat64: return v >= -(int64_t{1} << 53) && v <= (int64_t{1} << 53);
  }
  return false;
}

void store_token(TokenDType dtype, int64_t v, unsigned char* p) {
  switch (dtype) {
    case TokenDType::kUInt8: { uint8_t t = static_cast<uint8_t>(v); std::memcpy(p, &t, 1); return; }
    case TokenDType::kInt8: { int8_t t = static_cast<int8_t>(v); std::memcpy(p, &t, 1); return; }
    case TokenDType::kInt16: { int16_t t = static_cast<int16_t>(v); std::memcpy(p, &t, 2); return; }
    case TokenDType::kUInt16: { uint16_t t = static_cast<uint16_t>(v); std::memcpy(p, &t, 2); return; }
    case TokenDType::kInt32: { int32_t t = static_cast<int32_t>(v); std::memcpy(p, &t, 4); return; }
    case TokenDType::kInt64: std::memcpy(p, &v, 8); return;
    case TokenDType::kFloat32: { float t = static_cast<float>(v); std::memcpy(p, &t, 4); return; }
    case TokenDType::kFloat64: { double t = static_cast<double>(v); std::memcpy(p, &t, 8); return; }
  }
}

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open for reading: " + errno_text());
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw std::runtime_error(path + ": read error: " + errno_text());
  return bytes;
}

}  // namespace

size_t token_dtype_size(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::kUInt8:
    case TokenDType::kInt8: return 1;
    case TokenDType::kInt16:
    case TokenDType::kUInt16: return 2;
    case TokenDType::kInt32:
    case TokenDType::kFloat32: return 4;
    case TokenDType::kInt64:
    case TokenDType::kFloat64: return 8;
  }
  throw std::invalid_argument("token dtype code " + std::to_string(static_cast<int>(dtype)) +
                              " is not one of Megatron's codes 1..8");
}

const char* token_dtype_name(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::kUInt8: return "uint8";
    case TokenDType::kInt8: return "int8";
    case TokenDType::kInt16: return "int16";
    case TokenDType::kInt32: return "int32";
    case TokenDType::kInt64: return "int64";
    case TokenDType::kFloat64: return "float64";
    case TokenDType::kFloat32: return "float32";
    case TokenDType::kUInt16: return "uint16";
  }
  return "unknown";
}

TokenDType optimal_token_dtype(int64_t vocab_size) {
  return vocab_size < 65500 ? TokenDType::kUInt16 : TokenDType::kInt32;
}

std::string index_file_path(const std::string& path_prefix) { return path_prefix + ".idx"; }
std::string data_file_path(const std::string& path_prefix) { return path_prefix + ".bin"; }

// ---- reader -------------------------------------------------------------------------------------

IndexedDataset::IndexedDataset(std::string path_prefix)
    : path_prefix_(std::move(path_prefix)), checksums_(DatasetChecksums::load(path_prefix_)) {
  load_index();
  map_data();
}

IndexedDataset::~IndexedDataset() {
  if (data_ != nullptr) munmap(const_cast<unsigned char*>(data_), data_size_);
}

bool IndexedDataset::exists(const std::string& path_prefix) {
  struct stat st;
  return stat(index_file_path(path_prefix).c_str(), &st) == 0 &&
         stat(data_file_path(path_prefix).c_str(), &st) == 0;
}

void IndexedDataset::load_index() {
  const std::string path = index_file_path(path_prefix_);
  const std::string bytes = read_whole_file(path);
  if (checksums_) checksums_->verify_index(bytes);  // before parsing: a changed index is named as such
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t size = bytes.size();

  if (size < kHeaderSize) {
    std::ostringstream msg;
    msg << path << ": truncated index: " << size << " bytes, but the header alone is "
        << kHeaderSize << " bytes (magic, version, dtype code, sequence and document counts)";
    throw std::runtime_error(msg.str());
  }
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) {
    throw std::runtime_error(path + ": wrong magic: expected the 9 bytes of \"MMIDIDX\\0\\0\" " +
                             "(4d 4d 49 44 49 44 58 00 00), found " + hex_bytes(p, 9) +
                             "; this is not a Megatron indexed-dataset index");
  }
  const uint64_t version = load<uint64_t>(p + 9);
  if (version != kVersion) {
    throw std::runtime_error(path + ": unsupported version " + std::to_string(version) +
                             " (only version 1 exists)");
  }
  const uint8_t code = p[17];
  if (!valid_code(code)) {
    throw std::runtime_error(path + ": unknown dtype code " + std::to_string(code) +
                             " (Megatron's codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, " +
                             "6 float64, 7 float32, 8 uint16)");
  }
  dtype_ = static_cast<TokenDType>(code);
  const uint64_t seq_count = load<uint64_t>(p + 18);
  const uint64_t doc_count = load<uint64_t>(p + 26);

  // 128-bit so that absurd counts from a corrupt header cannot overflow the size check.
  const unsigned __int128 need = static_cast<unsigned __int128>(kHeaderSize) +
                                 static_cast<unsigned __int128>(seq_count) * 12u +
                                 static_cast<unsigned __int128>(doc_count) * 8u;
  if (need > size) {
    std::ostringstream msg;
    msg << path << ": truncated index: the header says " << seq_count << " sequences and "
        << doc_count << " document indices, which need "
        << (need > std::numeric_limits<uint64_t>::max() ? std::string("more than 2^64")
                                                         : std::to_string(static_cast<uint64_t>(need)))
        << " bytes, but the file has " << size << " bytes";
    throw std::runtime_error(msg.str());
  }
  const size_t trailing = size - static_cast<size_t>(need);
  if (trailing != 0 && trailing != seq_count) {
    std::ostringstream msg;
    msg << path << ": " << trailing << " unexpected bytes after the document indices (" << size
        << " bytes in all; the counts in the header account for " << static_cast<uint64_t>(need)
        << ", and a multimodal index adds exactly one mode byte per sequence, " << seq_count
        << ")";
    throw std::runtime_error(msg.str());
  }
  if (doc_count < 1) {
    throw std::runtime_error(path + ": the document index is empty; it must hold at least the " +
                             "leading 0");
  }

  size_t off = kHeaderSize;
  sequence_lengths_.resize(seq_count);
  if (seq_count) std::memcpy(sequence_lengths_.data(), p + off, seq_count * 4);
  off += seq_count * 4;
  sequence_pointers_.resize(seq_count);
  if (seq_count) std::memcpy(sequence_pointers_.data(), p + off, seq_count * 8);
  off += seq_count * 8;
  document_indices_.resize(doc_count);
  std::memcpy(document_indices_.data(), p + off, doc_count * 8);
  off += doc_count * 8;
  if (trailing != 0) {
    sequence_modes_.resize(seq_count);
    std::memcpy(sequence_modes_.data(), p + off, seq_count);
  }

  num_tokens_ = 0;
  for (uint64_t i = 0; i < seq_count; ++i) {
    if (sequence_lengths_[i] < 0) {
      throw std::runtime_error(path + ": sequence " + std::to_string(i) + " has negative length " +
                               std::to_string(sequence_lengths_[i]));
    }
    num_tokens_ += sequence_lengths_[i];
  }
  const auto S = static_cast<int64_t>(seq_count);
  if (document_indices_.front() != 0 || document_indices_.back() != S) {
    throw std::runtime_error(path + ": document indices must run from 0 to the sequence count " +
                             std::to_string(S) + ", found first " +
                             std::to_string(document_indices_.front()) + " and last " +
                             std::to_string(document_indices_.back()));
  }
  for (size_t d = 1; d < document_indices_.size(); ++d) {
    if (document_indices_[d] < document_indices_[d - 1]) {
      throw std::runtime_error(path + ": document indices decrease at entry " + std::to_string(d) +
                               " (" + std::to_string(document_indices_[d - 1]) + " then " +
                               std::to_string(document_indices_[d]) + ")");
    }
  }
}

void IndexedDataset::map_data() {
  const std::string path = data_file_path(path_prefix_);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(path + ": cannot open for reading: " + errno_text());
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const std::string err = errno_text();
    ::close(fd);
    throw std::runtime_error(path + ": cannot stat: " + err);
  }
  data_size_ = static_cast<size_t>(st.st_size);
  if (checksums_) {
    try {
      checksums_->verify_data_size(data_size_);
    } catch (...) {
      ::close(fd);
      throw;
    }
  }
  if (data_size_ > 0) {
    void* m = mmap(nullptr, data_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const std::string err = errno_text();
      ::close(fd);
      throw std::runtime_error(path + ": cannot map into memory: " + err);
    }
    data_ = static_cast<const unsigned char*>(m);
  }
  ::close(fd);

  // Every sequence's bytes must lie inside the .bin, so that reads never need to check again.
  const size_t itemsize = token_dtype_size(dtype_);
  for (size_t i = 0; i < sequence_lengths_.size(); ++i) {
    const int64_t ptr = sequence_pointers_[i];
    const unsigned __int128 end = static_cast<unsigned __int128>(ptr < 0 ? 0 : ptr) +
                                  static_cast<unsigned __int128>(sequence_lengths_[i]) * itemsize;
    if (ptr < 0 || end > data_size_) {
      std::ostringstream msg;
      msg << path << ": sequence " << i << " (" << sequence_lengths_[i] << " tokens of "
          << token_dtype_name(dtype_) << " at byte offset " << ptr << ", from "
          << index_file_path(path_prefix_) << ") lies beyond the end of the file (" << data_size_
          << " bytes)";
      if (data_ != nullptr) munmap(const_cast<unsigned char*>(data_), data_size_);
      data_ = nullptr;
      throw std::runtime_error(msg.str());
    }
  }
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  if (i < 0 || i >= size()) {
    throw std::out_of_range(path_prefix_ + ": sequence " + std::to_string(i) +
                            " out of range [0, " + std::to_string(size()) + ")");
  }
  return sequence_lengths_[static_cast<size_t>(i)];
}

void IndexedDataset::read(int64_t i, int64_t offset, int64_t length, int64_t* out) const {
  const int64_t n = sequence_length(i);
  if (offset < 0 || length < 0 || offset > n || length > n - offset) {
    throw std::out_of_range(path_prefix_ + ": tokens [" + std::to_string(offset) + ", " +
                            std::to_string(offset + length) + ") of sequence " +
                            std::to_string(i) + " are outside its " + std::to_string(n) +
                            " tokens");
  }
  const size_t itemsize = token_dtype_size(dtype_);
  const unsigned char* p =
      data_ + sequence_pointers_[static_cast<size_t>(i)] + static_cast<size_t>(offset) * itemsize;
  if (checksums_) {
    const uint64_t begin = static_cast<uint64_t>(p - data_);
    checksums_->verify_data(data_, begin, begin + static_cast<uint64_t>(length) * itemsize, i, offset, length);
  }
  switch (dtype_) {  // the common integer types without the per-token switch
    case TokenDType::kUInt16:
      for (int64_t k = 0; k < length; ++k) out[k] = load<uint16_t>(p + 2 * k);
      return;
    case TokenDType::kInt32:
      for (int64_t k = 0; k < length; ++k) out[k] = load<int32_t>(p + 4 * k);
      return;
    default:
      for (int64_t k = 0; k < length; ++k) {
        out[k] = token_at(dtype_, p + static_cast<size_t>(k) * itemsize,
                          data_file_path(path_prefix_) + " sequence " + std::to_string(i));
      }
  }
}

std::vector<int64_t> IndexedDataset::get(int64_t i, int64_t offset, int64_t length) const {
  const int64_t n = sequence_length(i);
  if (length < 0) length = n - offset;
  std::vector<int64_t> out(static_cast<size_t>(length < 0 ? 0 : length));
  read(i, offset, length, out.data());
  return out;
}

// ---- writer -------------------------------------------------------------------------------------

IndexedDatasetWriter::IndexedDatasetWriter(std::string path_prefix, TokenDType dtype)
    : path_prefix_(std::move(path_prefix)), dtype_(dtype), itemsize_(token_dtype_size(dtype)) {
  const std::string tmp = data_file_path(path_prefix_) + ".tmp";
  bin_ = std::fopen(tmp.c_str(), "wb");
  if (bin_ == nullptr) throw std::runtime_error(tmp + ": cannot open for writing: " + errno_text());
  document_indices_.push_back(0);
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (finalized_) return;
  if (bin_ != nullptr) std::fclose(bin_);
  std::remove((data_file_path(path_prefix_) + ".tmp").c_str());
  std::remove((index_file_path(path_prefix_) + ".tmp").c_str());
}

void IndexedDatasetWriter::check_open(const char* what) const {
  if (finalized_) {
    throw std::logic_error(path_prefix_ + ": " + what + " after finalize()");
  }
}

void IndexedDatasetWriter::write_bytes(const void* data, size_t n) {
  if (n == 0) return;
  if (std::fwrite(data, 1, n, bin_) != n) {
    throw std::runtime_error(data_file_path(path_prefix_) + ".tmp: write failed: " + errno_text());
  }
}

void IndexedDatasetWriter::add_item(const int64_t* tokens, size_t count) {
  check_open("add_item");
  if (count > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw std::length_error(path_prefix_ + ": a sequence of " + std::to_string(count) +
                            " tokens does not fit the index's int32 length field");
  }
  buffer_.resize(count * itemsize_);
  for (size_t k = 0; k < count; ++k) {
    if (!representable(dtype_, tokens[k])) {
      throw std::out_of_range(path_prefix_ + ": token " + std::to_string(tokens[k]) +
                              " does not fit the dataset dtype " + token_dtype_name(dtype_));
    }
    store_token(dtype_, tokens[k], buffer_.data() + k * itemsize_);
  }
  write_bytes(buffer_.data(), buffer_.size());
  sequence_lengths_.push_back(static_cast<int32_t>(count));
  num_tokens_ += static_cast<int64_t>(count);
}

void IndexedDatasetWriter::end_document() {
  check_open("end_document");
  document_indices_.push_back(num_sequences());
}

void IndexedDatasetWriter::add_document(const std::vector<int64_t>& tokens) {
  if (!tokens.empty()) add_item(tokens);
  end_document();
}

void IndexedDatasetWriter::add_document(const std::vector<int64_t>& tokens,
                                        const std::vector<int32_t>& lengths) {
  check_open("add_document");
  int64_t total = 0;
  for (int32_t n : lengths) {
    if (n < 0) throw std::invalid_argument(path_prefix_ + ": negative sequence length " +
                                           std::to_string(n) + " in add_document");
    total += n;
  }
  if (total != static_cast<int64_t>(tokens.size())) {
    throw std::invalid_argument(path_prefix_ + ": add_document lengths sum to " +
                                std::to_string(total) + " but the document has " +
                                std::to_string(tokens.size()) + " tokens");
  }
  size_t at = 0;
  for (int32_t n : lengths) {
    add_item(tokens.data() + at, static_cast<size_t>(n));
    at += static_cast<size_t>(n);
  }
  end_document();
}

void IndexedDatasetWriter::add_index(const std::string& path_prefix) {
  check_open("add_index");
  if (document_indices_.back() != num_sequences()) {
    throw std::logic_error(path_prefix_ + ": add_index while a document is open (call " +
                           "end_document() first)");
  }
  IndexedDataset other(path_prefix);
  if (other.dtype() != dtype_) {
    throw std::invalid_argument(path_prefix + ": dtype " + token_dtype_name(other.dtype()) +
                                " differs from the dataset being written (" +
                                token_dtype_name(dtype_) + ")");
  }
  if (!other.sequence_modes().empty()) {
    throw std::invalid_argument(path_prefix + ": multimodal datasets cannot be merged here");
  }
  const int64_t base = num_sequences();
  // Copy token bytes sequence by sequence (pointers need not be contiguous in a foreign file).
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < other.size(); ++i) {
    tokens.resize(static_cast<size_t>(other.sequence_length(i)));
    other.read(i, 0, static_cast<int64_t>(tokens.size()), tokens.data());
    add_item(tokens.data(), tokens.size());
  }
  const auto& docs = other.document_indices();
  for (size_t d = 1; d < docs.size(); ++d) document_indices_.push_back(base + docs[d]);
}

void IndexedDatasetWriter::finalize() {
  check_open("finalize");
  if (document_indices_.back() != num_sequences()) {
    throw std::logic_error(path_prefix_ + ": finalize() with " +
                           std::to_string(num_sequences() - document_indices_.back()) +
                           " sequence(s) after the last end_document()");
  }
  const std::string bin_tmp = data_file_path(path_prefix_) + ".tmp";
  const std::string idx_tmp = index_file_path(path_prefix_) + ".tmp";
  if (std::fclose(bin_) != 0) {
    bin_ = nullptr;
    throw std::runtime_error(bin_tmp + ": close failed: " + errno_text());
  }
  bin_ = nullptr;

  std::FILE* idx = std::fopen(idx_tmp.c_str(), "wb");
  if (idx == nullptr) throw std::runtime_error(idx_tmp + ": cannot open for writing: " + errno_text());
  const uint64_t seq_count = sequence_lengths_.size();
  const uint64_t doc_count = document_indices_.size();
  const uint8_t code = static_cast<uint8_t>(dtype_);
  // Megatron's _IndexWriter: pointers are the running byte offsets of the sequences.
  std::vector<int64_t> pointers(seq_count);
  int64_t ptr = 0;
  for (size_t i = 0; i < seq_count; ++i) {
    pointers[i] = ptr;
    ptr += static_cast<int64_t>(sequence_lengths_[i]) * static_cast<int64_t>(itemsize_);
  }
  bool ok = std::fwrite(kMagic, 1, sizeof(kMagic), idx) == sizeof(kMagic) &&
            std::fwrite(&kVersion, 8, 1, idx) == 1 && std::fwrite(&code, 1, 1, idx) == 1 &&
            std::fwrite(&seq_count, 8, 1, idx) == 1 && std::fwrite(&doc_count, 8, 1, idx) == 1 &&
            std::fwrite(sequence_lengths_.data(), 4, seq_count, idx) == seq_count &&
            std::fwrite(pointers.data(), 8, seq_count, idx) == seq_count &&
            std::fwrite(document_indices_.data(), 8, doc_count, idx) == doc_count;
  ok = (std::fclose(idx) == 0) && ok;
  if (!ok) throw std::runtime_error(idx_tmp + ": write failed: " + errno_text());

  if (std::rename(bin_tmp.c_str(), data_file_path(path_prefix_).c_str()) != 0) {
    throw std::runtime_error(bin_tmp + ": cannot rename to " + data_file_path(path_prefix_) +
                             ": " + errno_text());
  }
  if (std::rename(idx_tmp.c_str(), index_file_path(path_prefix_).c_str()) != 0) {
    throw std::runtime_error(idx_tmp + ": cannot rename to " + index_file_path(path_prefix_) +
                             ": " + errno_text());
  }
  write_dataset_checksums(path_prefix_);  // re-reads the files just written, from the page cache
  finalized_ = true;
}

}  // namespace mfsdp
