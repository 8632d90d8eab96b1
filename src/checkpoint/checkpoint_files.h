// Internal to src/checkpoint: the on-disk pieces of the fsdp_dtensor format that saving,
// loading and the reader share (names, the metadata's chunk records, atomic commit).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace mfsdp::checkpoint {

constexpr const char* kLatestFile = "latest_checkpointed_iteration.txt";
constexpr const char* kMetadataFile = "metadata.json";

std::string rank_file_name(int rank);                                  // "rank_00003.safetensors"
std::string chunk_key(const std::string& tensor, int64_t offset);      // "model.w@128"
std::string rng_tensor_name(int rank, const std::string& generator);   // "rng_state.rank3.cpu"

// One chunk as a rank reports it after writing its file; rank 0 merges them into metadata.json.
struct ChunkRecord {
  std::string tensor;
  std::string dtype;            // safetensors name, "F32"
  std::vector<int64_t> shape;   // global shape
  int64_t offset = 0;           // first element (of the flattened tensor)
  int64_t numel = 0;            // 0: the rank only declares the tensor (it holds none of it)
  uint64_t byte_begin = 0, byte_end = 0;  // in its file
  std::optional<uint32_t> crc32c;         // of those bytes (absent in files of older builds)
};
nlohmann::json to_json(const ChunkRecord& c);
ChunkRecord chunk_from_json(const nlohmann::json& j);

// The "tensors" object of metadata.json from every rank's records (records[r]: rank r's file).
// Throws std::logic_error if ranks disagree on a tensor's dtype or shape or the chunks do not
// tile a tensor exactly (a bug in the writer, never bad input).
nlohmann::json merge_chunk_records(const std::vector<std::vector<ChunkRecord>>& records);

// Writes `text` to `path` via a temporary file, fsync and rename, through the installed
// CheckpointFileSystem (checkpoint.h). Throws std::runtime_error.
void write_file_atomically(const std::string& path, const std::string& text);

// What the default CheckpointFileSystem::write_file_atomically does.
void write_posix_file_atomically(const std::string& path, const std::string& text);

// Rank 0's commit, through the installed CheckpointFileSystem, one step per call: `tmp_dir`
// (complete, with its metadata) becomes `final_dir`, then `save_dir`/latest_checkpointed_iteration.txt
// names `iteration`. An existing `final_dir` (a second save of one iteration) is swapped with
// `tmp_dir` in one step where the file system can, else moved aside to `final_dir`.old first. A
// crash between any two steps leaves `latest` naming a folder that loads (readable_iteration_dir).
void commit_checkpoint(const std::string& save_dir, const std::string& tmp_dir,
                       const std::string& final_dir, int64_t iteration);

// Where iteration `iteration` of `dir` is read from: iter_NNNNNNN, or iter_NNNNNNN.old when a
// replacement of it died after moving it aside and before its successor took its name.
std::string readable_iteration_dir(const std::string& dir, int64_t iteration);

}  // namespace mfsdp::checkpoint
