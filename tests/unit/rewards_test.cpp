// Post-training data: the SFT/RL JSONL formats (mfsdp/data/chat_dataset.h), the rule rewards
// (mfsdp/data/rewards.h) and the verifiable-task generator (mfsdp/data/verifiable_tasks.h). Reward values
// are hand-computed from verl's gsm8k.py and TinyZero's countdown.py rules (docs/post_training_data.md);
// countdown targets are checked by an exhaustive solver written here, not by the generator's
// own construction.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "harness/temp_dir.h"
#include "mfsdp/data/posttrain/chat_dataset.h"
#include "mfsdp/data/posttrain/rewards.h"
#include "mfsdp/data/posttrain/verifiable_tasks.h"

namespace {

using namespace mfsdp;
using mfsdp::testing::TempDir;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool same(const std::vector<ChatMessage>& a, const std::vector<ChatMessage>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].role != b[i].role || a[i].content != b[i].content) return false;
  return true;
}

// Expects `fn` to throw std::invalid_argument whose message contains every one of `parts`.
template <class Fn>
void expect_error(Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning " << parts.front();
  } catch (const std::invalid_argument& e) {
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "message: " << e.what() << "\nmissing: " << p;
  }
}

// ---- SFT JSONL ---------------------------------------------------------------------------------

TEST(SftJsonl, RoundTripsConversations) {
  TempDir dir;
  const std::vector<SftExample> examples = {
      {{{"system", "Be brief."}, {"user", "2+2="}, {"assistant", "4"}}},
      {{{"user", "quote \" backslash \\ newline\n tab\t"}, {"assistant", "caf\xC3\xA9 \xE2\x82\xAC"},
        {"user", "again"}, {"assistant", ""}}},
  };
  write_sft_jsonl(dir.file("a.jsonl"), examples);
  // One JSON object per line, in the messages format.
  const std::string text = read_text(dir.file("a.jsonl"));
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2);
  EXPECT_EQ(text.rfind("{\"messages\":[", 0), 0u);
  const auto back = read_sft_jsonl(dir.file("a.jsonl"));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_TRUE(same(back[0].messages, examples[0].messages));
  EXPECT_TRUE(same(back[1].messages, examples[1].messages));
}

TEST(SftJsonl, ReadsPromptResponseFormsAndSkipsBlankLines) {
  TempDir dir;
  write_text(dir.file("a.jsonl"),
             "\n"
             "{\"prompt\": \"1+1=\", \"response\": \"2\", \"other\": 5}\r\n"
             "   \n"
             "{\"prompt\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"U\", \"name\": \"x\"}],"
             " \"response\": [{\"role\": \"assistant\", \"content\": \"A\"}]}\n"
             "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", \"content\": \"a\"}],"
             " \"prompt\": 7}\n");  // messages_key wins over prompt/response
  const auto ex = read_sft_jsonl(dir.file("a.jsonl"));
  ASSERT_EQ(ex.size(), 3u);
  EXPECT_TRUE(same(ex[0].messages, {{"user", "1+1="}, {"assistant", "2"}}));
  EXPECT_TRUE(same(ex[1].messages, {{"system", "S"}, {"user", "U"}, {"assistant", "A"}}));
  EXPECT_TRUE(same(ex[2].messages, {{"user", "q"}, {"assistant", "a"}}));
}

TEST(SftJsonl, CustomKeysAsTrlPromptCompletion) {
  TempDir dir;
  write_text(dir.file("a.jsonl"),
             "{\"question\": \"Q\", \"completion\": \"C\"}\n"
             "{\"conversation\": [{\"role\": \"user\", \"content\": \"u\"}, {\"role\": \"assistant\", \"content\": \"v\"}]}\n");
  SftJsonlOptions o;
  o.messages_key = "conversation";
  o.prompt_key = "question";
  o.response_key = "completion";
  const auto ex = read_sft_jsonl(dir.file("a.jsonl"), o);
  ASSERT_EQ(ex.size(), 2u);
  EXPECT_TRUE(same(ex[0].messages, {{"user", "Q"}, {"assistant", "C"}}));
  EXPECT_TRUE(same(ex[1].messages, {{"user", "u"}, {"assistant", "v"}}));
}

