// Corruption is caught, never loaded: fuzzers for what mfsdp reads from disk. A real 2-rank
// ZeRO-3 checkpoint of mfsdp-pretrain (fsdp_dtensor and the earlier mfsdp format) is mutated
// thousands of times (tests/harness/fork_fuzz.h: bit flips, overwrites, truncation, insertion,
// deletion, data copied to the wrong place, deleted files), each mutated copy read in a forked
// child. Every read must be refused or give back exactly the original values: zero silent loads,
// crashes and hangs. The trainer itself refuses a checkpoint with one flipped byte, naming the
// file, tensor and byte range. The indexed dataset's fuzzer: corruption_fuzz_dataset_test.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/formats/zip_archive.h"
#include "harness/file_bytes.h"
#include "harness/fork_fuzz.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/base/directory_tree.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::CommandOutcome;
using mfsdp::testing::describe;
using mfsdp::testing::FuzzCounts;
using mfsdp::testing::fuzz_files;
using mfsdp::testing::harmless_examples;
using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kModel =
    " --device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32"
    " --num-attention-heads 4 --swiglu --ffn-hidden-size 48 --seq-length 16 --micro-batch-size 2"
    " --global-batch-size 4 --train-iters 2 --lr 3e-3 --log-interval 1 --eval-interval 1000 --seed 7"
    " --data-parallel-sharding-strategy optim_grads_params";

CommandOutcome pretrain(const std::string& flags) {
  return run_command(std::string(MFSDP_RUN_BIN_PATH) + " --nproc-per-node 2 " + MFSDP_PRETRAIN_BIN_PATH + kModel +
                     flags);
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const std::string& name : mfsdp::list_directory(dir))
    if (fs::is_regular_file(fs::path(dir) / name)) out.push_back((fs::path(dir) / name).string());
  return out;
}

// What a checkpoint holds, read through CheckpointReader (what loading uses).
struct CheckpointValues {
  std::map<std::string, at::Tensor> tensors;
  nlohmann::json metadata;
};

// Every tensor of `names` (loading needs each one: a missing one is an error, as in
// load_checkpoint), and the metadata.
CheckpointValues read_all(const std::string& dir, const std::vector<std::string>& names, bool with_metadata) {
  mfsdp::CheckpointReader r(dir);
  CheckpointValues v;
  for (const std::string& name : names) {
    if (!r.contains(name)) throw std::invalid_argument("the checkpoint has no tensor '" + name + "'");
    v.tensors[name] = r.read(name);
  }
  if (with_metadata) v.metadata = r.metadata();
  return v;
}

bool same(const CheckpointValues& a, const CheckpointValues& b) {
  if (a.metadata != b.metadata) return false;
  for (const auto& [name, t] : a.tensors) {
    const at::Tensor& o = b.tensors.at(name);
    if (o.sizes() != t.sizes() || o.scalar_type() != t.scalar_type() || !at::equal(o, t)) return false;
  }
  return true;
}

void fuzz_checkpoint(const std::string& format, int rounds, unsigned seed) {
  at::set_num_threads(1);
  TempDir dir("mfsdp-fuzz");
  CommandOutcome saved = pretrain(" --ckpt-format " + format + " --save " + dir.file("ckpt") + " --save-interval 2");
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  const std::string iter = dir.file("ckpt") + "/iter_0000002";
  // The earlier format's metadata.json carries no checksum of its own: there only the tensors
  // are compared (a changed "consumed_samples" is no tensor byte; a renamed tensor is missing).
  const bool with_metadata = format == "fsdp_dtensor";
  const std::vector<std::string> names = mfsdp::CheckpointReader(iter).tensor_names();
  const CheckpointValues original = read_all(iter, names, with_metadata);
  ASSERT_GT(original.tensors.size(), 10u);
  const FuzzCounts c =
      fuzz_files(files_in(iter), rounds, seed, [&] { return same(read_all(iter, names, with_metadata), original); });
  std::printf("%s checkpoint (%zu files, %zu tensors): %s\n%s\n", format.c_str(), files_in(iter).size(),
              names.size(), describe(c).c_str(), harmless_examples(c).c_str());
  EXPECT_EQ(c.silent, 0) << "first: " << c.first_silent;
  EXPECT_EQ(c.crashed, 0);
  EXPECT_EQ(c.hung, 0);
  EXPECT_GT(c.refused, rounds * 9 / 10);
}

TEST(CorruptionFuzz, FsdpDtensorCheckpointOfTwoRanks) { fuzz_checkpoint("fsdp_dtensor", 1500, 11); }

TEST(CorruptionFuzz, EarlierFormatCheckpointOfTwoRanks) { fuzz_checkpoint("mfsdp", 1000, 12); }

// The trainer, not only the reader: one flipped bit in a weight of a chunk of rank 1's file
// (a valid float still) stops --load on every rank with the file, the tensor and the byte range,
// and trains nothing.
TEST(CorruptionFuzz, TrainerRefusesAFlippedByteNamingFileTensorAndRange) {
  TempDir dir("mfsdp-flip");
  ASSERT_EQ(pretrain(" --save " + dir.file("ckpt") + " --save-interval 2").exit_code, 0);
  const std::string iter = dir.file("ckpt") + "/iter_0000002";
  const mfsdp::dcp::Reader r(iter);
  ASSERT_TRUE(r.has_checksums());
  const mfsdp::dcp::TensorChunk* victim = nullptr;
  std::string victim_name;
  for (const auto& [name, e] : r.metadata().tensors)
    for (const auto& chunk : e.chunks)
      if (!victim && chunk.location.file == mfsdp::dcp::rank_file_name(1) && name.rfind("model.", 0) == 0) {
        victim = &chunk;
        victim_name = name;
      }
  ASSERT_NE(victim, nullptr);
  const std::string file = iter + "/" + victim->location.file;
  std::string bytes = mfsdp::testing::slurp(file);
  const mfsdp::zip::ZipReader zip(file, "chunk", victim->location.offset, victim->location.length);
  size_t at = 0;
  for (const std::string& entry : zip.names())  // the tensor's raw bytes: "<archive>/data/0"
    if (entry.size() > 7 && entry.compare(entry.size() - 7, 7, "/data/0") == 0)
      at = victim->location.offset + zip.data_offset(entry) + 1;
  ASSERT_GT(at, 0u);
  bytes[at] = static_cast<char>(bytes[at] ^ 0x10);
  mfsdp::testing::put(file, bytes);
  const CommandOutcome loaded = pretrain(" --load " + dir.file("ckpt") + " --train-iters 4");
  EXPECT_NE(loaded.exit_code, 0);
  const std::string range = "bytes [" + std::to_string(victim->location.offset) + ", " +
                            std::to_string(victim->location.offset + victim->location.length) + ")";
  for (const std::string& part : {std::string("__1_0.distcp"), range, "'" + victim_name + "'", std::string("checksum")})
    EXPECT_NE(loaded.output.find(part), std::string::npos) << "missing \"" << part << "\" in:\n" << loaded.output;
  EXPECT_EQ(loaded.output.find("iteration        3/"), std::string::npos) << loaded.output;
}

}  // namespace
