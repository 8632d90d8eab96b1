// Freeing and re-growing a flat buffer's storage in place, so that parameters viewing it keep
// their TensorImpl and autograd keeps seeing the same storage: never point a parameter at a new
// storage between forward and backward (views autograd saved, such as addmm's weight.t(), keep
// the old one and the gradients come out wrong); resize the old one.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

namespace mfsdp {

// Releases the memory of `flat`'s storage; views of it keep their sizes and must not be read.
void free_storage(const at::Tensor& flat);
// Gives `flat`'s freed storage the memory `memory` (contents undefined; at least
// storage_bytes_needed(flat) bytes).
void regrow_storage(const at::Tensor& flat, c10::DataPtr memory);
size_t storage_bytes_needed(const at::Tensor& flat);
// A fresh 1-D tensor of `numel` elements living in `memory` (its storage owns the DataPtr).
at::Tensor tensor_in(c10::DataPtr memory, int64_t numel, const at::TensorOptions& options);
// True while `flat` has memory behind it.
bool has_storage(const at::Tensor& flat);

}  // namespace mfsdp