TEST(SftJsonl, ErrorsNameFileAndLine) {
  TempDir dir;
  const std::string ok = "{\"prompt\": \"p\", \"response\": \"r\"}\n";
  struct Case {
    std::string bad_line;
    std::string what;
  };
  const std::vector<Case> cases = {
      {"{\"prompt\": \"p\", \"response\": ", "invalid JSON"},
      {"{\"prompt\": \"p\", \"response\": \"r\", \"score\": 1e999999}", "invalid JSON ([json.exception.out_of_range.406]"},
      {"[1, 2]", "JSON object"},
      {"{\"prompt\": \"p\"}", "missing \"response\""},
      {"{\"response\": \"r\"}", "missing \"prompt\""},
      {"{\"prompt\": 3, \"response\": \"r\"}", "\"prompt\" must be a string or a list"},
      {"{\"prompt\": \"p\", \"response\": {}}", "\"response\" must be a string or a list"},
      {"{\"messages\": \"hi\"}", "\"messages\" must be a list"},
      {"{\"messages\": []}", "empty list"},
      {"{\"messages\": [\"hi\"]}", "\"messages\"[0] must be an object"},
      {"{\"messages\": [{\"content\": \"c\"}]}", "has no \"role\""},
      {"{\"messages\": [{\"role\": \"user\"}]}", "has no \"content\""},
      {"{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", ".content must be a string"},
      {"{\"messages\": [{\"role\": 1, \"content\": \"c\"}]}", ".role must be a string"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"tool\", \"content\": \"c\"}]}",
       "\"messages\"[1].role \"tool\" is unknown"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}", "no assistant message"},
  };
  for (const Case& c : cases) {
    const std::string path = dir.file("bad.jsonl");
    write_text(path, ok + "\n" + c.bad_line + "\n" + ok);  // the bad record is on line 3
    expect_error([&] { read_sft_jsonl(path); }, {path + ":3: ", c.what});
  }
  write_text(dir.file("empty.jsonl"), "");
  expect_error([&] { read_sft_jsonl(dir.file("empty.jsonl")); }, {dir.file("empty.jsonl") + ":0: ", "no examples"});
  write_text(dir.file("blank.jsonl"), "\n  \n");
  expect_error([&] { read_sft_jsonl(dir.file("blank.jsonl")); }, {dir.file("blank.jsonl") + ":2: ", "no examples"});
  expect_error([&] { read_sft_jsonl(dir.file("absent.jsonl")); }, {dir.file("absent.jsonl"), "cannot open"});
}

TEST(SftJsonl, WriterRefusesWhatTheReaderRefuses) {
  TempDir dir;
  expect_error([&] { write_sft_jsonl(dir.file("a.jsonl"), {{{{"user", "q"}, {"assistant", "a"}}}, {{{"robot", "x"}}}}); },
               {"example 1", "\"robot\""});
  expect_error([&] { write_sft_jsonl(dir.file("a.jsonl"), {{{{"user", "q"}}}}); }, {"example 0", "no assistant"});
  expect_error([&] { write_sft_jsonl(dir.file("a.jsonl"), {{{{"user", "q"}, {"assistant", "\xFF"}}}}); },
               {"example 0", "cannot be written as JSON"});
}

// ---- RL JSONL ----------------------------------------------------------------------------------

TEST(RlJsonl, RoundTripsAndKeepsGroundTruthTypes) {
  TempDir dir;
  const std::vector<RlExample> examples = {
      {{{"system", "S"}, {"user", "Q?"}}, "72", "openai/gsm8k", "{\"index\":3,\"split\":\"train\"}"},
      {{{"user", "Using the numbers [3, 5, 7] ..."}}, "{\"target\":22,\"numbers\":[3,5,7]}", "countdown", "{}"},
      // Not canonical JSON text: must stay a string to survive the round trip.
      {{{"user", "x"}}, "{ \"a\": 1 }", "exact", "null"},
  };
  write_rl_jsonl(dir.file("rl.jsonl"), examples);
  const std::string text = read_text(dir.file("rl.jsonl"));
  EXPECT_NE(text.find("\"ground_truth\":\"72\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"ground_truth\":{\"target\":22,\"numbers\":[3,5,7]}"), std::string::npos) << text;
  EXPECT_NE(text.find("\"style\":\"rule\""), std::string::npos);
  const auto back = read_rl_jsonl(dir.file("rl.jsonl"));
  ASSERT_EQ(back.size(), 3u);
  EXPECT_TRUE(same(back[0].prompt, examples[0].prompt));
  EXPECT_EQ(back[0].ground_truth, "72");
  EXPECT_EQ(back[0].data_source, "openai/gsm8k");
  EXPECT_EQ(back[0].extra_info_json, examples[0].extra_info_json);
  EXPECT_EQ(back[1].ground_truth, examples[1].ground_truth);
  EXPECT_EQ(countdown_reward("<answer>3*5+7</answer>", back[1].ground_truth), 1.0);
  EXPECT_EQ(back[2].ground_truth, "{ \"a\": 1 }");
  EXPECT_EQ(back[2].extra_info_json, "null");
}

