// PyTorch Distributed Checkpoint (DCP) directories, read and written without Python: the format
// of torch.distributed.checkpoint's FileSystemWriter/Reader, which Megatron-FSDP's fsdp_dtensor
// checkpoints and PyTorch FSDP2's dcp.save use (docs/checkpoints.md).
//
//   DIR/.metadata          a pickled torch.distributed.checkpoint.metadata.Metadata: for every
//                          entry (a flattened state-dict key, "model.module.layer.weight") either
//                          a tensor (dtype, global size, chunks: boxes given by offsets and sizes)
//                          or bytes; and for every chunk/bytes entry its file, offset and length
//   DIR/__<rank>_0.distcp  what rank <rank> wrote: each tensor chunk is a torch.save archive of a
//                          tensor of the chunk's size; bytes entries are stored as written
//
// Reading never runs code from the file: .metadata goes through an allow-list unpickler (only the
// DCP metadata classes, torch.Size, dtypes, layouts and the primitive types; anything else is an
// error naming the class), and chunks through the torch.save reader (torch_save.h). Writing emits
// a .metadata that torch 2.11 and later load.
//
//   mfsdp::dcp::Reader ckpt("ckpt/iter_0000010");
//   at::Tensor w = ckpt.read("model.module.model.norm.weight");
//
// Checksums: what mfsdp writes also holds DIR/.checksums.json, the CRC-32C (crc32c.h) of
// .metadata and of every entry's bytes, bound to the entry (tensor and chunk offsets, or bytes
// key) and its location. torch ignores the file. The Reader checks .metadata against it when
// opening, and each entry's bytes before parsing them, so a changed byte anywhere is an error
// naming the file, entry and byte range. Folders without the file (written by torch) are read
// unverified.
//
// Errors are std::invalid_argument naming the directory or file and, where one is at fault, the
// entry (and for a chunk its offsets and byte range).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "mfsdp/checkpoint/torch_save.h"

namespace mfsdp::dcp {

constexpr const char* kMetadataFile = ".metadata";
constexpr const char* kChecksumsFile = ".checksums.json";

// "__3_0.distcp": the file rank 3 writes (FileSystemWriter's naming with one file per rank).
std::string rank_file_name(int rank);

// Where an entry's bytes are: [offset, offset + length) of `file` (a name in the directory).
struct Location {
  std::string file;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::optional<uint32_t> crc32c;  // of those bytes: set by FileWriter, and by Reader from .checksums.json
};

// A box of a tensor: elements [offsets[d], offsets[d] + sizes[d]) along every dimension d.
struct Box {
  std::vector<int64_t> offsets, sizes;
  int64_t numel() const;
};

// The boxes that make up elements [begin, end) of the row-major flattening of a tensor of
// `shape`, in order, each one contiguous in that flattening: a run of whole rows (or whole
// sub-blocks) in the middle, partial rows at the ends. A flat shard of an FSDP buffer becomes
// DCP chunks this way. 0-d tensors: one box with no dimensions when begin < end.
std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

struct TensorChunk {
  Box box;
  Location location;  // a torch.save archive of a tensor of size box.sizes
};

struct TensorEntry {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::vector<TensorChunk> chunks;
};

struct Metadata {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, Location> bytes;  // raw bytes (an io.BytesIO) or a torch.save'd object
  // Each entry's path in the nested state dict it was flattened from ({"model": {"module.w":
  // t}} gives "model.module.w" -> {"model", "module.w"}); torch uses it to unflatten.
  std::map<std::string, std::vector<std::string>> paths;
};

// Parses a .metadata pickle. `where` names the file in errors. Validates that every chunk lies
// inside its tensor, has the tensor's rank and has a storage location, and that locations have
// plain file names. (Files are checked when chunks are read.)
Metadata parse_metadata(const std::string& pickled, const std::string& where);

// The .metadata pickle of `metadata` (protocol 2; the classes of torch.distributed.checkpoint).
std::string encode_metadata(const Metadata& metadata);

// .checksums.json for `metadata` (every location must carry its crc32c) and the bytes of the
// .metadata file written with it. Throws std::logic_error for a location without one.
std::string encode_checksums(const Metadata& metadata, const std::string& metadata_bytes);

// torch's name of a dtype ("torch.float32"), as Megatron's tools print it.
std::string torch_dtype_name(at::ScalarType dtype);

// True when `dir` holds a .metadata file.
bool is_dcp_directory(const std::string& dir);

class Reader {
 public:
  explicit Reader(const std::string& dir);  // verifies .metadata against .checksums.json, if any

