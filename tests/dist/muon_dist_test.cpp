// Muon over flat shards on 1-4 real ranks against a single-process Muon written here on the
// whole tensors (a plain Newton-Schulz on full matrices, torch.optim.Muon's formulas; AdamW
// elements against torch::optim::AdamW). Every rank computes the reference for all parameters
// (same seeds) and checks its own slice: weights, momentum_buffer and AdamW's exp_avg. Slices
// are uneven and cut matrices mid-row; with 3 ranks one rank holds nothing. Also: replicated
// shards, tensor parallelism (TP 2 x DP 2, duplicated mode), real fully_shard shards, refusals.
#include <torch/torch.h>

#include <array>
#include <cmath>
#include <map>
#include <string>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/muon.h"

namespace {

using mfsdp::Communicator;
using mfsdp::OptimizerShard;

constexpr int kMuonSteps = 4;

// ---- The reference: whole tensors, one process ----------------------------------------------

struct MuonRefConfig {
  double momentum = 0.95;
  bool nesterov = true;
  double weight_decay = 0.1;
  at::ScalarType dtype = at::kBFloat16;
  std::vector<std::array<double, 3>> coefficients = {{3.4445, -4.7750, 2.0315}};  // per step, cycled
  int steps = 5;
  // scale(rows, cols)
  std::function<double(double, double)> scale = [](double a, double b) { return std::sqrt(std::max(1.0, a / b)); };
};

// Newton-Schulz as Keller Jordan's Muon writes it: X = G / |G|_F on the wide side, then
// X = a X + (b A + c A A) X with A = X X^T.
at::Tensor ref_newton_schulz(const at::Tensor& g, const MuonRefConfig& c) {
  at::Tensor x = g.to(c.dtype);
  const bool tall = g.size(0) > g.size(1);
  if (tall) x = x.t();
  x = x / x.norm().clamp_min(1e-7);
  for (int i = 0; i < c.steps; ++i) {
    const auto& [a, b, cc] = c.coefficients[i % c.coefficients.size()];
    at::Tensor A = x.mm(x.t());
    at::Tensor B = at::addmm(A, A, A, b, cc);
    x = at::addmm(x, B, x, a);
  }
  return tall ? x.t() : x;
}

// One parameter of the reference model.
struct RefParam {
  std::string name;
  std::vector<int64_t> shape;  // full shape
  int split = -1;              // tensor-parallel dim (only the TP test)
  bool muon() const { return shape.size() == 2 && name.find("embed_tokens") == std::string::npos; }
};

struct Reference {
  std::vector<RefParam> specs;
  std::vector<at::Tensor> params, bufs;  // full values, Muon momentum (zeros for AdamW params)
  std::unique_ptr<torch::optim::AdamW> adamw;
  MuonRefConfig config;

  Reference(std::vector<RefParam> s, std::vector<at::Tensor> init, MuonRefConfig c, double adamw_wd)
      : specs(std::move(s)), config(std::move(c)) {
    std::vector<at::Tensor> decay, no_decay;
    for (size_t i = 0; i < specs.size(); ++i) {
      params.push_back(init[i].clone().set_requires_grad(true));
      bufs.push_back(at::zeros_like(init[i]));
      if (!specs[i].muon()) (specs[i].shape.size() >= 2 ? decay : no_decay).push_back(params.back());
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    auto opts = [](double wd) {
      return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-3).weight_decay(wd));
    };
    if (!decay.empty()) groups.emplace_back(decay, opts(adamw_wd));
    if (!no_decay.empty()) groups.emplace_back(no_decay, opts(0.0));
    adamw = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(1e-3));
  }

  void step(const std::vector<at::Tensor>& grads, double lr) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < specs.size(); ++i) {
      params[i].mutable_grad() = grads[i].clone();
      if (!specs[i].muon()) continue;
      bufs[i].lerp_(grads[i], 1 - config.momentum);
      at::Tensor u = config.nesterov ? grads[i].lerp(bufs[i], config.momentum) : bufs[i];
      at::Tensor o = ref_newton_schulz(u, config).to(at::kFloat);
      const double scale = config.scale(specs[i].shape[0], specs[i].shape[1]);
      params[i].mul_(1 - lr * config.weight_decay).sub_(o * (lr * scale));
    }
    for (auto& group : adamw->param_groups()) group.options().set_lr(lr);
    adamw->step();
  }

  at::Tensor exp_avg(size_t i) const {
    if (specs[i].muon()) return at::zeros_like(params[i]);
    auto& state = adamw->state().at(params[i].unsafeGetTensorImpl());
    return static_cast<torch::optim::AdamWParamState&>(*state).exp_avg();
  }
};

