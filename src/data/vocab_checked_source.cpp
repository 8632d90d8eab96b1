#include "mfsdp/data/gpt_dataset.h"

#include <stdexcept>
#include <string>

namespace mfsdp {

// Checks each token as it is read rather than the whole file when it is opened: a corpus of
// billions of tokens is read once per epoch anyway, and a scan would cost its full size up front.
VocabCheckedSource::VocabCheckedSource(std::shared_ptr<const SequenceSource> source, int64_t vocab_size)
    : source_(std::move(source)), vocab_size_(vocab_size) {
  if (!source_) throw std::invalid_argument("VocabCheckedSource: the source is null");
  if (vocab_size_ < 1) throw std::invalid_argument("VocabCheckedSource: vocabulary size must be >= 1");
}

void VocabCheckedSource::read(int64_t i, int64_t offset, int64_t length, int64_t* out) const {
  source_->read(i, offset, length, out);
  for (int64_t k = 0; k < length; ++k) {
    if (out[k] >= 0 && out[k] < vocab_size_) continue;
    throw std::invalid_argument(source_->describe() + ": token id " + std::to_string(out[k]) + " at position " +
                                std::to_string(offset + k) + " of sequence " + std::to_string(i) +
                                " (document order of the .idx) is outside the vocabulary [0, " +
                                std::to_string(vocab_size_) +
                                "): the data was tokenized with another tokenizer, or the file is corrupt");
  }
}

}  // namespace mfsdp
