// Generated tasks whose answers a rule reward can check (mfsdp/data/rewards.h), for SFT warm starts and
// GRPO on small models: "arith" (two-number addition, exact-match reward) and "countdown"
// (TinyZero's: reach a target with + - * / using each number once). Deterministic for a seed on
// every platform (own splitmix64 generator, no std:: distributions); train and test splits are
// disjoint by a hash of each problem's canonical text. docs/post_training_data.md.
// Torch-free (library mfsdp_data).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mfsdp/data/posttrain/chat_dataset.h"

namespace mfsdp {

struct TaskGenOptions {
  std::string task = "arith";  // "arith" or "countdown"
  int64_t count = 100;         // problems to generate (> 0)
  uint64_t seed = 0;
  int digits = 2;              // arith: each operand has exactly this many digits (1..18)
  std::string split = "train";  // "train" or "test"
  double test_fraction = 0.1;   // share of the problem space that belongs to the test split, [0, 1]
  int countdown_numbers = 3;     // countdown: how many numbers (2..6)
  int countdown_max_number = 20;  // countdown: numbers drawn uniformly from 1..max (>= 1)
};

// RL prompts of the requested split:
//   arith:     user "{a}+{b}=", ground truth "{a+b}", data_source "arith".
//   countdown: user "Using the numbers [3, 5, 7], create an equation that equals 22. You may use
//              + - * / and each number once. Put the equation in <answer></answer>.", ground
//              truth {"target":22,"numbers":[3,5,7]}, data_source "countdown"; the target is
//              the value of a random expression over all the numbers (+ - * and exact /).
// A problem is in the test split when the hash of its canonical text, as a fraction of 2^64, is
// below test_fraction (the seed plays no part, so train and test never share a problem).
// Problems do not repeat within the output until the split's space is exhausted (taken as
// 200,000 draws in a row that bring nothing new); then duplicates are allowed. An empty split and
// bad options throw std::invalid_argument. extra_info_json is {"split":..,"index":i}.
std::vector<RlExample> generate_tasks(const TaskGenOptions& options);

// The same problems (same options, same order) as conversations: user = the prompt, assistant =
// the answer (arith: the sum; countdown: "<answer>EXPR</answer>" with an expression that reaches
// the target).
std::vector<SftExample> generate_sft_tasks(const TaskGenOptions& options);

}  // namespace mfsdp
