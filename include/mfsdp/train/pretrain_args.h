// The command line of the trainers (mfsdp-pretrain, -sft, -grpo): Megatron-LM's flag names
// (Megatron-LM's megatron/training/arguments.py), parsed and validated before any work, into the
// sections of include/mfsdp/train/config/sections.h. Every flag is declared once, by its section
// (flags() in src/train/config/sections.cpp), with its default and help text; --help and
// docs/pretrain.md list them from there, section by section.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "mfsdp/train/config/sections.h"

namespace mfsdp {

// Every section of include/mfsdp/train/config/sections.h: a field reads as `args.lr` whichever section
// holds it.
struct PretrainArgs : ModelSection,
                      MoeSection,
                      TokenizerSection,
                      DataSection,
                      TrainingSection,
                      OptimizerSection,
                      CheckpointSection,
                      ParallelSection,
                      FsdpSection,
                      RuntimeSection,
                      LoggingSection,
                      ProfilingSection,
                      PretrainingSection {
  // Set by the tool before validation: mfsdp-sft and mfsdp-grpo start from what --load names, so
  // a --load without a checkpoint is an error there (mfsdp-pretrain starts afresh, as Megatron).
  bool load_requires_checkpoint = false;

  // Derived by validate().
  int64_t num_micro_batches = 1;
  int64_t real_vocab_size = 0;    // the tokenizer's (or --vocab-size): token ids must be below it
  int64_t padded_vocab_size = 0;  // real_vocab_size rounded up (--make-vocab-size-divisible-by)
};

// What a tool takes: the sections that mean something to it (mfsdp-sft and mfsdp-grpo take
// neither the pretraining corpus nor mfsdp-pretrain's own section) and flags of its own.
struct ToolFlags {
  std::string program = "mfsdp-pretrain";
  std::vector<Section> sections = all_sections();  // the sections of PretrainArgs this tool takes
  std::string extra_title;                          // --help's heading of `extra`
  std::vector<ToolFlag> extra;
  // Flags of a taken section that this tool sets another way, with what to use instead (an
  // error naming both when given).
  std::map<std::string, std::string> replaced;
};

// Parses argv (argv[0] is the program). Throws std::invalid_argument naming the flag for an
// unknown flag, a missing or malformed value, or a value outside its allowed set.
PretrainArgs parse_pretrain_args(const std::vector<std::string>& argv, const ToolFlags& tool = {});

// Checks what needs the world size (the data-parallel size is the world over the tensor- and
// context-parallel sizes) and the tokenizer's vocabulary, and derives num_micro_batches, ffn size
// and padded vocab size. Throws naming the flag(s). validate_training_args checks everything but
// the pretraining data (--data-path / --mock-data).
void validate_pretrain_args(PretrainArgs& args, int world_size, int64_t tokenizer_vocab);
void validate_training_args(PretrainArgs& args, int world_size, int64_t tokenizer_vocab);

// Every flag's value as --help shows it ({"--lr": "0.0001", ...}), recorded in checkpoints.
std::map<std::string, std::string> pretrain_args_values(const PretrainArgs& args, const ToolFlags& tool = {});

// "--flag VALUE  help (default: x)" for every flag, for --help and docs. `tool`'s extra flags show
// their values at the time of the call (call it on default-constructed tool args).
std::string pretrain_usage(const ToolFlags& tool = {});

// Flags accepted for Megatron compatibility that change nothing in this build, with the reason,
// for the one-time start-up notice.
std::vector<std::string> pretrain_inert_flag_notices(const PretrainArgs& args, bool nccl_in_use);

}  // namespace mfsdp
