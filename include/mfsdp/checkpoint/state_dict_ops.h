// The state-dict ops of Megatron-LM's checkpoint_inspector.py modify-state-dict, the one
// vocabulary for removing and renaming entries in mfsdp-ckpt: `modify-state-dict --op` and
// `convert --op` (and convert's shorthands --remove and --rename) all build a StateDictOps.
//
//   "remove REGEX"               a key is dropped when any remove REGEX is found in it (re.search)
//   "rename PATTERN REPLACEMENT" otherwise the first rename whose PATTERN is found in the key
//                                rewrites it (re.sub: every match replaced), and no later rename
//                                is tried on that key
//
// REPLACEMENT is written as Python's re.sub takes it: \1 .. \99 and \g<N> for groups, \\ for a
// backslash; a '$' is literal. Regexes are ECMAScript (std::regex), which reads the regexes
// these ops are written with (anchors, classes, groups, alternation) as Python does; Python-only
// syntax such as (?P<name>...) is an error naming the op.
#pragma once

#include <regex>
#include <string>
#include <utility>
#include <vector>

namespace mfsdp {

class StateDictOps {
 public:
  // One op as modify-state-dict's --op takes it: words separated by spaces. Throws
  // std::invalid_argument naming `flag` and the op for anything else or a bad regex.
  void add(const std::string& op, const std::string& flag = "--op");
  void add_remove(const std::string& regex, const std::string& flag);
  void add_rename(const std::string& pattern, const std::string& replacement, const std::string& flag);

  bool removes(const std::string& key) const;
  // The key after the first rename whose pattern is found in it, or the key unchanged (then
  // *applied, if given, is false).
  std::string renamed(const std::string& key, bool* applied = nullptr) const;
  bool empty() const { return removes_.empty() && renames_.empty(); }
  // The ops as "remove REGEX" / "rename PATTERN REPLACEMENT", in the order added (what a
  // converted checkpoint records).
  const std::vector<std::string>& texts() const { return texts_; }

 private:
  std::vector<std::string> texts_;
  std::vector<std::regex> removes_;
  std::vector<std::pair<std::regex, std::string>> renames_;  // replacement in ECMAScript's format
};

}  // namespace mfsdp
