// The flat-shard optimizer in one process, checked against LibTorch's own optimizers on the same
// parameters: torch::optim::AdamW / SGD with a decay and a no-decay parameter group, and
// torch::nn::utils::clip_grad_norm_. Parameters of uneven sizes are packed into a flat main
// weight with padding between and after them; padding must come out untouched. The LR schedule
// is checked against values computed by hand.
#include "mfsdp/optim/optim.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace {

using mfsdp::OptimizerShard;
using mfsdp::ShardSegment;

// Tolerances against torch: our ops are torch's ops, but a parameter's elements sit at other
// offsets inside a merged run than inside their own tensor, so an element can fall in a SIMD body
// here and in a scalar tail there, and the norm is accumulated in fp64 here, fp32 in torch (one
// fp32 ulp of the clip factor). On the development machine every comparison is bit-exact; 1e-6
// (about 8 fp32 ulps) absorbs such one-rounding differences on other CPUs over K steps while
// staying four orders below one step's update (~lr = 1e-2), so a wrong op cannot hide in it.
constexpr double kRtol = 1e-6;
constexpr double kAtol = 1e-7;

// Padding values that would show up in any norm or update that wrongly covered them.
constexpr float kPaddingGrad = 1000.f;

// A world of one rank that counts its all-reduces (the norm needs exactly one per call).
class CountingComm : public mfsdp::Communicator {
 public:
  int all_reduces = 0;

  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "gloo"; }
  at::Device device() const override { return at::kCPU; }
  std::chrono::milliseconds default_timeout() const override { return std::chrono::seconds(5); }

  mfsdp::WorkHandle all_gather_async(const at::Tensor& output, const at::Tensor& input,
                                     const mfsdp::AllGatherOptions&) override {
    if (!output.is_same(input)) output.copy_(input);
    return done();
  }
  mfsdp::WorkHandle reduce_scatter_async(const at::Tensor& output, const at::Tensor& input,
                                         const mfsdp::ReduceScatterOptions& options) override {
    output.copy_(input * options.prescale);
    return done();
  }
  mfsdp::WorkHandle all_reduce_async(const at::Tensor&, const mfsdp::AllReduceOptions&) override {
    ++all_reduces;  // the sum over one rank is the tensor itself
    return done();
  }
  mfsdp::WorkHandle broadcast_async(const at::Tensor&, const mfsdp::BroadcastOptions&) override {
    return done();
  }
  mfsdp::WorkHandle barrier_async(const mfsdp::BarrierOptions&) override { return done(); }
  std::shared_ptr<mfsdp::Communicator> new_group(const std::vector<int>&,
                                                 const std::string&) override {
    throw std::logic_error("CountingComm has no subgroups");
  }

 private:
  struct DoneWork : mfsdp::Work {
    void wait() override {}
    bool is_completed() override { return true; }
  };
  static mfsdp::WorkHandle done() { return std::make_shared<DoneWork>(); }
};

// One parameter: its shape, whether it decays, and where it sits in the flat buffer.
struct ParamSpec {
  std::vector<int64_t> shape;
  bool weight_decay;
  int64_t offset;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Uneven sizes; gaps of padding between some parameters and at the end; decay and no-decay
// neighbours inside one run (offsets 38..76), so runs must split their weight decay.
const std::vector<ParamSpec> kParams = {
    {{33, 17}, true, 0},     // 561 elements, [0, 561)
    {{13}, false, 566},      // bias-like, after a gap of 5
    {{1}, true, 579},        // scalar-ish, adjacent to the bias
    {{4, 3, 2}, true, 580},  // adjacent again
    {{9}, false, 604},       // adjacent, no decay: run [566, 613) decays only [579, 604)
    {{7, 3}, true, 620},     // after a gap of 7
};
constexpr int64_t kFlatNumel = 650;  // 641 used, 9 elements of padding at the end

// The parameters as independent leaves (what torch::optim trains) and the same values packed
// into a flat shard (what the code under test trains).
struct Packed {
  std::vector<at::Tensor> params;  // reference leaves, requires_grad
  OptimizerShard shard;
  at::Tensor padding_mask;  // [kFlatNumel] bool, true outside every parameter
};

Packed pack(uint64_t seed) {
  Packed out;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  out.shard.main_weight = at::zeros({kFlatNumel});
  out.shard.main_grad = at::full({kFlatNumel}, kPaddingGrad);
  out.padding_mask = at::ones({kFlatNumel}, at::kBool);
  // Segments listed out of order: the optimizer must not rely on sorted input.
  for (auto it = kParams.rbegin(); it != kParams.rend(); ++it) {
    out.shard.segments.push_back(ShardSegment{it->offset, it->numel(), it->weight_decay});
  }
  for (const ParamSpec& spec : kParams) {
    at::Tensor value = at::randn(spec.shape, gen);
    out.params.push_back(value.clone().set_requires_grad(true));
    out.shard.main_weight.narrow(0, spec.offset, spec.numel()).copy_(value.flatten());
    out.padding_mask.narrow(0, spec.offset, spec.numel()).fill_(false);
  }
  return out;
}

// Gradients of step `step`, the same for both sides; padding grads keep their poison value.
void set_grads(Packed& packed, int step, double scale = 1.0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  for (size_t i = 0; i < kParams.size(); ++i) {
    at::Tensor g = at::randn(kParams[i].shape, gen) * scale;
    packed.params[i].mutable_grad() = g.clone();
    packed.shard.main_grad.narrow(0, kParams[i].offset, kParams[i].numel()).copy_(g.flatten());
  }
}

void check_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double max_abs = (got - want).abs().max().item<double>();
  EXPECT_TRUE(at::allclose(got, want, kRtol, kAtol))
      << what << ": max |diff| " << max_abs << "\n got: " << got << "\nwant: " << want;
}

