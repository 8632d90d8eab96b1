// mfsdp-sft: supervised fine-tuning of a Llama-family model on conversations, on the sharded
// runtime (docs/sft.md). Megatron's model, optimizer, sharding, checkpoint and logging flags come
// from PretrainArgs; the data flags are named as verl's and TRL's.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "mfsdp/comm/comm.h"
#include "mfsdp/train/pretrain_args.h"
#include "mfsdp/train/task_source.h"

namespace mfsdp {

struct SftArgs {
  PretrainArgs base;  // --seq-length is --max-length here
  TaskSource data;  // --train-files / --val-files (verl data.train_files, val_files) or --gen-task
  std::string messages_key = "messages";
  std::string prompt_key = "prompt";
  std::string response_key = "response";
  std::string chat_template = "auto";  // auto: by the tokenizer's special tokens (detect_chat_template)
  int64_t max_length = 1024;
  std::string truncation = "error";
  std::string loss_on = "assistant";
  bool packing = false;
  std::string loss_agg_mode = "token-mean";
  std::string hf_load;  // start from this Hugging Face folder
  int64_t val_generate_samples = 100;  // held-out examples for greedy exact match (0: none)
  int64_t max_new_tokens = 64;         // generation length for exact match
};

// The flags of mfsdp-sft bound to `args` (which must outlive the result).
ToolFlags sft_tool_flags(SftArgs& args);

// Parses and checks everything that needs no data or communicator (flag values, choices,
// conflicts). Throws std::invalid_argument naming the flag.
SftArgs parse_sft_args(const std::vector<std::string>& argv);

struct SftResult {
  double first_loss = 0;
  double final_loss = 0;
  double final_val_loss = 0;
  double val_exact_match = -1;  // -1: not measured
  int64_t iterations = 0;
};

// Trains as `args` says. Collective over `comm`; logs on rank 0.
SftResult run_sft(SftArgs args, const std::shared_ptr<Communicator>& comm, std::ostream& log);

}  // namespace mfsdp
