// GPTDataset: Megatron's document/sample/shuffle indices (see [Note: How samples are drawn] in
// include/mfsdp/data/gpt_dataset.h).
#include "mfsdp/data/gpt_dataset.h"

#include "mfsdp/base/splitmix64.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <regex>
#include <sstream>
#include <stdexcept>

namespace mfsdp {
namespace {

// numpy's legacy RandomState(seed) as far as shuffle() goes: MT19937 seeded with init_genrand
// (std::mt19937's seeding), and numpy's random_interval (masked rejection sampling) per swap.
class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : gen_(seed) {}

  // Uniform in [0, max], as numpy's random_interval(bitgen, max).
  uint64_t interval(uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    uint64_t value;
    if (max <= 0xFFFFFFFFull) {
      while ((value = (static_cast<uint64_t>(gen_()) & mask)) > max) {
      }
    } else {
      do {
        const uint64_t hi = gen_();
        const uint64_t lo = gen_();
        value = ((hi << 32) | lo) & mask;
      } while (value > max);
    }
    return value;
  }

  // numpy's RandomState.shuffle on a 1-D array: for i = n-1 down to 1, swap x[i] and
  // x[random_interval(i)].
  template <typename T>
  void shuffle(T* x, size_t n) {
    for (size_t i = n; i-- > 1;) std::swap(x[i], x[interval(i)]);
  }

 private:
  std::mt19937 gen_;
};

}  // namespace

const char* data_split_name(DataSplit split) {
  switch (split) {
    case DataSplit::kTrain: return "train";
    case DataSplit::kValid: return "valid";
    case DataSplit::kTest: return "test";
  }
  return "unknown";
}

// ---- split -------------------------------------------------------------------------------------

std::array<double, 3> parse_split(const std::string& split) {
  // Megatron: re.findall(r"[.0-9]+", split), padded with zeros to three, normalised.
  static const std::regex number("[.0-9]+");
  std::vector<double> values;
  for (auto it = std::sregex_iterator(split.begin(), split.end(), number);
       it != std::sregex_iterator(); ++it) {
    const std::string text = it->str();
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != text.size()) {
      throw std::invalid_argument("--split '" + split + "': '" + text + "' is not a number");
    }
    values.push_back(v);
  }
  if (values.empty() || values.size() > 3) {
    throw std::invalid_argument("--split '" + split + "': expected one to three weights " +
                                "(train, valid, test), e.g. 949,50,1");
  }
  values.resize(3, 0.0);
  const double sum = (values[0] + values[1]) + values[2];
  if (!(sum > 0) || !std::isfinite(sum)) {
    throw std::invalid_argument("--split '" + split + "': the weights must not all be 0");
  }
  return {values[0] / sum, values[1] / sum, values[2] / sum};
}

std::array<std::optional<std::pair<int64_t, int64_t>>, 3> split_ranges(
    const std::array<double, 3>& weights, int64_t num_sequences) {
  // Megatron: convert_split_vector_to_split_matrix, then
  // beg = int(round(lo * N)), end = int(round(hi * N)); Python's round() is half-to-even, which
  // is nearbyint() in the default rounding mode.
  std::array<double, 4> bounds{0.0, 0.0, 0.0, 0.0};
  for (int k = 0; k < 3; ++k) bounds[k + 1] = bounds[k] + weights[k];
  std::array<std::optional<std::pair<int64_t, int64_t>>, 3> ranges;
  const auto n = static_cast<double>(num_sequences);
  for (int k = 0; k < 3; ++k) {
    if (bounds[k + 1] <= bounds[k]) continue;  // weight 0: no such split
    ranges[k] = std::make_pair(static_cast<int64_t>(std::nearbyint(bounds[k] * n)),
                               static_cast<int64_t>(std::nearbyint(bounds[k + 1] * n)));
  }
  return ranges;
}

// ---- mock data ---------------------------------------------------------------------------------

