// The LibTorch API differences between the versions mfsdp supports (2.11 up to the pinned one in
// scripts/requirements.txt), in one place, so the rest of the code is written once.
#pragma once

#include <torch/csrc/autograd/variable.h>

#include <utility>

namespace mfsdp::compat {

// An owning reference to an autograd node (e.g. a parameter's grad accumulator): a
// std::shared_ptr<Node> up to 2.11, a c10::intrusive_ptr<Node> in later releases.
using NodeRef =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

}  // namespace mfsdp::compat
