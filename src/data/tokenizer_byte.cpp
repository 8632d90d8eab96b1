// The byte-level tokenizer: ids 0..255 are bytes, 256 is EOD.
#include <stdexcept>

#include "mfsdp/data/tokenizer.h"

namespace mfsdp {

std::vector<int64_t> ByteLevelTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteLevelTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string text;
  text.reserve(ids.size());
  for (int64_t id : ids) {
    if (id == kEod) continue;
    if (id < 0 || id > 255) {
      throw std::out_of_range("ByteLevelTokenizer: id " + std::to_string(id) +
                              " is outside the vocabulary [0, 257)");
    }
    text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
  }
  return text;
}

}  // namespace mfsdp
