// Megatron's modify-state-dict ops (include/mfsdp/checkpoint/state_dict_ops.h).
#include "mfsdp/checkpoint/state_dict_ops.h"

#include <algorithm>
#include <cctype>
#include <sstream>
#include <stdexcept>

namespace mfsdp {
namespace {

std::regex compile(const std::string& regex, const std::string& where) {
  try {
    return std::regex(regex, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw std::invalid_argument(where + ": '" + regex + "' is not a valid regular expression (" + e.what() + ")");
  }
}

// Python's re.sub replacement template as std::regex_replace's (ECMAScript) format: \N and
// \g<N> become $N, a literal '$' becomes "$$", \\ a backslash, \n \t \r their characters.
std::string ecmascript_format(const std::string& python, const std::string& where) {
  std::string out;
  for (size_t i = 0; i < python.size(); ++i) {
    const char c = python[i];
    if (c == '$') {
      out += "$$";
      continue;
    }
    if (c != '\\') {
      out += c;
      continue;
    }
    if (i + 1 == python.size()) throw std::invalid_argument(where + ": the replacement ends in a lone backslash");
    const char n = python[++i];
    if (std::isdigit(static_cast<unsigned char>(n))) {
      std::string group(1, n);
      if (i + 1 < python.size() && std::isdigit(static_cast<unsigned char>(python[i + 1]))) group += python[++i];
      out += "$" + (group.size() == 1 ? "0" + group : group);  // $0N: a following digit stays a digit
    } else if (n == 'g') {
      const size_t close = python.find('>', i);
      const std::string group = close == std::string::npos || i + 1 >= python.size() || python[i + 1] != '<'
                                    ? ""
                                    : python.substr(i + 2, close - i - 2);
      if (group.empty() || group.size() > 2 || !std::all_of(group.begin(), group.end(), ::isdigit))
        throw std::invalid_argument(where + ": '\\g' takes a group number, \\g<1> .. \\g<99> (named groups are "
                                    "not supported)");
      out += "$" + (group.size() == 1 ? "0" + group : group);
      i = close;
    } else if (n == '\\') {
      out += '\\';
    } else if (n == 'n' || n == 't' || n == 'r') {
      out += n == 'n' ? '\n' : n == 't' ? '\t' : '\r';
    } else if (std::isalpha(static_cast<unsigned char>(n))) {
      throw std::invalid_argument(where + ": bad escape '\\" + std::string(1, n) + "' in the replacement");
    } else {
      out += '\\';
      out += n;  // Python keeps an unknown non-letter escape as it is
    }
  }
  return out;
}

}  // namespace

void StateDictOps::add(const std::string& op, const std::string& flag) {
  std::istringstream words(op);
  std::string verb, a, b, extra;
  words >> verb >> a >> b >> extra;
  if (verb == "remove" && !a.empty() && b.empty()) return add_remove(a, flag + " '" + op + "'");
  if (verb == "rename" && !b.empty() && extra.empty()) return add_rename(a, b, flag + " '" + op + "'");
  throw std::invalid_argument(flag + " '" + op + "': expected \"remove REGEX\" or \"rename PATTERN REPLACEMENT\"");
}

void StateDictOps::add_remove(const std::string& regex, const std::string& flag) {
  removes_.push_back(compile(regex, flag));
  texts_.push_back("remove " + regex);
}

void StateDictOps::add_rename(const std::string& pattern, const std::string& replacement, const std::string& flag) {
  if (pattern.empty()) throw std::invalid_argument(flag + ": the pattern to rename is empty");
  renames_.emplace_back(compile(pattern, flag), ecmascript_format(replacement, flag));
  texts_.push_back("rename " + pattern + " " + replacement);
}

bool StateDictOps::removes(const std::string& key) const {
  for (const std::regex& re : removes_)
    if (std::regex_search(key, re)) return true;
  return false;
}

std::string StateDictOps::renamed(const std::string& key, bool* applied) const {
  for (const auto& [re, format] : renames_)
    if (std::regex_search(key, re)) {
      if (applied) *applied = true;
      return std::regex_replace(key, re, format);
    }
  if (applied) *applied = false;
  return key;
}

}  // namespace mfsdp
