#include "mfsdp/train/chat_eval.h"

#include <torch/torch.h>

#include <functional>

#include "mfsdp/data/posttrain/chat_template.h"
#include "mfsdp/data/posttrain/rewards.h"
#include "mfsdp/models/batched_generate.h"
#include "mfsdp/train/rollout_model.h"

namespace mfsdp {

std::string resolve_chat_template(const std::string& choice, const Tokenizer& tokenizer) {
  return choice == "auto" ? detect_chat_template(tokenizer) : choice;
}

std::vector<std::string> chat_template_choices() {
  std::vector<std::string> choices{"auto"};
  for (const std::string& name : chat_template_names()) choices.push_back(name);
  return choices;
}

std::string describe_chat_template(const std::string& choice, const Tokenizer& tokenizer) {
  if (choice != "auto") return choice;
  std::string why;
  const std::string name = detect_chat_template(tokenizer, &why);
  return name + " (auto: " + why + ")";
}

std::string decode_generated(const Tokenizer& tokenizer, const std::vector<int64_t>& ids, int64_t end_of_turn) {
  std::vector<int64_t> text;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i + 1 == ids.size() && ids[i] == end_of_turn) break;
    if (ids[i] >= 0 && ids[i] < tokenizer.vocab_size()) text.push_back(ids[i]);
  }
  return tokenizer.decode(text);
}

namespace {

std::string strip(const std::string& s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t\r\n") - first + 1);
}

// The answer a reply gives: under qwen3 the text after its think block, as Qwen3's template keeps
// it (an answer is compared without the reasoning the model wrote before it).
std::string answer_of(const std::string& reply, const std::string& chat_template) {
  if (chat_template != "qwen3") return reply;
  const auto close = reply.rfind("</think>");
  return close == std::string::npos ? reply : reply.substr(close + 8);
}

// Generates greedy answers for prompts r, r + dp, ... of the first `count` and hands each decoded
// answer (without its end-of-turn token) to `score`, which returns its points. Returns this
// rank's point sum and prompt count.
std::pair<double, int64_t> answer_share(TrainingRun& run, int64_t count,
                                        const std::function<std::vector<ChatMessage>(int64_t)>& prompt_of,
                                        const Tokenizer& tokenizer, const ChatEvalOptions& o,
                                        const std::function<double(int64_t, const std::string&)>& score) {
  const int rank = run.comm()->rank(), dp = run.comm()->size();
  RolloutModel& rollout = run.load_rollout_model();
  const int64_t end_of_turn = chat_end_of_turn_id(tokenizer, o.chat_template);
  SamplingOptions sampling;
  sampling.greedy = true;
  sampling.max_new_tokens = o.max_new_tokens;
  sampling.stop_ids = {end_of_turn};
  sampling.pad_id = tokenizer.eod();
  std::vector<int64_t> mine;
  for (int64_t i = rank; i < count; i += dp) mine.push_back(i);
  double points = 0;
  torch::NoGradGuard no_grad;
  for (size_t first = 0; first < mine.size(); first += static_cast<size_t>(o.batch_size)) {
    const size_t last = std::min(mine.size(), first + static_cast<size_t>(o.batch_size));
    std::vector<std::vector<int64_t>> prompts;
    for (size_t k = first; k < last; ++k)
      prompts.push_back(apply_chat_template(tokenizer, o.chat_template, prompt_of(mine[k]), true).ids);
    GeneratedBatch out = generate_batch(rollout.model(), prompts, std::vector<uint64_t>(prompts.size(), 0), sampling);
    for (size_t k = first; k < last; ++k) {
      points += score(mine[k], decode_generated(tokenizer, out.tokens[k - first], end_of_turn));
    }
  }
  rollout.release();
  return {points, static_cast<int64_t>(mine.size())};
}

ChatEvalResult sum_over_ranks(TrainingRun& run, std::pair<double, int64_t> local) {
  at::Tensor t = at::tensor({local.first, static_cast<double>(local.second)}, at::kDouble).to(run.comm()->device());
  run.comm()->all_reduce(t, {ReduceOp::kSum});
  t = t.cpu();
  ChatEvalResult r;
  r.total = static_cast<int64_t>(t[1].item<double>());
  r.correct = static_cast<int64_t>(t[0].item<double>());
  r.accuracy = r.total > 0 ? t[0].item<double>() / r.total : 0;
  return r;
}

}  // namespace

ChatEvalResult greedy_exact_match(TrainingRun& run, const std::vector<SftExample>& examples, const Tokenizer& tokenizer,
                                  const ChatEvalOptions& o) {
  // The prompt is every message before the last assistant message, which is the expected answer.
  std::vector<std::vector<ChatMessage>> prompts;
  std::vector<std::string> expected;
  for (const SftExample& e : examples) {
    if (static_cast<int64_t>(prompts.size()) >= o.samples) break;
    size_t last = e.messages.size();
    while (last > 0 && e.messages[last - 1].role != "assistant") --last;
    if (last == 0) continue;
    prompts.emplace_back(e.messages.begin(), e.messages.begin() + static_cast<int64_t>(last) - 1);
    expected.push_back(strip(answer_of(e.messages[last - 1].content, o.chat_template)));
  }
  auto local = answer_share(
      run, static_cast<int64_t>(prompts.size()), [&](int64_t i) { return prompts[static_cast<size_t>(i)]; },
      tokenizer, o, [&](int64_t i, const std::string& answer) {
        return strip(answer_of(answer, o.chat_template)) == expected[static_cast<size_t>(i)] ? 1.0 : 0.0;
      });
  return sum_over_ranks(run, local);
}

ChatEvalResult greedy_reward(TrainingRun& run, const std::vector<RlExample>& examples, const Tokenizer& tokenizer,
                             const std::string& reward, const ChatEvalOptions& o) {
  const int64_t count = std::min<int64_t>(o.samples, static_cast<int64_t>(examples.size()));
  auto local = answer_share(
      run, count, [&](int64_t i) { return examples[static_cast<size_t>(i)].prompt; }, tokenizer, o,
      [&](int64_t i, const std::string& answer) {
        const RlExample& e = examples[static_cast<size_t>(i)];
        return compute_score_by_name(reward, e.data_source, answer, e.ground_truth);
      });
  return sum_over_ranks(run, local);
}

}  // namespace mfsdp
