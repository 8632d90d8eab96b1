#include "mfsdp/checkpoint/local_checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/rank_strings.h"
#include "mfsdp/base/crc32c.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/safetensors.h"

namespace mfsdp {
namespace fs = std::filesystem;
namespace {

// Buffers move between replica peers in pieces of this size, so that on CUDA at most this much
// device memory holds a copy of them at once.
constexpr int64_t kExchangeChunkBytes = int64_t{64} << 20;

std::string rank_name(const char* kind, int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "%s_%05d", kind, rank);
  return name;
}

// Everything a rank restores, as named views of the live tensors (the generators' states are
// copies), in a fixed order.
std::vector<std::pair<std::string, at::Tensor>> rank_state(const FsdpHandle& model,
                                                           const DistributedOptimizer& optimizer) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const LocalShard& s : model.local_shards()) out.emplace_back("model." + s.name, s.local);
  for (const auto& [key, tensors] : optimizer.state())
    for (size_t i = 0; i < tensors.size(); ++i) out.emplace_back("optim." + key + "." + std::to_string(i), tensors[i]);
  for (const auto& [name, b] : model.buffers()) out.emplace_back("buffer." + name, b);
  out.emplace_back("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
  for (const LocalShard& s : model.local_shards())
    if (s.local.is_cuda()) {
      out.emplace_back("rng.cuda", at::globalContext().defaultGenerator(s.local.device()).get_state());
      break;
    }
  return out;
}

// The rank's layout: every tensor's name, dtype and shape, where each shard lies in its parameter
// (offset and whole shape), and the world size. A local checkpoint loads only where this is the same.
std::string layout_checksum(const std::vector<std::pair<std::string, at::Tensor>>& state, const FsdpHandle& model,
                            int world_size) {
  std::ostringstream text;
  text << "world " << world_size;
  for (const auto& [name, t] : state) {
    if (name.rfind("rng.", 0) == 0) continue;
    text << ";" << name << ":" << safetensors_dtype_name(t.scalar_type()) << ":";
    for (int64_t d : t.sizes()) text << d << ",";
  }
  for (const LocalShard& s : model.local_shards()) {
    text << ";" << s.name << "@" << s.offset << " of ";
    for (int64_t d : s.global_shape) text << d << ",";
  }
  const std::string s = text.str();
  return crc32c_hex(crc32c(s.data(), s.size()));
}

// `state` as one safetensors file in memory (a uint8 tensor): the header, then every tensor's
// bytes, widest dtype first so each is aligned to its item size. `reuse` is taken when big enough.
at::Tensor serialize(const std::vector<std::pair<std::string, at::Tensor>>& state,
                     const std::map<std::string, std::string>& metadata, at::Tensor reuse) {
  std::vector<size_t> order(state.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return state[a].second.element_size() > state[b].second.element_size();
  });
  nlohmann::ordered_json header;
  header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (size_t i : order) {
    const at::Tensor& t = state[i].second;
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    header[state[i].first] = {{"dtype", safetensors_dtype_name(t.scalar_type())},
                              {"shape", t.sizes().vec()},
                              {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  const int64_t start = 8 + static_cast<int64_t>(text.size());
  const int64_t total = start + offset;
  at::Tensor out = reuse.defined() && reuse.numel() >= total ? reuse.narrow(0, 0, total)
                                                              : at::empty({total}, at::TensorOptions().dtype(at::kByte));
  uint8_t* p = out.data_ptr<uint8_t>();
  const uint64_t n = text.size();
  for (int b = 0; b < 8; ++b) p[b] = static_cast<uint8_t>(n >> (8 * b));
  std::copy(text.begin(), text.end(), p + 8);
  int64_t at = start;
  for (size_t i : order) {
    const at::Tensor& t = state[i].second;
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (bytes > 0)
      at::from_blob(p + at, t.sizes(), at::TensorOptions().dtype(t.scalar_type())).copy_(t.detach());
    at += bytes;
  }
  return out;
}

// `bytes` to `path` through a temporary file, fsync and rename; then its manifest.
void write_with_manifest(const std::string& path, const at::Tensor& bytes, const nlohmann::json& record) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error("local checkpoint: cannot create '" + tmp + "'");
  const char* p = reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>());
  size_t left = static_cast<size_t>(bytes.numel());
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n <= 0) {
      ::close(fd);
      throw std::runtime_error("local checkpoint: cannot write '" + tmp + "' (disk full?)");
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) throw std::runtime_error("local checkpoint: cannot sync '" + tmp + "'");
  fs::rename(tmp, path);
  nlohmann::json manifest = record;
  manifest["bytes"] = bytes.numel();
  manifest["crc32c"] = crc32c(bytes.data_ptr<uint8_t>(), static_cast<size_t>(bytes.numel()));
  checkpoint::write_posix_file_atomically(fs::path(path).replace_extension(".json").string(), manifest.dump());
}

