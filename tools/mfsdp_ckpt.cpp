// mfsdp-ckpt: inspect, compare and convert fsdp_dtensor checkpoints and Hugging Face folders, the
// counterpart of Megatron-LM's tools/checkpoint/checkpoint_inspector.py. See docs/mfsdp_ckpt.md.
//
//   mfsdp-ckpt inspect CKPT [--not-ignore-param-to-group-meta] [--json [--chunks]]
//   mfsdp-ckpt print-tensor CKPT NAME [--max-elements N]
//   mfsdp-ckpt compare-two-checkpoint A B [--atol X] [--rtol R] [--model-only] [--device cpu|cuda|auto]
//       (alias: compare)
//   mfsdp-ckpt convert IN OUT [--swiglu] [--op "remove REGEX" | --op "rename PATTERN REPLACEMENT"]...
//       [--remove REGEX]... [--rename PATTERN=REPLACEMENT]... [--iteration N]
//   mfsdp-ckpt export-hf CKPT OUT [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]   (default: CKPT's dtype)
//       [--model-config config.json]   (a checkpoint that records no model: PyTorch's dcp.save)
//   mfsdp-ckpt import-hf HF_DIR OUT_CKPT
//   mfsdp-ckpt verify CKPT
// and the rest of checkpoint_inspector.py's commands, for any PyTorch Distributed Checkpoint:
//   mfsdp-ckpt print-torch-dcp-in-json TORCH_DCP_DIR
//   mfsdp-ckpt modify-state-dict IN OUT --op "remove REGEX" --op "rename PATTERN REPLACEMENT" ...
//   mfsdp-ckpt convert-torch-dist-to-fsdp-dtensor IN OUT [--swiglu | --swiglu-modules M,N]
//       [--param-to-param-group-map-json FILE] [--output-model-weight-prefix P]
//       [--output-optimizer-state-prefix P]
//
// Exit status: 0 success (compare: no differences), 1 failure or differences, 2 bad usage.
#include <CLI/CLI.hpp>

#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/checkpoint_inspector.h"
#include "mfsdp/checkpoint/ckpt_operations.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/checkpoint/hf_interop.h"
#include "mfsdp/checkpoint/tensor_source.h"
#include "mfsdp/comm/comm.h"

