// Greedy answers of the policy to held-out conversations, for the trainers' evaluation:
// mfsdp-sft's exact match of the last assistant message, mfsdp-grpo's validation reward. Each
// rank answers every dp-th prompt with a full copy of the model (RolloutModel), in batches; the
// counts are summed over ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mfsdp/data/posttrain/chat_dataset.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/train/training_run.h"

namespace mfsdp {

// --chat-template: `choice` itself, or for auto the template detect_chat_template picks.
std::string resolve_chat_template(const std::string& choice, const Tokenizer& tokenizer);
// --chat-template's choices: auto and the built-in templates.
std::vector<std::string> chat_template_choices();
// The template as the start-up line shows it: "qwen3", or "qwen3 (auto: the tokenizer has ...)".
std::string describe_chat_template(const std::string& choice, const Tokenizer& tokenizer);

// The text of generated ids: without the final end-of-turn token, and without ids outside the
// tokenizer's vocabulary (the embedding's padding rows, which an untrained model may sample;
// they mean nothing, so a reward sees no text for them).
std::string decode_generated(const Tokenizer& tokenizer, const std::vector<int64_t>& ids, int64_t end_of_turn);

struct ChatEvalOptions {
  std::string chat_template = "plain";
  int64_t max_new_tokens = 64;
  int64_t samples = 100;    // the first this many prompts (all when fewer)
  int64_t batch_size = 32;  // prompts per generate_batch call
};

struct ChatEvalResult {
  int64_t correct = 0;  // exact matches (SFT), or the sum of rewards rounded down (GRPO: see score)
  int64_t total = 0;
  double accuracy = 0;  // correct / total (SFT), mean reward (GRPO)
};

// The answer to each conversation's last assistant message, given the messages before it
// (stripped of surrounding whitespace on both sides; under qwen3 both without the think block
// before "</think>"), greedy. Collective.
ChatEvalResult greedy_exact_match(TrainingRun& run, const std::vector<SftExample>& examples, const Tokenizer& tokenizer,
                                  const ChatEvalOptions& options);

// Greedy answers to verl-style prompts scored by compute_score_by_name(reward, data_source, ...).
// Collective.
ChatEvalResult greedy_reward(TrainingRun& run, const std::vector<RlExample>& examples, const Tokenizer& tokenizer,
                             const std::string& reward, const ChatEvalOptions& options);

}  // namespace mfsdp
