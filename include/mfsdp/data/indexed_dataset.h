// Megatron's indexed dataset: token sequences in `PREFIX.bin`, their index in `PREFIX.idx`.
//
// Byte-compatible with Megatron-LM's megatron/core/datasets/indexed_dataset.py (the "MMIDIDX"
// format): files written here load in Megatron, and files preprocessed by Megatron's
// tools/preprocess_data.py load here. The byte layout is documented in docs/data.md and pinned
// byte for byte by tests/unit/indexed_dataset_test.cpp. All integers are little-endian.
//
//   PREFIX.idx                                  PREFIX.bin
//   9 B   magic "MMIDIDX\0\0"                   the tokens of every sequence, back to back, each
//   u64   version = 1                           token `dtype` wide; sequence i occupies bytes
//   u8    dtype code (TokenDType)               [pointer[i], pointer[i] + length[i] * itemsize)
//   u64   S = sequence count
//   u64   D = document-index count (documents + 1)
//   i32   sequence lengths [S]     (tokens)
//   i64   sequence pointers [S]    (byte offsets into PREFIX.bin)
//   i64   document indices [D]     (sequence index where each document starts; [0] = 0,
//                                   [D-1] = S; document d is sequences [doc[d], doc[d+1]))
//   i8    sequence modes [S]       (only in multimodal datasets; read, never written here)
//
// Vocabulary: a *sequence* is one contiguous run of tokens with one entry in the index (for GPT
// pretraining data, one document = one sequence; Megatron's --split-sentences makes one sequence
// per sentence). A *document* is a run of consecutive sequences.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace mfsdp {

class DatasetChecksums;

// Megatron's DType codes (indexed_dataset.py, class DType). The code is what the .idx stores.
enum class TokenDType : uint8_t {
  kUInt8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUInt16 = 8,
};

// Bytes per token; throws std::invalid_argument on a code outside 1..8.
size_t token_dtype_size(TokenDType dtype);
// "uint16", "int32", ... (numpy's names, as Megatron prints them).
const char* token_dtype_name(TokenDType dtype);
// Megatron's DType.optimal_dtype: uint16 when vocab_size < 65500, else int32.
TokenDType optimal_token_dtype(int64_t vocab_size);

// PREFIX + ".idx" and PREFIX + ".bin".
std::string index_file_path(const std::string& path_prefix);
std::string data_file_path(const std::string& path_prefix);

// A read-only list of token sequences: what GPTDataset draws samples from. Implemented by
// IndexedDataset (files) and MockSequences (synthetic, gpt_dataset.h).
class SequenceSource {
 public:
  virtual ~SequenceSource() = default;
  virtual int64_t num_sequences() const = 0;
  virtual int64_t sequence_length(int64_t i) const = 0;
  // Writes tokens [offset, offset + length) of sequence i to out[0, length). Throws
  // std::out_of_range when the range is not inside the sequence.
  virtual void read(int64_t i, int64_t offset, int64_t length, int64_t* out) const = 0;
  // Names the source in error messages (the path prefix for files).
  virtual std::string describe() const = 0;
};

// Reads PREFIX.idx into memory and maps PREFIX.bin read-only.
//
// Opening validates everything an access could later trip over, and throws std::runtime_error
// naming the file and what is wrong: missing file, wrong magic, unsupported version, unknown
// dtype code, an index shorter (truncated) or longer than its counts say, negative lengths,
// document indices that do not run from 0 to S in order, and sequences whose bytes lie beyond the
// end of PREFIX.bin. After a successful open, every get()/read() inside the sequence bounds is
// valid. Safe to share between threads (all methods are const and read only).
class IndexedDataset : public SequenceSource {
 public:
  explicit IndexedDataset(std::string path_prefix);
  ~IndexedDataset() override;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  // True when both PREFIX.idx and PREFIX.bin exist.
  static bool exists(const std::string& path_prefix);

  const std::string& path_prefix() const { return path_prefix_; }
  TokenDType dtype() const { return dtype_; }

  // Number of sequences (Megatron's len(dataset)).
  int64_t size() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  // Number of documents: document_indices().size() - 1.
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  int64_t num_tokens() const { return num_tokens_; }

