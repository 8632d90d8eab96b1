// mfsdp-pretrain: pretrain a Llama-family model with fully_shard, taking Megatron-LM's flags.
//
//   mfsdp-run --nproc-per-node 2 mfsdp-pretrain --mock-data --vocab-size 256 --num-layers 2
//       --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4
//       --train-iters 100 --lr 1e-3 --data-parallel-sharding-strategy optim_grads_params
//
// Exit codes: 0 done, 2 bad flags (nothing was started), 1 failure during the run.
#include <iostream>

#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/train/activation_plan.h"
#include "mfsdp/train/model_memory_plan.h"
#include "mfsdp/train/pretrain_args.h"
#include "mfsdp/train/trainer.h"
#include "mfsdp/train/trainer_main.h"
#include "mfsdp/train/training_run.h"

int main(int argc, char** argv) {
  mfsdp::PretrainArgs args;
  mfsdp::TrainerTool tool;
  tool.program = "mfsdp-pretrain";
  tool.usage = [] { return mfsdp::pretrain_usage(); };
  tool.parse = [&](const std::vector<std::string>& argv_text) -> mfsdp::PretrainArgs& {
    args = mfsdp::parse_pretrain_args(argv_text);
    return args;
  };
  tool.validate = mfsdp::validate_pretrain_args;
  tool.run = [&](const std::shared_ptr<mfsdp::Communicator>& comm) {
    if (args.memory_plan) {
      mfsdp::print_memory_plan(mfsdp::model_config_from_args(args, args, args.seq_length, args.padded_vocab_size), args,
                               mfsdp::parallel_dims(args, args, comm->size()),
                               mfsdp::shard_options_from_args(args, args, args, args.calculate_per_token_loss),
                               args.num_micro_batches, comm, std::cout);
      if (comm->rank() == 0 || mfsdp::is_simulated(*comm))
        mfsdp::print_activation_plan(args, mfsdp::parallel_dims(args, args, comm->size()),
                                     mfsdp::model_build_options(args, args, args, args, args, false).recompute, std::cout);
    } else {
      mfsdp::pretrain(args, comm, std::cout);
    }
  };
  return mfsdp::trainer_main(argc, argv, tool);
}
