// mfsdp-sft's data: conversations tokenized with a chat template into sequences with a loss mask,
// truncated to --max-length, optionally packed, and cut into the micro-batches of each rank
// (docs/sft.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mfsdp/data/posttrain/chat_dataset.h"
#include "mfsdp/data/tokenizer.h"

namespace mfsdp {

// One tokenized conversation. loss_mask[i] = 1 when token i is a training target (predicted
// from tokens 0 .. i-1).
struct SftSequence {
  std::vector<int64_t> ids;
  std::vector<uint8_t> loss_mask;
};

struct SftTokenizeOptions {
  std::string chat_template = "plain";
  int64_t max_length = 1024;
  std::string truncation = "error";  // error | left (keep the end) | right (keep the start)
  bool loss_on_all = false;          // --loss-on all: every token but the first
};

// Tokenizes every example. Errors (std::invalid_argument) name `where` (the file) and the
// example's index: a sequence longer than max_length with truncation "error", one left with no
// target token.
std::vector<SftSequence> tokenize_sft_examples(const std::vector<SftExample>& examples, const Tokenizer& tokenizer,
                                               const SftTokenizeOptions& options, const std::string& where);

// Pre-tokenized data (docs/sft.md "Pre-tokenized data"), for templates mfsdp does not build in:
// JSONL lines holding "input_ids" and either "loss_mask" (0 or 1 per token, 1: a training target)
// or "labels" (-100: not trained, else the token's own id), as verl and TRL take them.
// is_pretokenized_sft_jsonl: whether the first non-blank line of `path` is a JSON object with
// "input_ids", or does not parse but holds "input_ids" (false when the file cannot be read, or
// its first line neither parses nor names input_ids: read_sft_jsonl then says why).
bool is_pretokenized_sft_jsonl(const std::string& path);
// Reads and checks every line, then applies max_length, truncation and loss_on_all as
// tokenize_sft_examples does. Throws std::invalid_argument "<path>:<line>: <key> ..." on invalid
// JSON, a missing or wrongly typed key, an id outside [0, vocab_size), lengths that differ, a mask
// value other than 0/1, a label that is neither -100 nor the id at its position, and the length
// and no-target errors of tokenize_sft_examples.
std::vector<SftSequence> read_pretokenized_sft_jsonl(const std::string& path, int64_t vocab_size,
                                                     const SftTokenizeOptions& options);

// One row of a batch: one sequence, or several packed back to back (--packing).
struct SftRow {
  std::vector<int64_t> ids;
  std::vector<uint8_t> loss_mask;
  std::vector<int64_t> position_ids;  // restart at 0 for every packed sequence
  std::vector<int64_t> segment_ids;   // 0, 1, ... per packed sequence
};

// Rows of at most `max_length` tokens: each sequence its own row, or (packing) sequences placed
// by first-fit decreasing length into as few rows as fit.
std::vector<SftRow> make_sft_rows(const std::vector<SftSequence>& sequences, int64_t max_length, bool packing);

// A micro-batch as tensors (CPU): rows right-padded with `pad_id` to the longest row.
struct SftBatch {
  at::Tensor input_ids;       // [B, L] int64
  at::Tensor labels;          // [B, L] int64: the next token (pad at the end)
  at::Tensor label_mask;      // [B, L] float: 1 where labels is a training target
  at::Tensor attention_mask;  // [B, L] int64: 1 for tokens, 0 for padding
  at::Tensor position_ids;    // [B, L] int64
  at::Tensor segment_ids;     // [B, L] int64: per packed sequence; -1 on padding
};
SftBatch collate_sft_rows(const std::vector<const SftRow*>& rows, int64_t pad_id);

// values [B, L] -> [B * S, L]: one row per packed sequence (S = the most sequences in a row),
// zero outside it, so per-sequence aggregation (seq-mean modes) treats packed conversations as
// the separate sequences they are. segment_ids as SftBatch's (-1: padding).
// `segments`: their number when the caller knows it (from the host copy of segment_ids); unset,
// it is read from segment_ids, a host sync when they are on a GPU.
at::Tensor per_sequence(const at::Tensor& values, const at::Tensor& segment_ids,
                        std::optional<int64_t> segments = std::nullopt);

// Which rows each step, micro-batch and rank trains on: the rows in an order shuffled per epoch
// with `seed`, global batch `it` (1-based) taking the next global_batch_size of them; within
// it, micro-batch m of rank r takes rows [(m * dp + r) * mbs, + mbs).
class SftSampler {
 public:
  SftSampler(int64_t num_rows, int64_t micro_batch_size, int64_t data_parallel_size, int64_t micro_batches,
             uint64_t seed);
  std::vector<int64_t> rows(int64_t iteration, int64_t micro_batch, int64_t rank) const;
  // Every row of global batch `iteration`, in order.
  std::vector<int64_t> global_batch(int64_t iteration) const;

 private:
  int64_t row_at(int64_t position) const;  // position in the endless shuffled stream
  int64_t num_rows_, mbs_, dp_, micro_batches_;
  uint64_t seed_;
  // One epoch's order at a time is enough: batches read positions in increasing order.
  mutable std::vector<int64_t> order_;
  mutable int64_t order_epoch_ = -1;
};

}  // namespace mfsdp
