// Generated verifiable tasks (include/mfsdp/data/posttrain/verifiable_tasks.h, docs/post_training_data.md).
//
// Problems are drawn one at a time from a splitmix64 stream seeded by options.seed and kept when
// they belong to the requested split and are new. The split of a problem depends only on its
// canonical text (never on the seed), so any train run and any test run are disjoint. A split's
// space counts as exhausted after kExhaustedAfter consecutive draws that bring nothing new; from
// then on duplicates are accepted.
#include "mfsdp/data/posttrain/verifiable_tasks.h"

#include "mfsdp/base/splitmix64.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <unordered_set>

namespace mfsdp {
namespace {

constexpr int64_t kExhaustedAfter = 200000;

// splitmix64 (Steele, Lea, Flood 2014): the same stream on every compiler and standard library,
// which std::uniform_int_distribution does not promise.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() { return splitmix64_mix(state_ += 0x9e3779b97f4a7c15ULL); }
  // Uniform in [0, n), n > 0, without modulo bias: draws below 2^64 mod n are rejected.
  uint64_t below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    while (true) {
      uint64_t x = next();
      if (x >= threshold) return x % n;
    }
  }
  int64_t uniform(int64_t lo, int64_t hi) {  // inclusive
    return lo + static_cast<int64_t>(below(static_cast<uint64_t>(hi - lo) + 1));
  }

 private:
  uint64_t state_;
};

// FNV-1a over the canonical text, then the splitmix64 finaliser to spread FNV's weak low bits.
uint64_t text_hash(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return splitmix64_mix(h);
}

bool in_test_split(const std::string& canonical, double test_fraction) {
  // h / 2^64 < f, computed as h < f * 2^64 without overflow at the ends.
  if (test_fraction <= 0.0) return false;
  if (test_fraction >= 1.0) return true;
  const double scaled = std::ldexp(test_fraction, 64);
  return static_cast<double>(text_hash(canonical)) < scaled;
}

struct Problem {
  std::string canonical;  // identity for the split hash and for de-duplication
  std::string prompt;
  std::string ground_truth;
  std::string answer;  // the assistant turn of the SFT form
};

// ---- arith ---------------------------------------------------------------------------------

Problem draw_arith(SplitMix64& rng, int digits) {
  int64_t hi = 1;
  for (int i = 0; i < digits; ++i) hi *= 10;
  const int64_t lo = digits == 1 ? 0 : hi / 10;  // exactly `digits` digits; 0 counts as one digit
  hi -= 1;
  const int64_t a = rng.uniform(lo, hi);
  const int64_t b = rng.uniform(lo, hi);
  Problem p;
  p.prompt = std::to_string(a) + "+" + std::to_string(b) + "=";
  p.canonical = "arith:" + p.prompt;
  p.ground_truth = std::to_string(a + b);
  p.answer = p.ground_truth;
  return p;
}

// ---- countdown -----------------------------------------------------------------------------

struct Term {
  int64_t value;
  std::string text;
  bool compound;  // needs parentheses when it becomes an operand
};

std::string operand(const Term& t) { return t.compound ? "(" + t.text + ")" : t.text; }

