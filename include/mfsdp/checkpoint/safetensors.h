// The safetensors file format (https://huggingface.co/docs/safetensors), read and written
// without Python (docs/checkpoints.md: HF interop, no pickle). See docs/safetensors.md.
//
//   [8 bytes: header length N, little-endian u64]
//   [N bytes: UTF-8 JSON {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
//                         ..., "__metadata__": {"k": "v"}}, padded with spaces]
//   [byte buffer: every tensor's bytes, little-endian, row-major, no gaps, no overlaps]
//
//   mfsdp::write_safetensors(path, {{"w", w}, {"b", b}}, {{"format", "pt"}});
//   mfsdp::SafetensorsFile f(path);            // validates the whole header
//   at::Tensor w2 = f.load("w");
//
// Errors are std::invalid_argument whose message names the file and, where one is at fault,
// the tensor. Supported dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace mfsdp {

// "F32" etc. for a torch dtype; throws std::invalid_argument for one safetensors cannot hold here.
std::string safetensors_dtype_name(at::ScalarType dtype);
// The torch dtype of "F32" etc.; throws std::invalid_argument for an unknown name.
at::ScalarType safetensors_dtype_from_name(const std::string& name);

// Writes `tensors` (any device, any strides: copied to contiguous CPU bytes) to `path`.
// Layout like the safetensors library: the byte buffer holds the tensors sorted by dtype
// (widest dtype first: I64/F64, then F32/I32, BF16/F16/I16, I8/U8/BOOL) and then by name, so
// every tensor is aligned to its item size; header entries appear in that same order,
// "__metadata__" first when `metadata` is not empty; the header is padded with spaces to a
// multiple of 8 bytes. The file is written to "<path>.tmp.<pid>", flushed and renamed over
// `path`, so readers never see a half-written file. Throws std::invalid_argument for an empty
// or duplicated name, the name "__metadata__", or an unsupported dtype; std::runtime_error for
// an I/O failure (naming the file).
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// One safetensors file. open() reads and validates the header (header length within the file,
// header starts with '{', valid JSON without duplicated names, every entry an object with a
// known dtype, non-negative shape, data_offsets [begin, end] with end - begin == numel * itemsize,
// all entries together tiling the byte buffer exactly: no gap, no overlap, nothing out of bounds,
// nothing after the last tensor; "__metadata__" an object of strings). Tensor bytes are read
// only by load(), with bounds checked again against the file's current size.
class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  explicit SafetensorsFile(const std::string& path) { open(path); }

  void open(const std::string& path);
  bool is_open() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

  // Tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // These throw std::invalid_argument naming the file and `name` when there is no such tensor.
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  // Byte size of the tensor's data.
  uint64_t nbytes(const std::string& name) const;
  // A fresh CPU tensor with the stored bytes (a copy; the file is not kept open).
  at::Tensor load(const std::string& name) const;
  // Elements [offset, offset + count) of the tensor, flattened row-major, as a fresh 1-D tensor
  // (sharded checkpoints read only the part a rank owns). Throws naming the file and tensor
  // when the range is outside the tensor.
  at::Tensor load_elements(const std::string& name, int64_t offset, int64_t count) const;
  // Elements [offset, offset + dst.numel()) of the tensor into the 1-D `dst` (any dtype, any
  // device), read and converted at most kRangeChunkBytes of the file at a time: a rank loading
  // its shard of a bf16 tensor into fp32 main weights never holds the range twice. Read with
  // pread, not mmap: a mapping's touched pages count in the process's RSS until unmapped, and a
  // file truncated under a mapping is a SIGBUS instead of an error naming it. Throws naming the
  // file and tensor when the range is outside the tensor or the file changed since open().
  void read_elements_into(const std::string& name, int64_t offset, const at::Tensor& dst) const;
  static constexpr uint64_t kRangeChunkBytes = uint64_t{16} << 20;
  // [begin, end) of the tensor's bytes, counted from the start of the file.
  std::pair<uint64_t, uint64_t> file_byte_range(const std::string& name) const;
  // Every tensor, by name.
  std::map<std::string, at::Tensor> load_all() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0;  // relative to the byte buffer
    uint64_t end = 0;
  };
  const Entry& entry(const std::string& name) const;

  std::string path_;
  uint64_t data_start_ = 0;  // 8 + header length
  uint64_t file_size_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face model folder. If the tensors' total byte size exceeds max_shard_bytes they are
// split, in the given order, greedily into shards of at most max_shard_bytes each (a single
// tensor larger than that gets a shard of its own), written as model-00001-of-0000N.safetensors
// plus model.safetensors.index.json {"metadata": {"total_size": bytes}, "weight_map":
// {name: file}}; otherwise one model.safetensors. Every file carries metadata {"format": "pt"}
// (what transformers expects). `dir` is created if missing; model*.safetensors files and an index
// left there by an earlier write and not part of this one are removed afterwards.
// Returns the names of the files written.
std::vector<std::string> write_safetensors_sharded(
    const std::string& dir, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
    uint64_t max_shard_bytes);

// Reads a folder written by write_safetensors_sharded or by transformers' save_pretrained:
// with model.safetensors.index.json, every file in its weight_map (plain file names inside
// `dir` only) must exist, hold the tensors mapped to it and no tensor mapped elsewhere; without
// one, model.safetensors is read. Errors (std::invalid_argument) name the file and tensor.
std::map<std::string, at::Tensor> read_safetensors_folder(const std::string& dir);

}  // namespace mfsdp