// The manifest of `data` (a .safetensors path) when it and the file agree: the file's size and
// CRC-32C; else why not.
std::optional<nlohmann::json> verified_manifest(const std::string& data, std::string& why_not) {
  const std::string manifest_path = fs::path(data).replace_extension(".json").string();
  std::ifstream in(manifest_path);
  if (!in) {
    if (fs::exists(data)) why_not = data + " has no manifest (its write did not finish)";
    return std::nullopt;
  }
  nlohmann::json m = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!m.is_object() || !m.contains("bytes") || !m.contains("crc32c") || !m.contains("iteration")) {
    why_not = manifest_path + " is not a manifest";
    return std::nullopt;
  }
  std::error_code ec;
  const uintmax_t size = fs::file_size(data, ec);
  if (ec || size != m["bytes"].get<uint64_t>()) {
    why_not = data + (ec ? " is missing" : " has " + std::to_string(size) + " bytes, its manifest says " +
                                               std::to_string(m["bytes"].get<uint64_t>()));
    return std::nullopt;
  }
  const uint32_t crc = crc32c_of_file_range(data, 0, size);
  if (crc != m["crc32c"].get<uint32_t>()) {
    why_not = data + ": the bytes do not match their checksum (CRC-32C " + crc32c_hex(m["crc32c"].get<uint32_t>()) +
              " in the manifest, " + crc32c_hex(crc) + " of the file)";
    return std::nullopt;
  }
  return m;
}

// Whether `path` is this rank's valid own file of `iteration` in `layout`; else why not (empty:
// there is no such file).
bool own_file_valid(const std::string& path, int64_t iteration, const std::string& layout, std::string& why_not) {
  const auto m = verified_manifest(path, why_not);
  if (!m) return false;
  const auto& meta = SafetensorsFile(path).metadata();
  if (m->value("iteration", int64_t{-1}) != iteration) {
    why_not = path + " records another iteration";
    return false;
  }
  if (!meta.count("layout") || meta.at("layout") != layout) {
    why_not = path + " was saved in another layout (world size or shard shapes differ)";
    return false;
  }
  return true;
}

std::vector<std::pair<int64_t, std::string>> iteration_dirs(const std::string& job_dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::is_directory(job_dir, ec)) return out;  // nothing saved on this node yet
  for (const std::string& name : list_directory(job_dir)) {
    const std::string path = job_dir + "/" + name;
    if (name.size() != 12 || name.rfind("iter_", 0) != 0 || !fs::is_directory(path, ec)) continue;
    if (name.find_first_not_of("0123456789", 5) != std::string::npos) continue;
    out.emplace_back(std::stoll(name.substr(5)), path);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Swaps byte buffers with the peers: sends `mine` (may be undefined: nothing) to `to` and
// receives from `from` what it sends (`from_size` bytes). Both sides of each message know its
// size. Pieces go through the communicator's device.
at::Tensor exchange(Communicator& comm, const at::Tensor& mine, int to, int from, int64_t from_size) {
  at::Tensor got = from >= 0 ? at::empty({from_size}, at::TensorOptions().dtype(at::kByte)) : at::Tensor();
  const int64_t send_size = to >= 0 ? mine.numel() : 0;
  for (int64_t at = 0; at < std::max(send_size, from_size); at += kExchangeChunkBytes) {
    std::vector<P2POp> ops;
    at::Tensor out_piece, in_piece;
    if (to >= 0 && at < send_size) {
      out_piece = mine.narrow(0, at, std::min(kExchangeChunkBytes, send_size - at)).to(comm.device()).contiguous();
      ops.push_back({P2POp::Kind::kSend, out_piece, to});
    }
    if (from >= 0 && at < from_size) {
      in_piece = at::empty({std::min(kExchangeChunkBytes, from_size - at)},
                           at::TensorOptions().dtype(at::kByte).device(comm.device()));
      ops.push_back({P2POp::Kind::kRecv, in_piece, from});
    }
    if (!ops.empty()) comm.send_recv_async(ops)->wait();
    if (in_piece.defined()) got.narrow(0, at, in_piece.numel()).copy_(in_piece);
  }
  return got;
}

// Sends `size` to `to` and receives the size `from` sends (-1 where there is no such peer).
int64_t exchange_size(Communicator& comm, int64_t size, int to, int from) {
  std::vector<P2POp> ops;
  at::Tensor out = at::full({1}, size, at::TensorOptions().dtype(at::kLong).device(comm.device()));
  at::Tensor in = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(comm.device()));
  if (to >= 0) ops.push_back({P2POp::Kind::kSend, out, to});
  if (from >= 0) ops.push_back({P2POp::Kind::kRecv, in, from});
  if (!ops.empty()) comm.send_recv_async(ops)->wait();
  return from >= 0 ? in.cpu().item<int64_t>() : -1;
}