at::Tensor full_grad(const RefParam& p, int step, size_t index) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9000 + 100 * step + index);
  return at::randn(p.shape, gen);
}

// ---- This rank's flat shard of the same parameters ------------------------------------------

// The parameter's slice on TP rank `tp_rank` of `tp` (the whole parameter when not split).
at::Tensor tp_local(const at::Tensor& full, const RefParam& p, int tp, int tp_rank) {
  return p.split < 0 || tp == 1 ? full : full.chunk(tp, p.split)[tp_rank];
}

// A flat buffer of the TP-local parameters with 3 padding elements after each, this rank's
// slice [offset, offset + count) of it, and the OptimizerShard over that slice.
struct FlatShard {
  std::vector<int64_t> offsets;  // of each parameter in the flat buffer
  int64_t total = 0, offset = 0, count = 0;
  OptimizerShard shard;
  std::vector<std::vector<int64_t>> local_shapes;

  at::Tensor pack(const std::vector<at::Tensor>& local) const {
    at::Tensor flat = at::zeros({total});
    for (size_t i = 0; i < local.size(); ++i) flat.narrow(0, offsets[i], local[i].numel()).copy_(local[i].flatten());
    return flat.narrow(0, offset, count);
  }
};

// Uneven slices: rank r gets weight w[r] of the buffer (0: nothing); cuts fall mid-row.
std::pair<int64_t, int64_t> uneven_slice(int64_t total, int rank, int world) {
  const std::vector<std::vector<int64_t>> weights = {{1}, {2, 1}, {3, 0, 2}, {1, 3, 2, 2}};
  const std::vector<int64_t>& w = weights.at(world - 1);
  int64_t sum = 0, before = 0;
  for (int64_t x : w) sum += x;
  for (int r = 0; r < rank; ++r) before += w[r];
  const int64_t lo = total * before / sum;
  const int64_t hi = rank == world - 1 ? total : total * (before + w[rank]) / sum;
  return {lo, hi - lo};
}

FlatShard make_flat_shard(const std::vector<RefParam>& specs, const std::vector<at::Tensor>& full, int tp,
                          int tp_rank, bool replicated, int dp_rank, int dp) {
  FlatShard f;
  std::vector<at::Tensor> local;
  for (size_t i = 0; i < specs.size(); ++i) {
    local.push_back(tp_local(full[i], specs[i], tp, tp_rank));
    f.local_shapes.push_back(local.back().sizes().vec());
    f.offsets.push_back(f.total);
    f.total += local.back().numel() + 3;
  }
  std::tie(f.offset, f.count) = replicated ? std::make_pair(int64_t{0}, f.total) : uneven_slice(f.total, dp_rank, dp);
  f.shard.main_weight = f.pack(local).clone();
  f.shard.main_grad = at::zeros({f.count});
  f.shard.replicated = replicated;
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t numel = local[i].numel();
    const int64_t lo = std::max(f.offsets[i], f.offset), hi = std::min(f.offsets[i] + numel, f.offset + f.count);
    if (hi <= lo) continue;
    f.shard.segments.push_back({lo - f.offset, hi - lo, specs[i].shape.size() >= 2});
    f.shard.params.push_back({specs[i].name, f.local_shapes[i], lo - f.offset, lo - f.offsets[i], hi - lo});
  }
  return f;
}

