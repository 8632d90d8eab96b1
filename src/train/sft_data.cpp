#include "mfsdp/train/sft_data.h"

#include "mfsdp/base/json_parse.h"
#include "mfsdp/base/splitmix64.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <stdexcept>

#include "mfsdp/data/posttrain/chat_template.h"

namespace mfsdp {

using nlohmann::json;

namespace {

void check_max_length(const SftTokenizeOptions& o) {
  if (o.max_length < 2) throw std::invalid_argument("--max-length: must be >= 2, got " + std::to_string(o.max_length));
}

// --loss-on all, --max-length and --truncation on one sequence; `at` names it in errors and
// `no_target` says why a sequence may have no target.
void fit_sequence(SftSequence& s, const SftTokenizeOptions& o, const std::string& at, const std::string& no_target) {
  if (o.loss_on_all) std::fill(s.loss_mask.begin(), s.loss_mask.end(), 1);
  const auto length = static_cast<int64_t>(s.ids.size());
  if (length > o.max_length) {
    if (o.truncation == "error")
      throw std::invalid_argument(at + " has " + std::to_string(length) + " tokens, more than --max-length " +
                                  std::to_string(o.max_length) + " (--truncation left or right cuts it)");
    const int64_t drop = length - o.max_length;
    const auto from = o.truncation == "left" ? drop : 0;
    s.ids = std::vector<int64_t>(s.ids.begin() + from, s.ids.begin() + from + o.max_length);
    s.loss_mask = std::vector<uint8_t>(s.loss_mask.begin() + from, s.loss_mask.begin() + from + o.max_length);
  }
  s.loss_mask[0] = 0;  // nothing predicts the first token
  if (std::find(s.loss_mask.begin(), s.loss_mask.end(), 1) == s.loss_mask.end())
    throw std::invalid_argument(at + " has no token to train on" +
                                (length > o.max_length ? " after --truncation " + o.truncation : no_target));
}

}  // namespace

std::vector<SftSequence> tokenize_sft_examples(const std::vector<SftExample>& examples, const Tokenizer& tokenizer,
                                               const SftTokenizeOptions& o, const std::string& where) {
  check_max_length(o);
  std::vector<SftSequence> out;
  out.reserve(examples.size());
  for (size_t i = 0; i < examples.size(); ++i) {
    ChatTokens t = apply_chat_template(tokenizer, o.chat_template, examples[i].messages, false);
    SftSequence s{std::move(t.ids), std::move(t.loss_mask)};
    fit_sequence(s, o, where + ": example " + std::to_string(i + 1), " (no assistant message?)");
    out.push_back(std::move(s));
  }
  return out;
}

namespace {

bool is_blank(const std::string& s) { return s.find_first_not_of(" \t\r\n\v\f") == std::string::npos; }

// A JSON integer in [lo, hi], or nullopt (a float, a string, an integer out of range).
std::optional<int64_t> integer_in(const json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi) || static_cast<int64_t>(u) < lo) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (!v.is_number_integer()) return std::nullopt;
  const auto i = v.get<int64_t>();
  if (i < lo || i > hi) return std::nullopt;
  return i;
}

