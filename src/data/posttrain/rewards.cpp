// Rule rewards (include/mfsdp/data/posttrain/rewards.h, docs/post_training_data.md): exact match, verl's GSM8K
// answer extraction and TinyZero's countdown check, with a hand-written expression parser in
// place of Python's eval.
#include "mfsdp/data/posttrain/rewards.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <nlohmann/json.hpp>

#include "mfsdp/base/json_parse.h"

namespace mfsdp {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string strip(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && is_space(s[b])) ++b;
  while (e > b && is_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

// ---- GSM8K ---------------------------------------------------------------------------------

// verl matches only the last 300 characters (Python str, i.e. code points) for speed; the same
// window changes which number is "last" when a response is long, so it is kept. UTF-8
// continuation bytes (10xxxxxx) are not counted as characters.
constexpr size_t kGsm8kWindow = 300;

std::string last_code_points(const std::string& s, size_t n) {
  size_t count = 0;
  size_t pos = s.size();
  while (pos > 0 && count < n) {
    --pos;
    if ((static_cast<unsigned char>(s[pos]) & 0xC0) != 0x80) ++count;
  }
  return s.substr(pos);
}

bool is_number_char(char c) { return is_digit(c) || c == '.' || c == ','; }

// The match of verl's pattern -?[0-9.,]+ starting at `pos`, or "" when none starts there.
std::string number_token_at(const std::string& s, size_t pos) {
  size_t b = pos;
  if (b < s.size() && s[b] == '-') ++b;
  size_t e = b;
  while (e < s.size() && is_number_char(s[e])) ++e;
  if (e == b) return "";
  return s.substr(pos, e - pos);
}

// Commas (thousands separators) and "$" out, trailing "." (end of sentence) dropped, whitespace
// stripped: "$1,234." -> "1234".
std::string normalize_number(const std::string& s) {
  std::string out;
  for (char c : strip(s))
    if (c != ',' && c != '$') out.push_back(c);
  while (!out.empty() && out.back() == '.') out.pop_back();
  return out;
}

// strict: the token after the last "#### " (an optional "$" between them is skipped, the one
// extension to verl's pattern); flexible: the last token holding a digit. Returns false when
// there is none.
bool extract_gsm8k_answer(const std::string& text, bool strict, std::string& answer) {
  bool found = false;
  if (strict) {
    const std::string marker = "#### ";
    for (size_t pos = text.find(marker); pos != std::string::npos; pos = text.find(marker, pos + 1)) {
      size_t start = pos + marker.size();
      if (start < text.size() && text[start] == '$') ++start;
      std::string tok = number_token_at(text, start);
      if (!tok.empty()) {
        answer = tok;
        found = true;
      }
    }
    return found;
  }
  size_t i = 0;
  while (i < text.size()) {
    std::string tok = number_token_at(text, i);
    if (tok.empty()) {
      ++i;
      continue;
    }
    // verl skips only the tokens "" and "."; "," or ".." are not numbers either.
    if (std::any_of(tok.begin(), tok.end(), is_digit)) {
      answer = tok;
      found = true;
    }
    i += tok.size();
  }
  return found;
}

// ---- countdown -----------------------------------------------------------------------------

// The content of the last <answer>...</answer>: matches are taken left to right, each ending at
// the first "</answer>" after its "<answer>" (Python's non-greedy finditer), and the last wins.
bool extract_answer_tag(const std::string& text, std::string& content) {
  const std::string open = "<answer>", close = "</answer>";
  bool found = false;
  size_t pos = 0;
  while (true) {
    size_t b = text.find(open, pos);
    if (b == std::string::npos) break;
    size_t e = text.find(close, b + open.size());
    if (e == std::string::npos) break;
    content = text.substr(b + open.size(), e - b - open.size());
    found = true;
    pos = e + close.size();
  }
  return found;
}

struct InvalidEquation {};  // thrown inside the parser only; any invalid equation scores 0.1

// Recursive descent over
//   expr   := term (("+" | "-") term)*
//   term   := factor (("*" | "/") factor)*
//   factor := ("+" | "-") factor | integer | "(" expr ")"
// the subset of Python expressions TinyZero's eval accepts from its allowed characters, minus
// "**", "//" and decimal points (not among + - * /). Division is true division in double, as
// Python 3; the numbers met are collected for the each-number-once check.
class EquationParser {
 public:
  explicit EquationParser(const std::string& s) : s_(s) {}

  double parse(std::vector<int64_t>& numbers) {
    double v = expr();
    skip_space();
    if (pos_ != s_.size()) throw InvalidEquation{};  // e.g. "3 4" or an unmatched ")"
    numbers = numbers_;
    return v;
  }

 private:
  void skip_space() {
    while (pos_ < s_.size() && is_space(s_[pos_])) ++pos_;
  }
  bool accept(char c) {
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  double expr() {
    double v = term();
    while (true) {
      if (accept('+')) v += term();
      else if (accept('-')) v -= term();
      else return v;
    }
  }
  double term() {
    double v = factor();
    while (true) {
      if (accept('*')) {
        if (pos_ < s_.size() && s_[pos_] == '*') throw InvalidEquation{};  // "**"
        v *= factor();
      } else if (accept('/')) {
        if (pos_ < s_.size() && s_[pos_] == '/') throw InvalidEquation{};  // "//"
        double d = factor();
        if (d == 0.0) throw InvalidEquation{};  // Python raises ZeroDivisionError
        v /= d;
      } else {
        return v;
      }
    }
  }
  double factor() {
    if (++depth_ > 200) throw InvalidEquation{};  // bounds the recursion on "((((..." input
    double v;
    if (accept('-')) v = -factor();
    else if (accept('+')) v = factor();
    else if (accept('(')) {
      v = expr();
      if (!accept(')')) throw InvalidEquation{};
    } else {
      v = integer();
    }
    --depth_;
    return v;
  }
  double integer() {
    skip_space();
    size_t b = pos_;
    while (pos_ < s_.size() && is_digit(s_[pos_])) ++pos_;
    size_t len = pos_ - b;
    if (len == 0) throw InvalidEquation{};
    // Python 3 rejects "07"; 18 digits keep the value inside int64.
    if ((len > 1 && s_[b] == '0') || len > 18) throw InvalidEquation{};
    int64_t n = std::stoll(s_.substr(b, len));
    numbers_.push_back(n);
    return static_cast<double>(n);
  }

  const std::string& s_;
  size_t pos_ = 0;
  int depth_ = 0;
  std::vector<int64_t> numbers_;
};

struct CountdownTruth {
  int64_t target;
  std::vector<int64_t> numbers;
};

CountdownTruth parse_countdown_truth(const std::string& ground_truth_json) {
  auto bad = [&](const std::string& what) {
    // At most 200 characters of the text: a hostile one can be megabytes.
    const std::string quoted = ground_truth_json.size() <= 200 ? ground_truth_json
                                                               : ground_truth_json.substr(0, 200) + "...";
    return std::invalid_argument("countdown ground truth " + what +
                                 " (expected {\"target\": int, \"numbers\": [ints]}): " + quoted);
  };
  const nlohmann::json j = try_parse_json(ground_truth_json);
  if (j.is_discarded()) throw bad("is not valid JSON");
  if (!j.is_object()) throw bad("is not an object");
  auto t = j.find("target");
  auto ns = j.find("numbers");
  if (t == j.end() || !t->is_number_integer()) throw bad("has no integer \"target\"");
  if (ns == j.end() || !ns->is_array() || ns->empty()) throw bad("has no non-empty list \"numbers\"");
  CountdownTruth truth{t->get<int64_t>(), {}};
  for (const auto& n : *ns) {
    if (!n.is_number_integer()) throw bad("has a non-integer in \"numbers\"");
    truth.numbers.push_back(n.get<int64_t>());
  }
  return truth;
}

}  // namespace

double exact_match_reward(const std::string& response, const std::string& ground_truth) {
  return strip(response) == strip(ground_truth) ? 1.0 : 0.0;
}

double gsm8k_reward(const std::string& response, const std::string& ground_truth, bool strict) {
  std::string answer;
  if (!extract_gsm8k_answer(last_code_points(response, kGsm8kWindow), strict, answer)) return 0.0;
  return normalize_number(answer) == normalize_number(ground_truth) ? 1.0 : 0.0;
}

double countdown_reward(const std::string& response, const std::string& ground_truth_json) {
  constexpr double kCorrect = 1.0, kFormat = 0.1;
  const CountdownTruth truth = parse_countdown_truth(ground_truth_json);
  std::string equation;
  if (!extract_answer_tag(response, equation)) return 0.0;
  equation = strip(equation);
  for (char c : equation)
    if (!(is_digit(c) || is_space(c) || c == '+' || c == '-' || c == '*' || c == '/' || c == '(' || c == ')'))
      return kFormat;
  std::vector<int64_t> used;
  double value;
  try {
    value = EquationParser(equation).parse(used);
  } catch (const InvalidEquation&) {
    return kFormat;
  }
  std::vector<int64_t> available = truth.numbers;
  std::sort(used.begin(), used.end());
  std::sort(available.begin(), available.end());
  if (used != available) return kFormat;  // a number reused, missing or not offered
  if (!std::isfinite(value)) return kFormat;
  return std::fabs(value - static_cast<double>(truth.target)) < 1e-5 ? kCorrect : kFormat;
}

namespace {

[[noreturn]] void no_rule_reward(const std::string& data_source) {
  throw std::invalid_argument("no rule reward for data_source \"" + data_source +
                              "\" (known: exact, arith, openai/gsm8k, gsm8k, countdown; or choose one "
                              "with --reward exact|gsm8k|countdown)");
}

}  // namespace

double compute_score(const std::string& data_source, const std::string& response,
                     const std::string& ground_truth) {
  if (data_source == "exact" || data_source == "arith") return exact_match_reward(response, ground_truth);
  if (data_source == "openai/gsm8k" || data_source == "gsm8k") return gsm8k_reward(response, ground_truth);
  if (data_source == "countdown") return countdown_reward(response, ground_truth);
  no_rule_reward(data_source);
}

void check_reward_for(const std::string& reward, const std::string& data_source) {
  if (reward != "auto") return;
  for (const char* known : {"exact", "arith", "openai/gsm8k", "gsm8k", "countdown"})
    if (data_source == known) return;
  no_rule_reward(data_source);
}

double compute_score_by_name(const std::string& reward, const std::string& data_source,
                             const std::string& response, const std::string& ground_truth) {
  if (reward == "auto") return compute_score(data_source, response, ground_truth);
  if (reward == "exact") return exact_match_reward(response, ground_truth);
  if (reward == "gsm8k") return gsm8k_reward(response, ground_truth);
  if (reward == "countdown") return countdown_reward(response, ground_truth);
  throw std::invalid_argument("unknown reward \"" + reward + "\" (known: auto, exact, gsm8k, countdown)");
}

const std::vector<std::string>& reward_names() {
  static const std::vector<std::string> names = {"auto", "exact", "gsm8k", "countdown"};
  return names;
}

}  // namespace mfsdp