// The test model: matrices wide, tall and square, a bias, a norm and an excluded embedding.
std::vector<RefParam> muon_test_params() {
  return {{"layers.0.w", {12, 20}, 0}, {"layers.0.b", {12}, 0},  {"embed_tokens.weight", {10, 6}, -1},
          {"layers.1.w", {30, 8}, 1},  {"norm.weight", {8}, -1}, {"layers.2.w", {7, 7}, -1}};
}

std::vector<at::Tensor> initial_values(const std::vector<RefParam>& specs, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> out;
  for (const RefParam& p : specs) out.push_back(at::randn(p.shape, gen));
  return out;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const double diff = got.numel() == 0 ? 0.0 : (got - want).abs().max().item<double>();
  EXPECT_LE(diff, tol) << what << ": max |diff| " << diff;
}

std::shared_ptr<Communicator> borrow(Communicator& comm) {
  return std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
}

struct MuonCase {
  mfsdp::MuonOptions options;
  MuonRefConfig ref;
  double tol = 1e-5;
  std::vector<bool> replicated = {false};  // one flat shard each
  int tp = 1;
};

// Trains the case's shards for kMuonSteps against the reference and checks this rank's slices.
void run_muon_case(Communicator& world, MuonCase c, const std::string& label) {
  // TP x DP: TP ranks adjacent (rank = dp_rank * tp + tp_rank), as Megatron orders them.
  const int tp_rank = world.rank() % c.tp, dp_rank = world.rank() / c.tp;
  std::shared_ptr<Communicator> dp = borrow(world);
  if (c.tp > 1) {
    std::vector<int> tp_ranks, dp_ranks;
    for (int t = 0; t < c.tp; ++t) tp_ranks.push_back(dp_rank * c.tp + t);
    for (int d = 0; d < world.size() / c.tp; ++d) dp_ranks.push_back(d * c.tp + tp_rank);
    c.options.tensor_parallel = world.new_group(tp_ranks, "muon_tp");
    dp = world.new_group(dp_ranks, "muon_dp");
    for (const RefParam& p : muon_test_params())
      if (p.split >= 0 && p.muon()) c.options.tensor_parallel_split[p.name] = p.split;
  }
  const std::vector<RefParam> specs = muon_test_params();
  std::vector<FlatShard> flats;
  std::vector<Reference> refs;
  std::vector<OptimizerShard> shards;
  for (size_t b = 0; b < c.replicated.size(); ++b) {
    const std::vector<at::Tensor> init = initial_values(specs, 31 + b);
    refs.emplace_back(specs, init, c.ref, c.options.adamw.weight_decay);
    flats.push_back(make_flat_shard(specs, init, c.tp, tp_rank, c.replicated[b], dp_rank, dp->size()));
    shards.push_back(flats.back().shard);
  }
  auto opt = mfsdp::make_muon(shards, dp, c.options);
  ASSERT_EQ(opt->name(), "Muon");
  for (int k = 0; k < kMuonSteps; ++k) {
    const double lr = 0.02 * (1 + k % 2);
    for (size_t b = 0; b < flats.size(); ++b) {
      std::vector<at::Tensor> grads, local;
      for (size_t i = 0; i < specs.size(); ++i) {
        grads.push_back(full_grad(specs[i], k, 10 * b + i));
        local.push_back(tp_local(grads.back(), specs[i], c.tp, tp_rank));
      }
      flats[b].shard.main_grad.copy_(flats[b].pack(local));
      refs[b].step(grads, lr);
    }
    opt->step(lr);
  }
  const auto listed = opt->state();
  const std::map<std::string, std::vector<at::Tensor>> state(listed.begin(), listed.end());
  ASSERT_EQ(state.size(), 3u);
  for (size_t b = 0; b < flats.size(); ++b) {
    std::vector<at::Tensor> w, m, v;
    for (size_t i = 0; i < specs.size(); ++i) {
      w.push_back(tp_local(refs[b].params[i].detach(), specs[i], c.tp, tp_rank));
      m.push_back(tp_local(refs[b].bufs[i], specs[i], c.tp, tp_rank));
      v.push_back(tp_local(refs[b].exp_avg(i), specs[i], c.tp, tp_rank));
    }
    const std::string where = label + ", shard " + std::to_string(b) + ", rank " + std::to_string(world.rank()) +
                              " of " + std::to_string(world.size());
    expect_close(flats[b].shard.main_weight, flats[b].pack(w), c.tol, where + ": main weight");
    expect_close(state.at("momentum_buffer")[b], flats[b].pack(m), 1e-6, where + ": momentum_buffer");
    expect_close(state.at("exp_avg")[b], flats[b].pack(v), 1e-6, where + ": exp_avg");
  }
}

