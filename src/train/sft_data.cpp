#include "train/sft_data.h"

#include "mfsdp/data/splitmix64.h"

#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "mfsdp/data/chat_template.h"

namespace mfsdp {

std::vector<SftSequence> tokenize_sft_examples(const std::vector<SftExample>& examples, const Tokenizer& tokenizer,
                                               const SftTokenizeOptions& o, const std::string& where) {
  if (o.max_length < 2) throw std::invalid_argument("--max-length: must be >= 2, got " + std::to_string(o.max_length));
  std::vector<SftSequence> out;
  out.reserve(examples.size());
  for (size_t i = 0; i < examples.size(); ++i) {
    const std::string at = where + ": example " + std::to_string(i + 1);
    ChatTokens t = apply_chat_template(tokenizer, o.chat_template, examples[i].messages, false);
    SftSequence s{std::move(t.ids), std::move(t.loss_mask)};
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
                                  (length > o.max_length ? std::string(" after --truncation ") + o.truncation
                                                         : std::string(" (no assistant message?)")));
    out.push_back(std::move(s));
  }
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

at::Tensor per_sequence(const at::Tensor& values, const at::Tensor& segment_ids) {
  const int64_t segments = std::max<int64_t>(1, segment_ids.max().item<int64_t>() + 1);
  const at::Tensor one_hot =
      (segment_ids.unsqueeze(1) == at::arange(segments, segment_ids.options()).view({1, -1, 1})).to(values.dtype());
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
