// Declaring the trainers' own flags (ToolFlag, pretrain_args.h) bound to fields of their args
// struct, with the same value parsing and error messages as Megatron's flags.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/pretrain_args.h"

namespace mfsdp {

ToolFlag string_flag(const char* name, std::string& field, const std::string& help, std::vector<std::string> choices = {});
ToolFlag int_flag(const char* name, int64_t& field, const std::string& help);
ToolFlag double_flag(const char* name, double& field, const std::string& help);
ToolFlag bool_flag(const char* name, bool& field, const std::string& help);

}  // namespace mfsdp