MuonCase fp32_case() {
  MuonCase c;
  c.options.ns_dtype = at::kFloat;
  c.ref.dtype = at::kFloat;
  return c;
}

}  // namespace

// torch's defaults in fp32 Newton-Schulz (so the only differences are fp32 rounding), then
// Megatron's: momentum 0.9 without nesterov, spectral scale with an extra factor, quintic
// coefficients; and torch's bf16 iteration.
MFSDP_DIST_TEST(MuonDist, ShardedMatchesFullMatrixReference, {1, 2, 3, 4}) {
  run_muon_case(comm, fp32_case(), "torch defaults, fp32");

  MuonCase megatron = fp32_case();
  megatron.options.momentum = megatron.ref.momentum = 0.9;
  megatron.options.nesterov = megatron.ref.nesterov = false;
  megatron.options.weight_decay = megatron.ref.weight_decay = 0.01;
  megatron.options.scale_mode = "spectral";
  megatron.options.extra_scale_factor = 0.5;
  megatron.ref.scale = [](double a, double b) { return 0.5 * std::sqrt(std::max(a, b)); };
  megatron.options.coefficient_type = "quintic";
  megatron.ref.coefficients = {{4.0848, -6.8946, 2.9270},
                               {3.9505, -6.3029, 2.6377},
                               {3.7418, -5.5913, 2.3037},
                               {2.8769, -3.1427, 1.2046},
                               {2.8366, -3.0525, 1.2012}};
  run_muon_case(comm, megatron, "Megatron options, fp32");

  MuonCase bf16;  // defaults: bf16 iteration, as torch.optim.Muon
  bf16.tol = 1e-4;
  run_muon_case(comm, bf16, "torch defaults, bf16");
}

// no_shard: every rank holds whole matrices and orthogonalises them itself; mixed with a
// sharded shard in one optimizer.
MFSDP_DIST_TEST(MuonDist, ReplicatedShards, {1, 2, 3}) {
  MuonCase c = fp32_case();
  c.replicated = {true, false};
  run_muon_case(comm, c, "replicated + sharded");
}

// Tensor parallel 2 x data parallel 2: column- and row-parallel slices put together over the TP
// group (Megatron's duplicated mode: the whole matrix orthogonalised and scaled by its whole
// shape), the same result as one process on the whole matrices.
MFSDP_DIST_TEST(MuonDist, TensorParallelSlicesOrthogonaliseTheWholeMatrix, {2, 4}) {
  MuonCase c = fp32_case();
  c.tp = 2;
  run_muon_case(comm, c, "TP 2");
}