  const std::vector<int32_t>& sequence_lengths() const { return sequence_lengths_; }   // [S]
  const std::vector<int64_t>& sequence_pointers() const { return sequence_pointers_; } // [S] bytes
  const std::vector<int64_t>& document_indices() const { return document_indices_; }   // [D]
  // [S] for multimodal datasets (the index carries a modes array), else empty.
  const std::vector<int8_t>& sequence_modes() const { return sequence_modes_; }

  // Tokens [offset, offset + length) of sequence i (length < 0: to the end), as Megatron's
  // IndexedDataset.get(idx, offset, length). Float dtypes must hold integral values.
  std::vector<int64_t> get(int64_t i, int64_t offset = 0, int64_t length = -1) const;

  // SequenceSource
  int64_t num_sequences() const override { return size(); }
  int64_t sequence_length(int64_t i) const override;
  void read(int64_t i, int64_t offset, int64_t length, int64_t* out) const override;
  std::string describe() const override { return path_prefix_; }

 private:
  void load_index();
  void map_data();

  std::string path_prefix_;
  TokenDType dtype_ = TokenDType::kInt32;
  std::vector<int32_t> sequence_lengths_;   // [S]
  std::vector<int64_t> sequence_pointers_;  // [S]
  std::vector<int64_t> document_indices_;   // [D]
  std::vector<int8_t> sequence_modes_;      // [S] or empty
  int64_t num_tokens_ = 0;
  const unsigned char* data_ = nullptr;     // PREFIX.bin, mapped (null when the file is empty)
  size_t data_size_ = 0;
  std::unique_ptr<DatasetChecksums> checksums_;  // PREFIX.checksums.json, when there is one
};

// Writes PREFIX.bin and PREFIX.idx, as Megatron's IndexedDatasetBuilder.
//
// Tokens go to PREFIX.bin.tmp as they are added; finalize() writes PREFIX.idx.tmp and the
// checksums of both (dataset_checksums.h) and renames all three into place (.bin first, the
// checksums last), so a reader never sees a half-written dataset. A writer
// destroyed before finalize() deletes its temporary files. Each token must be representable in
// the dtype (std::out_of_range otherwise, naming the token and the dtype). Not thread-safe.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(std::string path_prefix, TokenDType dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Appends one sequence to the current document (Megatron's add_item).
  void add_item(const int64_t* tokens, size_t count);
  void add_item(const std::vector<int64_t>& tokens) { add_item(tokens.data(), tokens.size()); }
  // Closes the current document (Megatron's end_document). A document may hold no sequence.
  void end_document();
  // Appends a whole document as one sequence, then closes it. An empty `tokens` makes a document
  // with no sequence, as Megatron's preprocess_data.py does for empty text.
  void add_document(const std::vector<int64_t>& tokens);
  // Appends a whole document cut into sequences of the given lengths (which must sum to
  // tokens.size()), then closes it (Megatron's add_document(tensor, lengths)).
  void add_document(const std::vector<int64_t>& tokens, const std::vector<int32_t>& lengths);
  // Appends every sequence and document of the dataset at `path_prefix` (same dtype required),
  // as Megatron's add_index (tools/merge_datasets.py). The current document must be closed.
  void add_index(const std::string& path_prefix);

  // Writes the index and moves both files into place. Throws std::logic_error when sequences were
  // added after the last end_document() (the index could not say which document holds them).
  void finalize();

  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  int64_t num_tokens() const { return num_tokens_; }
  TokenDType dtype() const { return dtype_; }

 private:
  void check_open(const char* what) const;
  void write_bytes(const void* data, size_t n);

  std::string path_prefix_;
  TokenDType dtype_;
  size_t itemsize_;
  std::FILE* bin_ = nullptr;                // PREFIX.bin.tmp while open
  bool finalized_ = false;
  std::vector<int32_t> sequence_lengths_;   // [S]
  std::vector<int64_t> document_indices_;   // starts as {0}, as Megatron's builder
  int64_t num_tokens_ = 0;
  std::vector<unsigned char> buffer_;       // conversion scratch
};

}  // namespace mfsdp
