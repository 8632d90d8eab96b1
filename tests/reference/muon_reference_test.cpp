// mfsdp's Muon against torch.optim.Muon of the reference environment (muon_reference.py): the
// same initial weights and gradients, 5 steps, for adjust_lr_fn original / match_rms_adamw /
// spectral_unclamped and nesterov on / off. On 1 rank the matrices sit in one flat shard with
// padding; on 2 ranks that shard is cut unevenly (mid-row), so the pieces travel to their owners.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <string>

#include "harness/dist_test.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/optim/muon.h"

namespace {

const std::string kMuonPython = MFSDP_PYTHON_PATH;
const std::string kMuonScript = MFSDP_REFERENCE_SCRIPT;
constexpr int kTorchMuonSteps = 5;  // muon_reference.py STEPS

const std::vector<std::pair<std::string, std::vector<int64_t>>> kTorchMuonShapes = {
    {"wide", {16, 24}}, {"tall", {40, 12}}, {"square", {9, 9}}};

at::Tensor read_f32(const std::string& path, const std::vector<int64_t>& shape) {
  at::Tensor t = at::empty(shape, at::kFloat);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(t.data_ptr<float>()), t.numel() * sizeof(float));
  if (!in) throw std::runtime_error("cannot read " + path);
  return t;
}

void check_against_torch(mfsdp::Communicator& comm, const std::string& dir, const std::string& scale_mode,
                         bool nesterov) {
  const std::string config = scale_mode + (nesterov ? "_nesterov" : "_plain");
  // Flat buffer: each matrix then 5 padding elements; rank r holds an uneven slice of it.
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const auto& [name, shape] : kTorchMuonShapes) {
    offsets.push_back(total);
    total += shape[0] * shape[1] + 5;
  }
  const int64_t lo = comm.rank() == 0 ? 0 : total * 3 / 5, hi = comm.size() == 1 || comm.rank() == 1 ? total : total * 3 / 5;
  auto pack = [&](const std::string& prefix) {
    at::Tensor flat = at::zeros({total});
    for (size_t i = 0; i < kTorchMuonShapes.size(); ++i) {
      const auto& [name, shape] = kTorchMuonShapes[i];
      flat.narrow(0, offsets[i], shape[0] * shape[1]).copy_(read_f32(dir + "/" + prefix + name + ".bin", shape).flatten());
    }
    return flat.narrow(0, lo, hi - lo).clone();
  };
  mfsdp::OptimizerShard shard;
  shard.main_weight = pack("init_");
  shard.main_grad = at::zeros_like(shard.main_weight);
  for (size_t i = 0; i < kTorchMuonShapes.size(); ++i) {
    const auto& [name, shape] = kTorchMuonShapes[i];
    const int64_t a = std::max(lo, offsets[i]), b = std::min(hi, offsets[i] + shape[0] * shape[1]);
    if (b <= a) continue;
    shard.segments.push_back({a - lo, b - a, true});
    shard.params.push_back({name, shape, a - lo, a - offsets[i], b - a});
  }
  mfsdp::MuonOptions options;  // torch's defaults: momentum 0.95, bf16 Newton-Schulz, 5 steps
  options.weight_decay = 0.1;
  options.nesterov = nesterov;
  options.scale_mode = scale_mode;
  auto opt = mfsdp::make_muon({shard}, std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {}),
                              options);
  for (int k = 0; k < kTorchMuonSteps; ++k) {
    shard.main_grad.copy_(pack("grad_" + std::to_string(k) + "_"));
    opt->step(0.02 * (1 + k % 2));
  }
  const std::string where = config + ", rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
  auto compare = [&](const at::Tensor& got, const at::Tensor& want, const std::string& what) {
    const double diff = (got - want).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5) << where << ", " << what << ": max |diff| " << diff;
    std::cout << where << ", " << what << ": max |diff| vs torch.optim.Muon " << diff << "\n";
  };
  compare(shard.main_weight, pack(config + "_weight_"), "weights");
  compare(opt->state().at(0).second.at(0), pack(config + "_momentum_"), "momentum_buffer");
}

}  // namespace

TEST(MuonReference, MatchesTorchOptimMuon) {
  mfsdp::testing::TempDir dir("mfsdp-muon-reference");
  mfsdp::testing::DistOptions options;
  options.world_sizes = {1, 2};
  options.shared_dir = dir.path().string();
  if (!mfsdp::testing::is_rank_process()) {
    const auto outcome = mfsdp::testing::run_command("env OMP_NUM_THREADS=1 '" + kMuonPython + "' '" + kMuonScript +
                                                     "' '" + options.shared_dir + "'");
    ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  }
  mfsdp::testing::run_distributed(options, [](mfsdp::Communicator& comm) {
    const std::string shared = mfsdp::testing::shared_temp_dir();
    for (const char* mode : {"original", "match_rms_adamw", "spectral_unclamped"})
      for (bool nesterov : {true, false}) check_against_torch(comm, shared, mode, nesterov);
  });
}