  const std::string& dir() const { return dir_; }
  const Metadata& metadata() const { return metadata_; }
  bool contains_tensor(const std::string& name) const { return metadata_.tensors.count(name) > 0; }
  const TensorEntry& tensor(const std::string& name) const;  // throws naming `name`
  bool has_checksums() const { return has_checksums_; }
  // Every entry's bytes against .checksums.json, without parsing them (constant memory): throws
  // naming the first entry that differs or is missing from its file, or a folder without
  // checksums. Returns the number of entries and bytes checked.
  std::pair<int64_t, uint64_t> verify_checksums() const;
  // One chunk, as stored (size chunk.box.sizes, the entry's dtype): its bytes are checked
  // against their checksum, if any, and the archive against the metadata (size, dtype; bytes
  // inside the file).
  at::Tensor read_chunk(const std::string& name, const TensorChunk& chunk) const;
  // Elements [offset, offset + dst.numel()) of the flattened tensor into the 1-D `dst` (any
  // dtype and device: converted). Throws if any of them is in no chunk.
  void read_range(const std::string& name, int64_t offset, const at::Tensor& dst) const;
  // Each box of the tensor into the tensor of its size at the same index of `dsts` (any dtype
  // and device: converted), each chunk read once: what a tensor-parallel rank reads of a whole
  // tensor. Throws if a box is not inside the tensor or any of its elements is in no chunk.
  void read_boxes(const std::string& name, const std::vector<Box>& boxes, const std::vector<at::Tensor>& dsts) const;
  at::Tensor read(const std::string& name) const;  // the whole tensor, on CPU
  std::string read_bytes(const std::string& name) const;
  // A bytes entry that holds a torch.save'd value (what dcp.save writes for "iteration": 7), as
  // JSON (read_torch_save_value, torch_save.h): plain values only, or with kDescribeObjects also
  // objects such as Megatron's pickled argparse.Namespace "args", described, never constructed.
  nlohmann::json read_object(const std::string& name, ObjectPolicy policy = ObjectPolicy::kPlainOnly) const;

 private:
  void attach_checksums(const std::string& metadata_bytes);
  // Throws unless the bytes of `l` match its crc32c (if it has one and the file holds them).
  void verify(const Location& l, const std::string& what) const;
  // read_range's and read_box's work: `dst` (of want's size) from the chunks overlapping `want`;
  // `loaded` keeps the chunks read, so a chunk several boxes overlap is read once per call.
  void read_box_into(const std::string& name, const Box& want, const at::Tensor& dst,
                     std::map<size_t, at::Tensor>& loaded) const;
  std::string dir_;
  Metadata metadata_;
  bool has_checksums_ = false;
};

// Appends entries to one .distcp file; close() flushes and fsyncs. Not thread-safe.
class FileWriter {
 public:
  FileWriter(const std::string& dir, const std::string& file_name);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  Location write_tensor(const at::Tensor& chunk);  // as a torch.save archive
  Location write_bytes(const std::string& bytes);
  // A plain value as torch.save(value) (objects become dicts, arrays lists), which torch's
  // dcp.load turns back into the Python value.
  Location write_object(const nlohmann::json& value);
  void close();

 private:
  std::string path_, name_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// A whole checkpoint written from one process: every entry into __0_0.distcp, then .metadata
// (what conversions and edits of a checkpoint write). `path`: the entry's nested state-dict path
// (default: the key alone).
class DirectoryWriter {
 public:
  explicit DirectoryWriter(const std::string& dir);  // creates `dir`
  void tensor(const std::string& key, const at::Tensor& value, std::vector<std::string> path = {});
  void bytes(const std::string& key, const std::string& torch_saved, std::vector<std::string> path = {});
  void object(const std::string& key, const nlohmann::json& value, std::vector<std::string> path = {});
  void finish();  // writes .metadata; throws std::invalid_argument for a key written twice

 private:
  void add_path(const std::string& key, std::vector<std::string> path);
  std::string dir_;
  FileWriter file_;
  Metadata metadata_;
};

}  // namespace mfsdp::dcp