namespace {

constexpr const char* kSubcommands =
    "inspect, print-tensor, compare-two-checkpoint (compare), convert, export-hf, import-hf, verify, "
    "print-torch-dcp-in-json, "
    "modify-state-dict, convert-torch-dist-to-fsdp-dtensor";

// True when `path` names a PyTorch DCP checkpoint that has the entry `key` (checkpoint_inspector
// keys), so print-tensor shows it as Megatron's tool does.
bool is_dcp_entry(const std::string& path, const std::string& key) {
  try {
    const mfsdp::dcp::Reader r(mfsdp::resolve_checkpoint_dir(path));
    return r.contains_tensor(key) || r.metadata().bytes.count(key);
  } catch (const std::exception&) {
    return false;
  }
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string part = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!part.empty()) out.push_back(part);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// CLI11 checks that build the op on a scratch StateDictOps, so a malformed op or a bad regex is a
// usage error (exit 2) with the engine's own message.
template <class Add>
std::string op_error(Add add) {
  try {
    mfsdp::StateDictOps scratch;
    add(scratch);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
std::string check_op(const std::string& s) {
  return op_error([&](mfsdp::StateDictOps& ops) { ops.add(s, "--op"); });
}
std::string check_remove(const std::string& s) {
  return op_error([&](mfsdp::StateDictOps& ops) { ops.add_remove(s, "--remove '" + s + "'"); });
}
std::string check_rename(const std::string& s) {
  const size_t eq = s.find('=');
  if (eq == std::string::npos || eq == 0) return "expected PATTERN=REPLACEMENT with a non-empty PATTERN, got '" + s + "'";
  return op_error([&](mfsdp::StateDictOps& ops) { ops.add_rename(s.substr(0, eq), s.substr(eq + 1), "--rename '" + s + "'"); });
}

std::string check_size(const std::string& s) {
  try {
    mfsdp::parse_byte_size(s);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// --dtype's value; unset: the checkpoint's dtype (export_hf decides).
std::optional<at::ScalarType> dtype_of(const std::string& s) {
  if (s.empty()) return std::nullopt;
  if (s == "fp32" || s == "float32") return at::kFloat;
  if (s == "fp16" || s == "float16") return at::kHalf;
  return at::kBFloat16;
}

const char* dtype_name(at::ScalarType t) {
  return t == at::kFloat ? "fp32" : t == at::kHalf ? "fp16" : "bf16";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Inspect, compare and convert mfsdp checkpoints (fsdp_dtensor) and Hugging Face folders",
               "mfsdp-ckpt"};
  app.require_subcommand(1, 1);
  std::string a, b, name, dtype, max_shard = "5GB", device = "cpu", model_config;
  bool chunks = false, json = false, show_group_meta = false;
  std::vector<std::string> ops;
  std::string swiglu_modules;
  mfsdp::TorchDistConversion conversion;
  int64_t max_elements = 64, iteration = 0;
  mfsdp::CompareOptions compare_options;
  mfsdp::StateTransform transform;

  auto* inspect = app.add_subcommand(
      "inspect", "Print a checkpoint's entries as checkpoint_inspector.py does (--json: mfsdp's JSON report)");
  inspect->add_option("CKPT", a, "Checkpoint save folder (latest iteration) or iter_NNNNNNN folder")->required();
  inspect->add_flag("--not-ignore-param-to-group-meta", show_group_meta,
                    "Also list Megatron's optimizer.param_to_group_meta.* entries");
  inspect->add_flag("--json", json, "Print metadata and tensors (canonical names) as JSON; an mfsdp-format checkpoint "
                                    "always prints this");
  inspect->add_flag("--chunks", chunks, "With --json: list every tensor's chunks");

  auto* print = app.add_subcommand("print-tensor", "Print one tensor: dtype, shape, min/max/mean, values");
  print->add_option("CKPT", a, "Checkpoint (or Hugging Face folder)")->required();
  print->add_option("NAME", name, "Tensor name, e.g. model.model.norm.weight (the leading 'model.' may be left out)")
      ->required();
  print->add_option("--max-elements", max_elements, "Print at most N values (default 64)")
      ->check(CLI::NonNegativeNumber);

  // Megatron's name; `compare`, mfsdp's earlier one, is an alias.
  auto* compare = app.add_subcommand(
      "compare-two-checkpoint",
      "Compare every tensor of A and B, and a DCP checkpoint's other entries by key (exit 1 on any difference)");
  compare->alias("compare");
  compare->add_option("A", a, "Checkpoint (any DCP folder too) or Hugging Face folder (HF names compare as model.<name>)")
      ->required();
  compare->add_option("B", b, "Checkpoint or Hugging Face folder")->required();
  compare->add_option("--atol", compare_options.atol, "allclose's absolute tolerance (default 1e-8, Megatron's)")
      ->check(CLI::NonNegativeNumber);
  compare->add_option("--rtol", compare_options.rtol,
                      "allclose's relative tolerance (default 1e-5, Megatron's; --atol 0 --rtol 0: bit-exact values)")
      ->check(CLI::NonNegativeNumber);
  compare->add_flag("--model-only", compare_options.model_only,
                    "Compare only model.* tensors (no optimizer state, no RNG, no other entries)");
  compare->add_option("--device", device, "Where the differences are computed: cpu (default), cuda or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));

  auto* convert = app.add_subcommand(
      "convert", "Turn an HF folder, a torch.save file or a checkpoint into a weights-only checkpoint");
  convert->add_option("IN", a, "HF folder, torch.save file (.pt/.bin) or checkpoint")->required();
  convert->add_option("OUT", b, "Checkpoint save folder to write")->required();
  convert->add_flag("--swiglu", transform.swiglu,
                    "Split every fused ...fc1.weight / ...linear_fc1.weight into gate_proj (first half) and up_proj (second)");
  // One op vocabulary with modify-state-dict (Megatron's); --remove and --rename are shorthands
  // for one op each, applied in command-line order with the --op ones (the first matching rename
  // wins). Each is checked as it is parsed, so a bad regex is a usage error naming the option.
  auto add_op = [&](const std::string& flag) {
    return [&, flag](const std::string& v) {
      if (flag == "--op") transform.ops.add(v, flag);
      else if (flag == "--remove") transform.ops.add_remove(v, flag + " '" + v + "'");
      else transform.ops.add_rename(v.substr(0, v.find('=')), v.substr(v.find('=') + 1), flag + " '" + v + "'");
    };
  };
  convert->add_option("--op")
      ->description("\"remove REGEX\" or \"rename PATTERN REPLACEMENT\", as modify-state-dict (repeatable)")
      ->allow_extra_args(false)
      ->check(check_op)
      ->trigger_on_parse()
      ->each(add_op("--op"));
  convert->add_option("--remove")
      ->description("REGEX: the same as --op \"remove REGEX\" (repeatable)")
      ->allow_extra_args(false)
      ->check(check_remove)
      ->trigger_on_parse()
      ->each(add_op("--remove"));
  convert->add_option("--rename")
      ->description("PATTERN=REPLACEMENT: the same as --op \"rename PATTERN REPLACEMENT\" (repeatable)")
      ->allow_extra_args(false)
      ->check(check_rename)
      ->trigger_on_parse()
      ->each(add_op("--rename"));
  // An iteration folder is iter_%07d; CLI11 saturates a number too large for int64 (1e20 would
  // write iter_9223372036854775807), so the range bounds it.
  convert->add_option("--iteration", iteration, "Iteration of the written checkpoint, 0 .. 999999999 (default 0)")
      ->check(CLI::Range(int64_t{0}, int64_t{999999999}));

  auto* export_hf = app.add_subcommand("export-hf", "Write a Hugging Face LlamaForCausalLM folder from a checkpoint");
  export_hf->add_option("CKPT", a, "Checkpoint save folder or iter_NNNNNNN folder")->required();
  export_hf->add_option("OUT", b, "Folder to write config.json and *.safetensors into")->required();
  export_hf->add_option("--dtype", dtype,
                        "Weight dtype: bf16, fp16 or fp32 (default: the checkpoint's, its embedding's dtype)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32", "bfloat16", "float16", "float32"}));
  export_hf->add_option("--max-shard-size", max_shard, "Largest safetensors file, e.g. 500MB, 2GB or bytes (default 5GB)")
      ->check(check_size);
  export_hf->add_option("--model-config", model_config,
                        "The model as a Hugging Face config.json, for a checkpoint that records none (PyTorch's "
                        "dcp.save)")
      ->check(CLI::ExistingFile);

  auto* to_json = app.add_subcommand(
      "print-torch-dcp-in-json",
      "Print a DCP folder as JSON and write it to <dir>/param_to_param_group_map.json ('module.module' read as "
      "'model.module')");
  to_json->add_option("TORCH_DCP_DIR", a, "DCP folder, e.g. what --dump-param-to-param-group-map wrote")->required();

  auto* modify = app.add_subcommand("modify-state-dict", "Copy a DCP checkpoint, removing and renaming entries");
  modify->add_option("INPUT_DIR", a, "DCP checkpoint")->required();
  modify->add_option("OUTPUT_DIR", b, "Folder to write (must not exist)")->required();
  modify->add_option("--op", ops, "\"remove REGEX\" or \"rename PATTERN REPLACEMENT\" (repeatable)")
      ->required()
      ->allow_extra_args(false)
      ->check(check_op);

  auto* torch_dist = app.add_subcommand("convert-torch-dist-to-fsdp-dtensor",
                                        "Convert a Megatron-LM torch_dist checkpoint to fsdp_dtensor (docs/checkpoints.md)");
  torch_dist->add_option("INPUT_DIR", a, "torch_dist iter_NNNNNNN folder (or its save folder)")->required();
  torch_dist->add_option("OUTPUT_DIR", b, "Folder to write; named iter_NNNNNNN, its parent gets "
                                          "latest_checkpointed_iteration.txt")->required();
  torch_dist->add_flag("--swiglu", conversion.swiglu, "Split every mlp.linear_fc1 into weight_w (gate) and weight_v (up)");
  torch_dist->add_option("--swiglu-modules", swiglu_modules, "Comma-separated modules to split fc1 in (overrides --swiglu)");
  torch_dist->add_option("--param-to-param-group-map-json", conversion.param_to_param_group_map_json,
                         "JSON from print-torch-dcp-in-json: each parameter's optimizer group");
  torch_dist->add_option("--output-model-weight-prefix", conversion.model_prefix, "Default model.module");
  torch_dist->add_option("--output-optimizer-state-prefix", conversion.optimizer_prefix,
                         "Default optimizer.state.module.module.module");

  auto* import_hf = app.add_subcommand("import-hf", "Write a weights-only checkpoint from a Hugging Face Llama folder");
  import_hf->add_option("HF_DIR", a, "Folder with config.json and model.safetensors (or an index and shards)")
      ->required();
  import_hf->add_option("OUT_CKPT", b, "Checkpoint save folder to write")->required();

  auto* verify = app.add_subcommand("verify", "Check every stored byte against the checksums the save recorded");
  verify->add_option("CKPT", a, "Checkpoint save folder (latest iteration) or iter_NNNNNNN folder")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string what = e.what();
    if (app.get_subcommands().empty() && argc > 1 && argv[1][0] != '-')
      what = std::string("unknown subcommand '") + argv[1] + "'";
    if (app.get_subcommands().empty()) what += " (subcommands: " + std::string(kSubcommands) + ")";
    std::cerr << "mfsdp-ckpt: " << what << "\nRun 'mfsdp-ckpt --help' or 'mfsdp-ckpt SUBCOMMAND --help'.\n";
    return 2;
  }

  try {
    if (inspect->parsed()) {
      const mfsdp::CheckpointReader reader(a);
      if (json || chunks || reader.format() != mfsdp::CheckpointFormat::kFsdpDtensor)
        std::cout << mfsdp::inspect_checkpoint(reader, chunks).dump(2) << "\n";
      else
        mfsdp::inspect_dcp_checkpoint(a, show_group_meta, std::cout);
    } else if (print->parsed()) {
      if (is_dcp_entry(a, name)) mfsdp::print_dcp_tensor(a, name, std::cout);
      else std::cout << mfsdp::describe_tensor(mfsdp::TensorSource(a), name, max_elements);
    } else if (to_json->parsed()) {
      mfsdp::print_dcp_in_json(a, std::cout);
    } else if (modify->parsed()) {
      mfsdp::modify_dcp_state_dict(a, b, ops, std::cout);
    } else if (torch_dist->parsed()) {
      if (!swiglu_modules.empty()) conversion.swiglu_modules = split_commas(swiglu_modules);
      mfsdp::convert_torch_dist_to_fsdp_dtensor(a, b, conversion, std::cout);
    } else if (compare->parsed()) {
      const mfsdp::TensorSource sa(a), sb(b);
      std::cout << "Comparing checkpoints...\nA: " << sa.description() << "\nB: " << sb.description() << "\n";
      if (!sa.is_checkpoint() || !sb.is_checkpoint())
        std::cout << "(Hugging Face tensor names are compared as model.<name>)\n";
      compare_options.device = mfsdp::resolve_device(device, /*local_rank=*/0);
      const mfsdp::ComparisonReport report = mfsdp::compare_tensors(sa, sb, compare_options);
      std::cout << report.table() << "Comparison between " << a << " and " << b << " completed.\n";
      return report.same ? 0 : 1;
    } else if (convert->parsed()) {
      const auto names = mfsdp::convert_to_checkpoint(a, b, transform, iteration);
      std::cout << "wrote " << names.size() << " tensors to " << mfsdp::checkpoint_iteration_dir(b, iteration)
                << " (stored as model.<name>):\n";
      for (const std::string& n : names) std::cout << "  model." << n << "\n";
    } else if (export_hf->parsed()) {
      const at::ScalarType written = mfsdp::export_hf(a, b, dtype_of(dtype), mfsdp::parse_byte_size(max_shard), model_config);
      std::cout << "wrote Hugging Face folder " << b << " (config.json, " << dtype_name(written) << " safetensors) from "
                << mfsdp::CheckpointReader(a).dir() << "\n";
    } else if (verify->parsed()) {
      const mfsdp::CheckpointReader reader(a);
      const auto [entries, bytes] = reader.verify_checksums();
      std::cout << reader.dir() << ": " << entries << " entries, " << bytes << " bytes match their CRC-32C\n";
    } else if (import_hf->parsed()) {
      mfsdp::import_hf(a, b);
      std::cout << "wrote checkpoint " << mfsdp::checkpoint_iteration_dir(b, 0)
                << " (model weights only; train from it with mfsdp-pretrain --load " << b << " --finetune)\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "mfsdp-ckpt: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