// Every parameter's slice of the flat `flat` against the reference tensors `want`.
void check_params(const at::Tensor& flat, const std::vector<at::Tensor>& want,
                  const std::string& what) {
  for (size_t i = 0; i < kParams.size(); ++i) {
    check_close(flat.narrow(0, kParams[i].offset, kParams[i].numel()), want[i].detach().flatten(),
                what + ", parameter " + std::to_string(i));
  }
}

// Elements of `flat` outside every parameter must all equal `value` (bit for bit).
void expect_padding(const at::Tensor& flat, const at::Tensor& mask, float value,
                    const std::string& what) {
  at::Tensor padding = flat.masked_select(mask);
  EXPECT_TRUE(at::equal(padding, at::full_like(padding, value))) << what << ": " << padding;
}

OptimizerShard empty_shard() { return OptimizerShard{at::zeros({0}), at::zeros({0}), {}, false}; }

std::string invalid_argument_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "<no std::invalid_argument>";
}

#define EXPECT_INVALID(statement, ...)                                        \
  do {                                                                        \
    const std::string msg_ = invalid_argument_of([&] { statement; });         \
    for (const char* part_ : {__VA_ARGS__})                                   \
      EXPECT_NE(msg_.find(part_), std::string::npos)                          \
          << "message of `" #statement "` lacks '" << part_ << "': " << msg_; \
  } while (0)

// Parameter groups for torch::optim: decay parameters first, then the rest.
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> split_by_decay(
    const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> decay, no_decay;
  for (size_t i = 0; i < kParams.size(); ++i) {
    (kParams[i].weight_decay ? decay : no_decay).push_back(params[i]);
  }
  return {decay, no_decay};
}

const std::vector<double> kLrs = {1e-2, 2e-2, 5e-3, 1e-2, 3e-2, 0.0, 1e-2};  // one per step

// ---------------------------------------------------------------------------------------------
// AdamW