std::string capture(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Every rank throws the first error any rank met.
void agree(Communicator& comm, const std::string& error, const std::string& what) {
  const std::vector<std::string> errors = checkpoint::all_gather_strings(comm, error);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) throw std::runtime_error(what + ": rank " + std::to_string(r) + ": " + errors[r]);
}

}  // namespace

struct LocalCheckpointer::Writer {
  std::thread thread;
  std::string error;  // of the last write, set by the thread before it ends
  int64_t written = -1;  // the iteration the last write finished (-1: none, or it failed)
  at::Tensor mine, replica;
  int64_t staged_bytes = 0;
  void join() {
    if (thread.joinable()) thread.join();
  }
};

LocalCheckpointer::LocalCheckpointer(LocalCheckpointOptions options, std::shared_ptr<Communicator> world)
    : options_(std::move(options)), world_(std::move(world)), writer_(std::make_unique<Writer>()) {
  const std::string job = fs::absolute(options_.job).lexically_normal().string();
  job_dir_ = (fs::path(options_.dir) / ("mfsdp_job_" + crc32c_hex(crc32c(job.data(), job.size())))).string();
  if (options_.replica_jump < 1) options_.replica_jump = 1;
}

LocalCheckpointer::~LocalCheckpointer() { writer_->join(); }

int64_t LocalCheckpointer::staged_bytes() const { return writer_->staged_bytes; }

void LocalCheckpointer::wait() { settle(); }

void LocalCheckpointer::save(const LocalCheckpointProgress& progress, const FsdpHandle& model,
                             const DistributedOptimizer& optimizer) {
  at::NoGradGuard no_grad;
  Communicator& comm = *world_;
  const int rank = comm.rank(), world = comm.size();
  // A failed earlier write fails this save on every rank, naming it; one that every rank finished
  // makes the iterations before it unneeded.
  settle();
  std::string error = capture([&] {
    const auto state = rank_state(model, optimizer);
    const std::map<std::string, std::string> meta = {
        {"iteration", std::to_string(progress.iteration)},
        {"consumed_samples", std::to_string(progress.consumed_samples)},
        {"optimizer_steps", std::to_string(optimizer.steps())},
        {"world_size", std::to_string(world)},
        {"rank", std::to_string(rank)},
        {"layout", layout_checksum(state, model, world)},
        {"extra", progress.extra}};
    writer_->mine = serialize(state, meta, writer_->mine);
  });
  agree(comm, error, "local checkpoint of iteration " + std::to_string(progress.iteration));
  writer_->staged_bytes = writer_->mine.numel();
  const bool replicated = world > 1;
  const int jump = options_.replica_jump % world == 0 ? 1 : options_.replica_jump % world;
  const int to = replicated ? (rank + jump) % world : -1, from = replicated ? (rank - jump + world) % world : -1;
  const int64_t from_size = exchange_size(comm, writer_->mine.numel(), to, from);
  writer_->replica = replicated ? exchange(comm, writer_->mine, to, from, from_size) : at::Tensor();

  const std::string dir = checkpoint_iteration_dir(job_dir_, progress.iteration);
  const int64_t iteration = progress.iteration;
  Writer* w = writer_.get();
  const std::string job_dir = job_dir_;
  w->written = -1;
  w->thread = std::thread([w, dir, iteration, rank, from] {
    w->error = capture([&] {
      fs::create_directories(dir);
      write_with_manifest(dir + "/" + rank_name("rank", rank) + ".safetensors", w->mine,
                          {{"iteration", iteration}, {"rank", rank}});
      if (w->replica.defined())
        write_with_manifest(dir + "/" + rank_name("replica", from) + ".safetensors", w->replica,
                            {{"iteration", iteration}, {"rank", from}});
    });
    if (w->error.empty()) w->written = iteration;
  });
}

