// Flags bound to a field (ToolFlag, config/sections.h): the sections' flags (config/sections.cpp)
// and the trainers' own, with Megatron's value parsing and one form of error for each kind.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mfsdp/train/config/sections.h"

namespace mfsdp {

ToolFlag string_flag(const char* name, std::string& field, const std::string& help, std::vector<std::string> choices = {});
ToolFlag int_flag(const char* name, int64_t& field, const std::string& help);
ToolFlag double_flag(const char* name, double& field, const std::string& help);
// Takes no value and sets `field` to `value`: --bf16 sets true, --no-check-for-nan-in-loss-and-grad
// false (shown "on" when the field holds `value`).
ToolFlag bool_flag(const char* name, bool& field, const std::string& help, bool value = true);
// argparse's nargs='+' of integers: "--profile-ranks 0 1 3".
ToolFlag int_list_flag(const char* name, std::vector<int64_t>& field, const std::string& help);

}  // namespace mfsdp