TEST(RlJsonl, ReadsVerlRecords) {
  TempDir dir;
  write_text(dir.file("rl.jsonl"),
             "{\"data_source\": \"arith\", \"prompt\": \"12+34=\", \"reward_model\": {\"ground_truth\": 46}}\n"
             "\n"
             "{\"data_source\": \"gsm8k\", \"prompt\": [{\"role\": \"user\", \"content\": \"q\"}], \"ability\": \"math\","
             " \"reward_model\": {\"style\": \"rule\", \"ground_truth\": 3.5}, \"extra_info\": {\"split\": \"test\", \"index\": 0}}\n");
  const auto ex = read_rl_jsonl(dir.file("rl.jsonl"));
  ASSERT_EQ(ex.size(), 2u);
  EXPECT_TRUE(same(ex[0].prompt, {{"user", "12+34="}}));
  EXPECT_EQ(ex[0].ground_truth, "46");  // a number kept as its JSON text
  EXPECT_EQ(ex[0].extra_info_json, "{}");
  EXPECT_EQ(ex[1].ground_truth, "3.5");
  EXPECT_EQ(ex[1].data_source, "gsm8k");
  EXPECT_EQ(ex[1].extra_info_json, "{\"split\":\"test\",\"index\":0}");  // compact, order kept
}

TEST(RlJsonl, ErrorsNameFileAndLine) {
  TempDir dir;
  const std::string ok = "{\"data_source\": \"arith\", \"prompt\": \"p\", \"reward_model\": {\"ground_truth\": \"1\"}}\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"data_source\": \"arith\"", "invalid JSON"},
      {"{\"data_source\": \"arith\", \"prompt\": \"p\", \"x\": -1e999999}", "invalid JSON ([json.exception.out_of_range.406]"},
      {"\"text\"", "JSON object"},
      {"{\"data_source\": \"arith\", \"reward_model\": {\"ground_truth\": \"1\"}}", "missing \"prompt\""},
      {"{\"data_source\": \"arith\", \"prompt\": {}, \"reward_model\": {\"ground_truth\": \"1\"}}", "\"prompt\" must be"},
      {"{\"data_source\": \"arith\", \"prompt\": [{\"role\": \"bot\", \"content\": \"c\"}], \"reward_model\": {\"ground_truth\": \"1\"}}",
       "\"bot\" is unknown"},
      {"{\"data_source\": \"arith\", \"prompt\": \"p\"}", "missing \"reward_model\""},
      {"{\"data_source\": \"arith\", \"prompt\": \"p\", \"reward_model\": \"1\"}", "\"reward_model\" must be an object"},
      {"{\"data_source\": \"arith\", \"prompt\": \"p\", \"reward_model\": {\"style\": \"model\", \"ground_truth\": \"1\"}}",
       "must be \"rule\""},
      {"{\"data_source\": \"arith\", \"prompt\": \"p\", \"reward_model\": {\"style\": \"rule\"}}", "missing \"reward_model.ground_truth\""},
      {"{\"data_source\": \"arith\", \"prompt\": \"p\", \"reward_model\": {\"ground_truth\": null}}", "is null"},
      {"{\"prompt\": \"p\", \"reward_model\": {\"ground_truth\": \"1\"}}", "missing \"data_source\""},
      {"{\"data_source\": 4, \"prompt\": \"p\", \"reward_model\": {\"ground_truth\": \"1\"}}", "\"data_source\" must be a string"},
  };
  for (const auto& [line, what] : cases) {
    const std::string path = dir.file("bad.jsonl");
    write_text(path, ok + line + "\n");
    expect_error([&] { read_rl_jsonl(path); }, {path + ":2: ", what});
  }
  write_text(dir.file("empty.jsonl"), "");
  expect_error([&] { read_rl_jsonl(dir.file("empty.jsonl")); }, {dir.file("empty.jsonl") + ":0: ", "no examples"});
  expect_error([&] { write_rl_jsonl(dir.file("w.jsonl"), {{{}, "1", "arith", "{}"}}); }, {"example 0", "empty prompt"});
  expect_error([&] { write_rl_jsonl(dir.file("w.jsonl"), {{{{"user", "p"}}, "1", "arith", "{oops"}}); },
               {"example 0", "extra_info_json is not valid JSON"});
}

// mfsdp-grpo checks every prompt's data_source at load: a source no rule reward takes is that
// line's error under --reward auto, and any source is fine with a named reward.
TEST(RlJsonl, AnUnknownDataSourceIsTheLinesErrorAtLoad) {
  TempDir dir;
  const std::string path = dir.file("rl.jsonl");
  write_text(path,
             "{\"data_source\": \"arith\", \"prompt\": \"p\", \"reward_model\": {\"ground_truth\": \"1\"}}\n"
             "{\"data_source\": \"openai/gsm8k\", \"prompt\": \"p\", \"reward_model\": {\"ground_truth\": \"1\"}}\n"
             "{\"data_source\": \"lighteval/MATH\", \"prompt\": \"p\", \"reward_model\": {\"ground_truth\": \"1\"}}\n");
  expect_error([&] { read_rl_jsonl(path, [](const RlExample& e) { check_reward_for("auto", e.data_source); }); },
               {path + ":3: ", "no rule reward for data_source \"lighteval/MATH\"", "--reward"});
  EXPECT_EQ(read_rl_jsonl(path, [](const RlExample& e) { check_reward_for("exact", e.data_source); }).size(), 3u);
}

// ---- rewards -----------------------------------------------------------------------------------

