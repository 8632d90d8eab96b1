#include "checkpoint/checkpoint_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/base/directory_tree.h"

namespace fs = std::filesystem;

namespace mfsdp::checkpoint {

std::string rank_file_name(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank_%05d.safetensors", rank);
  return buf;
}

std::string chunk_key(const std::string& tensor, int64_t offset) {
  return tensor + "@" + std::to_string(offset);
}

std::string rng_tensor_name(int rank, const std::string& generator) {
  return "rng_state.rank" + std::to_string(rank) + "." + generator;
}

nlohmann::json to_json(const ChunkRecord& c) {
  nlohmann::json j = {{"tensor", c.tensor}, {"dtype", c.dtype}, {"shape", c.shape},
                      {"offset", c.offset}, {"numel", c.numel}, {"bytes", {c.byte_begin, c.byte_end}}};
  if (c.crc32c) j["crc32c"] = *c.crc32c;
  return j;
}

ChunkRecord chunk_from_json(const nlohmann::json& j) {
  ChunkRecord c;
  c.tensor = j.at("tensor").get<std::string>();
  c.dtype = j.at("dtype").get<std::string>();
  c.shape = j.at("shape").get<std::vector<int64_t>>();
  c.offset = j.at("offset").get<int64_t>();
  c.numel = j.at("numel").get<int64_t>();
  c.byte_begin = j.at("bytes").at(0).get<uint64_t>();
  c.byte_end = j.at("bytes").at(1).get<uint64_t>();
  if (j.contains("crc32c")) c.crc32c = j.at("crc32c").get<uint32_t>();
  return c;
}

nlohmann::json merge_chunk_records(const std::vector<std::vector<ChunkRecord>>& records) {
  struct Merged {
    std::string dtype;
    std::vector<int64_t> shape;
    std::vector<std::pair<int, ChunkRecord>> chunks;  // (file, chunk)
  };
  std::map<std::string, Merged> tensors;
  for (size_t rank = 0; rank < records.size(); ++rank)
    for (const ChunkRecord& c : records[rank]) {
      auto [it, fresh] = tensors.try_emplace(c.tensor, Merged{c.dtype, c.shape, {}});
      if (!fresh && (it->second.dtype != c.dtype || it->second.shape != c.shape))
        throw std::logic_error("checkpoint save: ranks disagree on dtype/shape of '" + c.tensor + "'");
      if (c.numel > 0) it->second.chunks.emplace_back(static_cast<int>(rank), c);
    }
  nlohmann::json out = nlohmann::json::object();
  for (auto& [name, m] : tensors) {
    std::sort(m.chunks.begin(), m.chunks.end(),
              [](const auto& a, const auto& b) { return a.second.offset < b.second.offset; });
    int64_t numel = 1;
    for (int64_t s : m.shape) numel *= s;
    int64_t next = 0;
    nlohmann::json chunks = nlohmann::json::array();
    for (const auto& [file, c] : m.chunks) {
      if (c.offset != next)
        throw std::logic_error("checkpoint save: chunks of '" + name + "' do not tile it at element " +
                               std::to_string(next));
      next += c.numel;
      chunks.push_back({{"file", file},
                        {"key", chunk_key(name, c.offset)},
                        {"offset", c.offset},
                        {"numel", c.numel},
                        {"bytes", {c.byte_begin, c.byte_end}}});
      if (c.crc32c) chunks.back()["crc32c"] = *c.crc32c;
    }
    if (next != numel)
      throw std::logic_error("checkpoint save: chunks of '" + name + "' cover " + std::to_string(next) + " of " +
                             std::to_string(numel) + " elements");
    out[name] = {{"dtype", m.dtype}, {"shape", m.shape}, {"chunks", std::move(chunks)}};
  }
  return out;
}

namespace {

[[noreturn]] void io_error(const std::string& what, const std::string& path) {
  throw std::runtime_error("checkpoint: " + what + " '" + path + "': " + std::strerror(errno));
}

void fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) io_error("cannot open", path);
  const bool ok = ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) io_error("fsync failed for", path);
}

}  // namespace

void write_file_atomically(const std::string& path, const std::string& text) {
  checkpoint_file_system().write_file_atomically(path, text);
}

void write_posix_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_error("cannot create", tmp);
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
      io_error("write failed for", tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    io_error("fsync/close failed for", tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    io_error("cannot rename to", path);
  }
}

