// fsdp_dtensor checkpoints across world sizes and strategies: a model trained 2 AdamW steps with
// N ranks under strategy S, saved, and loaded with M ranks under S' has the saved weights (bit
// for bit), the optimizer state and step of single-process torch::optim::AdamW after 2 steps,
// and a third step lands where torch's third step does. Bad checkpoints fail with an error
// naming the file and tensor and leave the model and optimizer untouched on every rank, in the
// fsdp_dtensor format (PyTorch DCP) and in the earlier mfsdp format.
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "harness/temp_dir.h"
#include "harness/uneven_net.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"

namespace {

using namespace torch;
using mfsdp::ShardingStrategy;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
namespace fs = std::filesystem;

using Net = mfsdp::testing::UnevenNet;

constexpr int64_t kGlobalBatch = 12;  // divisible by every world size used
constexpr double kLr = 0.05, kWd = 0.1;

Net make_net() {
  torch::manual_seed(42);
  return Net();
}

std::pair<Tensor, Tensor> global_batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return {at::randn({kGlobalBatch, 7}, gen), at::randn({kGlobalBatch, 3}, gen)};
}

struct Sharded {
  Net net;
  mfsdp::FsdpHandle root;
  std::unique_ptr<mfsdp::DistributedOptimizer> opt;
};

// `mesh_shape` {outer, shard} for HSDP (`hfsdp`: main weights and optimizer state split across
// the replicas too), empty for 1-D sharding over the world.
Sharded make_sharded(const std::shared_ptr<mfsdp::Communicator>& world, ShardingStrategy s,
                     std::vector<int> mesh_shape = {}, bool hfsdp = false) {
  Sharded m{make_net(), {}, nullptr};
  mfsdp::FullyShardOptions o;
  if (mesh_shape.empty()) {
    o.comm = world;
  } else {
    o.mesh = std::make_shared<mfsdp::DeviceMesh>(world, mesh_shape, std::vector<std::string>{"dp_outer", "dp_shard"});
  }
  o.strategy = s;
  if (hfsdp) o.outer_strategy = ShardingStrategy::kOptim;
  for (auto& b : m.net->blocks) mfsdp::fully_shard(*b, o);
  m.root = mfsdp::fully_shard(*m.net, o);
  mfsdp::AdamWOptions a;
  a.weight_decay = kWd;
  m.opt = mfsdp::make_adamw(m.root, a);
  return m;
}

// Steps [first, first + steps) on this rank's rows of the global batch.
void train(mfsdp::Communicator& comm, Sharded& m, int first, int steps) {
  const int64_t rows = kGlobalBatch / comm.size();
  for (int step = first; step < first + steps; ++step) {
    auto [x, y] = global_batch(step);
    Tensor loss = torch::mse_loss(mfsdp::call(*m.net, x.narrow(0, comm.rank() * rows, rows), true),
                                  y.narrow(0, comm.rank() * rows, rows));
    loss.backward();
    m.opt->step(kLr);
    m.root.zero_grad();
  }
}

// Independent reference: torch::optim::AdamW on one process over the whole batch.
struct Reference {
  std::map<std::string, Tensor> params, exp_avg, exp_avg_sq;
  int64_t step = 0;
};
Reference reference(int steps) {
  Net net = make_net();
  std::vector<Tensor> decay, no_decay;
  for (auto& p : net->parameters())
    if (p.requires_grad()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::vector<optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<optim::AdamWOptions>(optim::AdamWOptions(kLr).weight_decay(kWd)));
  groups.emplace_back(no_decay, std::make_unique<optim::AdamWOptions>(optim::AdamWOptions(kLr).weight_decay(0)));
  optim::AdamW opt(groups, optim::AdamWOptions(kLr));
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step);
    opt.zero_grad();
    torch::mse_loss(net->forward(x, false), y).backward();
    opt.step();
  }
  Reference r;
  for (auto& item : net->named_parameters()) {
    r.params[item.key()] = item.value().detach().clone();
    auto it = opt.state().find(item.value().unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;  // frozen
    auto& st = static_cast<optim::AdamWParamState&>(*it->second);
    r.exp_avg[item.key()] = st.exp_avg().clone();
    r.exp_avg_sq[item.key()] = st.exp_avg_sq().clone();
    r.step = st.step();
  }
  return r;
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what, double rtol = 1e-5) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  if (got.numel() == 0) return;
  const double err = (got.to(kDouble).flatten() - want.to(kDouble).flatten()).abs().max().item<double>();
  const double scale = want.to(kDouble).abs().max().item<double>() + 1e-30;
  EXPECT_LE(err, rtol * scale) << what << ": max abs error " << err << " (scale " << scale << ")";
}

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