TEST(ExactMatchReward, StripsSurroundingWhitespaceOnly) {
  EXPECT_EQ(exact_match_reward(" 42\n", "42"), 1.0);
  EXPECT_EQ(exact_match_reward("42", "\t42 "), 1.0);
  EXPECT_EQ(exact_match_reward("042", "42"), 0.0);
  EXPECT_EQ(exact_match_reward("4 2", "42"), 0.0);
  EXPECT_EQ(exact_match_reward("42.", "42"), 0.0);
  EXPECT_EQ(exact_match_reward("", ""), 1.0);
}

TEST(Gsm8kReward, FlexibleTakesTheLastNumber) {
  EXPECT_EQ(gsm8k_reward("She has 3 apples and buys 5, so 8.", "8"), 1.0);    // trailing "." dropped
  EXPECT_EQ(gsm8k_reward("She has 3 apples and buys 5, so 8.", "5"), 0.0);
  EXPECT_EQ(gsm8k_reward("The total is $1,234,567.", "1234567"), 1.0);      // commas and "$"
  EXPECT_EQ(gsm8k_reward("It drops to -15 degrees", "-15"), 1.0);            // negative
  EXPECT_EQ(gsm8k_reward("It drops to -15 degrees", "15"), 0.0);
  EXPECT_EQ(gsm8k_reward("each costs 2.75", "2.75"), 1.0);                    // decimals as strings:
  EXPECT_EQ(gsm8k_reward("each costs 2.50", "2.5"), 0.0);                     // "2.50" != "2.5"
  EXPECT_EQ(gsm8k_reward("no number here. , ...", "0"), 0.0);                 // "." "," are not numbers
  EXPECT_EQ(gsm8k_reward("", "0"), 0.0);
  EXPECT_EQ(gsm8k_reward("first 5 then #### 7 and finally 9", "9"), 1.0);    // flexible ignores "####"
  EXPECT_EQ(gsm8k_reward("x=12-3", "-3"), 1.0);                               // verl's -?[0-9.,]+ tokens
  EXPECT_EQ(gsm8k_reward("answer: 42", " 42\n"), 1.0);                        // ground truth normalised too
}

TEST(Gsm8kReward, StrictTakesTheLastHashAnswer) {
  EXPECT_EQ(gsm8k_reward("so #### 72", "72", true), 1.0);
  EXPECT_EQ(gsm8k_reward("#### 5\nthen again\n#### 72\n", "72", true), 1.0);  // several: the last
  EXPECT_EQ(gsm8k_reward("#### 5\nthen again\n#### 72\n", "5", true), 0.0);
  EXPECT_EQ(gsm8k_reward("#### 72 because 3 apples", "72", true), 1.0);
  EXPECT_EQ(gsm8k_reward("#### 72 because 3 apples", "72", false), 0.0);     // flexible sees 3
  EXPECT_EQ(gsm8k_reward("The answer is 72", "72", true), 0.0);              // no "####"
  EXPECT_EQ(gsm8k_reward("####72", "72", true), 0.0);                        // needs "#### "
  EXPECT_EQ(gsm8k_reward("#### $1,000", "1000", true), 1.0);
  EXPECT_EQ(gsm8k_reward("#### -3", "-3", true), 1.0);
  EXPECT_EQ(gsm8k_reward("#### 72.", "72", true), 1.0);
  EXPECT_EQ(gsm8k_reward("#### 0.5", "0.5", true), 1.0);
  EXPECT_EQ(gsm8k_reward("##### 8", "8", true), 1.0);  // "#### 8" occurs inside "##### 8"
}

TEST(Gsm8kReward, LooksAtTheLast300Characters) {
  const std::string pad(298, 'x');
  EXPECT_EQ(gsm8k_reward("42" + pad, "42"), 1.0);                    // 300 characters: all seen
  EXPECT_EQ(gsm8k_reward("742" + pad, "42"), 1.0);                   // 301: the "7" falls outside
  EXPECT_EQ(gsm8k_reward("742" + pad, "742"), 0.0);
  EXPECT_EQ(gsm8k_reward("#### 42" + std::string(293, ' '), "42", true), 1.0);  // 300: all seen
  EXPECT_EQ(gsm8k_reward("#### 42" + std::string(294, ' '), "42", true), 0.0);  // 301: "### 42" no match
  EXPECT_EQ(gsm8k_reward("answer 42 " + std::string(300, 'y'), "42"), 0.0);
  // Characters, not bytes: 298 two-byte "é" keep "42" inside the window.
  std::string accents;
  for (int i = 0; i < 298; ++i) accents += "\xC3\xA9";
  EXPECT_EQ(gsm8k_reward("42" + accents, "42"), 1.0);
  EXPECT_EQ(gsm8k_reward("742" + accents, "42"), 1.0);  // 301 characters: exactly the "7" cut
}

const std::string kTruth = "{\"target\":22,\"numbers\":[3,5,7]}";

