#include "models/param_init.h"

#include "mfsdp/base/splitmix64.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/TensorImpl.h>

#include <mutex>

namespace mfsdp::detail {

at::Tensor new_parameter_tensor(at::IntArrayRef sizes, bool deferred) {
  auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  if (!deferred) return at::empty(sizes, options);
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

bool is_deferred(const at::Tensor& t) {
  return t.numel() > 0 &&
         t.storage().nbytes() < static_cast<size_t>((t.storage_offset() + t.numel()) * t.element_size());
}

void materialize(const at::Tensor& t) {
  if (!is_deferred(t)) return;
  at::NoGradGuard no_grad;
  at::Tensor handle = at::empty({0}, t.options());
  handle.set_(t.storage(), 0, {0}, {1});
  handle.resize_({t.storage_offset() + t.numel()});  // grows the shared StorageImpl
}

void resize_deferred(const at::Tensor& t, at::IntArrayRef sizes) {
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
}

uint64_t draw_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

namespace {
uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}
}  // namespace

uint64_t parameter_seed(uint64_t seed, const std::string& name) {
  // CPUGeneratorImpl's mt19937 uses the low 32 bits of its seed: mix everything into them.
  uint64_t h = splitmix64(seed ^ splitmix64(fnv1a64(name)));
  return (h ^ (h >> 32)) & 0xFFFFFFFFull;
}

void fill_normal(const at::Tensor& out, double std, uint64_t seed) {
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const bool direct = out.device().is_cpu() && out.scalar_type() == at::kFloat &&
                      out.is_contiguous();
  if (direct) {
    out.normal_(0.0, std, gen);
  } else {
    at::Tensor values = at::empty(out.sizes(), at::TensorOptions().dtype(at::kFloat));
    values.normal_(0.0, std, gen);
    out.copy_(values);
  }
}

}  // namespace mfsdp::detail