struct Config {
  int world;
  ShardingStrategy strategy;
  std::vector<int> mesh;  // HSDP shape or empty
  bool hfsdp = false;     // outer_strategy kOptim
  std::string label() const {
    std::string l = std::to_string(world) + "_" + mfsdp::to_string(strategy);
    for (int d : mesh) l += "_m" + std::to_string(d);
    return hfsdp ? l + "_hf" : l;
  }
};

void save_phase(mfsdp::Communicator& comm, const Config& c) {
  auto world = borrow(comm);
  Sharded m = make_sharded(world, c.strategy, c.mesh, c.hfsdp);
  train(comm, m, 0, 2);
  const std::string dir = mfsdp::testing::shared_temp_dir();
  mfsdp::CheckpointInfo info;
  info.iteration = 2;
  info.consumed_samples = 2 * kGlobalBatch;
  mfsdp::save_checkpoint(dir + "/ckpt", world, m.root, m.opt.get(), info);
  // The weights as the saving run sees them, for a bit-exact comparison after loading.
  auto full = m.root.full_state_dict(/*all_ranks=*/false);
  if (comm.rank() == 0) mfsdp::write_safetensors(dir + "/saved_weights.safetensors", {full.begin(), full.end()});
  comm.barrier();
}

void load_phase(mfsdp::Communicator& comm, const Config& saved, const Config& c) {
  auto world = borrow(comm);
  const std::string where = " (saved " + saved.label() + ", loaded " + c.label() + ")";
  Sharded m = make_sharded(world, c.strategy, c.mesh, c.hfsdp);
  const std::string dir = mfsdp::testing::shared_temp_dir();
  mfsdp::LoadedCheckpoint got = mfsdp::load_checkpoint(dir + "/ckpt", world, m.root, m.opt.get());
  EXPECT_EQ(got.iteration, 2) << where;
  EXPECT_EQ(got.consumed_samples, 2 * kGlobalBatch) << where;
  EXPECT_TRUE(got.optimizer_loaded) << where;
  EXPECT_EQ(got.rng_loaded, saved.world == c.world) << where;
  EXPECT_EQ(m.opt->steps(), 2) << where;

  // Weights: exactly the saved ones.
  auto saved_weights = mfsdp::SafetensorsFile(dir + "/saved_weights.safetensors").load_all();
  auto full = m.root.full_state_dict(/*all_ranks=*/true);
  ASSERT_EQ(full.size(), saved_weights.size()) << where;
  for (auto& [name, t] : saved_weights) EXPECT_TRUE(torch::equal(full.at(name), t)) << name << where;

  // Optimizer state: torch's after 2 steps, piece by piece where this rank holds it.
  Reference ref2 = reference(2);
  EXPECT_EQ(ref2.step, 2);
  auto state = m.opt->state();
  for (const auto& s : m.root.local_shards()) {
    if (s.shard_index < 0) continue;
    for (auto& [key, tensors] : state) {
      const auto& ref = key == "exp_avg" ? ref2.exp_avg : ref2.exp_avg_sq;
      Tensor want = ref.at(s.name).flatten().narrow(0, s.offset, s.local.numel());
      Tensor got_piece = tensors.at(s.shard_index).narrow(0, s.shard_offset, s.local.numel());
      expect_close(got_piece, want, key + " of " + s.name + where, 1e-4);
    }
  }

  // A third step continues torch's trajectory.
  train(comm, m, 2, 1);
  Reference ref3 = reference(3);
  full = m.root.full_state_dict(/*all_ranks=*/true);
  for (auto& [name, want] : ref3.params) expect_close(full.at(name), want, name + " after step 3" + where);
}

}  // namespace

