// SFT and RL JSONL readers and writers (include/mfsdp/data/posttrain/chat_dataset.h, docs/post_training_data.md).
// Every reader error names the file and the 1-based line, so a bad record in a large dataset is
// found without bisecting.
#include "mfsdp/data/posttrain/chat_dataset.h"

#include <fstream>
#include <functional>
#include <stdexcept>
#include <nlohmann/json.hpp>

#include "mfsdp/base/json_parse.h"

namespace mfsdp {
namespace {

// ordered_json keeps the keys in file order, so JSON text read here (a ground-truth object, the
// extra_info) is written back unchanged, and messages come out as {"role", "content"}.
using json = nlohmann::ordered_json;

// A reader error: "<path>:<line>: <what>".
struct LineError : std::invalid_argument {
  LineError(const std::string& path, int64_t line, const std::string& what)
      : std::invalid_argument(path + ":" + std::to_string(line) + ": " + what) {}
};

bool is_blank(const std::string& s) {
  for (char c : s)
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n' && c != '\v' && c != '\f') return false;
  return true;
}

bool known_role(const std::string& role) {
  return role == "system" || role == "user" || role == "assistant";
}

const char* type_name(const json& j) { return j.type_name(); }

// Parses a list of {"role", "content"} objects; `what` names the field in errors. Extra keys in
// a message (verl and TRL datasets sometimes carry "name" or "loss") are ignored.
std::vector<ChatMessage> parse_messages(const json& j, const std::string& what,
                                        const std::function<void(const std::string&)>& fail) {
  if (!j.is_array()) fail(what + " must be a list of {\"role\", \"content\"} objects, got " + type_name(j));
  if (j.empty()) fail(what + " is an empty list");
  std::vector<ChatMessage> out;
  out.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const json& m = j[i];
    const std::string where = what + "[" + std::to_string(i) + "]";
    if (!m.is_object()) fail(where + " must be an object, got " + type_name(m));
    auto role = m.find("role");
    auto content = m.find("content");
    if (role == m.end()) fail(where + " has no \"role\"");
    if (content == m.end()) fail(where + " has no \"content\"");
    if (!role->is_string()) fail(where + ".role must be a string, got " + type_name(*role));
    if (!content->is_string()) fail(where + ".content must be a string, got " + type_name(*content));
    ChatMessage msg{role->get<std::string>(), content->get<std::string>()};
    if (!known_role(msg.role))
      fail(where + ".role \"" + msg.role + "\" is unknown (expected system, user or assistant)");
    out.push_back(std::move(msg));
  }
  return out;
}

// Calls `on_record(object, fail)` for every non-blank line of `path`, parsed as a JSON object.
void for_each_record(const std::string& path,
                     const std::function<void(const json&, const std::function<void(const std::string&)>&)>& on_record) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(path + ":0: cannot open file");
  std::string line;
  int64_t line_no = 0;
  int64_t records = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (is_blank(line)) continue;
    auto fail = [&](const std::string& what) { throw LineError(path, line_no, what); };
    json j;
    try {
      j = parse_ordered_json(line);
    } catch (const json::exception& e) {  // parse_error, out_of_range (1e999999), nesting past the limit
      fail(std::string("invalid JSON (") + e.what() + ")");
    }
    if (!j.is_object()) fail(std::string("a line must hold a JSON object, got ") + type_name(j));
    on_record(j, fail);
    ++records;
  }
  if (in.bad()) throw std::invalid_argument(path + ":" + std::to_string(line_no) + ": read error");
  if (records == 0) throw LineError(path, line_no, "no examples (the file is empty or only blank lines)");
}

// dump() in the one style used for every JSON text kept or written here: compact, UTF-8 as is.
// Strings that are not valid UTF-8 cannot be written as JSON; that is reported, not replaced.
std::string dump_json(const json& j, const std::string& what) {
  try {
    return j.dump();
  } catch (const json::type_error& e) {
    throw std::invalid_argument(what + ": cannot be written as JSON (" + e.what() + ")");
  }
}

json messages_json(const std::vector<ChatMessage>& messages) {
  json list = json::array();
  for (const ChatMessage& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  return list;
}

void write_lines(const std::string& path, const std::vector<std::string>& lines) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error(path + ": cannot open for writing");
  for (const std::string& l : lines) out << l << '\n';
  out.flush();
  if (!out) throw std::runtime_error(path + ": write failed");
}

}  // namespace

std::vector<SftExample> read_sft_jsonl(const std::string& path, const SftJsonlOptions& options) {
  std::vector<SftExample> examples;
  for_each_record(path, [&](const json& j, const std::function<void(const std::string&)>& fail) {
    SftExample ex;
    auto messages = j.find(options.messages_key);
    if (messages != j.end()) {
      ex.messages = parse_messages(*messages, "\"" + options.messages_key + "\"", fail);
    } else {
      auto prompt = j.find(options.prompt_key);
      auto response = j.find(options.response_key);
      if (prompt == j.end() || response == j.end())
        fail("expected \"" + options.messages_key + "\", or \"" + options.prompt_key + "\" and \"" +
             options.response_key + "\"; missing \"" +
             (prompt == j.end() ? options.prompt_key : options.response_key) + "\"");
      if (prompt->is_string())
        ex.messages.push_back({"user", prompt->get<std::string>()});
      else if (prompt->is_array())
        ex.messages = parse_messages(*prompt, "\"" + options.prompt_key + "\"", fail);
      else
        fail("\"" + options.prompt_key + "\" must be a string or a list of messages, got " + type_name(*prompt));
      if (response->is_string()) {
        ex.messages.push_back({"assistant", response->get<std::string>()});
      } else if (response->is_array()) {
        for (ChatMessage& m : parse_messages(*response, "\"" + options.response_key + "\"", fail))
          ex.messages.push_back(std::move(m));
      } else {
        fail("\"" + options.response_key + "\" must be a string or a list of messages, got " +
             type_name(*response));
      }
    }
    // Without an assistant turn there is nothing to train on: the loss mask would be all zeros.
    bool has_assistant = false;
    for (const ChatMessage& m : ex.messages) has_assistant |= m.role == "assistant";
    if (!has_assistant) fail("the conversation has no assistant message");
    examples.push_back(std::move(ex));
  });
  return examples;
}