void commit_checkpoint(const std::string& save_dir, const std::string& tmp_dir,
                       const std::string& final_dir, int64_t iteration) {
  CheckpointFileSystem& files = checkpoint_file_system();
  const std::string aside = final_dir + ".old";
  // An earlier replacement died with the old folder aside: put it back before anything else.
  if (!fs::exists(final_dir) && fs::exists(aside)) files.rename(aside, final_dir);
  files.remove_all(aside);
  files.sync_directory(tmp_dir);
  if (!fs::exists(final_dir)) {
    files.rename(tmp_dir, final_dir);
  } else if (files.exchange(tmp_dir, final_dir)) {
    files.sync_directory(save_dir);
    files.remove_all(tmp_dir);  // now the replaced save
  } else {
    files.rename(final_dir, aside);  // from here to the next rename, readers use `aside`
    files.rename(tmp_dir, final_dir);
    files.sync_directory(save_dir);
    files.remove_all(aside);
  }
  files.sync_directory(save_dir);
  files.write_file_atomically(save_dir + "/" + kLatestFile, std::to_string(iteration) + "\n");
  files.sync_directory(save_dir);
}

std::string readable_iteration_dir(const std::string& dir, int64_t iteration) {
  const std::string path = checkpoint_iteration_dir(dir, iteration);
  if (!fs::exists(path) && fs::exists(path + ".old")) return path + ".old";
  return path;
}

}  // namespace mfsdp::checkpoint

namespace mfsdp {
namespace {
std::shared_ptr<CheckpointFileSystem>& installed_file_system() {
  static std::shared_ptr<CheckpointFileSystem> fs = std::make_shared<CheckpointFileSystem>();
  return fs;
}
}  // namespace

void CheckpointFileSystem::write_file_atomically(const std::string& path, const std::string& bytes) {
  checkpoint::write_posix_file_atomically(path, bytes);
}

void CheckpointFileSystem::rename(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw std::runtime_error("checkpoint: cannot rename '" + from + "' to '" + to + "': " + std::strerror(errno));
}

bool CheckpointFileSystem::exchange(const std::string& a, const std::string& b) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) return false;  // not on this file system
  throw std::runtime_error("checkpoint: cannot swap '" + a + "' and '" + b + "': " + std::strerror(errno));
}

void CheckpointFileSystem::remove_all(const std::string& path) {
  std::error_code ec;
  remove_tree(path, ec);
  if (ec) throw std::runtime_error("checkpoint: cannot remove '" + path + "': " + ec.message());
}

void CheckpointFileSystem::append_to_shard(int fd, const std::string& path, const char* data, size_t length) {
  for (size_t done = 0; done < length;) {
    const ssize_t n = ::write(fd, data + done, length - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error("writing '" + path + "' failed: " + std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

void CheckpointFileSystem::sync_directory(const std::string& dir) {
  checkpoint::fsync_path(dir, O_RDONLY | O_DIRECTORY);
}

CheckpointFileSystem& checkpoint_file_system() { return *installed_file_system(); }

void set_checkpoint_file_system(std::shared_ptr<CheckpointFileSystem> file_system) {
  installed_file_system() = file_system ? std::move(file_system) : std::make_shared<CheckpointFileSystem>();
}

std::string checkpoint_iteration_dir(const std::string& dir, int64_t iteration) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "/iter_%07lld", static_cast<long long>(iteration));
  return dir + buf;
}

std::optional<int64_t> latest_checkpoint_iteration(const std::string& dir) {
  const std::string path = dir + "/" + checkpoint::kLatestFile;
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) {
    if (errno == ENOENT) return std::nullopt;
    throw std::invalid_argument("checkpoint: cannot read '" + path + "': " + std::strerror(errno));
  }
  char buf[64] = {0};
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::string text(buf, n);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ' || text.back() == '\r')) text.pop_back();
  const bool digits = !text.empty() && text.size() < 19 &&
                      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits)
    throw std::invalid_argument("checkpoint: '" + path + "' should hold an iteration number, found '" + text + "'");
  const int64_t iteration = std::stoll(text);
  const std::string iter_dir = checkpoint::readable_iteration_dir(dir, iteration);
  if (!fs::is_directory(iter_dir))
    throw std::invalid_argument("checkpoint: '" + path + "' names iteration " + text + " but '" + iter_dir +
                                "' does not exist");
  return iteration;
}

}  // namespace mfsdp