TEST(Checkpoint, LoadsAtOtherWorldSizesAndStrategies) {
  mfsdp::testing::TempDir base("mfsdp-ckpt-reshard");
  const std::vector<Config> saves = {{1, ShardingStrategy::kOptimGradsParams, {}},
                                     {2, ShardingStrategy::kNoShard, {}},
                                     {3, ShardingStrategy::kOptimGradsParams, {}},
                                     {3, ShardingStrategy::kOptim, {}},
                                     {4, ShardingStrategy::kOptimGradsParams, {2, 2}},
                                     {4, ShardingStrategy::kOptimGradsParams, {2, 2}, true}};
  const std::vector<Config> loads = {{1, ShardingStrategy::kNoShard, {}},
                                     {2, ShardingStrategy::kOptimGrads, {}},
                                     {4, ShardingStrategy::kOptimGradsParams, {}},
                                     {4, ShardingStrategy::kOptimGradsParams, {2, 2}, true}};
  for (const Config& s : saves) {
    mfsdp::testing::DistOptions save_opts;
    save_opts.world_sizes = {s.world};
    save_opts.phase = "save_" + s.label();
    save_opts.shared_dir = base.file(s.label());
    mfsdp::testing::run_distributed(save_opts, [&](mfsdp::Communicator& comm) { save_phase(comm, s); });
    for (const Config& l : loads) {
      mfsdp::testing::DistOptions load_opts = save_opts;
      load_opts.world_sizes = {l.world};
      load_opts.phase = "load_" + s.label() + "_" + l.label();
      mfsdp::testing::run_distributed(load_opts, [&](mfsdp::Communicator& comm) { load_phase(comm, s, l); });
    }
  }
}

namespace {

// Runs `corrupt` on rank 0 over a copy of a good checkpoint, then loads it: every rank must fail
// with an error containing `parts`, and nothing may change.
void expect_rejected(mfsdp::Communicator& comm, Sharded& m, const std::string& good, const std::string& name,
                     const std::function<void(const std::string&)>& corrupt, std::initializer_list<std::string> parts,
                     bool with_optimizer = true) {
  const std::string bad = mfsdp::testing::shared_temp_dir() + "/" + name;
  if (comm.rank() == 0) {
    mfsdp::copy_tree(good, bad);
    corrupt(bad);
  }
  comm.barrier();
  auto before = m.root.full_state_dict(/*all_ranks=*/true);
  std::vector<Tensor> state_before;
  for (auto& [key, tensors] : m.opt->state())
    for (auto& t : tensors) state_before.push_back(t.clone());
  const int64_t steps_before = m.opt->steps();

  std::string error = error_of([&] {
    mfsdp::load_checkpoint(bad, borrow(comm), m.root, with_optimizer ? m.opt.get() : nullptr);
  });
  SCOPED_TRACE(name);
  expect_contains(error, parts);

  auto after = m.root.full_state_dict(/*all_ranks=*/true);
  for (auto& [n, t] : before) EXPECT_TRUE(torch::equal(after.at(n), t)) << n << " changed by a failed load";
  size_t i = 0;
  for (auto& [key, tensors] : m.opt->state())
    for (auto& t : tensors) EXPECT_TRUE(torch::equal(t, state_before[i++])) << key << " changed by a failed load";
  EXPECT_EQ(m.opt->steps(), steps_before);
  comm.barrier();
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}
void write_json(const std::string& path, const nlohmann::json& j) { std::ofstream(path) << j.dump(1); }

// Rewrites a DCP checkpoint's .metadata (parsed and re-encoded by include/mfsdp/checkpoint/dcp.h) as
// another tool would: without mfsdp's .checksums.json (which would refuse the edit at once).
void edit_dcp(const std::string& ckpt, const std::function<void(mfsdp::dcp::Metadata&)>& edit, bool keep_checksums = false) {
  if (!keep_checksums) fs::remove(ckpt + "/iter_0000002/" + mfsdp::dcp::kChecksumsFile);
  const std::string path = ckpt + "/iter_0000002/" + mfsdp::dcp::kMetadataFile;
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  mfsdp::dcp::Metadata m = mfsdp::dcp::parse_metadata(bytes.str(), path);
  edit(m);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << mfsdp::dcp::encode_metadata(m);
}

void edit_metadata(const std::string& ckpt, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = ckpt + "/iter_0000002/metadata.json";
  nlohmann::json j = read_json(path);
  edit(j);
  write_json(path, j);
}

}  // namespace