TEST(CountdownReward, HandComputedCases) {
  EXPECT_EQ(countdown_reward("<answer>3*5+7</answer>", kTruth), 1.0);
  EXPECT_EQ(countdown_reward("Let me think. <answer> 7 + 5 * 3 </answer>", kTruth), 1.0);
  EXPECT_EQ(countdown_reward("<answer>(7 + (5 * 3))</answer>", kTruth), 1.0);
  EXPECT_EQ(countdown_reward("<answer>(3+5)*7</answer>", kTruth), 0.1);   // 56: wrong value
  EXPECT_EQ(countdown_reward("<answer>5*5-3</answer>", kTruth), 0.1);     // 22, but 5 twice, 7 missing
  EXPECT_EQ(countdown_reward("<answer>3*5+7+0</answer>", kTruth), 0.1);   // 22, with a number not offered
  EXPECT_EQ(countdown_reward("<answer>15+7</answer>", kTruth), 0.1);      // 22, numbers not offered
  EXPECT_EQ(countdown_reward("<answer>3*5</answer>", kTruth), 0.1);       // 7 missing
  EXPECT_EQ(countdown_reward("<answer>3*5+7=22</answer>", kTruth), 0.1);  // "=" not allowed
  EXPECT_EQ(countdown_reward("<answer>3x5+7</answer>", kTruth), 0.1);
  EXPECT_EQ(countdown_reward("<answer>3.0*5+7</answer>", kTruth), 0.1);   // "." not allowed
  EXPECT_EQ(countdown_reward("<answer>03*5+7</answer>", kTruth), 0.1);    // Python rejects 03
  EXPECT_EQ(countdown_reward("<answer>(3*5+7</answer>", kTruth), 0.1);    // unbalanced
  EXPECT_EQ(countdown_reward("<answer>3*5 7</answer>", kTruth), 0.1);     // no operator
  EXPECT_EQ(countdown_reward("<answer></answer>", kTruth), 0.1);
  EXPECT_EQ(countdown_reward("3*5+7", kTruth), 0.0);                      // no tag
  EXPECT_EQ(countdown_reward("<answer>3*5+7", kTruth), 0.0);              // never closed
  EXPECT_EQ(countdown_reward("</answer>3*5+7<answer>", kTruth), 0.0);
  // Two tags: the last one counts.
  EXPECT_EQ(countdown_reward("<answer>(3+5)*7</answer> no wait <answer>3*5+7</answer>", kTruth), 1.0);
  EXPECT_EQ(countdown_reward("<answer>3*5+7</answer> no wait <answer>(3+5)*7</answer>", kTruth), 0.1);
}

TEST(CountdownReward, ArithmeticRules) {
  // True division: 3/2*4 = 1.5*4 = 6 with a non-integer intermediate.
  EXPECT_EQ(countdown_reward("<answer>3/2*4</answer>", "{\"target\":6,\"numbers\":[2,3,4]}"), 1.0);
  // 1/3*3 is 1 only within floating-point error: the 1e-5 tolerance accepts it.
  EXPECT_EQ(countdown_reward("<answer>1/3*3</answer>", "{\"target\":1,\"numbers\":[1,3,3]}"), 1.0);
  // 7/2 = 3.5 is not the integer target 3 or 4.
  EXPECT_EQ(countdown_reward("<answer>7/2</answer>", "{\"target\":3,\"numbers\":[2,7]}"), 0.1);
  // Division by zero is invalid, not a crash or infinity.
  EXPECT_EQ(countdown_reward("<answer>7/(5-5)</answer>", "{\"target\":7,\"numbers\":[5,5,7]}"), 0.1);
  EXPECT_EQ(countdown_reward("<answer>7+(5-5)</answer>", "{\"target\":7,\"numbers\":[5,5,7]}"), 1.0);
  // Left associativity: 8-4-2 = 2 (not 6); 8/4/2 = 1 (not 4).
  EXPECT_EQ(countdown_reward("<answer>8-4-2</answer>", "{\"target\":2,\"numbers\":[2,4,8]}"), 1.0);
  EXPECT_EQ(countdown_reward("<answer>8/4/2</answer>", "{\"target\":1,\"numbers\":[2,4,8]}"), 1.0);
  // Unary minus, as Python's eval allows; "**" and "//" are not among + - * /.
  EXPECT_EQ(countdown_reward("<answer>-(3+5)</answer>", "{\"target\":-8,\"numbers\":[3,5]}"), 1.0);
  EXPECT_EQ(countdown_reward("<answer>2**3*1</answer>", "{\"target\":8,\"numbers\":[1,2,3]}"), 0.1);
  EXPECT_EQ(countdown_reward("<answer>7//2</answer>", "{\"target\":3,\"numbers\":[2,7]}"), 0.1);
  // Deep nesting is bounded, not a stack overflow.
  EXPECT_EQ(countdown_reward("<answer>" + std::string(100000, '(') + "1" + "</answer>", "{\"target\":1,\"numbers\":[1]}"), 0.1);
}

