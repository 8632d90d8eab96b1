// Where the post-training trainers' examples come from: JSONL files (--train-files,
// --val-files) or a generator of verifiable tasks (--gen-task and its sizes, digits and seed;
// include/mfsdp/data/posttrain/verifiable_tasks.h), with the same flags in mfsdp-sft and mfsdp-grpo.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mfsdp/data/posttrain/verifiable_tasks.h"
#include "mfsdp/train/pretrain_args.h"

namespace mfsdp {

struct TaskSource {
  std::string train_files;
  std::string val_files;
  std::string gen_task;  // arith | countdown: generate instead of reading files
  int64_t gen_train_size = 2000;
  int64_t gen_val_size = 200;
  int64_t gen_digits = 2;
  int64_t gen_seed = 0;

  bool generated() const { return !gen_task.empty(); }
  // The generator's options for a split ("train", or "test" for the held-out examples).
  TaskGenOptions generator(const std::string& split) const;
  // How errors name the training data: the file, or "--gen-task arith (train)".
  std::string describe(const std::string& split) const;
};

// The flags, with `what` naming the examples in their help ("conversations", "prompts") and
// `format` describing the files.
std::vector<ToolFlag> task_source_flags(TaskSource& source, const std::string& what, const std::string& format);
// Exactly one of --train-files and --gen-task; no --val-files with --gen-task; sizes in range.
// Throws std::invalid_argument naming the flag.
void check_task_source(const TaskSource& source);

}  // namespace mfsdp
