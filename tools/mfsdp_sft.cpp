// mfsdp-sft: supervised fine-tuning on conversations (docs/sft.md), with Megatron's model,
// optimizer and sharding flags and verl's / TRL's data flags.
//
//   mfsdp-run --nproc-per-node 2 mfsdp-sft --train-files train.jsonl --val-files val.jsonl
//       --tokenizer-type ByteLevelTokenizer --max-length 64 --num-layers 2 --hidden-size 64
//       --num-attention-heads 4 --micro-batch-size 8 --train-iters 200 --lr 1e-3
//
// Exit codes: 0 done, 2 bad flags (nothing was started), 1 failure during the run.
#include <iostream>

#include "mfsdp/train/sft.h"
#include "mfsdp/train/trainer_main.h"

int main(int argc, char** argv) {
  mfsdp::SftArgs args;
  mfsdp::TrainerTool tool;
  tool.program = "mfsdp-sft";
  tool.usage = [] {
    mfsdp::SftArgs defaults;
    return mfsdp::pretrain_usage(mfsdp::sft_tool_flags(defaults));
  };
  tool.parse = [&](const std::vector<std::string>& argv_text) -> mfsdp::PretrainArgs& {
    args = mfsdp::parse_sft_args(argv_text);
    return args.base;
  };
  tool.validate = [](mfsdp::PretrainArgs& a, int world, int64_t vocab) {
    mfsdp::validate_training_args(a, world, vocab);
  };
  tool.run = [&](const std::shared_ptr<mfsdp::Communicator>& comm) { mfsdp::run_sft(args, comm, std::cout); };
  return mfsdp::trainer_main(argc, argv, tool);
}