TEST(CountdownReward, MalformedGroundTruthThrows) {
  expect_error([] { countdown_reward("<answer>1</answer>", "not json"); }, {"countdown ground truth", "not valid JSON"});
  expect_error([] { countdown_reward("<answer>1</answer>", "{\"numbers\":[1]}"); }, {"integer \"target\""});
  expect_error([] { countdown_reward("<answer>1</answer>", "{\"target\":1}"); }, {"\"numbers\""});
  expect_error([] { countdown_reward("<answer>1</answer>", "{\"target\":1,\"numbers\":[1.5]}"); }, {"non-integer"});
}

TEST(ComputeScore, DispatchesOnDataSourceAndName) {
  EXPECT_EQ(compute_score("arith", " 46 ", "46"), 1.0);
  EXPECT_EQ(compute_score("exact", "46", "47"), 0.0);
  EXPECT_EQ(compute_score("openai/gsm8k", "so 1,000 in all", "1000"), 1.0);
  EXPECT_EQ(compute_score("gsm8k", "so 1,000 in all", "999"), 0.0);
  EXPECT_EQ(compute_score("countdown", "<answer>3*5+7</answer>", kTruth), 1.0);
  expect_error([] { compute_score("lighteval/MATH", "1", "1"); }, {"\"lighteval/MATH\"", "gsm8k", "countdown", "arith"});
  // A name overrides the data source.
  EXPECT_EQ(compute_score_by_name("auto", "arith", "46", "46"), 1.0);
  EXPECT_EQ(compute_score_by_name("exact", "countdown", "46", "46"), 1.0);
  EXPECT_EQ(compute_score_by_name("gsm8k", "whatever", "it is 46.", "46"), 1.0);
  EXPECT_EQ(compute_score_by_name("countdown", "arith", "<answer>3*5+7</answer>", kTruth), 1.0);
  expect_error([] { compute_score_by_name("auto", "nope", "1", "1"); }, {"\"nope\""});
  expect_error([] { compute_score_by_name("fuzzy", "arith", "1", "1"); }, {"\"fuzzy\"", "auto"});
  EXPECT_EQ(reward_names(), (std::vector<std::string>{"auto", "exact", "gsm8k", "countdown"}));
}

// ---- verifiable tasks --------------------------------------------------------------------------

// Every value reachable from `nums` combining all of them with + - * / (any order, any
// parenthesisation, true division): the exhaustive check that a countdown target is solvable.
bool reachable(std::vector<double> nums, double target) {
  if (nums.size() == 1) return std::fabs(nums[0] - target) < 1e-6;
  for (size_t i = 0; i < nums.size(); ++i)
    for (size_t j = 0; j < nums.size(); ++j) {
      if (i == j) continue;
      std::vector<double> rest;
      for (size_t k = 0; k < nums.size(); ++k)
        if (k != i && k != j) rest.push_back(nums[k]);
      const double a = nums[i], b = nums[j];
      std::vector<double> results = {a + b, a - b, a * b};
      if (b != 0) results.push_back(a / b);
      for (double r : results) {
        rest.push_back(r);
        if (reachable(rest, target)) return true;
        rest.pop_back();
      }
    }
  return false;
}

std::vector<std::string> prompts(const std::vector<RlExample>& v) {
  std::vector<std::string> out;
  for (const auto& e : v) out.push_back(e.prompt.at(0).content);
  return out;
}

TEST(VerifiableTasks, ArithFormatAndAnswers) {
  TaskGenOptions o;
  o.count = 500;
  o.seed = 7;
  const auto rl = generate_tasks(o);
  const auto sft = generate_sft_tasks(o);
  ASSERT_EQ(rl.size(), 500u);
  ASSERT_EQ(sft.size(), 500u);
  const std::regex re("^([0-9]+)\\+([0-9]+)=$");
  std::set<std::string> distinct;
  for (size_t i = 0; i < rl.size(); ++i) {
    ASSERT_EQ(rl[i].prompt.size(), 1u);
    EXPECT_EQ(rl[i].prompt[0].role, "user");
    std::smatch m;
    ASSERT_TRUE(std::regex_match(rl[i].prompt[0].content, m, re)) << rl[i].prompt[0].content;
    const int a = std::stoi(m[1]), b = std::stoi(m[2]);
    EXPECT_TRUE(a >= 10 && a <= 99 && b >= 10 && b <= 99) << a << " " << b;
    EXPECT_EQ(rl[i].ground_truth, std::to_string(a + b));
    EXPECT_EQ(rl[i].data_source, "arith");
    EXPECT_EQ(rl[i].extra_info_json, "{\"split\":\"train\",\"index\":" + std::to_string(i) + "}");
    // The SFT form is the same problem with its answer, which the reward scores 1.
    ASSERT_EQ(sft[i].messages.size(), 2u);
    EXPECT_EQ(sft[i].messages[0].content, rl[i].prompt[0].content);
    EXPECT_EQ(sft[i].messages[1].role, "assistant");
    EXPECT_EQ(compute_score(rl[i].data_source, sft[i].messages[1].content, rl[i].ground_truth), 1.0);
    distinct.insert(rl[i].prompt[0].content);
  }
  EXPECT_EQ(distinct.size(), 500u);  // 8100 pairs: no repeats before exhaustion
  o.digits = 3;
  for (const auto& e : generate_tasks(o)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(e.prompt[0].content, m, re));
    EXPECT_TRUE(std::stoi(m[1]) >= 100 && std::stoi(m[1]) <= 999 && std::stoi(m[2]) >= 100 && std::stoi(m[2]) <= 999);
  }
}

