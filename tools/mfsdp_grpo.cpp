// mfsdp-grpo: GRPO on verifiable prompts (docs/grpo.md), with Megatron's model, optimizer and
// sharding flags and verl's algorithm flags and metric names.
//
//   mfsdp-run --nproc-per-node 2 mfsdp-grpo --load sft_ckpt --finetune --gen-task arith
//       --tokenizer-type ByteLevelTokenizer --train-batch-size 16 --rollout-n 8 --train-iters 100
//       --lr 1e-5 --micro-batch-size 16 --metrics-file grpo.jsonl
//
// Exit codes: 0 done, 2 bad flags (nothing was started), 1 failure during the run.
#include <iostream>

#include "mfsdp/train/grpo.h"
#include "mfsdp/train/trainer_main.h"

int main(int argc, char** argv) {
  mfsdp::GrpoArgs args;
  mfsdp::TrainerTool tool;
  tool.program = "mfsdp-grpo";
  tool.usage = [] {
    mfsdp::GrpoArgs defaults;
    return mfsdp::pretrain_usage(mfsdp::grpo_tool_flags(defaults));
  };
  tool.parse = [&](const std::vector<std::string>& argv_text) -> mfsdp::PretrainArgs& {
    args = mfsdp::parse_grpo_args(argv_text);
    return args.base;
  };
  tool.validate = [&](mfsdp::PretrainArgs&, int dp, int64_t vocab) { mfsdp::validate_grpo_args(args, dp, vocab); };
  tool.run = [&](const std::shared_ptr<mfsdp::Communicator>& comm) { mfsdp::run_grpo(args, comm, std::cout); };
  return mfsdp::trainer_main(argc, argv, tool);
}
