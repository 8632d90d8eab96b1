// Reads PyTorch `torch.save` files (the zip format, torch >= 1.6) without running any code from
// them: a restricted unpickler that knows only the opcodes and globals torch.save writes for
// (nested) dicts of tensors. A malicious file can fail to load; it cannot execute anything.
// (LibTorch's torch::pickle_load cannot read state_dict()'s OrderedDict, which it maps to None,
// and, in older versions, one-entry dicts: the SETITEM opcode.)
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

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

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

// The one tensor of a torch.save archive that lies at bytes [offset, offset + length) of `path`
// (a PyTorch Distributed Checkpoint's .distcp file holds one archive per chunk). `what` starts
// every error message.
at::Tensor read_torch_save_tensor(const std::string& path, uint64_t offset, uint64_t length, const std::string& what);

// The data.pkl of the torch.save archive at bytes [offset, offset + length) of `path`, for a
// caller that unpickles a plain object from it (DCP stores non-tensor values that way).
std::string read_torch_save_pickle(const std::string& path, uint64_t offset, uint64_t length, const std::string& what);

// A torch.save archive whose data.pkl is `data_pkl` (an object without tensors).
std::string torch_save_pickle(const std::string& data_pkl);

enum class ObjectPolicy {
  kPlainOnly,        // None, bool, int, float, str, list, tuple, dict; any other object is an error
  kDescribeObjects,  // also objects, never constructed: one built from a dict state (an
                     // argparse.Namespace) becomes that dict, any other global or call its name
                     // in angle brackets ("<torch.bfloat16>")
};

// The value a torch.save archive (bytes [offset, offset + length) of `path`) holds, as JSON
// (tuples become arrays, int dict keys strings). Tensors are not read: they are described
// ("<tensor>") under kDescribeObjects and refused otherwise.
nlohmann::json read_torch_save_value(const std::string& path, uint64_t offset, uint64_t length,
                                     const std::string& what, ObjectPolicy policy = ObjectPolicy::kPlainOnly);

// torch.save(value) of a plain value (objects become dicts, arrays lists), in memory.
std::string torch_save_value(const nlohmann::json& value);
// torch.save(argparse.Namespace(**fields)) of plain fields (Megatron's "args").
std::string torch_save_namespace(const nlohmann::json& fields);

// torch.save(tensor) in memory: a contiguous CPU copy of `tensor` as the archive torch.load reads.
std::string torch_save_tensor(const at::Tensor& tensor);

// The same archive as the bytes around the tensor's, which stay where they are: head, then the
// `data.nbytes()` bytes at data.data_ptr(), then tail == torch_save_tensor(tensor). `data` is
// `tensor` on the CPU, contiguous (no copy when it already is). For writers that put the
// storage into a file straight from memory (dcp::FileWriter). `data_crc32`, when given, is taken
// as the zip CRC-32 of the storage instead of reading it: a writer that checksums the storage as
// it writes it asks first with a placeholder, then again with the CRC (head and tail keep their
// sizes).
struct TorchSaveParts {
  at::Tensor data;
  std::string head, tail;
};
TorchSaveParts torch_save_tensor_parts(const at::Tensor& tensor, std::optional<uint32_t> data_crc32 = std::nullopt);

// What read_torch_save_tensor reads, described without reading the storage: the tensor is
// as_strided(sizes, strides, storage_offset) of the `data_bytes` bytes of dtype at
// [data_at, data_at + data_bytes) of the archive's window (data_at counts from `offset`). The
// same checks as read_torch_save_tensor (errors the same), except that the storage's bytes are
// not read.
struct TorchSaveTensorLayout {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t storage_offset = 0;  // elements
  uint64_t data_at = 0, data_bytes = 0;
};
TorchSaveTensorLayout read_torch_save_tensor_layout(const std::string& path, uint64_t offset, uint64_t length,
                                                    const std::string& what);

}  // namespace mfsdp