// A real fully_shard root (rows not aligned: pieces cut mid-row) fills OptimizerShard::params;
// Muon over it equals the reference on the gathered full state dict.
MFSDP_DIST_TEST(MuonDist, FullyShardShardsCarryTheirMatrices, {2, 3}) {
  struct NetImpl : torch::nn::Module {
    NetImpl() {
      embed_tokens = register_module("embed_tokens", torch::nn::Embedding(20, 6));
      up = register_module("up", torch::nn::Linear(6, 14));
      down = register_module("down", torch::nn::Linear(torch::nn::LinearOptions(14, 5).bias(false)));
    }
    torch::nn::Embedding embed_tokens{nullptr};
    torch::nn::Linear up{nullptr}, down{nullptr};
  };
  torch::manual_seed(3);
  auto net = std::make_shared<NetImpl>();
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);
  o.align_rows = false;
  mfsdp::FsdpHandle root = mfsdp::fully_shard(*net, o);

  std::map<std::string, at::Tensor> start = root.full_state_dict(/*all_ranks=*/true);
  std::vector<RefParam> specs;
  std::vector<at::Tensor> init;
  for (const auto& [name, value] : start) {
    specs.push_back({name, value.sizes().vec(), -1});
    init.push_back(value);
  }
  mfsdp::MuonOptions options;
  options.ns_dtype = at::kFloat;
  MuonRefConfig rc;
  rc.dtype = at::kFloat;
  Reference ref(specs, init, rc, options.adamw.weight_decay);

  std::vector<OptimizerShard> shards = root.optimizer_shards();
  for (const OptimizerShard& s : shards)  // one piece per parameter slice, as one segment
    ASSERT_EQ(s.params.size(), s.segments.size()) << "optimizer_shards() did not fill OptimizerShard::params";
  auto opt = mfsdp::make_muon(shards, root.optimizer_comm(), options, root.optimizer_step_hook());
  const std::vector<mfsdp::LocalShard> locals = root.local_shards();
  for (int k = 0; k < kMuonSteps; ++k) {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < specs.size(); ++i) grads.push_back(full_grad(specs[i], k, i));
    for (const mfsdp::LocalShard& ls : locals) {
      size_t i = 0;
      while (specs[i].name != ls.name) ++i;
      if (ls.shard_index < 0 || ls.local.numel() == 0) continue;
      shards[ls.shard_index].main_grad.narrow(0, ls.shard_offset, ls.local.numel())
          .copy_(grads[i].flatten().narrow(0, ls.offset, ls.local.numel()));
    }
    ref.step(grads, 0.03);
    opt->step(0.03);
  }
  std::map<std::string, at::Tensor> end = root.full_state_dict(/*all_ranks=*/true);
  for (size_t i = 0; i < specs.size(); ++i)
    expect_close(end.at(specs[i].name), ref.params[i].detach(), 1e-5, "fully_shard " + specs[i].name);
}

MFSDP_DIST_TEST(MuonDist, RefusesWhatItCannotDoRight, {2}) {
  auto world = borrow(comm);
  const std::vector<RefParam> specs = muon_test_params();
  const FlatShard f = make_flat_shard(specs, initial_values(specs, 5), 1, 0, false, comm.rank(), comm.size());
  auto expect_refused = [&](mfsdp::MuonOptions o, OptimizerShard s, const std::string& needle) {
    try {
      mfsdp::make_muon({s}, world, o);
      ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // Options are checked before any collective, so each rank throws alike.
  mfsdp::MuonOptions o;
  o.scale_mode = "spectrl";
  expect_refused(o, f.shard, "'spectrl'");
  o = {};
  o.coefficient_type = "quintic";
  o.ns_steps = 4;
  expect_refused(o, f.shard, "multiple of 5");
  o = {};
  o.tp_mode = "sharded";
  expect_refused(o, f.shard, "'sharded'");
  o = {};
  o.ns_dtype = at::kHalf;
  expect_refused(o, f.shard, "ns_dtype");
  OptimizerShard no_params = f.shard;
  no_params.params.clear();
  expect_refused({}, no_params, "no params");
  // Every rank passing the whole buffer as if sharded: each element held twice (what a TP group
  // mistaken for the data-parallel group would look like). Collective: both ranks get here.
  OptimizerShard whole = make_flat_shard(specs, initial_values(specs, 5), 1, 0, false, 0, 1).shard;
  expect_refused({}, whole, "held twice");
}
