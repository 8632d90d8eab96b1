// locate_checkpoint (include/mfsdp/checkpoint/checkpoint.h): what a checkpoint path names, decided in one
// place for every tool, so `--load ITER_FOLDER` cannot mean "a checkpoint" to one tool and "an
// empty save folder" to another.
#include <filesystem>
#include <stdexcept>
#include <string>

#include "checkpoint/checkpoint_files.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/dcp.h"

namespace fs = std::filesystem;

namespace mfsdp {
namespace {

// What any checkpoint path is, for the messages.
constexpr const char* kWhatACheckpointIs =
    "a checkpoint is a save folder (with latest_checkpointed_iteration.txt) or one iteration folder "
    "(iter_NNNNNNN, or any folder torch.distributed.checkpoint wrote: .metadata; the earlier format: "
    "metadata.json)";

bool is_iteration_folder(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p / dcp::kMetadataFile, ec) || fs::is_regular_file(p / checkpoint::kMetadataFile, ec);
}

// The iteration an iteration folder records, when the name says it (iter_0000350 -> 350).
std::optional<int64_t> iteration_of_name(const fs::path& path) {
  fs::path p = path.lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "iter_0000350/"
  const std::string name = p.filename().string();
  if (name.size() != 12 || name.rfind("iter_", 0) != 0) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  return std::stoll(name.substr(5));
}

}  // namespace

CheckpointLocation locate_checkpoint(const std::string& path, std::optional<int64_t> step) {
  if (path.empty()) throw std::invalid_argument("checkpoint: the path is empty");
  if (step && *step < 0)
    throw std::invalid_argument("checkpoint '" + path + "': the step must be >= 0, got " + std::to_string(*step));
  std::error_code ec;
  const fs::path p(path);
  if (!fs::exists(p, ec)) return {"", "does not exist"};
  if (!fs::is_directory(p, ec))
    throw std::invalid_argument("checkpoint '" + path + "' is a file, not a folder; " + kWhatACheckpointIs);
  if (is_iteration_folder(p)) {
    // A step names a save folder's iteration; asked of one iteration folder it must be its own.
    if (step) {
      const std::optional<int64_t> own = iteration_of_name(p);
      if (!own || *own != *step)
        throw std::invalid_argument("checkpoint '" + path + "' is one iteration folder" +
                                    (own ? " (iteration " + std::to_string(*own) + ")" : std::string()) +
                                    "; step " + std::to_string(*step) + " needs the save folder that holds iter_" +
                                    std::to_string(*step));
    }
    return {path, ""};
  }
  if (step) {
    const std::string dir = checkpoint::readable_iteration_dir(path, *step);
    if (!is_iteration_folder(dir))
      throw std::invalid_argument("checkpoint '" + path + "': no checkpoint of step " + std::to_string(*step) + " ('" +
                                  checkpoint_iteration_dir(path, *step) + "' " +
                                  (fs::exists(dir, ec) ? "holds no .metadata or metadata.json" : "does not exist") +
                                  ")");
    return {dir, ""};
  }
  if (const std::optional<int64_t> latest = latest_checkpoint_iteration(path)) {
    const std::string dir = checkpoint::readable_iteration_dir(path, *latest);
    if (!is_iteration_folder(dir))
      throw std::invalid_argument("checkpoint '" + path + "': " + checkpoint::kLatestFile + " names iteration " +
                                  std::to_string(*latest) + ", but '" + dir + "' holds no .metadata or metadata.json");
    return {dir, ""};
  }
  return {"", std::string("holds no checkpoint (no ") + checkpoint::kLatestFile + ", no .metadata, no " +
                  checkpoint::kMetadataFile + ")"};
}

std::string resolve_checkpoint_dir(const std::string& path, std::optional<int64_t> step) {
  const CheckpointLocation at = locate_checkpoint(path, step);
  if (!at.found()) throw std::invalid_argument("checkpoint '" + path + "' " + at.reason + "; " + kWhatACheckpointIs);
  return at.dir;
}

bool is_checkpoint(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && locate_checkpoint(path).found();  // a file is no checkpoint here
}

}  // namespace mfsdp