// A file system whose commit of one iteration dies before the folder rename (the injected
// failure stands for a crash there: nothing after it runs).
class CrashBeforeCommit : public mfsdp::CheckpointFileSystem {
 public:
  explicit CrashBeforeCommit(std::string tmp_suffix) : suffix_(std::move(tmp_suffix)) {}
  void rename(const std::string& from, const std::string& to) override {
    if (from.size() >= suffix_.size() && from.compare(from.size() - suffix_.size(), suffix_.size(), suffix_) == 0)
      throw std::runtime_error("injected crash before renaming " + from);
    CheckpointFileSystem::rename(from, to);
  }

 private:
  std::string suffix_;
};

MFSDP_DIST_TEST(Checkpoint, SaveThatDiesBeforeCommitKeepsThePreviousCheckpoint, {2}) {
  auto world = borrow(comm);
  const std::string ckpt = mfsdp::testing::shared_temp_dir() + "/ckpt";
  Sharded m = make_sharded(world, ShardingStrategy::kOptimGradsParams);
  train(comm, m, 0, 2);
  mfsdp::CheckpointInfo info;
  info.iteration = 2;
  mfsdp::save_checkpoint(ckpt, world, m.root, m.opt.get(), info);
  train(comm, m, 2, 2);
  info.iteration = 4;
  mfsdp::set_checkpoint_file_system(std::make_shared<CrashBeforeCommit>("iter_0000004.tmp"));
  expect_contains(error_of([&] { mfsdp::save_checkpoint(ckpt, world, m.root, m.opt.get(), info); }),
                  {"injected crash before renaming", "iter_0000004.tmp"});
  mfsdp::set_checkpoint_file_system(nullptr);
  std::ifstream latest(ckpt + "/latest_checkpointed_iteration.txt");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(latest), {}), "2\n");
  // The error shows the save got as far as the rename; a commit that fails frees its space.
  EXPECT_FALSE(fs::exists(ckpt + "/iter_0000004.tmp")) << "a failed save keeps its bytes on the disk";
  EXPECT_FALSE(fs::exists(ckpt + "/iter_0000004"));
  comm.barrier();
  Sharded fresh = make_sharded(world, ShardingStrategy::kOptimGradsParams);
  EXPECT_EQ(mfsdp::load_checkpoint(ckpt, world, fresh.root, fresh.opt.get()).iteration, 2);
  // The next save of that iteration replaces the leftover and commits.
  mfsdp::save_checkpoint(ckpt, world, m.root, m.opt.get(), info);
  EXPECT_EQ(mfsdp::latest_checkpoint_iteration(ckpt), 4);
  EXPECT_FALSE(fs::exists(ckpt + "/iter_0000004.tmp"));
}