std::string join_numbers(const std::vector<int64_t>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

// Numbers uniform in 1..max (with repetition, as TinyZero draws them); the target is the value
// of a random expression that combines all of them: two random terms at a time, with an operator
// drawn among those that keep every intermediate value a positive integer (+ and * always; a - b
// when a > b, larger minus smaller; a / b when b divides a). The target is therefore reachable
// by construction, and the expression is the SFT answer.
Problem draw_countdown(SplitMix64& rng, int count, int max_number) {
  std::vector<int64_t> numbers(count);
  for (auto& n : numbers) n = rng.uniform(1, max_number);
  std::vector<Term> terms;
  for (int64_t n : numbers) terms.push_back({n, std::to_string(n), false});
  while (terms.size() > 1) {
    size_t i = rng.below(terms.size());
    size_t j = rng.below(terms.size() - 1);
    if (j >= i) ++j;
    Term a = terms[i], b = terms[j];
    std::vector<char> ops = {'+', '*'};
    if (a.value != b.value) ops.push_back('-');
    if (a.value % b.value == 0 || b.value % a.value == 0) ops.push_back('/');
    const char op = ops[rng.below(ops.size())];
    if ((op == '-' && a.value < b.value) || (op == '/' && a.value % b.value != 0)) std::swap(a, b);
    int64_t v = 0;
    switch (op) {
      case '+': v = a.value + b.value; break;
      case '*': v = a.value * b.value; break;
      case '-': v = a.value - b.value; break;
      default: v = a.value / b.value; break;
    }
    Term combined{v, operand(a) + " " + op + " " + operand(b), true};
    terms.erase(terms.begin() + static_cast<std::ptrdiff_t>(std::max(i, j)));
    terms.erase(terms.begin() + static_cast<std::ptrdiff_t>(std::min(i, j)));
    terms.push_back(std::move(combined));
  }
  const int64_t target = terms[0].value;
  Problem p;
  p.prompt = "Using the numbers [" + join_numbers(numbers, ", ") + "], create an equation that equals " +
             std::to_string(target) +
             ". You may use + - * / and each number once. Put the equation in <answer></answer>.";
  p.ground_truth = "{\"target\":" + std::to_string(target) + ",\"numbers\":[" + join_numbers(numbers, ",") + "]}";
  // The order the numbers are shown in does not change the problem: one identity per multiset.
  std::vector<int64_t> sorted = numbers;
  std::sort(sorted.begin(), sorted.end());
  p.canonical = "countdown:" + join_numbers(sorted, ",") + "=" + std::to_string(target);
  p.answer = "<answer>" + terms[0].text + "</answer>";
  return p;
}

void validate(const TaskGenOptions& o) {
  auto bad = [](const std::string& what) { return std::invalid_argument("task generation: " + what); };
  if (o.task != "arith" && o.task != "countdown")
    throw bad("unknown task \"" + o.task + "\" (known: arith, countdown)");
  if (o.count <= 0) throw bad("count must be positive, got " + std::to_string(o.count));
  if (o.split != "train" && o.split != "test")
    throw bad("split must be \"train\" or \"test\", got \"" + o.split + "\"");
  if (!(o.test_fraction >= 0.0 && o.test_fraction <= 1.0))
    throw bad("test_fraction must be in [0, 1], got " + std::to_string(o.test_fraction));
  if (o.split == "test" && o.test_fraction == 0.0) throw bad("the test split is empty (test_fraction 0)");
  if (o.split == "train" && o.test_fraction == 1.0) throw bad("the train split is empty (test_fraction 1)");
  if (o.task == "arith" && (o.digits < 1 || o.digits > 18))
    throw bad("digits must be in 1..18, got " + std::to_string(o.digits));
  if (o.task == "countdown") {
    if (o.countdown_numbers < 2 || o.countdown_numbers > 6)
      throw bad("countdown_numbers must be in 2..6, got " + std::to_string(o.countdown_numbers));
    if (o.countdown_max_number < 1) throw bad("countdown_max_number must be >= 1, got " + std::to_string(o.countdown_max_number));
    // The largest target (every number multiplied) must stay exact in the reward's double
    // arithmetic.
    const double largest = std::pow(static_cast<double>(o.countdown_max_number), o.countdown_numbers);
    if (largest > 9007199254740992.0)  // 2^53
      throw bad("countdown_max_number^countdown_numbers exceeds 2^53 (" + std::to_string(o.countdown_max_number) +
                "^" + std::to_string(o.countdown_numbers) + ")");
  }
}

std::vector<Problem> generate_problems(const TaskGenOptions& o) {
  validate(o);
  const bool want_test = o.split == "test";
  SplitMix64 rng(o.seed);
  std::unordered_set<std::string> seen;
  std::vector<Problem> out;
  out.reserve(static_cast<size_t>(o.count));
  int64_t misses = 0;  // consecutive draws that gave nothing usable
  bool exhausted = false;
  while (static_cast<int64_t>(out.size()) < o.count) {
    Problem p = o.task == "arith" ? draw_arith(rng, o.digits)
                                  : draw_countdown(rng, o.countdown_numbers, o.countdown_max_number);
    const bool usable = in_test_split(p.canonical, o.test_fraction) == want_test &&
                        (exhausted || seen.insert(p.canonical).second);
    if (usable) {
      out.push_back(std::move(p));
      misses = 0;
      continue;
    }
    if (++misses < kExhaustedAfter) continue;
    if (out.empty())
      throw std::invalid_argument("task generation: no " + o.split + " problem found in " +
                                  std::to_string(kExhaustedAfter) + " draws of task " + o.task +
                                  " (test_fraction " + std::to_string(o.test_fraction) + ")");
    exhausted = true;  // every problem of the split has been produced; repeat them from here
    misses = 0;
  }
  return out;
}

}  // namespace

std::vector<RlExample> generate_tasks(const TaskGenOptions& options) {
  std::vector<RlExample> out;
  for (Problem& p : generate_problems(options)) {
    // verl's preprocessing scripts record the split and the index in extra_info; so do we.
    const std::string extra =
        "{\"split\":\"" + options.split + "\",\"index\":" + std::to_string(out.size()) + "}";
    out.push_back(RlExample{{ChatMessage{"user", std::move(p.prompt)}}, std::move(p.ground_truth), options.task, extra});
  }
  return out;
}

std::vector<SftExample> generate_sft_tasks(const TaskGenOptions& options) {
  std::vector<SftExample> out;
  for (Problem& p : generate_problems(options))
    out.push_back(SftExample{{ChatMessage{"user", std::move(p.prompt)}, ChatMessage{"assistant", std::move(p.answer)}}});
  return out;
}

}  // namespace mfsdp
