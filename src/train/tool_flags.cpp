#include "train/tool_flags.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace mfsdp {

ToolFlag string_flag(const char* name, std::string& field, const std::string& help, std::vector<std::string> choices) {
  return {name, help, true, std::move(choices), [&field](const std::string& v) { field = v; },
          [&field] { return field.empty() ? std::string("unset") : field; }};
}

ToolFlag int_flag(const char* name, int64_t& field, const std::string& help) {
  return {name, help, true, {},
          [&field, name](const std::string& v) {
            try {
              size_t used = 0;
              const long long x = std::stoll(v, &used);
              if (used == v.size()) {
                field = x;
                return;
              }
            } catch (const std::exception&) {
            }
            flag_error(name, "expected an integer, got '" + v + "'");
          },
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

ToolFlag bool_flag(const char* name, bool& field, const std::string& help) {
  return {name, help, false, {}, [&field](const std::string&) { field = true; },
          [&field] { return std::string(field ? "on" : "off"); }};
}

}  // namespace mfsdp
