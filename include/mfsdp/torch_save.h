// Reads PyTorch `torch.save` files (the zip format, torch >= 1.6) without running any code from
// them: a restricted unpickler that knows only the opcodes and globals torch.save writes for
// (nested) dicts of tensors. A malicious file can fail to load; it cannot execute anything.
// (LibTorch's torch::pickle_load cannot read state_dict()'s OrderedDict nor one-entry dicts:
// research/libtorch_probe.md Q8.)
//
//   <archive>/data.pkl     the pickled object (protocol 2; FRAME/MEMOIZE/STACK_GLOBAL of newer
//                          protocols are understood too). Tensors are
//                          torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...),
//                          storages persistent ids ('storage', torch.FloatStorage, key, location,
//                          numel)
//   <archive>/data/<key>   each storage's bytes, stored uncompressed
//   <archive>/byteorder    "little" (absent before torch 2.0, which means little)
//
// <archive> is the file stem or "archive"; any one top-level folder holding data.pkl is accepted.
//
//   auto tensors = mfsdp::read_torch_save("model.pt");   // {"proj.weight": ..., ...}
//   mfsdp::write_safetensors("model.safetensors", {tensors.begin(), tensors.end()});
//
// Errors are std::invalid_argument whose message names the file and what is wrong: not a zip
// (with a hint for the legacy pre-1.6 format), a truncated or malformed archive, a compressed
// entry, a global outside the allowlist (named), an unknown opcode, a big-endian file, a storage
// too short for a tensor (named).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace mfsdp {

// The tensors of a torch.save file, as CPU tensors whatever the saved device. The top-level
// object must be a dict or OrderedDict (a state_dict, or a checkpoint dict); nested dicts are
// flattened by joining keys with '.' ({"model": {"w": t}} -> "model.w"; int keys become decimal
// strings, as in an optimizer's "state.0.exp_avg"). Everything else (numbers, strings, None, and
// lists/tuples with whatever they hold) is skipped. Tensors keep torch.load's sharing: views of
// one storage come back as views (strides and offsets as saved) of one CPU buffer, and a tensor
// object saved under two names comes back under both. Allowed globals: collections.OrderedDict,
// torch._utils._rebuild_tensor_v2 and _rebuild_parameter, and torch.{Float,Double,Half,BFloat16,
// Long,Int,Short,Char,Byte,Bool}Storage; any other is an error naming it.
std::map<std::string, at::Tensor> read_torch_save(const std::string& path);

}  // namespace mfsdp
