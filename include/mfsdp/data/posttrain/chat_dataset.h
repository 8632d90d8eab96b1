// Post-training data files as JSON Lines: supervised fine-tuning conversations and RL prompts with
// their rule-reward ground truth. The field names follow verl (data.messages_key / prompt_key /
// response_key, and the RL parquet schema prompt / reward_model / data_source / extra_info) and
// TRL's conversational and prompt-completion dataset formats, so a verl or TRL dataset exported
// to JSONL (e.g. pandas `to_json(orient="records", lines=True)`) loads unchanged. The formats are
// described in docs/post_training_data.md. Torch-free (library mfsdp_data); nlohmann/json stays
// out of this header.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "mfsdp/data/posttrain/chat_template.h"

namespace mfsdp {

// The keys that read_sft_jsonl looks for in each line.
struct SftJsonlOptions {
  std::string messages_key = "messages";
  std::string prompt_key = "prompt";
  std::string response_key = "response";
};

struct SftExample {
  std::vector<ChatMessage> messages;
};

// Reads one conversation per line. Each line is a JSON object with either
//   messages_key: [{"role": ..., "content": ...}, ...]   (roles system/user/assistant; at least
//                                                         one assistant message), or
//   prompt_key and response_key: the prompt a string (one user message) or a messages list, the
//                                response a string (one assistant message) or a messages list.
// Blank lines are skipped. Throws std::invalid_argument "<path>:<line>: <what>" on a file that
// cannot be opened, bad JSON, missing keys, wrong types, an unknown role, a conversation without
// an assistant message, or a file with no examples.
std::vector<SftExample> read_sft_jsonl(const std::string& path, const SftJsonlOptions& options = {});

// Writes {"messages": [...]} per line (the format read_sft_jsonl reads with default options).
// Throws std::runtime_error if the file cannot be written.
void write_sft_jsonl(const std::string& path, const std::vector<SftExample>& examples);

// One RL prompt with what the rule reward needs to score a response to it.
struct RlExample {
  std::vector<ChatMessage> prompt;
  std::string ground_truth;  // a JSON string's value as is; any other JSON value as its JSON text
  std::string data_source;   // selects the reward (compute_score in mfsdp/data/rewards.h)
  std::string extra_info_json = "{}";  // verl's free-form "extra_info", kept as JSON text
};

// verl's RL schema as JSONL, one object per line:
//   "prompt": [{"role", "content"}, ...] or a plain string (one user message),
//   "reward_model": {"style": "rule", "ground_truth": <string, number or object>},
//   "data_source": string,
//   "extra_info": optional, any JSON value (kept as its JSON text).
// Blank lines skipped; errors as read_sft_jsonl ("<path>:<line>: <what>"). `check`, when given,
// runs on every example as it is read; the std::invalid_argument it throws becomes that line's
// error (the trainer checks each data_source has a reward before training starts).
std::vector<RlExample> read_rl_jsonl(const std::string& path,
                                     const std::function<void(const RlExample&)>& check = {});

// Writes the schema above. A ground truth that is itself valid JSON of an object or array (as
// countdown's {"target":..,"numbers":[..]}) is written as that JSON value; any other ground truth
// is written as a JSON string, so read_rl_jsonl(write_rl_jsonl(x)) == x. extra_info_json must be
// valid JSON (std::invalid_argument otherwise).
void write_rl_jsonl(const std::string& path, const std::vector<RlExample>& examples);

}  // namespace mfsdp
