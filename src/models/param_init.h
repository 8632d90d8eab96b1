// Parameters that can be created without storage and initialised independently of order.
//
// A deferred parameter is a real CPU tensor with its full sizes and a 0-byte storage
// (meta tensors cannot become CPU tensors in place: set_data from a meta tensor to a CPU one fails
// with "incompatible tensor type", since LibTorch counts Meta as no dense backend).
// materialize() grows that same storage, so the parameter keeps its TensorImpl and autograd
// identity. Each parameter's initial values come from a generator seeded by (seed, name), so they
// do not depend on which parameters were initialised before.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace mfsdp::detail {

// Full-size fp32 CPU tensor: allocated (uninitialised) or, when deferred, with a 0-byte storage.
at::Tensor new_parameter_tensor(at::IntArrayRef sizes, bool deferred);
// True when t's storage is smaller than its sizes need (not materialised yet).
bool is_deferred(const at::Tensor& t);
// Grows a deferred tensor's storage in place to its full size (values uninitialised).
void materialize(const at::Tensor& t);
// Gives a deferred tensor other sizes in place (still deferred, same TensorImpl): a
// tensor-parallel slice of a parameter built whole.
void resize_deferred(const at::Tensor& t, at::IntArrayRef sizes);

// The default CPU generator's next 64-bit draw (so torch::manual_seed decides it).
uint64_t draw_seed();
// Seed of the generator for parameter `name` under init seed `seed`.
uint64_t parameter_seed(uint64_t seed, const std::string& name);
// Fills `out` with normal(0, std) drawn from a fresh generator seeded by `seed`: the values are
// generated as a contiguous fp32 CPU tensor and copied, so they are the same for any dtype,
// device or layout of `out`.
void fill_normal(const at::Tensor& out, double std, uint64_t seed);

}  // namespace mfsdp::detail
