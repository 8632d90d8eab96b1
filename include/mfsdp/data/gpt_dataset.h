// Training samples for GPT pretraining, drawn exactly as Megatron's GPTDataset
// (megatron/core/datasets/gpt_dataset.py, helpers.cpp build_sample_idx, and
// blended_megatron_dataset_builder.py for the train/valid/test split).
//
// [Note: How samples are drawn]
// 1. Split. `--split 949,50,1` is normalised to weights w (w / sum w). Split k gets the
//    contiguous sequence range [round(c_k * N), round(c_{k+1} * N)) of the N sequences, where
//    c_0 = 0 and c_{k+1} = c_k + w_k; round() is round-half-to-even (Python's). A split of weight 0
//    does not exist. (Megatron splits by *sequence*; with Megatron's preprocessing a document is
//    one sequence.)
// 2. Epochs. T = tokens in the split. Enough epochs E are taken that E * T >= num_samples * S + 1
//    (S = seq_length); num_samples < 0 means one epoch.
// 3. Document order. A numpy RandomState(seed) (MT19937) shuffles the list of the split's
//    sequences repeated E times, all epochs together. If E > 1 and the last epoch would contribute
//    fewer than 80% of an epoch's samples, the first E-1 epochs are shuffled together and the last
//    epoch separately ("separate final epoch").
// 4. Packing. The sequences are concatenated in that order into one token stream (documents run
//    into each other; nothing is padded). Sample j is stream[j*S, j*S + S + 1): S + 1 tokens, and
//    consecutive samples share one token (the last token of sample j is the first of sample j+1),
//    so that input = sample[0:S] and label = sample[1:S+1] cover every position. The number of
//    samples is floor((E * T - 1) / S); a partial last sample is dropped.
// 5. Sample order. The same RandomState then shuffles the sample indices (with a separate final
//    epoch: [0, n') and [n', n) separately, n' = samples of the first E-1 epochs). sample(i) is
//    unshuffled sample shuffle[i].
// The shuffles reproduce numpy's legacy RandomState.shuffle draw for draw (std::mt19937 seeded as
// RandomState(seed), numpy's masked rejection sampling), so for the same data, split, seed,
// sequence length and number of samples, sample(i) equals Megatron's dataset[i]["tokens"] plus the
// last label. tests/unit/gpt_dataset_test.cpp pins this against numpy.
//
// [Note: Data-parallel batch layout]
// Global batch b holds samples [b*G, (b+1)*G), G = micro_batch_size * dp * num_micro_batches.
// Micro-batch m (0 <= m < num_micro_batches) of data-parallel rank r holds samples
//   [b*G + (m*dp + r)*micro_batch_size, +micro_batch_size)
// i.e. each micro-step consumes the next micro_batch_size * dp samples and rank r takes the r-th
// block of them, as Megatron's MegatronPretrainingSampler does with
// consumed_samples = b*G + m*micro_batch_size*dp. Every sample of a global batch goes to exactly
// one (rank, micro-batch).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/data/indexed_dataset.h"

namespace mfsdp {

enum class DataSplit { kTrain = 0, kValid = 1, kTest = 2 };
const char* data_split_name(DataSplit split);  // "train", "valid", "test"

// Parses Megatron's --split ("949,50,1", "99,1", "0.9 0.1 0"): up to three non-negative numbers,
// missing ones are 0, normalised to sum 1. Throws std::invalid_argument naming --split.
std::array<double, 3> parse_split(const std::string& split);

// The sequence range [begin, end) of each split of `num_sequences` sequences (Note step 1);
// nullopt for a split of weight 0.
std::array<std::optional<std::pair<int64_t, int64_t>>, 3> split_ranges(
    const std::array<double, 3>& weights, int64_t num_sequences);

// Synthetic sequences for --mock-data: deterministic from the seed, with a learnable pattern.
// Sequence i has a length in [min_length, max_length] and tokens t_k = (a_i + k * c_i) mod
// (vocab_size - 1) for k < length - 1 (skipping the EOD id), then EOD; a_i and c_i come from the
// seed and i. So a model can learn "next = previous + c" within a sequence.
struct MockDataOptions {
  int64_t num_sequences = 4096;
  int64_t vocab_size = 257;
  int64_t eod = 256;           // in [0, vocab_size)
  int64_t min_length = 16;
  int64_t max_length = 1024;
  uint64_t seed = 1234;
};

class MockSequences : public SequenceSource {
 public:
  explicit MockSequences(MockDataOptions options);
  int64_t num_sequences() const override { return options_.num_sequences; }
  int64_t sequence_length(int64_t i) const override;
  void read(int64_t i, int64_t offset, int64_t length, int64_t* out) const override;
  std::string describe() const override { return "mock data"; }