TEST(AdamW, MatchesTorchAdamWWithDecayGroupsAndPadding) {
  Packed packed = pack(1);
  auto comm = std::make_shared<CountingComm>();
  mfsdp::AdamWOptions options;
  options.beta1 = 0.8;
  options.beta2 = 0.95;
  options.eps = 1e-6;
  options.weight_decay = 0.1;
  auto opt = mfsdp::make_adamw({empty_shard(), packed.shard}, comm, options);

  auto [decay, no_decay] = split_by_decay(packed.params);
  auto ref_options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(kLrs[0]).betas({0.8, 0.95}).eps(1e-6).weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, ref_options(0.1));
  groups.emplace_back(no_decay, ref_options(0.0));
  torch::optim::AdamW ref(groups, torch::optim::AdamWOptions(kLrs[0]));

  for (size_t k = 0; k < kLrs.size(); ++k) {
    set_grads(packed, static_cast<int>(k));
    for (auto& group : ref.param_groups()) group.options().set_lr(kLrs[k]);
    ref.step();
    opt->step(kLrs[k]);
    EXPECT_EQ(opt->steps(), static_cast<int64_t>(k + 1));
  }
  check_params(packed.shard.main_weight, packed.params, "AdamW weights");
  expect_padding(packed.shard.main_weight, packed.padding_mask, 0.f, "AdamW weight padding");
  expect_padding(packed.shard.main_grad, packed.padding_mask, kPaddingGrad, "main_grad padding");
  EXPECT_EQ(comm->all_reduces, 0);  // steps never talk to peers

  // State: one flat tensor per shard, the reference's moments at each parameter's place.
  auto state = opt->state();
  ASSERT_EQ(state.size(), 2u);
  EXPECT_EQ(state[0].first, "exp_avg");
  EXPECT_EQ(state[1].first, "exp_avg_sq");
  for (const auto& [name, tensors] : state) {
    ASSERT_EQ(tensors.size(), 2u) << name;
    EXPECT_EQ(tensors[0].numel(), 0) << name;
    ASSERT_EQ(tensors[1].numel(), kFlatNumel) << name;
    EXPECT_EQ(tensors[1].scalar_type(), at::kFloat) << name;
    expect_padding(tensors[1], packed.padding_mask, 0.f, name + " padding");
    std::vector<at::Tensor> want;
    for (const at::Tensor& p : packed.params) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(
          *ref.state().at(p.unsafeGetTensorImpl()));
      want.push_back(name == "exp_avg" ? s.exp_avg() : s.exp_avg_sq());
    }
    check_params(tensors[1], want, name);
  }
}

// The precision-aware optimizer's bf16 moments (AdamWOptions::exp_avg_dtype and exp_avg_sq_dtype,
// Megatron's --exp-avg-dtype bf16): each step is AdamW in fp32 from the stored moments, which are
// then rounded to bf16; the reference here does that per parameter with plain tensor ops. Fused
// and unfused kernels alike; the state is bf16 (half the bytes) and differs from fp32 moments.
TEST(AdamW, Bf16MomentsAreTheFp32UpdateRoundedEachStep) {
  for (const bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "unfused");
    Packed packed = pack(5);
    auto comm = std::make_shared<CountingComm>();
    mfsdp::AdamWOptions options;
    options.beta1 = 0.8;
    options.beta2 = 0.95;
    options.weight_decay = 0.1;
    options.fused = fused;
    options.exp_avg_dtype = at::kBFloat16;
    options.exp_avg_sq_dtype = at::kBFloat16;
    auto opt = mfsdp::make_adamw({packed.shard}, comm, options);
    std::vector<at::Tensor> w, m, v;
    for (const at::Tensor& p : packed.params) {
      w.push_back(p.detach().clone());
      m.push_back(at::zeros_like(w.back()));
      v.push_back(at::zeros_like(w.back()));
    }
    for (size_t k = 0; k < kLrs.size(); ++k) {
      set_grads(packed, static_cast<int>(k));
      opt->step(kLrs[k]);
      const double step = static_cast<double>(k + 1), lr = kLrs[k];
      for (size_t i = 0; i < kParams.size(); ++i) {
        const at::Tensor g = packed.params[i].grad();
        // torch::optim::AdamW's ops, in its order (the fp32 update the moments are rounded after).
        if (kParams[i].weight_decay) w[i].mul_(1 - lr * 0.1);
        const at::Tensor m32 = m[i].clone().mul_(0.8).add_(g, 0.2), v32 = v[i].clone().mul_(0.95).addcmul_(g, g, 0.05);
        const at::Tensor denom = v32.sqrt().div_(std::sqrt(1 - std::pow(0.95, step))).add_(1e-8);
        w[i].addcdiv_(m32, denom, -lr / (1 - std::pow(0.8, step)));
        m[i] = m32.to(at::kBFloat16).to(at::kFloat);  // stored in bf16
        v[i] = v32.to(at::kBFloat16).to(at::kFloat);
      }
    }
    check_params(packed.shard.main_weight, w, "weights");
    auto state = opt->state();
    ASSERT_EQ(state.size(), 2u);
    for (const auto& [name, tensors] : state) {
      ASSERT_EQ(tensors[0].scalar_type(), at::kBFloat16) << name;
      check_params(tensors[0].to(at::kFloat), name == "exp_avg" ? m : v, name);
    }
  }
  mfsdp::AdamWOptions fp16;
  fp16.exp_avg_dtype = at::kHalf;
  Packed packed = pack(6);
  EXPECT_INVALID(mfsdp::make_adamw({packed.shard}, std::make_shared<CountingComm>(), fp16),
                 "AdamWOptions.exp_avg_dtype must be float32 or bfloat16, got Half");
}

