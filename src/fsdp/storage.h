// Freeing and re-growing a flat buffer's storage in place, so that parameters viewing it keep
// their TensorImpl and autograd keeps seeing the same storage (research/libtorch_probe.md Q4):
// never point a parameter at a new storage between forward and backward; resize the old one.
#pragma once

#include <ATen/core/Tensor.h>

namespace mfsdp {

// Releases the memory of `flat`'s storage; views of it keep their sizes and must not be read.
void free_storage(const at::Tensor& flat);
// Allocates `flat`'s storage again (contents undefined) if it was freed; returns true if it did.
bool regrow_storage(const at::Tensor& flat);
// True while `flat` has memory behind it.
bool has_storage(const at::Tensor& flat);

}  // namespace mfsdp
