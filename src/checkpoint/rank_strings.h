// Internal to src/checkpoint: every rank's string, in rank order, for the collective steps of
// saving and loading (sharded_checkpoint.cpp, load_model.cpp) that carry chunk lists and the error
// each rank met, so that every rank throws the same error instead of some waiting on the others.
#pragma once

#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"

namespace mfsdp::checkpoint {

// Collective over `comm`; strings of any length, empty ones included.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& text);

}  // namespace mfsdp::checkpoint