// The fused kernel (AdamWOptions::fused) against what torch.optim.AdamW(fused=True) runs: the
// same at::_fused_adamw_ over each parameter as its own tensor, bit for bit, and against
// torch::optim::AdamW's separate ops within rounding.
TEST(AdamW, FusedIsTorchsFusedKernelPerParameter) {
  Packed packed = pack(3);
  mfsdp::AdamWOptions options;
  options.beta1 = 0.8;
  options.beta2 = 0.95;
  options.eps = 1e-6;
  options.weight_decay = 0.1;
  options.fused = true;
  auto opt = mfsdp::make_adamw({empty_shard(), packed.shard}, std::make_shared<CountingComm>(), options);
  Packed unfused_packed = pack(3);
  mfsdp::AdamWOptions unfused_options = options;
  unfused_options.fused = false;
  auto unfused = mfsdp::make_adamw({unfused_packed.shard}, std::make_shared<CountingComm>(), unfused_options);

  // torch.optim.AdamW(fused=True)'s step: the step counts incremented, then one kernel call per
  // parameter group (decay, no decay) over its parameters.
  std::vector<at::Tensor> params, exp_avgs, exp_avg_sqs, counts;
  for (const at::Tensor& p : packed.params) {
    params.push_back(p.detach());
    exp_avgs.push_back(at::zeros_like(p));
    exp_avg_sqs.push_back(at::zeros_like(p));
    counts.push_back(at::zeros({}, at::kFloat));
  }
  auto reference_step = [&](double lr) {
    for (const bool decay : {true, false}) {
      std::vector<at::Tensor> p, g, m, v, c;
      for (size_t i = 0; i < kParams.size(); ++i) {
        if (kParams[i].weight_decay != decay) continue;
        counts[i].add_(1);
        p.push_back(params[i]);
        g.push_back(packed.params[i].grad());
        m.push_back(exp_avgs[i]);
        v.push_back(exp_avg_sqs[i]);
        c.push_back(counts[i]);
      }
      at::_fused_adamw_(p, g, m, v, {}, c, lr, 0.8, 0.95, decay ? 0.1 : 0.0, 1e-6, false, false);
    }
  };
  for (size_t k = 0; k < kLrs.size(); ++k) {
    set_grads(packed, static_cast<int>(k));
    set_grads(unfused_packed, static_cast<int>(k));
    reference_step(kLrs[k]);
    opt->step(kLrs[k]);
    unfused->step(kLrs[k]);
  }
  for (size_t i = 0; i < kParams.size(); ++i) {
    const at::Tensor got = packed.shard.main_weight.narrow(0, kParams[i].offset, kParams[i].numel());
    EXPECT_TRUE(at::equal(got, params[i].flatten())) << "parameter " << i << ": max |diff| "
                                                     << (got - params[i].flatten()).abs().max().item<double>();
  }
  EXPECT_TRUE(at::equal(opt->state()[0].second[1].narrow(0, 0, 561), exp_avgs[0].flatten()));
  EXPECT_TRUE(at::equal(opt->state()[1].second[1].narrow(0, 0, 561), exp_avg_sqs[0].flatten()));
  expect_padding(packed.shard.main_weight, packed.padding_mask, 0.f, "fused AdamW weight padding");
  expect_padding(opt->state()[0].second[1], packed.padding_mask, 0.f, "fused exp_avg padding");
  // The separate ops of the default path: the same update within rounding, not bit for bit.
  check_close(packed.shard.main_weight, unfused_packed.shard.main_weight, "fused vs unfused");
  EXPECT_FALSE(at::equal(packed.shard.main_weight, unfused_packed.shard.main_weight))
      << "the fused and unfused paths agree bit for bit: is the fused kernel running?";
}

TEST(AdamW, DefaultOptionsMatchTorchDefaults) {
  // AdamWOptions' defaults are torch's (the lr is step's argument): a single-group torch AdamW with its own defaults must
  // agree (no weight decay split: every segment decays).
  Packed packed = pack(2);
  for (auto& seg : packed.shard.segments) seg.weight_decay = true;
  auto opt = mfsdp::make_adamw({packed.shard}, std::make_shared<CountingComm>(), {});
  torch::optim::AdamW ref(packed.params, torch::optim::AdamWOptions());
  for (int k = 0; k < 3; ++k) {
    set_grads(packed, k);
    ref.step();
    opt->step(1e-3);  // torch AdamW's default lr
  }
  check_params(packed.shard.main_weight, packed.params, "AdamW defaults");
}