MFSDP_DIST_TEST(Checkpoint, BadDcpCheckpointsAreRejectedAndChangeNothing, {2}) {
  auto world = borrow(comm);
  const std::string dir = mfsdp::testing::shared_temp_dir();
  const std::string good = dir + "/good";
  {
    Sharded saved = make_sharded(world, ShardingStrategy::kOptimGradsParams);
    train(comm, saved, 0, 2);
    mfsdp::CheckpointInfo info;
    info.iteration = 2;
    mfsdp::save_checkpoint(good, world, saved.root, saved.opt.get(), info);
  }
  Sharded m = make_sharded(world, ShardingStrategy::kOptimGradsParams);
  train(comm, m, 0, 1);  // a state that differs from the checkpoint's
  using mfsdp::dcp::Metadata;
  const std::string it = "/iter_0000002/";
  expect_rejected(comm, m, good, "dcp_truncated", [&](const std::string& c) {
    fs::resize_file(c + it + "__1_0.distcp", fs::file_size(c + it + "__1_0.distcp") - 10);
  }, {"__1_0.distcp", "truncated"});
  expect_rejected(comm, m, good, "dcp_foreign_class", [&](const std::string& c) {
    fs::remove(c + it + mfsdp::dcp::kChecksumsFile);
    std::ofstream(c + it + ".metadata", std::ios::binary | std::ios::trunc) << "\x80\x02" "cos\nsystem\n.";
  }, {".metadata", "'os.system'", "not allowed"});
  // With mfsdp's checksums: a flipped byte in rank 1's file, a .metadata edited in place.
  expect_rejected(comm, m, good, "dcp_flipped_byte", [&](const std::string& c) {
    std::fstream f(c + it + "__1_0.distcp", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(700);
    const char byte = static_cast<char>(f.get() ^ 0x20);
    f.seekp(700);
    f.put(byte);
  }, {"__1_0.distcp", "bytes [", "tensor '", "do not match their checksum", ".checksums.json"});
  expect_rejected(comm, m, good, "dcp_edited_metadata", [&](const std::string& c) {
    edit_dcp(c, [](Metadata& md) { md.tensors["model.module.head.weight"].shape = {3, 11}; }, /*keep_checksums=*/true);
  }, {".metadata", "does not match its checksum"});
  expect_rejected(comm, m, good, "dcp_shape", [&](const std::string& c) {
    edit_dcp(c, [](Metadata& md) { md.tensors["model.module.head.weight"].shape = {3, 11}; });
  }, {"model.head.weight", "[3, 11]", "[3, 10]"});
  expect_rejected(comm, m, good, "dcp_missing", [&](const std::string& c) {
    edit_dcp(c, [](Metadata& md) { md.tensors.erase("model.module.block1.fc1.bias"); });
  }, {"no tensor 'model.block1.fc1.bias'"});
  expect_rejected(comm, m, good, "dcp_missing_optimizer_tensor", [&](const std::string& c) {
    edit_dcp(c, [](Metadata& md) { md.tensors.erase("optimizer.state.module.module.module.tiny.exp_avg_sq"); });
  }, {"optimizer.state.tiny.exp_avg_sq", "--no-load-optim"});
  expect_rejected(comm, m, good, "dcp_uncovered", [&](const std::string& c) {
    edit_dcp(c, [](Metadata& md) { md.tensors["model.module.embed.weight"].chunks.pop_back(); });
  }, {"model.module.embed.weight", "do not cover"});
  expect_rejected(comm, m, good, "dcp_moved_bytes", [&](const std::string& c) {
    edit_dcp(c, [](Metadata& md) {
      for (auto& chunk : md.tensors["model.module.embed.weight"].chunks) chunk.location.offset += 4;
    });
  }, {"model.module.embed.weight", ".distcp", "not a zip archive"});
}

MFSDP_DIST_TEST(Checkpoint, BadCheckpointsAreRejectedAndChangeNothing, {2}) {
  auto world = borrow(comm);
  const std::string dir = mfsdp::testing::shared_temp_dir();
  const std::string good = dir + "/good";
  {  // the earlier format (--ckpt-format mfsdp): metadata.json + safetensors
    Sharded saved = make_sharded(world, ShardingStrategy::kOptimGradsParams);
    train(comm, saved, 0, 2);
    mfsdp::CheckpointInfo info;
    info.iteration = 2;
    mfsdp::save_checkpoint(good, world, saved.root, saved.opt.get(), info, mfsdp::CheckpointFormat::kMfsdp);
    mfsdp::save_checkpoint(dir + "/no_optimizer", world, saved.root, nullptr, info, mfsdp::CheckpointFormat::kMfsdp);
  }
  Sharded m = make_sharded(world, ShardingStrategy::kOptimGradsParams);
  train(comm, m, 0, 1);  // a state that differs from the checkpoint's

  const std::string it = "/iter_0000002/";
  expect_rejected(comm, m, good, "truncated", [&](const std::string& c) {
    fs::resize_file(c + it + "rank_00001.safetensors", fs::file_size(c + it + "rank_00001.safetensors") - 10);
  }, {"rank_00001.safetensors"});
  expect_rejected(comm, m, good, "bad_header", [&](const std::string& c) {
    std::fstream f(c + it + "rank_00000.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.write("\xff\xff\xff\xff\xff\xff\xff\x7f", 8);
  }, {"rank_00000.safetensors"});
  expect_rejected(comm, m, good, "shape", [&](const std::string& c) {
    edit_metadata(c, [](nlohmann::json& j) { j["tensors"]["model.head.weight"]["shape"] = {10, 3}; });
  }, {"model.head.weight", "[10, 3]", "[3, 10]"});
  expect_rejected(comm, m, good, "missing", [&](const std::string& c) {
    edit_metadata(c, [](nlohmann::json& j) { j["tensors"].erase("model.block1.fc1.bias"); });
  }, {"no tensor 'model.block1.fc1.bias'"});
  expect_rejected(comm, m, good, "missing_optimizer_tensor", [&](const std::string& c) {
    edit_metadata(c, [](nlohmann::json& j) { j["tensors"].erase("optimizer.state.tiny.exp_avg_sq"); });
  }, {"optimizer.state.tiny.exp_avg_sq", "--no-load-optim"});
  expect_rejected(comm, m, good, "unexpected", [&](const std::string& c) {
    edit_metadata(c, [](nlohmann::json& j) {
      j["tensors"]["model.extra.weight"] = j["tensors"]["model.head.weight"];
    });
  }, {"model.extra.weight", "does not have"});
  expect_rejected(comm, m, good, "newer", [&](const std::string& c) {
    edit_metadata(c, [](nlohmann::json& j) { j["version"] = mfsdp::kCheckpointFormatVersion + 1; });
  }, {"metadata.json", "newer"});
  expect_rejected(comm, m, good, "not_tiling", [&](const std::string& c) {
    edit_metadata(c, [](nlohmann::json& j) { j["tensors"]["model.embed.weight"]["chunks"].erase(0); });
  }, {"metadata.json", "model.embed.weight", "tile"});
  expect_rejected(comm, m, good, "moved_bytes", [&](const std::string& c) {
    edit_metadata(c, [](nlohmann::json& j) {
      for (auto& chunk : j["tensors"]["model.embed.weight"]["chunks"]) {
        chunk["bytes"][0] = chunk["bytes"][0].get<uint64_t>() + 4;
        chunk["bytes"][1] = chunk["bytes"][1].get<uint64_t>() + 4;
      }
    });
  }, {"model.embed.weight", "other bytes"});
  expect_rejected(comm, m, good, "bad_latest", [&](const std::string& c) {
    std::ofstream(c + "/latest_checkpointed_iteration.txt") << "two\n";
  }, {"latest_checkpointed_iteration.txt", "'two'"});
  expect_rejected(comm, m, good, "latest_missing_dir", [&](const std::string& c) {
    std::ofstream(c + "/latest_checkpointed_iteration.txt") << "7\n";
  }, {"iter_0000007", "does not exist"});
  expect_rejected(comm, m, dir + "/no_optimizer", "no_optimizer_copy", [](const std::string&) {},
                  {"no optimizer state", "--finetune"});

  // The same checkpoint without optimizer loads when the optimizer is not asked for.
  auto got = mfsdp::load_checkpoint(dir + "/no_optimizer", world, m.root, m.opt.get(),
                                    {std::nullopt, /*load_optimizer=*/false, true, true});
  EXPECT_FALSE(got.optimizer_loaded);
  // Not strict: a missing tensor keeps its value and is reported.
  if (comm.rank() == 0) {
    mfsdp::copy_tree(good, dir + "/partial");
    edit_metadata(dir + "/partial", [](nlohmann::json& j) { j["tensors"].erase("model.tiny"); });
  }
  comm.barrier();
  const Tensor tiny_before = m.root.full_state_dict(true).at("tiny");
  got = mfsdp::load_checkpoint(dir + "/partial", world, m.root, m.opt.get(), {std::nullopt, true, true, false});
  EXPECT_EQ(got.missing, std::vector<std::string>{"model.tiny"});
  EXPECT_TRUE(torch::equal(m.root.full_state_dict(true).at("tiny"), tiny_before));
}