MockSequences::MockSequences(MockDataOptions options) : options_(options) {
  const auto& o = options_;
  if (o.num_sequences < 1) throw std::invalid_argument("mock data: num_sequences must be >= 1");
  if (o.vocab_size < 2) throw std::invalid_argument("mock data: vocab_size must be >= 2");
  if (o.eod < 0 || o.eod >= o.vocab_size) {
    throw std::invalid_argument("mock data: eod " + std::to_string(o.eod) +
                                " outside the vocabulary [0, " + std::to_string(o.vocab_size) + ")");
  }
  if (o.min_length < 1 || o.max_length < o.min_length ||
      o.max_length > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("mock data: need 1 <= min_length <= max_length < 2^31");
  }
  lengths_.resize(static_cast<size_t>(o.num_sequences));
  const auto span = static_cast<uint64_t>(o.max_length - o.min_length + 1);
  for (int64_t i = 0; i < o.num_sequences; ++i) {
    const uint64_t r = splitmix64(o.seed * 3 + 0x5EEDull + static_cast<uint64_t>(i) * 0x10001ull);
    lengths_[static_cast<size_t>(i)] = static_cast<int32_t>(o.min_length + static_cast<int64_t>(r % span));
  }
}

int64_t MockSequences::sequence_length(int64_t i) const {
  if (i < 0 || i >= options_.num_sequences) {
    throw std::out_of_range("mock data: sequence " + std::to_string(i) + " out of range [0, " +
                            std::to_string(options_.num_sequences) + ")");
  }
  return lengths_[static_cast<size_t>(i)];
}

void MockSequences::read(int64_t i, int64_t offset, int64_t length, int64_t* out) const {
  const int64_t n = sequence_length(i);
  if (offset < 0 || length < 0 || offset > n || length > n - offset) {
    throw std::out_of_range("mock data: tokens [" + std::to_string(offset) + ", " +
                            std::to_string(offset + length) + ") of sequence " +
                            std::to_string(i) + " are outside its " + std::to_string(n) + " tokens");
  }
  const auto values = static_cast<uint64_t>(options_.vocab_size - 1);  // every id but EOD
  const uint64_t r = splitmix64(options_.seed ^ (static_cast<uint64_t>(i) << 20) ^ 0xC0FFEEull);
  const uint64_t start = r % values;
  const uint64_t step = 1 + (r >> 32) % std::min<uint64_t>(values, 8);
  for (int64_t k = 0; k < length; ++k) {
    const int64_t pos = offset + k;
    if (pos == n - 1) {
      out[k] = options_.eod;
      continue;
    }
    const auto v = static_cast<int64_t>((start + static_cast<uint64_t>(pos) * step) % values);
    out[k] = v < options_.eod ? v : v + 1;
  }
}

// ---- batch layout ------------------------------------------------------------------------------

int64_t micro_batch_first_sample(const BatchLayout& layout, int64_t global_batch,
                                 int64_t micro_batch, int64_t dp_rank) {
  if (layout.micro_batch_size < 1 || layout.data_parallel_size < 1 ||
      layout.num_micro_batches < 1) {
    throw std::invalid_argument("BatchLayout: micro_batch_size, data_parallel_size and "
                                "num_micro_batches must be >= 1");
  }
  if (global_batch < 0 || micro_batch < 0 || micro_batch >= layout.num_micro_batches ||
      dp_rank < 0 || dp_rank >= layout.data_parallel_size) {
    throw std::invalid_argument(
        "micro_batch_first_sample: global batch " + std::to_string(global_batch) +
        ", micro-batch " + std::to_string(micro_batch) + " of " +
        std::to_string(layout.num_micro_batches) + ", data-parallel rank " +
        std::to_string(dp_rank) + " of " + std::to_string(layout.data_parallel_size));
  }
  return global_batch * layout.global_batch_size() +
         (micro_batch * layout.data_parallel_size + dp_rank) * layout.micro_batch_size;
}

// ---- GPTDataset --------------------------------------------------------------------------------