TEST(AdamW, AfterStepRunsOnceAfterTheUpdate) {
  Packed packed = pack(3);
  set_grads(packed, 0);
  const at::Tensor before = packed.shard.main_weight.clone();
  int calls = 0;
  mfsdp::DistributedOptimizer* self = nullptr;
  auto opt = mfsdp::make_adamw({packed.shard}, std::make_shared<CountingComm>(), {}, [&] {
    ++calls;
    // Runs after the update and after the step count went up.
    EXPECT_EQ(self->steps(), calls);
    EXPECT_FALSE(at::equal(packed.shard.main_weight, before));
  });
  self = opt.get();
  opt->step(1e-2);
  opt->step(1e-2);
  EXPECT_EQ(calls, 2);
}

TEST(AdamW, OnlyEmptyShardsOrNoShards) {
  auto comm = std::make_shared<CountingComm>();
  for (auto shards : {std::vector<OptimizerShard>{}, std::vector<OptimizerShard>{empty_shard()}}) {
    auto opt = mfsdp::make_adamw(shards, comm, {});
    const int before = comm->all_reduces;
    EXPECT_EQ(opt->clip_grad_norm(1.0), 0.0);
    EXPECT_EQ(comm->all_reduces, before + 1);  // joins the collective with nothing of its own
    opt->step(1e-3);
    EXPECT_EQ(opt->steps(), 1);
  }
}

// ---------------------------------------------------------------------------------------------
// SGD

struct SgdCase {
  const char* name;
  double momentum, dampening, weight_decay;
  bool nesterov;
};

TEST(SGD, MatchesTorchSGDWithDecayGroupsAndPadding) {
  const std::vector<SgdCase> cases = {
      {"momentum+nesterov+wd", 0.9, 0.0, 0.05, true},
      {"momentum+dampening+wd", 0.8, 0.25, 0.05, false},
      {"plain+wd", 0.0, 0.0, 0.05, false},
      {"momentum, no wd", 0.9, 0.0, 0.0, false},
  };
  for (const SgdCase& c : cases) {
    SCOPED_TRACE(c.name);
    Packed packed = pack(4);
    mfsdp::SGDOptions options;
    options.momentum = c.momentum;
    options.dampening = c.dampening;
    options.weight_decay = c.weight_decay;
    options.nesterov = c.nesterov;
    auto opt =
        mfsdp::make_sgd({packed.shard, empty_shard()}, std::make_shared<CountingComm>(), options);

    auto [decay, no_decay] = split_by_decay(packed.params);
    auto ref_options = [&](double wd) {
      return std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(kLrs[0])
                                                            .momentum(c.momentum)
                                                            .dampening(c.dampening)
                                                            .weight_decay(wd)
                                                            .nesterov(c.nesterov));
    };
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, ref_options(c.weight_decay));
    groups.emplace_back(no_decay, ref_options(0.0));
    torch::optim::SGD ref(groups, torch::optim::SGDOptions(kLrs[0]));

    for (size_t k = 0; k < kLrs.size(); ++k) {
      set_grads(packed, static_cast<int>(k));
      for (auto& group : ref.param_groups()) group.options().set_lr(kLrs[k]);
      ref.step();
      opt->step(kLrs[k]);
    }
    check_params(packed.shard.main_weight, packed.params, "SGD weights");
    expect_padding(packed.shard.main_weight, packed.padding_mask, 0.f, "SGD weight padding");
    expect_padding(packed.shard.main_grad, packed.padding_mask, kPaddingGrad, "main_grad padding");

    auto state = opt->state();
    if (c.momentum == 0) {
      EXPECT_TRUE(state.empty());
      continue;
    }
    ASSERT_EQ(state.size(), 1u);
    EXPECT_EQ(state[0].first, "momentum_buffer");
    ASSERT_EQ(state[0].second.size(), 2u);
    const at::Tensor& buf = state[0].second[0];
    expect_padding(buf, packed.padding_mask, 0.f, "momentum_buffer padding");
    std::vector<at::Tensor> want;
    for (const at::Tensor& p : packed.params) {
      want.push_back(static_cast<torch::optim::SGDParamState&>(
                         *ref.state().at(p.unsafeGetTensorImpl()))
                         .momentum_buffer());
    }
    check_params(buf, want, "momentum_buffer");
  }
}