// A JSON value in words for errors, cut short.
std::string shown(const json& v) {
  std::string s = v.dump();
  return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

// One pre-tokenized line, checked; `fail` throws with the file and line.
SftSequence parse_pretokenized(const json& j, int64_t vocab_size, const std::function<void(const std::string&)>& fail) {
  if (!j.is_object()) fail(std::string("a line must hold a JSON object, got ") + j.type_name());
  const auto ids_it = j.find("input_ids");
  if (ids_it == j.end())
    fail("no \"input_ids\" (the file's first line has it: every line must be pre-tokenized, not a conversation)");
  const auto mask_it = j.find("loss_mask");
  const auto labels_it = j.find("labels");
  if (mask_it == j.end() && labels_it == j.end()) fail("\"input_ids\" needs \"loss_mask\" or \"labels\" beside it");
  if (mask_it != j.end() && labels_it != j.end()) fail("has both \"loss_mask\" and \"labels\"; give one");
  const json& ids = *ids_it;
  if (!ids.is_array()) fail(std::string("\"input_ids\" must be a list of token ids, got ") + ids.type_name());
  if (ids.empty()) fail("\"input_ids\" is empty");
  SftSequence s;
  s.ids.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto id = integer_in(ids[i], 0, vocab_size - 1);
    if (!id)
      fail("\"input_ids\"[" + std::to_string(i) + "] is " + shown(ids[i]) + ": not a token id of the vocabulary (" +
           "integers 0.." + std::to_string(vocab_size - 1) + ")");
    s.ids.push_back(*id);
  }
  const bool by_mask = mask_it != j.end();
  const std::string key = by_mask ? "\"loss_mask\"" : "\"labels\"";
  const json& values = by_mask ? *mask_it : *labels_it;
  if (!values.is_array()) fail(key + " must be a list, got " + values.type_name());
  if (values.size() != ids.size())
    fail(key + " has " + std::to_string(values.size()) + " values and \"input_ids\" " + std::to_string(ids.size()) +
         "; they must be of equal length");
  s.loss_mask.reserve(ids.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const std::string at = key + "[" + std::to_string(i) + "] is " + shown(values[i]);
    if (by_mask) {
      const json& v = values[i];
      const auto bit = v.is_boolean() ? std::optional<int64_t>(v.get<bool>() ? 1 : 0) : integer_in(v, 0, 1);
      if (!bit) fail(at + "; a loss mask value must be 0 or 1");
      s.loss_mask.push_back(static_cast<uint8_t>(*bit));
    } else {
      const auto label = integer_in(values[i], -100, vocab_size - 1);
      // Each token is trained on as the next token after the ones before it, so a label can only
      // say whether its own position is trained: -100, or the id there.
      if (!label || (*label != -100 && *label != s.ids[i]))
        fail(at + "; a label must be -100 (not trained) or input_ids[" + std::to_string(i) + "] (" +
             std::to_string(s.ids[i]) + ")");
      s.loss_mask.push_back(*label == -100 ? 0 : 1);
    }
  }
  return s;
}

}  // namespace

bool is_pretokenized_sft_jsonl(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string line;
  while (std::getline(in, line)) {
    if (is_blank(line)) continue;
    const json j = try_parse_json(line);
    // A first line that does not parse but names input_ids is a broken pre-tokenized line: the
    // pre-tokenized reader says what is wrong with it.
    if (j.is_discarded()) return line.find("\"input_ids\"") != std::string::npos;
    return j.is_object() && j.contains("input_ids");
  }
  return false;
}

std::vector<SftSequence> read_pretokenized_sft_jsonl(const std::string& path, int64_t vocab_size,
                                                     const SftTokenizeOptions& o) {
  check_max_length(o);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(path + ":0: cannot open file");
  std::vector<SftSequence> out;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (is_blank(line)) continue;
    const std::string at = path + ":" + std::to_string(line_no);
    auto fail = [&](const std::string& what) { throw std::invalid_argument(at + ": " + what); };
    json j;
    try {
      j = parse_json(line);
    } catch (const json::exception& e) {  // parse_error, out_of_range (1e999999), nesting past the limit
      fail(std::string("invalid JSON (") + e.what() + ")");
    }
    SftSequence s = parse_pretokenized(j, vocab_size, fail);
    fit_sequence(s, o, at, " (no token after the first is marked for training)");
    out.push_back(std::move(s));
  }
  if (in.bad()) throw std::invalid_argument(path + ":" + std::to_string(line_no) + ": read error");
  if (out.empty())
    throw std::invalid_argument(path + ":" + std::to_string(line_no) +
                                ": no sequences (the file is empty or only blank lines)");
  return out;
}

std::vector<SftRow> make_sft_rows(const std::vector<SftSequence>& sequences, int64_t max_length, bool packing) {
  std::vector<SftRow> rows;
  auto append = [](SftRow& row, const SftSequence& s) {
    const int64_t segment = row.segment_ids.empty() ? 0 : row.segment_ids.back() + 1;
    for (size_t t = 0; t < s.ids.size(); ++t) {
      row.ids.push_back(s.ids[t]);
      row.loss_mask.push_back(s.loss_mask[t]);
      row.position_ids.push_back(static_cast<int64_t>(t));
      row.segment_ids.push_back(segment);
    }
  };
  if (!packing) {
    for (const SftSequence& s : sequences) append(rows.emplace_back(), s);
    return rows;
  }
  // First-fit decreasing: longest first, each into the first row with room (ties by index, so
  // the packing is deterministic).
  std::vector<size_t> order(sequences.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return sequences[a].ids.size() > sequences[b].ids.size(); });
  for (size_t i : order) {
    const auto length = static_cast<int64_t>(sequences[i].ids.size());
    auto fits = [&](const SftRow& r) { return static_cast<int64_t>(r.ids.size()) + length <= max_length; };
    auto it = std::find_if(rows.begin(), rows.end(), fits);
    append(it == rows.end() ? rows.emplace_back() : *it, sequences[i]);
  }
  return rows;
}

