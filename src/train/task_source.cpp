#include "mfsdp/train/task_source.h"

#include <filesystem>

#include "train/tool_flags.h"

namespace mfsdp {

TaskGenOptions TaskSource::generator(const std::string& split) const {
  TaskGenOptions t;
  t.task = gen_task;
  t.seed = static_cast<uint64_t>(gen_seed);
  t.digits = static_cast<int>(gen_digits);
  t.split = split;
  t.count = split == "train" ? gen_train_size : gen_val_size;
  return t;
}

std::string TaskSource::describe(const std::string& split) const {
  if (generated()) return "--gen-task " + gen_task + " (" + split + ")";
  return split == "train" ? train_files : val_files;
}

std::vector<ToolFlag> task_source_flags(TaskSource& s, const std::string& what, const std::string& format) {
  return {
      string_flag("--train-files", s.train_files, "training " + what + ", JSONL: " + format),
      string_flag("--val-files", s.val_files, "held-out " + what + " (same format)"),
      string_flag("--gen-task", s.gen_task,
                  "generate " + what + " of a verifiable task instead of --train-files / --val-files "
                  "(the held-out ones never among the training ones)",
                  {"arith", "countdown"}),
      int_flag("--gen-train-size", s.gen_train_size, "generated training " + what),
      int_flag("--gen-val-size", s.gen_val_size, "generated held-out " + what),
      int_flag("--gen-digits", s.gen_digits, "digits of each arith operand"),
      int_flag("--gen-seed", s.gen_seed, "seed of the generated " + what),
  };
}

void check_task_source(const TaskSource& s) {
  if (s.train_files.empty() == s.gen_task.empty())
    flag_error("--train-files", s.gen_task.empty() ? "is required (or --gen-task)" : "conflicts with --gen-task");
  if (!s.val_files.empty() && s.generated()) flag_error("--val-files", "conflicts with --gen-task");
  for (const auto& [flag, file] : {std::pair{"--train-files", s.train_files}, {"--val-files", s.val_files}})
    if (std::error_code ec; !file.empty() && !std::filesystem::is_regular_file(file, ec))
      flag_error(flag, "no such file: '" + file + "'");
  if (!s.generated()) return;
  if (s.gen_train_size < 1) flag_error("--gen-train-size", "must be >= 1, got " + std::to_string(s.gen_train_size));
  if (s.gen_val_size < 0) flag_error("--gen-val-size", "must be >= 0, got " + std::to_string(s.gen_val_size));
  // The problems are held in memory (~200 bytes each); 4M is far past any prompt set a run uses
  // (GSM8K has 7.5K, DAPO's math set 17K), and a typo beyond it is refused, not allocated.
  constexpr int64_t kMaxGeneratedProblems = int64_t{1} << 22;
  for (auto [flag, n] : {std::pair{"--gen-train-size", s.gen_train_size}, {"--gen-val-size", s.gen_val_size}})
    if (n > kMaxGeneratedProblems)
      flag_error(flag, "must be at most " + std::to_string(kMaxGeneratedProblems) + ", got " + std::to_string(n));
  // An arith operand is an int64 (verifiable_tasks.h): at most 18 decimal digits.
  if (s.gen_digits < 1 || s.gen_digits > 18)
    flag_error("--gen-digits", "must be in 1..18, got " + std::to_string(s.gen_digits));
}

}  // namespace mfsdp