// ---------------------------------------------------------------------------------------------
// Gradient clipping

TEST(ClipGradNorm, MatchesTorchClipGradNorm) {
  struct Case {
    const char* name;
    double max_norm_over_norm;  // max_norm as a multiple of the true norm; 0: max_norm = 0
  };
  for (const Case& c : {Case{"active", 0.3}, Case{"inactive", 3.0}, Case{"max_norm 0", 0.0}}) {
    SCOPED_TRACE(c.name);
    Packed packed = pack(5);
    set_grads(packed, 7, /*scale=*/2.5);
    auto comm = std::make_shared<CountingComm>();
    auto opt = mfsdp::make_adamw({empty_shard(), packed.shard}, comm, {});

    // The true norm in fp64, for choosing max_norm independently of both implementations.
    double sq = 0;
    for (const at::Tensor& p : packed.params) {
      sq += p.grad().to(at::kDouble).square().sum().item<double>();
    }
    const double max_norm = c.max_norm_over_norm * std::sqrt(sq);

    // Our max_norm <= 0 means "do not clip"; torch would zero every grad, so its reference for
    // that case is an infinite max_norm (which torch turns into a factor of exactly 1).
    const double ref_max_norm = max_norm > 0 ? max_norm : std::numeric_limits<double>::infinity();
    const double want = torch::nn::utils::clip_grad_norm_(packed.params, ref_max_norm);
    const double got = opt->clip_grad_norm(max_norm);
    EXPECT_NEAR(got, want, kRtol * want);
    EXPECT_NEAR(got, std::sqrt(sq), 1e-12 * std::sqrt(sq));  // fp64 accumulation
    EXPECT_EQ(comm->all_reduces, 1);
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : packed.params) grads.push_back(p.grad());
    check_params(packed.shard.main_grad, grads, "clipped grads");
    if (c.max_norm_over_norm != 0.3) {
      // Nothing clipped: torch multiplies by exactly 1, we do not touch the grads.
      for (size_t i = 0; i < kParams.size(); ++i) {
        EXPECT_TRUE(
            at::equal(packed.shard.main_grad.narrow(0, kParams[i].offset, kParams[i].numel()),
                      grads[i].flatten()));
      }
    }
    expect_padding(packed.shard.main_grad, packed.padding_mask, kPaddingGrad, "grad padding");
  }
}

TEST(ClipGradNorm, NonFiniteNormIsReturnedAndNothingIsScaled) {
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    Packed packed = pack(6);
    set_grads(packed, 0);
    packed.shard.main_grad[kParams[1].offset] = bad;
    const at::Tensor before = packed.shard.main_grad.clone();
    auto opt = mfsdp::make_sgd({packed.shard}, std::make_shared<CountingComm>(), {});
    const double norm = opt->clip_grad_norm(1e-3);
    EXPECT_FALSE(std::isfinite(norm)) << norm;
    if (std::isnan(bad)) {
      EXPECT_TRUE(std::isnan(norm));
    }
    EXPECT_TRUE(at::equal(packed.shard.main_grad.nan_to_num(0), before.nan_to_num(0)));
  }
}

TEST(ClipGradNorm, NaNMaxNormIsRejected) {
  Packed packed = pack(7);
  auto comm = std::make_shared<CountingComm>();
  auto opt = mfsdp::make_sgd({packed.shard}, comm, {});
  EXPECT_INVALID(opt->clip_grad_norm(std::nan("")), "max_norm", "NaN");
  EXPECT_EQ(comm->all_reduces, 0);  // rejected before the collective, the same way on every rank
}

// ---------------------------------------------------------------------------------------------
// Construction and argument checks