GPTDataset::GPTDataset(std::shared_ptr<const SequenceSource> source, int64_t begin, int64_t end,
                       int64_t num_samples, int64_t seq_length, uint32_t seed, std::string name)
    : source_(std::move(source)), name_(std::move(name)), seq_length_(seq_length) {
  if (!source_) throw std::invalid_argument(name_ + " dataset: no source");
  const std::string where = name_ + " dataset of " + source_->describe();
  if (seq_length < 1) {
    throw std::invalid_argument(where + ": --seq-length must be >= 1, got " +
                                std::to_string(seq_length));
  }
  if (begin < 0 || end < begin || end > source_->num_sequences()) {
    throw std::invalid_argument(where + ": sequence range [" + std::to_string(begin) + ", " +
                                std::to_string(end) + ") is not inside [0, " +
                                std::to_string(source_->num_sequences()) + ")");
  }
  if (end > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(where + ": more than 2^31 sequences");
  }
  int64_t tokens_per_epoch = 0;
  for (int64_t s = begin; s < end; ++s) tokens_per_epoch += source_->sequence_length(s);
  if (tokens_per_epoch < 2) {
    throw std::invalid_argument(where + ": sequences [" + std::to_string(begin) + ", " +
                                std::to_string(end) + ") hold " +
                                std::to_string(tokens_per_epoch) +
                                " tokens; a sample needs at least 2 (adjust --split or the data)");
  }
  const int64_t S = seq_length;
  const int64_t T = tokens_per_epoch;

  // Megatron's _get_num_epochs.
  int64_t epochs = 1;
  if (num_samples >= 0) {
    const int64_t requested = num_samples * S + 1;
    for (int64_t tokens = T; tokens < requested; tokens += T) ++epochs;
  }
  num_epochs_ = epochs;

  // Megatron's separate_final_epoch decision.
  bool separate_final_epoch = false;
  int64_t samples_sans_final_epoch = 0;
  if (epochs > 1) {
    samples_sans_final_epoch = ((epochs - 1) * T - 1) / S;
    const int64_t from_final_epoch = num_samples - samples_sans_final_epoch;
    const int64_t per_epoch = (T - 1) / S;
    separate_final_epoch = from_final_epoch < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  }

  NumpyRandomState rng(seed);

  // Document index (Megatron's _build_document_index): epochs of [begin, end), shuffled.
  const int64_t docs = end - begin;
  document_index_.resize(static_cast<size_t>(epochs * docs));
  for (int64_t e = 0; e < epochs; ++e) {
    for (int64_t d = 0; d < docs; ++d) {
      document_index_[static_cast<size_t>(e * docs + d)] = static_cast<int32_t>(begin + d);
    }
  }
  if (separate_final_epoch) {
    rng.shuffle(document_index_.data(), static_cast<size_t>((epochs - 1) * docs));
    rng.shuffle(document_index_.data() + (epochs - 1) * docs, static_cast<size_t>(docs));
  } else {
    rng.shuffle(document_index_.data(), document_index_.size());
  }

  // Packing (Megatron's build_sample_idx): sample j = stream[j*S, j*S + S + 1).
  stream_offset_.resize(document_index_.size() + 1);
  stream_offset_[0] = 0;
  for (size_t k = 0; k < document_index_.size(); ++k) {
    stream_offset_[k + 1] = stream_offset_[k] + source_->sequence_length(document_index_[k]);
  }
  const int64_t total_samples = (epochs * T - 1) / S;

  // Shuffle index (Megatron's _build_shuffle_index).
  shuffle_index_.resize(static_cast<size_t>(total_samples));
  for (int64_t j = 0; j < total_samples; ++j) shuffle_index_[static_cast<size_t>(j)] = j;
  if (separate_final_epoch) {
    rng.shuffle(shuffle_index_.data(), static_cast<size_t>(samples_sans_final_epoch));
    rng.shuffle(shuffle_index_.data() + samples_sans_final_epoch,
                static_cast<size_t>(total_samples - samples_sans_final_epoch));
  } else {
    rng.shuffle(shuffle_index_.data(), shuffle_index_.size());
  }
}

