#include "train/tool_flags.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace mfsdp {
namespace {

int64_t to_int(const char* flag, const std::string& v) {
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  flag_error(flag, "expected an integer, got '" + v + "'");
}

}  // namespace

ToolFlag string_flag(const char* name, std::string& field, const std::string& help, std::vector<std::string> choices) {
  return {name, help, true, std::move(choices), [&field](const std::string& v) { field = v; },
          [&field] { return field.empty() ? std::string("unset") : field; }};
}

ToolFlag int_flag(const char* name, int64_t& field, const std::string& help) {
  return {name, help, true, {}, [&field, name](const std::string& v) { field = to_int(name, v); },
          [&field] { return std::to_string(field); }};
}

ToolFlag double_flag(const char* name, double& field, const std::string& help) {
  return {name, help, true, {},
          [&field, name](const std::string& v) {
            try {
              size_t used = 0;
              const double x = std::stod(v, &used);
              if (used == v.size() && std::isfinite(x)) {  // "nan" and "inf" are no flag's value
                field = x;
                return;
              }
            } catch (const std::exception&) {
            }
            flag_error(name, "expected a finite number, got '" + v + "'");
          },
          [&field] {
            std::ostringstream s;
            s << field;
            return s.str();
          }};
}

ToolFlag bool_flag(const char* name, bool& field, const std::string& help, bool value) {
  return {name, help, false, {}, [&field, value](const std::string&) { field = value; },
          [&field, value] { return std::string(field == value ? "on" : "off"); }};
}

ToolFlag int_list_flag(const char* name, std::vector<int64_t>& field, const std::string& help) {
  return {name, help, true, {},
          [&field, name](const std::string& v) {
            std::vector<int64_t> values;
            std::istringstream in(v);
            for (std::string word; in >> word;) values.push_back(to_int(name, word));
            if (values.empty()) flag_error(name, "needs at least one value");
            field = std::move(values);
          },
          [&field] {
            std::string out;
            for (int64_t v : field) {
              if (!out.empty()) out += ' ';
              out += std::to_string(v);
            }
            return out;
          },
          /*many_values=*/true};
}

}  // namespace mfsdp
