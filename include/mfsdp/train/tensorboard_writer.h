// --tensorboard-dir: TensorBoard event files of the training scalars, written without TensorFlow
// or protobuf. An event file is a sequence of TFRecords (length, masked CRC-32C of the length,
// the serialized tensorflow.Event, masked CRC-32C of it); each Event holds wall_time, step and a
// Summary of simple_value scalars. The first Event carries file_version "brain.Event:2", as
// TensorBoard's own writers do. tests/reference/tensorboard_test.py reads ours back with the
// tensorboard package's EventAccumulator.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace mfsdp {

struct IterationRecord;

class TensorBoardWriter {
 public:
  // Creates `dir` and events.out.tfevents.<seconds>.<host>.<pid>.0 in it; a no-op writer when
  // `dir` is empty. Throws std::runtime_error naming the path when it cannot be written.
  explicit TensorBoardWriter(const std::string& dir);

  // One Event at `step` with these (tag, value) scalars, flushed so a crash loses nothing.
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  // A training record under Megatron's tag names ("lm loss", "learning-rate", "grad-norm",
  // "throughput", ...; eval records: "lm loss validation"), every `interval`-th iteration.
  void write(const IterationRecord& r, int64_t interval);

  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& bytes);
  std::string path_;
  std::ofstream out_;
};

}  // namespace mfsdp