void GPTDataset::sample_into(int64_t i, int64_t* out) const {
  if (i < 0 || i >= size()) {
    throw std::out_of_range(name_ + " dataset of " + source_->describe() + ": sample " +
                            std::to_string(i) + " out of range [0, " + std::to_string(size()) +
                            ")");
  }
  int64_t pos = shuffle_index_[static_cast<size_t>(i)] * seq_length_;  // stream position
  int64_t need = seq_length_ + 1;
  // The entry holding `pos`: the last k with stream_offset_[k] <= pos (skips empty sequences).
  size_t k = static_cast<size_t>(
      std::upper_bound(stream_offset_.begin(), stream_offset_.end(), pos) - stream_offset_.begin() -
      1);
  while (need > 0) {
    const int64_t offset = pos - stream_offset_[k];
    const int64_t avail = stream_offset_[k + 1] - stream_offset_[k] - offset;
    const int64_t take = std::min(need, avail);
    if (take > 0) source_->read(document_index_[k], offset, take, out);
    out += take;
    need -= take;
    pos += take;
    ++k;
  }
}

at::Tensor GPTDataset::sample(int64_t i) const {
  at::Tensor t = at::empty({seq_length_ + 1}, at::TensorOptions().dtype(at::kLong));
  sample_into(i, t.data_ptr<int64_t>());
  return t;
}

at::Tensor GPTDataset::micro_batch(const BatchLayout& layout, int64_t global_batch,
                                   int64_t micro_batch, int64_t dp_rank) const {
  const int64_t first = micro_batch_first_sample(layout, global_batch, micro_batch, dp_rank);
  at::Tensor t = at::empty({layout.micro_batch_size, seq_length_ + 1},
                           at::TensorOptions().dtype(at::kLong));
  int64_t* p = t.data_ptr<int64_t>();
  for (int64_t s = 0; s < layout.micro_batch_size; ++s) {
    sample_into(first + s, p + s * (seq_length_ + 1));
  }
  return t;
}

// ---- builders ----------------------------------------------------------------------------------

GPTDatasets build_gpt_datasets(std::shared_ptr<const SequenceSource> source,
                               const std::string& split, int64_t seq_length, uint32_t seed,
                               const std::array<int64_t, 3>& num_samples) {
  const auto ranges = split_ranges(parse_split(split), source->num_sequences());
  std::array<std::shared_ptr<GPTDataset>, 3> built;
  for (int k = 0; k < 3; ++k) {
    if (!ranges[k]) continue;
    const auto [begin, end] = *ranges[k];
    const char* name = data_split_name(static_cast<DataSplit>(k));
    if (begin == end) {
      if (num_samples[k] == 0) continue;
      throw std::invalid_argument("--split '" + split + "' leaves the " + name + " split of " +
                                  source->describe() + " (" +
                                  std::to_string(source->num_sequences()) +
                                  " sequences) empty, but " + std::to_string(num_samples[k]) +
                                  " samples are needed from it");
    }
    built[k] = std::make_shared<GPTDataset>(source, begin, end, num_samples[k], seq_length, seed,
                                            name);
  }
  return {built[0], built[1], built[2]};
}

GPTDatasets build_gpt_datasets(const GPTDatasetOptions& options,
                               const std::array<int64_t, 3>& num_samples) {
  std::shared_ptr<const SequenceSource> source;
  if (options.mock) {
    source = std::make_shared<MockSequences>(options.mock_options);
  } else {
    if (options.data_prefix.empty()) {
      throw std::invalid_argument("--data-path is required unless --mock-data is given");
    }
    if (!IndexedDataset::exists(options.data_prefix)) {
      throw std::invalid_argument("--data-path " + options.data_prefix + ": " +
                                  index_file_path(options.data_prefix) + " and " +
                                  data_file_path(options.data_prefix) +
                                  " must both exist (the prefix is given without .bin/.idx)");
    }
    source = std::make_shared<IndexedDataset>(options.data_prefix);
  }
  if (options.vocab_size > 0) source = std::make_shared<VocabCheckedSource>(source, options.vocab_size);
  return build_gpt_datasets(source, options.split, options.seq_length, options.seed, num_samples);
}

}  // namespace mfsdp
