// mfsdp-ckpt: inspect, compare and convert fsdp_dtensor checkpoints and Hugging Face folders, the
// counterpart of Megatron-LM's tools/checkpoint/checkpoint_inspector.py. See docs/mfsdp_ckpt.md.
//
//   mfsdp-ckpt inspect CKPT [--chunks]
//   mfsdp-ckpt print-tensor CKPT NAME [--max-elements N]
//   mfsdp-ckpt compare A B [--atol X] [--model-only] [--device cpu|cuda|auto]
//   mfsdp-ckpt convert IN OUT [--swiglu] [--rename OLD=NEW]... [--remove REGEX]... [--iteration N]
//   mfsdp-ckpt export-hf CKPT OUT [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]   (default: CKPT's dtype)
//   mfsdp-ckpt import-hf HF_DIR OUT_CKPT
//
// Exit status: 0 success (compare: no differences), 1 failure or differences, 2 bad usage.
#include <CLI/CLI.hpp>

#include <cstring>
#include <iostream>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "mfsdp/checkpoint.h"
#include "mfsdp/ckpt_operations.h"
#include "mfsdp/comm.h"
#include "mfsdp/hf_interop.h"
#include "mfsdp/tensor_source.h"

namespace {

constexpr const char* kSubcommands = "inspect, print-tensor, compare, convert, export-hf, import-hf";

std::string check_rename(const std::string& s) {
  const size_t eq = s.find('=');
  if (eq == std::string::npos || eq == 0) return "expected OLD=NEW with a non-empty OLD, got '" + s + "'";
  return "";
}

std::string check_regex(const std::string& s) {
  try {
    std::regex re(s, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return "'" + s + "' is not a valid regular expression (" + e.what() + ")";
  }
  return "";
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
  std::string a, b, name, dtype, max_shard = "5GB", device = "cpu";
  bool chunks = false, model_only = false;
  int64_t max_elements = 64, iteration = 0;
  double atol = 0;
  std::vector<std::string> renames;
  mfsdp::StateTransform transform;

  auto* inspect = app.add_subcommand("inspect", "Print a checkpoint's metadata and tensor list as JSON");
  inspect->add_option("CKPT", a, "Checkpoint save folder (latest iteration) or iter_NNNNNNN folder")->required();
  inspect->add_flag("--chunks", chunks, "List every tensor's chunks (file, key, offset, numel, bytes)");

  auto* print = app.add_subcommand("print-tensor", "Print one tensor: dtype, shape, min/max/mean, values");
  print->add_option("CKPT", a, "Checkpoint (or Hugging Face folder)")->required();
  print->add_option("NAME", name, "Tensor name, e.g. model.model.norm.weight (the leading 'model.' may be left out)")
      ->required();
  print->add_option("--max-elements", max_elements, "Print at most N values (default 64)")
      ->check(CLI::NonNegativeNumber);

  auto* compare = app.add_subcommand("compare", "Compare every tensor of A and B (exit 1 on any difference)");
  compare->add_option("A", a, "Checkpoint or Hugging Face folder (HF names compare as model.<name>)")->required();
  compare->add_option("B", b, "Checkpoint or Hugging Face folder")->required();
  compare->add_option("--atol", atol, "Largest |a-b| still counted as equal (default 0: bit exact values)")
      ->check(CLI::NonNegativeNumber);
  compare->add_flag("--model-only", model_only, "Compare only model.* tensors (no optimizer state, no RNG)");
  compare->add_option("--device", device, "Where the differences are computed: cpu (default), cuda or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));

  auto* convert = app.add_subcommand(
      "convert", "Turn an HF folder, a torch.save file or a checkpoint into a weights-only checkpoint");
  convert->add_option("IN", a, "HF folder, torch.save file (.pt/.bin) or checkpoint")->required();
  convert->add_option("OUT", b, "Checkpoint save folder to write")->required();
  convert->add_flag("--swiglu", transform.swiglu,
                    "Split every fused ...fc1.weight / ...linear_fc1.weight into gate_proj (first half) and up_proj (second)");
  convert->add_option("--rename", renames, "OLD=NEW: replace OLD by NEW in every name (repeatable, in order)")
      ->allow_extra_args(false)
      ->check(check_rename);
  convert->add_option("--remove", transform.remove, "Drop tensors whose name fully matches REGEX (repeatable)")
      ->allow_extra_args(false)
      ->check(check_regex);
  convert->add_option("--iteration", iteration, "Iteration of the written checkpoint (default 0)")
      ->check(CLI::NonNegativeNumber);

  auto* export_hf = app.add_subcommand("export-hf", "Write a Hugging Face LlamaForCausalLM folder from a checkpoint");
  export_hf->add_option("CKPT", a, "Checkpoint save folder or iter_NNNNNNN folder")->required();
  export_hf->add_option("OUT", b, "Folder to write config.json and *.safetensors into")->required();
  export_hf->add_option("--dtype", dtype,
                        "Weight dtype: bf16, fp16 or fp32 (default: the checkpoint's, its embedding's dtype)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32", "bfloat16", "float16", "float32"}));
  export_hf->add_option("--max-shard-size", max_shard, "Largest safetensors file, e.g. 500MB, 2GB or bytes (default 5GB)")
      ->check(check_size);

  auto* import_hf = app.add_subcommand("import-hf", "Write a weights-only checkpoint from a Hugging Face Llama folder");
  import_hf->add_option("HF_DIR", a, "Folder with config.json and model.safetensors (or an index and shards)")
      ->required();
  import_hf->add_option("OUT_CKPT", b, "Checkpoint save folder to write")->required();

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
      std::cout << mfsdp::inspect_checkpoint(mfsdp::CheckpointReader(a), chunks).dump(2) << "\n";
    } else if (print->parsed()) {
      std::cout << mfsdp::describe_tensor(mfsdp::TensorSource(a), name, max_elements);
    } else if (compare->parsed()) {
      const mfsdp::TensorSource sa(a), sb(b);
      std::cout << "A: " << sa.description() << "\nB: " << sb.description() << "\n";
      if (!sa.is_checkpoint() || !sb.is_checkpoint())
        std::cout << "(Hugging Face tensor names are compared as model.<name>)\n";
      const mfsdp::ComparisonReport report =
          mfsdp::compare_tensors(sa, sb, atol, model_only, mfsdp::resolve_device(device, /*local_rank=*/0));
      std::cout << report.table();
      return report.same ? 0 : 1;
    } else if (convert->parsed()) {
      for (const std::string& r : renames) {
        const size_t eq = r.find('=');
        transform.rename.emplace_back(r.substr(0, eq), r.substr(eq + 1));
      }
      const auto names = mfsdp::convert_to_checkpoint(a, b, transform, iteration);
      std::cout << "wrote " << names.size() << " tensors to " << mfsdp::checkpoint_iteration_dir(b, iteration)
                << " (stored as model.<name>):\n";
      for (const std::string& n : names) std::cout << "  model." << n << "\n";
    } else if (export_hf->parsed()) {
      const at::ScalarType written = mfsdp::export_hf(a, b, dtype_of(dtype), mfsdp::parse_byte_size(max_shard));
      std::cout << "wrote Hugging Face folder " << b << " (config.json, " << dtype_name(written) << " safetensors) from "
                << mfsdp::CheckpointReader(a).dir() << "\n";
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
