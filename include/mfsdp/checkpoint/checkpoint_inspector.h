// Megatron-LM's tools/checkpoint/checkpoint_inspector.py commands for PyTorch Distributed
// Checkpoints (fsdp_dtensor, torch_dist, anything dcp.save wrote), in one process and without
// Python: `mfsdp-ckpt inspect | print-tensor | compare-two-checkpoint | print-torch-dcp-in-json |
// modify-state-dict | convert-torch-dist-to-fsdp-dtensor` (docs/mfsdp_ckpt.md). Names, options
// and output follow checkpoint_inspector.py; where it has a bug we do what its help says (noted
// per function). Every path may be an iter_NNNNNNN folder or a save folder (its latest).
//
// Each function writes its report to `out` and throws std::invalid_argument (naming the file and
// entry) on bad input, before writing anything to disk.
#pragma once

#include <map>
#include <ostream>
#include <string>
#include <vector>

namespace mfsdp {

// Keys, dtypes and shapes of every entry; metadata.json and common.pt (torch_dist) when present.
// Megatron's optimizer.param_to_group_meta.* entries are counted, not listed, unless
// `show_param_to_group_meta`.
void inspect_dcp_checkpoint(const std::string& path, bool show_param_to_group_meta, std::ostream& out);

// One entry: key, shape and dtype, then its values (a bytes entry: its value as JSON).
void print_dcp_tensor(const std::string& path, const std::string& key, std::ostream& out);

// compare-two-checkpoint (and its alias compare): compare_tensors (include/mfsdp/checkpoint/ckpt_operations.h), for any checkpoint
// or Hugging Face folder.

// Every entry as JSON (tensors as nested lists, nested as the state dict was), printed and
// written to `path`/param_to_param_group_map.json with "module.module" read as "model.module",
// as Megatron's command does for a --dump-param-to-param-group-map folder. Returns the file.
std::string print_dcp_in_json(const std::string& path, std::ostream& out);

// Copies a checkpoint without the entries a "remove REGEX" op drops and with the first matching
// "rename PATTERN REPLACEMENT" op applied to each key (StateDictOps, state_dict_ops.h), with
// metadata.json and common.pt if present. (Megatron's version removes every key when only
// rename ops are given and writes empty tensors; this one copies the values.)
void modify_dcp_state_dict(const std::string& in, const std::string& out_dir, const std::vector<std::string>& ops,
                           std::ostream& out);

// What Megatron-LM's --dump-param-to-param-group-map writes: a DCP folder of {name: group id}
// (pickled ints), names as Megatron's DDP-wrapped model has them ("module.module.<fqn>"), which
// print-torch-dcp-in-json turns into the JSON convert-torch-dist-to-fsdp-dtensor takes.
void write_param_to_param_group_map(const std::string& dir, const std::map<std::string, int>& group_of_fqn);

struct TorchDistConversion {
  bool swiglu = false;                       // split every mlp.linear_fc1 into _w / _v
  std::vector<std::string> swiglu_modules;   // or only those under these modules
  std::string param_to_param_group_map_json; // from print-torch-dcp-in-json; "" for none
  std::string model_prefix = "model.module";
  std::string optimizer_prefix = "optimizer.state.module.module.module";
};

// Megatron torch_dist (stacked layers, TP chunks, optimizer.state.<state>.<key>, common.pt) to
// fsdp_dtensor (one tensor per layer under `model_prefix`, optimizer state under
// `optimizer_prefix`, SwiGLU fc1 split, param groups from common.pt by the map). Unlike
// Megatron's script, optimizer.state.fp32_param becomes the model weights (fsdp_dtensor's model
// tensors are the fp32 main weights) instead of a ".fp32_param" entry. Also writes
// "mfsdp_metadata" (a Llama model_config from Megatron's args, so mfsdp trains from it) and, when
// `out_dir` is named iter_NNNNNNN, its parent's latest_checkpointed_iteration.txt. Atomic.
void convert_torch_dist_to_fsdp_dtensor(const std::string& in, const std::string& out_dir,
                                        const TorchDistConversion& options, std::ostream& out);

}  // namespace mfsdp