void write_sft_jsonl(const std::string& path, const std::vector<SftExample>& examples) {
  std::vector<std::string> lines;
  lines.reserve(examples.size());
  for (size_t i = 0; i < examples.size(); ++i) {
    const std::string where = path + ": example " + std::to_string(i);
    bool has_assistant = false;
    for (const ChatMessage& m : examples[i].messages) {
      if (!known_role(m.role))
        throw std::invalid_argument(where + ": role \"" + m.role + "\" is unknown (expected system, user or assistant)");
      has_assistant |= m.role == "assistant";
    }
    // Refuse to write what read_sft_jsonl would refuse to read.
    if (!has_assistant) throw std::invalid_argument(where + ": the conversation has no assistant message");
    lines.push_back(dump_json(json{{"messages", messages_json(examples[i].messages)}}, where));
  }
  write_lines(path, lines);
}

std::vector<RlExample> read_rl_jsonl(const std::string& path, const std::function<void(const RlExample&)>& check) {
  std::vector<RlExample> examples;
  for_each_record(path, [&](const json& j, const std::function<void(const std::string&)>& fail) {
    RlExample ex;
    auto prompt = j.find("prompt");
    if (prompt == j.end()) fail("missing \"prompt\"");
    if (prompt->is_string())
      ex.prompt.push_back({"user", prompt->get<std::string>()});
    else if (prompt->is_array())
      ex.prompt = parse_messages(*prompt, "\"prompt\"", fail);
    else
      fail(std::string("\"prompt\" must be a string or a list of messages, got ") + type_name(*prompt));

    auto rm = j.find("reward_model");
    if (rm == j.end()) fail("missing \"reward_model\"");
    if (!rm->is_object()) fail(std::string("\"reward_model\" must be an object, got ") + type_name(*rm));
    // verl also knows style "model" (a learned reward model); only rule rewards exist here.
    auto style = rm->find("style");
    if (style != rm->end() && !(style->is_string() && style->get<std::string>() == "rule"))
      fail("\"reward_model.style\" must be \"rule\", got " + style->dump());
    auto gt = rm->find("ground_truth");
    if (gt == rm->end()) fail("missing \"reward_model.ground_truth\"");
    if (gt->is_null()) fail("\"reward_model.ground_truth\" is null");
    ex.ground_truth = gt->is_string() ? gt->get<std::string>() : gt->dump();

    auto ds = j.find("data_source");
    if (ds == j.end()) fail("missing \"data_source\"");
    if (!ds->is_string()) fail(std::string("\"data_source\" must be a string, got ") + type_name(*ds));
    ex.data_source = ds->get<std::string>();

    auto extra = j.find("extra_info");
    if (extra != j.end()) ex.extra_info_json = extra->dump();
    if (check) {
      try {
        check(ex);
      } catch (const std::invalid_argument& e) {
        fail(e.what());
      }
    }
    examples.push_back(std::move(ex));
  });
  return examples;
}

void write_rl_jsonl(const std::string& path, const std::vector<RlExample>& examples) {
  std::vector<std::string> lines;
  lines.reserve(examples.size());
  for (size_t i = 0; i < examples.size(); ++i) {
    const RlExample& ex = examples[i];
    const std::string where = path + ": example " + std::to_string(i);
    if (ex.prompt.empty()) throw std::invalid_argument(where + ": empty prompt");
    for (const ChatMessage& m : ex.prompt)
      if (!known_role(m.role))
        throw std::invalid_argument(where + ": role \"" + m.role + "\" is unknown (expected system, user or assistant)");
    // A ground truth that is the canonical text of a JSON object or array (countdown's
    // {"target":..,"numbers":[..]}) goes out as that value, the way verl's parquet files hold
    // it; everything else as a string. Only canonical text qualifies, so reading the file back
    // gives the same string.
    json gt = ex.ground_truth;
    json parsed = try_parse_ordered_json(ex.ground_truth);
    if ((parsed.is_object() || parsed.is_array()) && parsed.dump() == ex.ground_truth) gt = parsed;
    json extra = try_parse_ordered_json(ex.extra_info_json);
    if (extra.is_discarded())
      throw std::invalid_argument(where + ": extra_info_json is not valid JSON: " + ex.extra_info_json);
    json record = {{"data_source", ex.data_source},
                   {"prompt", messages_json(ex.prompt)},
                   {"reward_model", {{"style", "rule"}, {"ground_truth", gt}}},
                   {"extra_info", extra}};
    lines.push_back(dump_json(record, where));
  }
  write_lines(path, lines);
}

}  // namespace mfsdp