TEST(VerifiableTasks, DeterministicForASeed) {
  for (const std::string task : {"arith", "countdown"}) {
    TaskGenOptions o;
    o.task = task;
    o.count = 200;
    o.seed = 123;
    const auto a = prompts(generate_tasks(o));
    EXPECT_EQ(a, prompts(generate_tasks(o)));
    o.seed = 124;
    EXPECT_NE(a, prompts(generate_tasks(o)));
  }
}

TEST(VerifiableTasks, TrainAndTestAreDisjointWhateverTheSeeds) {
  for (const std::string task : {"arith", "countdown"}) {
    TaskGenOptions o;
    o.task = task;
    o.count = 1500;
    o.seed = 1;
    std::set<std::string> train;
    for (const auto& e : generate_tasks(o)) train.insert(e.prompt[0].content + "|" + e.ground_truth);
    o.split = "test";
    o.count = 150;
    o.seed = 2;  // another seed: the split depends on the problem only
    const auto test = generate_tasks(o);
    for (const auto& e : test) {
      EXPECT_EQ(train.count(e.prompt[0].content + "|" + e.ground_truth), 0u) << task << ": " << e.prompt[0].content;
      EXPECT_EQ(e.extra_info_json.rfind("{\"split\":\"test\"", 0), 0u);
    }
  }
}

TEST(VerifiableTasks, ExhaustedSpaceRepeatsAndSplitsPartitionIt) {
  // One-digit sums: 10 x 10 = 100 problems in all, shared between the two splits.
  TaskGenOptions o;
  o.digits = 1;
  o.count = 300;
  std::map<std::string, std::vector<std::string>> by_split;
  for (const std::string split : {"train", "test"}) {
    o.split = split;
    by_split[split] = prompts(generate_tasks(o));
    ASSERT_EQ(by_split[split].size(), 300u);
  }
  std::set<std::string> train(by_split["train"].begin(), by_split["train"].end());
  std::set<std::string> test(by_split["test"].begin(), by_split["test"].end());
  EXPECT_EQ(train.size() + test.size(), 100u);
  for (const auto& p : test) EXPECT_EQ(train.count(p), 0u);
  EXPECT_GT(test.size(), 2u);  // about 10% of 100
  EXPECT_LT(test.size(), 25u);
  // No repeat until every problem of the split has appeared.
  for (const auto& [split, list] : by_split) {
    const size_t n = split == "train" ? train.size() : test.size();
    EXPECT_EQ(std::set<std::string>(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(n)).size(), n) << split;
  }
  for (int a = 0; a <= 9; ++a)
    for (int b = 0; b <= 9; ++b) {
      const std::string p = std::to_string(a) + "+" + std::to_string(b) + "=";
      EXPECT_EQ(train.count(p) + test.count(p), 1u) << p;
    }
}

TEST(VerifiableTasks, CountdownProblemsAreSolvable) {
  const std::regex re(
      "^Using the numbers \\[([0-9, ]+)\\], create an equation that equals ([0-9]+)\\. You may use "
      "\\+ - \\* / and each number once\\. Put the equation in <answer></answer>\\.$");
  for (int n : {2, 3, 4}) {
    TaskGenOptions o;
    o.task = "countdown";
    o.count = 300;
    o.seed = 99;
    o.countdown_numbers = n;
    o.countdown_max_number = 20;
    const auto rl = generate_tasks(o);
    const auto sft = generate_sft_tasks(o);
    ASSERT_EQ(rl.size(), 300u);
    for (size_t i = 0; i < rl.size(); ++i) {
      std::smatch m;
      const std::string& text = rl[i].prompt[0].content;
      ASSERT_TRUE(std::regex_match(text, m, re)) << text;
      std::vector<int64_t> nums;
      std::stringstream ss(m[1].str());
      std::string tok;
      while (std::getline(ss, tok, ',')) nums.push_back(std::stoll(tok));
      ASSERT_EQ(nums.size(), static_cast<size_t>(n));
      for (int64_t x : nums) EXPECT_TRUE(x >= 1 && x <= 20) << text;
      const int64_t target = std::stoll(m[2]);
      EXPECT_GE(target, 1);
      std::string expected_truth = "{\"target\":" + std::to_string(target) + ",\"numbers\":[";
      for (size_t k = 0; k < nums.size(); ++k) expected_truth += (k ? "," : "") + std::to_string(nums[k]);
      EXPECT_EQ(rl[i].ground_truth, expected_truth + "]}");
      EXPECT_EQ(rl[i].data_source, "countdown");
      EXPECT_TRUE(reachable(std::vector<double>(nums.begin(), nums.end()), static_cast<double>(target))) << text;
      const std::string& answer = sft[i].messages.at(1).content;
      EXPECT_EQ(answer.rfind("<answer>", 0), 0u);
      EXPECT_EQ(compute_score("countdown", answer, rl[i].ground_truth), 1.0) << text << " " << answer;
    }
  }
}