TEST(DistributedOptimizer, RejectsBadShards) {
  auto comm = std::make_shared<CountingComm>();
  auto make = [&](OptimizerShard shard) { mfsdp::make_adamw({empty_shard(), shard}, comm, {}); };
  auto shard = [](int64_t n, std::vector<ShardSegment> segments) {
    return OptimizerShard{at::zeros({n}), at::zeros({n}), std::move(segments), false};
  };

  OptimizerShard short_grad = shard(10, {{0, 10, true}});
  short_grad.main_grad = at::zeros({9});
  EXPECT_INVALID(make(short_grad), "OptimizerShard 1", "main_grad length 9",
                 "main_weight length 10");

  OptimizerShard double_grad = shard(10, {});
  double_grad.main_grad = at::zeros({10}, at::kDouble);
  EXPECT_INVALID(make(double_grad), "dtype", "Double", "Float");

  OptimizerShard two_d = shard(10, {});
  two_d.main_weight = at::zeros({2, 5});
  EXPECT_INVALID(make(two_d), "main_weight must be 1-D", "[2, 5]");

  OptimizerShard undefined = shard(10, {});
  undefined.main_grad = at::Tensor();
  EXPECT_INVALID(make(undefined), "main_grad is undefined");

  OptimizerShard integer = shard(10, {});
  integer.main_weight = at::zeros({10}, at::kLong);
  integer.main_grad = at::zeros({10}, at::kLong);
  EXPECT_INVALID(make(integer), "floating point", "Long");

  EXPECT_INVALID(make(shard(10, {{0, 4, true}, {8, 3, true}})), "segment 1", "offset 8", "length 3",
                 "out of range of 10");
  EXPECT_INVALID(make(shard(10, {{-1, 2, true}})), "segment 0", "offset -1");
  EXPECT_INVALID(make(shard(10, {{2, -2, true}})), "segment 0", "length -2");
  EXPECT_INVALID(make(shard(10, {{4, 3, true}, {0, 5, false}})), "overlaps", "offset 4",
                 "end at 5");
  EXPECT_INVALID(make(shard(10, {{0, 10, true}, {3, 0, true}, {5, 1, true}})), "overlaps");

  EXPECT_INVALID(mfsdp::make_sgd({shard(4, {{0, 4, true}})}, nullptr, {}), "communicator is null");

  // Touching and empty segments are fine.
  EXPECT_NO_THROW(make(shard(10, {{0, 3, true}, {3, 0, false}, {3, 7, false}})));
}

TEST(DistributedOptimizer, RejectsBadOptions) {
  auto comm = std::make_shared<CountingComm>();
  auto adamw = [&](auto edit) {
    mfsdp::AdamWOptions o;
    edit(o);
    mfsdp::make_adamw({}, comm, o);
  };
  EXPECT_INVALID(adamw([](auto& o) { o.beta1 = 1.0; }), "AdamWOptions.beta1", "[0, 1)");
  EXPECT_INVALID(adamw([](auto& o) { o.beta2 = -0.5; }), "AdamWOptions.beta2", "-0.5");
  EXPECT_INVALID(adamw([](auto& o) { o.eps = -1e-8; }), "AdamWOptions.eps");
  EXPECT_INVALID(adamw([](auto& o) { o.weight_decay = -0.1; }), "AdamWOptions.weight_decay");

  auto sgd = [&](auto edit) {
    mfsdp::SGDOptions o;
    edit(o);
    mfsdp::make_sgd({}, comm, o);
  };
  EXPECT_INVALID(sgd([](auto& o) { o.momentum = -0.9; }), "SGDOptions.momentum", "-0.9");
  EXPECT_INVALID(sgd([](auto& o) { o.weight_decay = -1; }), "SGDOptions.weight_decay");
  EXPECT_INVALID(sgd([](auto& o) { o.nesterov = true; }), "SGDOptions.nesterov", "momentum 0");
  EXPECT_INVALID(sgd([](auto& o) {
                   o.nesterov = true;
                   o.momentum = 0.9;
                   o.dampening = 0.1;
                 }),
                 "SGDOptions.nesterov", "dampening 0.1");

  auto opt = mfsdp::make_sgd({}, comm, {});
  EXPECT_INVALID(opt->step(-1e-3), "SGD.step", "lr", "-0.001");
  EXPECT_INVALID(opt->step(std::numeric_limits<double>::infinity()), "SGD.step", "inf");
  EXPECT_EQ(opt->steps(), 0);
}

// ---------------------------------------------------------------------------------------------
// Learning-rate schedule, against values worked out by hand.

mfsdp::LRSchedule schedule(const char* style, int64_t warmup, int64_t decay) {
  mfsdp::LRSchedule s;
  s.max_lr = 3e-4;
  s.min_lr = 3e-5;
  s.warmup_steps = warmup;
  s.decay_steps = decay;
  s.style = style;
  return s;
}

