#include "mfsdp/train/tensorboard_writer.h"

#include "mfsdp/base/crc32c.h"
#include "mfsdp/base/host_name.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "mfsdp/train/metrics.h"

namespace mfsdp {
namespace {

// The protobuf wire format, only what an Event of scalars needs (field numbers from
// tensorflow/core/util/event.proto and tensorflow/core/framework/summary.proto).
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_tag(std::string& out, int field, int wire_type) { put_varint(out, static_cast<uint64_t>(field) << 3 | wire_type); }
template <class T>
void put_fixed(std::string& out, int field, int wire_type, T value) {
  put_tag(out, field, wire_type);
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian, as the wire format is (x86, ARM)
  out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event { double wall_time = 1; int64 step = 2; oneof { string file_version = 3; Summary summary = 5; } }
std::string event(int64_t step, const std::string& file_version, const std::string& summary) {
  const double wall_time =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string e;
  put_fixed(e, 1, 1, wall_time);
  put_tag(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));
  if (!file_version.empty()) put_bytes(e, 3, file_version);
  if (!summary.empty()) put_bytes(e, 5, summary);
  return e;
}

// Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
std::string summary(const std::vector<std::pair<std::string, double>>& scalars) {
  std::string s;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    put_fixed(v, 2, 5, static_cast<float>(value));
    put_bytes(s, 1, v);
  }
  return s;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(seconds) + "." + host_name() + "." +
                                         std::to_string(::getpid()) + ".0")).string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw std::runtime_error("--tensorboard-dir: cannot create '" + path_ + "'");
  write_record(event(0, "brain.Event:2", ""));
}

void TensorBoardWriter::write_record(const std::string& bytes) {
  const uint64_t length = bytes.size();
  const uint32_t length_crc = masked(crc32c(&length, sizeof length));
  const uint32_t data_crc = masked(crc32c(bytes.data(), bytes.size()));
  out_.write(reinterpret_cast<const char*>(&length), sizeof length);
  out_.write(reinterpret_cast<const char*>(&length_crc), sizeof length_crc);
  out_.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out_.write(reinterpret_cast<const char*>(&data_crc), sizeof data_crc);
  out_.flush();
  if (!out_) throw std::runtime_error("--tensorboard-dir: writing '" + path_ + "' failed");
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  if (!out_.is_open()) return;
  write_record(event(step, "", summary(scalars)));
}

void TensorBoardWriter::write(const IterationRecord& r, int64_t interval) {
  if (!out_.is_open()) return;
  if (r.eval) return add_scalars(r.iteration, {{"lm loss validation", r.lm_loss}});
  if (interval > 1 && r.iteration % interval != 0) return;
  std::vector<std::pair<std::string, double>> s = {
      {"lm loss", r.lm_loss},           {"learning-rate", r.lr},
      {"grad-norm", r.grad_norm},       {"iteration-time", r.iter_time_s},
      {"tokens-per-sec", r.tokens_per_sec}, {"throughput", r.tflops_per_rank},
      {"mem-bytes", static_cast<double>(r.mem_bytes)}, {"consumed-samples", static_cast<double>(r.consumed_samples)}};
  for (const auto& [key, value] : r.extra) {
    std::string tag = key;
    for (char& c : tag)
      if (c == '_') c = '-';
    if (tag == "num-zeros-in-grad") tag = "num-zeros";  // Megatron's names for these two
    s.emplace_back(tag, value);
  }
  add_scalars(r.iteration, s);
}

}  // namespace mfsdp
