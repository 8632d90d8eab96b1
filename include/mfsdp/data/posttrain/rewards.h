// Rule-based rewards for RL post-training, after verl's verl/utils/reward_score/ (gsm8k.py and
// the default_compute_score dispatch) and TinyZero's countdown.py. A reward maps (response text,
// ground truth) to a score; no model involved. Definitions and edge cases: docs/post_training_data.md.
// Torch-free (library mfsdp_data).
#pragma once

#include <string>
#include <vector>

namespace mfsdp {

// 1 if the response with surrounding whitespace stripped equals the ground truth stripped, else 0.
double exact_match_reward(const std::string& response, const std::string& ground_truth);

// verl's GSM8K reward. Only the last 300 characters of the response are looked at.
//   strict:   the answer is the number after the last "#### " (verl's "#### (-?[0-9.,]+)", with
//             an optional "$" after the space);
//   flexible: the last match of "-?[0-9.,]+" that holds a digit (the default here; verl's own
//             default is strict).
// The answer and the ground truth lose commas, "$", trailing "." and surrounding whitespace; the
// score is 1.0 if it equals the ground truth as a string, else 0 (verl's format_score 0).
double gsm8k_reward(const std::string& response, const std::string& ground_truth, bool strict = false);

// TinyZero's countdown reward. ground_truth_json is {"target": int, "numbers": [ints]}. The
// equation is the content of the last <answer>...</answer>; it may hold only digits, + - * / ( )
// and spaces, and must use every number exactly once. It is evaluated by a recursive-descent
// parser in double precision (true division). Scores: 1.0 if |value - target| < 1e-5; 0.1 if an
// answer tag exists but the equation is invalid (characters, numbers, syntax, division by zero)
// or wrong; 0 if there is no answer tag. Throws std::invalid_argument on a malformed ground truth.
double countdown_reward(const std::string& response, const std::string& ground_truth_json);

// verl's default_compute_score-style dispatch on data_source:
//   "exact", "arith"          -> exact_match_reward
//   "openai/gsm8k", "gsm8k"   -> gsm8k_reward (flexible)
//   "countdown"               -> countdown_reward
// Any other data_source: std::invalid_argument naming it and the known ones.
double compute_score(const std::string& data_source, const std::string& response,
                     const std::string& ground_truth);

// Throws the std::invalid_argument compute_score would throw for `data_source` (naming it and
// the known ones) when `reward` ("auto") dispatches on it and no rule reward takes it: what a
// prompt file is checked with at load, line by line, before any prompt is scored.
void check_reward_for(const std::string& reward, const std::string& data_source);

// The --reward override: "auto" dispatches on data_source (compute_score); "exact", "gsm8k" and
// "countdown" pick the reward whatever the data_source. Other names: std::invalid_argument.
double compute_score_by_name(const std::string& reward, const std::string& data_source,
                             const std::string& response, const std::string& ground_truth);

// The names compute_score_by_name accepts ("auto", "exact", "gsm8k", "countdown"), for flags.
const std::vector<std::string>& reward_names();

}  // namespace mfsdp