TEST(VerifiableTasks, TinyCountdownSpaceIsEnumerable) {
  // Numbers from {1, 2}, two of them, all intermediate values positive integers:
  // {1,1} -> 2 (+), 1 (* or /); {1,2} -> 3, 2, 1; {2,2} -> 4 (+ or *), 1 (/). Seven problems.
  const std::set<std::string> space = {"1,1=2", "1,1=1", "1,2=3", "1,2=2", "1,2=1", "2,2=4", "2,2=1"};
  TaskGenOptions o;
  o.task = "countdown";
  o.countdown_numbers = 2;
  o.countdown_max_number = 2;
  o.count = 30;
  o.test_fraction = 0.5;
  std::set<std::string> seen[2];
  int s = 0;
  for (const std::string split : {"train", "test"}) {
    o.split = split;
    for (const auto& e : generate_tasks(o)) {
      std::smatch m;
      const std::regex re("numbers \\[([12]), ([12])\\], create an equation that equals ([0-9]+)\\.");
      ASSERT_TRUE(std::regex_search(e.prompt[0].content, m, re)) << e.prompt[0].content;
      std::string a = m[1], b = m[2];
      if (a > b) std::swap(a, b);
      seen[s].insert(a + "," + b + "=" + m[3].str());
    }
    ++s;
  }
  std::set<std::string> all = seen[0];
  all.insert(seen[1].begin(), seen[1].end());
  EXPECT_EQ(all, space);
  EXPECT_EQ(seen[0].size() + seen[1].size(), 7u);  // disjoint
}

TEST(VerifiableTasks, RoundTripThroughJsonlFiles) {
  TempDir dir;
  TaskGenOptions o;
  o.task = "countdown";
  o.count = 50;
  const auto rl = generate_tasks(o);
  const auto sft = generate_sft_tasks(o);
  write_rl_jsonl(dir.file("rl.jsonl"), rl);
  write_sft_jsonl(dir.file("sft.jsonl"), sft);
  const auto rl_back = read_rl_jsonl(dir.file("rl.jsonl"));
  const auto sft_back = read_sft_jsonl(dir.file("sft.jsonl"));
  ASSERT_EQ(rl_back.size(), rl.size());
  ASSERT_EQ(sft_back.size(), sft.size());
  // The ground truth travels as a JSON object, as in verl's parquet files.
  EXPECT_NE(read_text(dir.file("rl.jsonl")).find("\"ground_truth\":{\"target\":"), std::string::npos);
  for (size_t i = 0; i < rl.size(); ++i) {
    EXPECT_TRUE(same(rl_back[i].prompt, rl[i].prompt));
    EXPECT_EQ(rl_back[i].ground_truth, rl[i].ground_truth);
    EXPECT_EQ(rl_back[i].data_source, rl[i].data_source);
    EXPECT_EQ(rl_back[i].extra_info_json, rl[i].extra_info_json);
    EXPECT_TRUE(same(sft_back[i].messages, sft[i].messages));
    EXPECT_EQ(compute_score(rl_back[i].data_source, sft_back[i].messages[1].content, rl_back[i].ground_truth), 1.0);
  }
}

TEST(VerifiableTasks, BadOptionsThrow) {
  auto with = [](auto edit) {
    TaskGenOptions o;
    edit(o);
    return o;
  };
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.task = "sudoku"; })); }, {"\"sudoku\"", "arith, countdown"});
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.count = 0; })); }, {"count"});
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.split = "val"; })); }, {"\"val\""});
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.test_fraction = 1.5; })); }, {"test_fraction"});
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.test_fraction = std::nan(""); })); }, {"test_fraction"});
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.split = "test"; o.test_fraction = 0; })); },
               {"test split is empty"});
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.test_fraction = 1; })); }, {"train split is empty"});
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.digits = 0; })); }, {"digits"});
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.task = "countdown"; o.countdown_numbers = 1; })); },
               {"countdown_numbers"});
  expect_error([&] { generate_tasks(with([](TaskGenOptions& o) { o.task = "countdown"; o.countdown_max_number = 0; })); },
               {"countdown_max_number"});
  expect_error([&] {
    generate_tasks(with([](TaskGenOptions& o) { o.task = "countdown"; o.countdown_numbers = 6; o.countdown_max_number = 1000; }));
  }, {"2^53"});
}

}  // namespace