void LocalCheckpointer::settle() {
  Communicator& comm = *world_;
  writer_->join();
  const std::string error = writer_->error;
  writer_->error.clear();
  agree(comm, error, "local checkpoint of an earlier iteration");
  if (writer_->written < 0) return;
  // Every rank wrote iteration `written`: this rank's files of older ones go (only the newest is
  // kept), and a folder left empty. Not before: a job killed during a save must keep the last
  // iteration every rank finished. A file that cannot be removed is left.
  const int world = comm.size();
  const int jump = options_.replica_jump % world == 0 ? 1 : options_.replica_jump % world;
  const int from = (comm.rank() - jump + world) % world;
  std::error_code ec;
  for (const auto& [older, path] : iteration_dirs(job_dir_)) {
    if (older >= writer_->written) continue;
    for (const std::string& stem : {rank_name("rank", comm.rank()), rank_name("replica", from)})
      for (const char* ext : {".safetensors", ".json", ".safetensors.tmp"}) fs::remove(path + "/" + stem + ext, ec);
    fs::remove(path, ec);  // fails while another rank's files are still there
  }
}

namespace {

struct RankHoldings {
  std::string layout;                      // this rank's layout now
  std::set<int64_t> own;                   // iterations of its own valid file, in its layout
  std::map<int64_t, std::string> replica;  // iteration -> layout recorded, of the replica it keeps
};

}  // namespace

std::optional<int64_t> LocalCheckpointer::newest_valid(const FsdpHandle& model, const DistributedOptimizer& optimizer,
                                                       std::string* why_not) {
  writer_->join();
  Communicator& comm = *world_;
  const int rank = comm.rank(), world = comm.size();
  const int jump = options_.replica_jump % world == 0 ? 1 : options_.replica_jump % world;
  const std::string layout = layout_checksum(rank_state(model, optimizer), model, world);
  nlohmann::json mine = {{"layout", layout}, {"own", nlohmann::json::array()}, {"replica", nlohmann::json::object()},
                         {"skipped", nlohmann::json::array()}};
  const std::string scan_error = capture([&] {
    for (const auto& [iteration, dir] : iteration_dirs(job_dir_)) {
      std::string why;
      const std::string own = dir + "/" + rank_name("rank", rank) + ".safetensors";
      if (own_file_valid(own, iteration, layout, why))
        mine["own"].push_back(iteration);
      else if (!why.empty())
        mine["skipped"].push_back(why);
      why.clear();
      if (world > 1) {
        const int of = (rank - jump + world) % world;
        const std::string replica = dir + "/" + rank_name("replica", of) + ".safetensors";
        if (auto m = verified_manifest(replica, why)) {
          if (m->value("iteration", int64_t{-1}) == iteration) {
            const auto md = SafetensorsFile(replica).metadata();
            mine["replica"][std::to_string(iteration)] = md.count("layout") ? md.at("layout") : "";
          }
        } else if (!why.empty()) {
          mine["skipped"].push_back(why);
        }
      }
    }
  });
  agree(comm, scan_error, "looking for local checkpoints in " + job_dir_);
  std::vector<RankHoldings> all(static_cast<size_t>(world));
  std::string skipped;
  const std::vector<std::string> texts = checkpoint::all_gather_strings(comm, mine.dump());
  for (int r = 0; r < world; ++r) {
    const nlohmann::json j = nlohmann::json::parse(texts[static_cast<size_t>(r)]);
    RankHoldings& h = all[static_cast<size_t>(r)];
    h.layout = j["layout"].get<std::string>();
    for (const auto& it : j["own"]) h.own.insert(it.get<int64_t>());
    for (const auto& [it, l] : j["replica"].items()) h.replica[std::stoll(it)] = l.get<std::string>();
    for (const auto& s : j["skipped"]) skipped += (skipped.empty() ? "" : "; ") + s.get<std::string>();
  }
  if (why_not) *why_not = skipped;
  // Candidates: every iteration any rank holds anything of, newest first.
  std::set<int64_t> candidates;
  for (const RankHoldings& h : all) {
    candidates.insert(h.own.begin(), h.own.end());
    for (const auto& [it, l] : h.replica) candidates.insert(it);
  }
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) {
    bool complete = true;
    for (int r = 0; r < world && complete; ++r) {
      if (all[static_cast<size_t>(r)].own.count(*it)) continue;
      const RankHoldings& holder = all[static_cast<size_t>((r + jump) % world)];
      const auto rep = holder.replica.find(*it);
      complete = world > 1 && rep != holder.replica.end() && rep->second == all[static_cast<size_t>(r)].layout;
    }
    if (complete) return *it;
  }
  return std::nullopt;
}

