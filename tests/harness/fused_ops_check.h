// The model's fused ATen ops against the plain composition they replace, on any device: the CPU
// tier (tests/unit/fused_ops_test.cpp) and the GPU tier (tests/gpu/fused_ops_gpu_test.cpp) run the
// same checks, where CUDA dispatches to other kernels (the fused RMSNorm, flash attention).
//   - RMSNorm (at::rms_norm in LlamaRMSNorm) against transformers' LlamaRMSNorm written here in
//     plain tensor ops: fp32 values and gradients within 1e-6; in bf16 every value is the exact
//     result (fp64 from the same bf16 inputs) rounded once, where transformers' composition
//     rounds twice and misses that bound somewhere.
//   - Grouped-query attention (SDPA with enable_gqa on the unmasked causal path, and SDPA over
//     expanded heads under a mask) against the explicit math path (repeat_kv, matmul, fp32
//     softmax, matmul): in fp32 within 1e-5 of it, output and every gradient; in bf16 no further
//     from the fp64 math path than the bf16 math path is (twice its error, plus 1e-3 of scale).
// Header-only.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "mfsdp/models/llama.h"

namespace mfsdp::testing {

inline double max_abs_of(const at::Tensor& t) { return t.to(at::kDouble).abs().max().item<double>(); }

inline double max_error(const at::Tensor& got, const at::Tensor& want) {
  return max_abs_of(got.to(at::kDouble) - want.to(at::kDouble));
}

// transformers' LlamaRMSNorm.forward, op for op.
inline at::Tensor rms_norm_composition(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

inline void check_rms_norm(const at::Device& device) {
  constexpr int64_t kDim = 96;
  constexpr double kEps = 1e-5;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  const at::Tensor x0 = (3 * at::randn({4, 7, kDim}, gen)).to(device);
  const at::Tensor w0 = (1 + 0.3 * at::randn({kDim}, gen)).to(device);
  const at::Tensor upstream = at::randn({4, 7, kDim}, gen).to(device);
  mfsdp::LlamaRMSNorm norm(kDim, kEps, /*deferred=*/false);
  norm->to(device);

  // fp32: the same values and gradients as the composition.
  {
    {
      at::NoGradGuard no_grad;
      norm->weight.copy_(w0);
    }
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    norm->weight.mutable_grad().reset();
    at::Tensor got = norm(x);
    got.backward(upstream);
    const at::Tensor got_dx = x.grad().clone(), got_dw = norm->weight.grad().clone();
    x.mutable_grad().reset();
    at::Tensor want = rms_norm_composition(x, w, kEps);
    want.backward(upstream);
    EXPECT_LE(max_error(got, want), 1e-6 * max_abs_of(want)) << "fp32 RMSNorm on " << device;
    EXPECT_LE(max_error(got_dx, x.grad()), 1e-6 * max_abs_of(x.grad())) << "fp32 RMSNorm input gradient on " << device;
    EXPECT_LE(max_error(got_dw, w.grad()), 1e-6 * max_abs_of(w.grad())) << "fp32 RMSNorm weight gradient on " << device;
  }

  // bf16: rounded once from the exact result; gradients within bf16's precision of fp64's.
  {
    norm->to(at::kBFloat16);
    const at::Tensor xb = x0.to(at::kBFloat16), wb = w0.to(at::kBFloat16);
    {
      at::NoGradGuard no_grad;
      norm->weight.copy_(wb);
    }
    at::Tensor x = xb.clone().requires_grad_(true);
    norm->weight.mutable_grad().reset();
    at::Tensor got = norm(x);
    ASSERT_EQ(got.scalar_type(), at::kBFloat16);
    got.backward(upstream.to(at::kBFloat16));
    at::Tensor xd = xb.to(at::kDouble).requires_grad_(true), wd = wb.to(at::kDouble).requires_grad_(true);
    at::Tensor exact = wd * xd * at::rsqrt(xd.pow(2).mean(-1, true) + kEps);
    exact.backward(upstream.to(at::kBFloat16).to(at::kDouble));
    // Half a bf16 ulp is at most 2^-8 of the value; fp32 arithmetic before the rounding adds ~1e-6.
    const at::Tensor bound = exact.detach().abs() * std::ldexp(1.0, -8) + 1e-5;
    const at::Tensor fused_error = (got.to(at::kDouble) - exact.detach()).abs();
    EXPECT_TRUE((fused_error <= bound).all().item<bool>())
        << "bf16 RMSNorm on " << device << " is not rounded once: worst excess "
        << (fused_error - bound).max().item<double>();
    const at::Tensor twice_error = (rms_norm_composition(xb, wb, kEps).to(at::kDouble) - exact.detach()).abs();
    EXPECT_FALSE((twice_error <= bound).all().item<bool>())
        << "transformers' composition (two roundings) met the one-rounding bound: the check cannot tell them apart";
    EXPECT_LE(max_error(x.grad(), xd.grad()), 2e-2 * max_abs_of(xd.grad())) << "bf16 RMSNorm input gradient on " << device;
    EXPECT_LE(max_error(norm->weight.grad(), wd.grad()), 2e-2 * max_abs_of(wd.grad()))
        << "bf16 RMSNorm weight gradient on " << device;
  }
}

// One attention call's output and gradients (input, then q, k, v, o weights).
struct AttentionRun {
  at::Tensor out;
  std::vector<at::Tensor> grads;
};

inline AttentionRun run_attention(mfsdp::LlamaAttention& attn, const at::Tensor& x, const mfsdp::RotaryTables& rope,
                                  const at::Tensor& allowed, const at::Tensor& upstream) {
  for (auto& p : attn->parameters()) p.mutable_grad().reset();
  at::Tensor input = x.detach().clone().requires_grad_(true);
  AttentionRun r;
  r.out = attn->forward(input, rope, nullptr, allowed);
  r.out.backward(upstream.to(r.out.scalar_type()));
  r.grads = {input.grad()};
  for (const auto& p : {attn->q_proj->weight, attn->k_proj->weight, attn->v_proj->weight, attn->o_proj->weight})
    r.grads.push_back(p.grad());
  return r;
}

inline void check_grouped_query_attention(const at::Device& device) {
  for (int64_t kv_heads : {2, 1})
    for (bool masked : {false, true}) {
      mfsdp::LlamaConfig c;
      c.vocab_size = 16;
      c.hidden_size = 64;
      c.intermediate_size = 32;
      c.num_layers = 1;
      c.num_attention_heads = 4;  // head_dim 16
      c.num_key_value_heads = kv_heads;
      c.max_position_embeddings = 64;
      const std::string what = "kv heads " + std::to_string(kv_heads) + (masked ? ", padding mask" : ", causal") +
                               " on " + device.str();
      torch::manual_seed(23);
      mfsdp::LlamaAttention attn(c, 0, /*deferred=*/false);
      {
        at::NoGradGuard no_grad;
        for (auto& p : attn->parameters()) p.normal_(0, 0.2);
      }
      attn->to(device);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(29);
      constexpr int64_t kBatch = 2, kTokens = 11;
      const at::Tensor x = at::randn({kBatch, kTokens, c.hidden_size}, gen).to(device);
      const at::Tensor upstream = at::randn({kBatch, kTokens, c.hidden_size}, gen).to(device);
      const mfsdp::RotaryTables rope =
          mfsdp::rotary_tables(at::arange(kTokens, at::kLong).to(device), c.head_dim(), c.rope_theta);
      at::Tensor allowed;
      if (masked) {  // row 1 left-padded by 3
        mfsdp::SequenceLayout layout;
        at::Tensor mask = at::ones({kBatch, kTokens}, at::kLong);
        mask[1].narrow(0, 0, 3).zero_();
        layout.attention_mask = mask;
        allowed = layout.allowed_keys(kBatch, kTokens, device);
      }
      auto run = [&](bool sdpa, at::ScalarType dtype) {
        attn->to(dtype);
        attn->use_sdpa = sdpa;
        return run_attention(attn, x.to(dtype), rope, allowed, upstream);
      };
      const AttentionRun exact = run(false, at::kDouble);
      const AttentionRun math = run(false, at::kFloat), fused = run(true, at::kFloat);
      EXPECT_LE(max_error(fused.out, math.out), 1e-5 * max_abs_of(math.out)) << "fp32 output, " << what;
      for (size_t i = 0; i < math.grads.size(); ++i)
        EXPECT_LE(max_error(fused.grads[i], math.grads[i]), 1e-5 * max_abs_of(math.grads[i]))
            << "fp32 gradient " << i << ", " << what;
      const AttentionRun math16 = run(false, at::kBFloat16), fused16 = run(true, at::kBFloat16);
      auto bf16_bound = [](const at::Tensor& math_result, const at::Tensor& reference) {
        return 2 * max_error(math_result, reference) + 1e-3 * max_abs_of(reference);
      };
      EXPECT_LE(max_error(fused16.out, exact.out), bf16_bound(math16.out, exact.out)) << "bf16 output, " << what;
      for (size_t i = 0; i < exact.grads.size(); ++i)
        EXPECT_LE(max_error(fused16.grads[i], exact.grads[i]), bf16_bound(math16.grads[i], exact.grads[i]))
            << "bf16 gradient " << i << ", " << what;
    }
}

}  // namespace mfsdp::testing