 private:
  MockDataOptions options_;
  std::vector<int32_t> lengths_;  // [num_sequences]
};

// Micro-batch geometry of one global batch (Note: Data-parallel batch layout).
struct BatchLayout {
  int64_t micro_batch_size = 1;
  int64_t data_parallel_size = 1;
  int64_t num_micro_batches = 1;  // gradient-accumulation steps
  int64_t global_batch_size() const {
    return micro_batch_size * data_parallel_size * num_micro_batches;
  }
};

// The first sample index of micro-batch `micro_batch` of rank `dp_rank` in global batch
// `global_batch`; the micro-batch is [first, first + micro_batch_size). Throws
// std::invalid_argument on a rank or micro-batch out of range.
int64_t micro_batch_first_sample(const BatchLayout& layout, int64_t global_batch,
                                 int64_t micro_batch, int64_t dp_rank);

class GPTDataset {
 public:
  // Samples of seq_length + 1 tokens from sequences [begin, end) of `source` (Note steps 2-5).
  // num_samples < 0: one epoch. Throws std::invalid_argument when seq_length < 1, the range is
  // not inside the source, or samples are requested from a range with fewer than 2 tokens.
  GPTDataset(std::shared_ptr<const SequenceSource> source, int64_t begin, int64_t end,
             int64_t num_samples, int64_t seq_length, uint32_t seed, std::string name = "train");

  // Samples available (>= the number requested; the last epoch is used whole).
  int64_t size() const { return static_cast<int64_t>(shuffle_index_.size()); }
  int64_t seq_length() const { return seq_length_; }
  int64_t num_epochs() const { return num_epochs_; }
  const std::string& name() const { return name_; }

  // Sample i as int64 tokens [seq_length + 1]. Throws std::out_of_range naming the dataset.
  at::Tensor sample(int64_t i) const;
  // The same tokens into out[0, seq_length + 1), without LibTorch.
  void sample_into(int64_t i, int64_t* out) const;
  // Micro-batch `micro_batch` of rank `dp_rank` in global batch `global_batch`:
  // int64 [micro_batch_size, seq_length + 1].
  at::Tensor micro_batch(const BatchLayout& layout, int64_t global_batch, int64_t micro_batch,
                         int64_t dp_rank) const;

  // The index arrays of Note steps 3 and 5, for tests and diagnostics.
  const std::vector<int32_t>& document_index() const { return document_index_; }  // [E * docs]
  const std::vector<int64_t>& shuffle_index() const { return shuffle_index_; }    // [size()]

 private:
  std::shared_ptr<const SequenceSource> source_;
  std::string name_;
  int64_t seq_length_;
  int64_t num_epochs_ = 1;
  std::vector<int32_t> document_index_;  // [E * (end - begin)] sequence ids in stream order
  std::vector<int64_t> stream_offset_;   // [E * (end - begin) + 1] token offset of each entry
  std::vector<int64_t> shuffle_index_;   // [num samples] unshuffled sample of each sample
};

// The train/valid/test datasets of one source. Megatron's sizes: train = train_iters * global
// batch; valid = (train_iters / eval_interval + 1) * eval_iters * global batch; test =
// eval_iters * global batch. A split whose weight is 0 is nullopt; so is a split asked for 0
// samples whose range is empty.
struct GPTDatasets {
  std::shared_ptr<GPTDataset> train, valid, test;
};

// A source whose reads throw std::invalid_argument, naming the file, the sequence, the position
// and the id, when a token is outside [0, vocab_size): ids beyond the model's embedding would
// fail deep inside LibTorch, and ids between the tokenizer's vocabulary and its padded size
// would train silently on rows no tokenizer produces.
class VocabCheckedSource : public SequenceSource {
 public:
  VocabCheckedSource(std::shared_ptr<const SequenceSource> source, int64_t vocab_size);
  int64_t num_sequences() const override { return source_->num_sequences(); }
  int64_t sequence_length(int64_t i) const override { return source_->sequence_length(i); }
  void read(int64_t i, int64_t offset, int64_t length, int64_t* out) const override;
  std::string describe() const override { return source_->describe(); }

 private:
  std::shared_ptr<const SequenceSource> source_;
  int64_t vocab_size_;
};

struct GPTDatasetOptions {
  std::string data_prefix;          // --data-path (one prefix; ignored with mock)
  bool mock = false;                // --mock-data
  MockDataOptions mock_options;
  std::string split = "969,30,1";   // --split (Megatron's default)
  int64_t seq_length = 1024;        // --seq-length
  uint32_t seed = 1234;             // --seed
  int64_t vocab_size = 0;           // > 0: token ids must lie in [0, vocab_size) (VocabCheckedSource)
};

GPTDatasets build_gpt_datasets(const GPTDatasetOptions& options,
                               const std::array<int64_t, 3>& num_samples);
// The same over a source the caller built.
GPTDatasets build_gpt_datasets(std::shared_ptr<const SequenceSource> source,
                               const std::string& split, int64_t seq_length, uint32_t seed,
                               const std::array<int64_t, 3>& num_samples);

}  // namespace mfsdp