LocalCheckpointProgress LocalCheckpointer::load(int64_t iteration, FsdpHandle& model, DistributedOptimizer& optimizer) {
  at::NoGradGuard no_grad;
  Communicator& comm = *world_;
  const int rank = comm.rank(), world = comm.size();
  const int jump = options_.replica_jump % world == 0 ? 1 : options_.replica_jump % world;
  const std::string dir = checkpoint_iteration_dir(job_dir_, iteration);
  const std::string own = dir + "/" + rank_name("rank", rank) + ".safetensors";
  std::string unused;
  bool have_own = false;
  std::string error = capture([&] {
    have_own = own_file_valid(own, iteration, layout_checksum(rank_state(model, optimizer), model, world), unused);
  });
  agree(comm, error, "local checkpoint of iteration " + std::to_string(iteration));
  // Which ranks lack their own file: the rank `jump` above each sends its replica.
  const std::vector<std::string> needs = checkpoint::all_gather_strings(comm, have_own ? "" : "need");
  const int keeper = (rank + jump) % world, kept = (rank - jump + world) % world;
  const bool i_receive = !have_own && world > 1;
  const bool i_send = world > 1 && !needs[static_cast<size_t>(kept)].empty();
  at::Tensor replica;
  if (i_send)
    error = capture([&] {
      const std::string path = dir + "/" + rank_name("replica", kept) + ".safetensors";
      if (!verified_manifest(path, unused)) throw std::runtime_error("the replica " + path + " is gone: " + unused);
      replica = at::from_file(path, /*shared=*/false, fs::file_size(path), at::TensorOptions().dtype(at::kByte));
    });
  agree(comm, error, "local checkpoint of iteration " + std::to_string(iteration));
  const int64_t size = exchange_size(comm, i_send ? replica.numel() : 0, i_send ? kept : -1, i_receive ? keeper : -1);
  at::Tensor got = exchange(comm, replica, i_send ? kept : -1, i_receive ? keeper : -1, i_receive ? size : 0);

  LocalCheckpointProgress progress;
  error = capture([&] {
    // A replica received becomes this rank's own file again, so the node's copy is whole.
    if (i_receive) {
      fs::create_directories(dir);  // a fresh node has none of this job's folders
      write_with_manifest(own, got, {{"iteration", iteration}, {"rank", rank}});
    }
    SafetensorsFile file(own);
    const auto& meta = file.metadata();
    for (const auto& [name, dst] : rank_state(model, optimizer)) {
      if (!file.contains(name)) throw std::runtime_error(own + " has no tensor '" + name + "'");
      if (file.shape(name) != dst.sizes().vec() || file.dtype(name) != dst.scalar_type())
        throw std::runtime_error(own + ": tensor '" + name + "' differs in shape or dtype from this run's");
    }
    // Checked first, then copied: a mismatch above changes nothing. A generator's state is a CPU
    // tensor whichever device the generator is for: the CUDA one is the shards' device's.
    at::Device cuda = at::kCPU;
    for (const LocalShard& s : model.local_shards())
      if (s.local.is_cuda()) cuda = s.local.device();
    for (const auto& [name, dst] : rank_state(model, optimizer)) {
      if (name.rfind("rng.", 0) == 0) {
        at::Generator gen = name == "rng.cpu" ? at::detail::getDefaultCPUGenerator()
                                              : at::globalContext().defaultGenerator(cuda);
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(file.load(name));
      } else if (dst.numel() > 0) {
        file.read_elements_into(name, 0, dst.view({-1}));
      }
    }
    optimizer.set_steps(std::stoll(meta.at("optimizer_steps")));
    progress.iteration = std::stoll(meta.at("iteration"));
    progress.consumed_samples = std::stoll(meta.at("consumed_samples"));
    progress.extra = meta.count("extra") ? meta.at("extra") : "";
  });
  agree(comm, error, "loading the local checkpoint of iteration " + std::to_string(iteration));
  model.refresh_model_weights();
  return progress;
}

}  // namespace mfsdp