TEST(LRSchedule, WarmupThenDecayMatchesHandComputedValues) {
  constexpr double kTol = 1e-15;
  for (const char* style : {"constant", "linear", "cosine"}) {
    SCOPED_TRACE(style);
    const auto s = schedule(style, 10, 110);
    EXPECT_NEAR(s.lr_at(0), 0.0, kTol);
    EXPECT_NEAR(s.lr_at(1), 3e-5, kTol);
    EXPECT_NEAR(s.lr_at(5), 1.5e-4, kTol);
    EXPECT_NEAR(s.lr_at(10), 3e-4, kTol);  // the last warmup step reaches max_lr
  }
  const auto constant = schedule("constant", 10, 110);
  EXPECT_NEAR(constant.lr_at(11), 3e-4, kTol);
  EXPECT_NEAR(constant.lr_at(500), 3e-4, kTol);  // constant never drops to min_lr

  const auto linear = schedule("linear", 10, 110);
  // decay ratio (step - 10) / 100; lr = 3e-5 + (1 - ratio) * 2.7e-4
  EXPECT_NEAR(linear.lr_at(35), 3e-5 + 0.75 * 2.7e-4, kTol);  // 2.325e-4
  EXPECT_NEAR(linear.lr_at(60), 1.65e-4, kTol);
  EXPECT_NEAR(linear.lr_at(110), 3e-5, kTol);
  EXPECT_NEAR(linear.lr_at(111), 3e-5, kTol);
  EXPECT_NEAR(linear.lr_at(10000), 3e-5, kTol);

  const auto cosine = schedule("cosine", 10, 110);
  // coeff = (cos(pi * ratio) + 1) / 2: ratio 0.25 -> (sqrt(2)/2 + 1) / 2 = 0.85355339059327373
  EXPECT_NEAR(cosine.lr_at(35), 3e-5 + 0.85355339059327373 * 2.7e-4, kTol);  // 2.6045941546e-4
  EXPECT_NEAR(cosine.lr_at(60), 1.65e-4, kTol);                              // ratio 0.5
  EXPECT_NEAR(cosine.lr_at(85), 3e-5 + 0.14644660940672624 * 2.7e-4, kTol);  // ratio 0.75
  EXPECT_NEAR(cosine.lr_at(110), 3e-5, kTol);
  EXPECT_NEAR(cosine.lr_at(200), 3e-5, kTol);
}

TEST(LRSchedule, NoWarmupAndNoDecay) {
  constexpr double kTol = 1e-15;
  const auto linear = schedule("linear", 0, 100);
  EXPECT_NEAR(linear.lr_at(0), 3e-4, kTol);
  EXPECT_NEAR(linear.lr_at(1), 3e-5 + 0.99 * 2.7e-4, kTol);
  EXPECT_NEAR(linear.lr_at(50), 1.65e-4, kTol);
  // decay_steps 0: no decay at all, whatever the style.
  const auto no_decay = schedule("cosine", 4, 0);
  EXPECT_NEAR(no_decay.lr_at(2), 1.5e-4, kTol);
  EXPECT_NEAR(no_decay.lr_at(5), 3e-4, kTol);
  EXPECT_NEAR(no_decay.lr_at(100000), 3e-4, kTol);
  // Warmup as long as the decay: straight from max_lr to min_lr.
  const auto all_warmup = schedule("linear", 20, 20);
  EXPECT_NEAR(all_warmup.lr_at(20), 3e-4, kTol);
  EXPECT_NEAR(all_warmup.lr_at(21), 3e-5, kTol);
}

TEST(LRSchedule, RejectsBadSettings) {
  auto bad = [](auto edit) {
    auto s = schedule("linear", 10, 100);
    edit(s);
    return [s] { s.lr_at(1); };
  };
  EXPECT_INVALID(bad([](auto& s) { s.style = "exponential"; })(), "style", "'exponential'");
  EXPECT_INVALID(bad([](auto& s) { s.min_lr = 1e-3; })(), "min_lr", "0.001", "max_lr");
  EXPECT_INVALID(bad([](auto& s) { s.max_lr = -1; })(), "max_lr", "-1");
  EXPECT_INVALID(bad([](auto& s) { s.warmup_steps = 200; })(), "warmup_steps", "200",
                 "decay_steps (100)");
  EXPECT_INVALID(bad([](auto& s) { s.warmup_steps = -1; })(), "warmup_steps", "-1");
  EXPECT_INVALID(bad([](auto& s) { s.decay_steps = -5; })(), "decay_steps", "-5");
  EXPECT_INVALID(schedule("linear", 10, 100).lr_at(-1), "step", "-1");
  // Warmup longer than "no decay" is fine.
  EXPECT_NO_THROW(schedule("linear", 10, 0).lr_at(1));
}

}  // namespace
