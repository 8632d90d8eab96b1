// The main() of the trainers (mfsdp-pretrain, mfsdp-sft, mfsdp-grpo): --help, flags parsed and
// checked before anything starts (exit 2, naming the flag), the rendezvous of mfsdp-run, the
// device (--device) and its communicator, threads per rank, and exit 1 with the error of a
// failed run.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"
#include "mfsdp/train/pretrain_args.h"

namespace mfsdp {

struct TrainerTool {
  std::string program;
  std::function<std::string()> usage;
  // Parses argv into the tool's args and returns their PretrainArgs part.
  std::function<PretrainArgs&(const std::vector<std::string>& argv)> parse;
  // Checks what needs the data-parallel size and the tokenizer's vocabulary (0: none).
  std::function<void(PretrainArgs& args, int data_parallel_size, int64_t tokenizer_vocab)> validate;
  std::function<void(const std::shared_ptr<Communicator>& comm)> run;
};

int trainer_main(int argc, char** argv, const TrainerTool& tool);

}  // namespace mfsdp