SftBatch collate_sft_rows(const std::vector<const SftRow*>& rows, int64_t pad_id) {
  const auto b = static_cast<int64_t>(rows.size());
  int64_t length = 1;
  for (const SftRow* r : rows) length = std::max<int64_t>(length, static_cast<int64_t>(r->ids.size()));
  auto i64 = at::TensorOptions().dtype(at::kLong);
  SftBatch batch;
  batch.input_ids = at::full({b, length}, pad_id, i64);
  batch.labels = at::full({b, length}, pad_id, i64);
  batch.label_mask = at::zeros({b, length}, at::kFloat);
  batch.attention_mask = at::zeros({b, length}, i64);
  batch.position_ids = at::zeros({b, length}, i64);
  batch.segment_ids = at::full({b, length}, -1, i64);
  auto ids = batch.input_ids.accessor<int64_t, 2>();
  auto labels = batch.labels.accessor<int64_t, 2>();
  auto mask = batch.label_mask.accessor<float, 2>();
  auto attn = batch.attention_mask.accessor<int64_t, 2>();
  auto pos = batch.position_ids.accessor<int64_t, 2>();
  auto seg = batch.segment_ids.accessor<int64_t, 2>();
  for (int64_t i = 0; i < b; ++i) {
    const SftRow& r = *rows[i];
    const auto n = static_cast<int64_t>(r.ids.size());
    for (int64_t t = 0; t < n; ++t) {
      ids[i][t] = r.ids[t];
      attn[i][t] = 1;
      pos[i][t] = r.position_ids[t];
      seg[i][t] = r.segment_ids[t];
      // Token t predicts token t + 1, when that one belongs to the same packed sequence.
      if (t + 1 < n && r.segment_ids[t + 1] == r.segment_ids[t]) {
        labels[i][t] = r.ids[t + 1];
        mask[i][t] = r.loss_mask[t + 1];
      }
    }
  }
  return batch;
}

at::Tensor per_sequence(const at::Tensor& values, const at::Tensor& segment_ids, std::optional<int64_t> segments) {
  if (!segments) segments = std::max<int64_t>(1, segment_ids.max().item<int64_t>() + 1);
  const at::Tensor one_hot =
      (segment_ids.unsqueeze(1) == at::arange(*segments, segment_ids.options()).view({1, -1, 1})).to(values.dtype());
  return (values.unsqueeze(1) * one_hot).reshape({-1, values.size(1)});
}

namespace {

// Fisher-Yates with splitmix64 draws: the same order on every machine and standard library.
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  uint64_t state = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(epoch) + 1));
  for (int64_t i = n - 1; i > 0; --i) {
    state = splitmix64(state);
    std::swap(order[i], order[state % static_cast<uint64_t>(i + 1)]);
  }
  return order;
}

}  // namespace

SftSampler::SftSampler(int64_t num_rows, int64_t micro_batch_size, int64_t dp, int64_t micro_batches, uint64_t seed)
    : num_rows_(num_rows), mbs_(micro_batch_size), dp_(dp), micro_batches_(micro_batches), seed_(seed) {
  if (num_rows < 1) throw std::invalid_argument("the training data holds no sequences");
}

int64_t SftSampler::row_at(int64_t position) const {
  const int64_t epoch = position / num_rows_;
  if (epoch != order_epoch_) {
    order_ = epoch_order(num_rows_, seed_, epoch);
    order_epoch_ = epoch;
  }
  return order_[static_cast<size_t>(position % num_rows_)];
}

std::vector<int64_t> SftSampler::rows(int64_t iteration, int64_t m, int64_t rank) const {
  const int64_t gbs = mbs_ * dp_ * micro_batches_;
  const int64_t first = (iteration - 1) * gbs + (m * dp_ + rank) * mbs_;
  std::vector<int64_t> out;
  for (int64_t i = 0; i < mbs_; ++i) out.push_back(row_at(first + i));
  return out;
}

std::vector<int64_t> SftSampler::global_batch(int64_t iteration) const {
  std::vector<int64_t> out;
  for (int64_t m = 0; m < micro_batches_; ++m)
    for (int64_t r = 0; r < dp_; ++r)
      for (int64_t row : rows(iteration, m, r)) out.push_back(row);
  return out;
}

}  // namespace mfsdp
