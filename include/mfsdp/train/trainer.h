// mfsdp-pretrain's training loop: a Llama model sharded with fully_shard, Megatron-format data,
// the distributed optimizer, Megatron-style logging and the metrics file.
#pragma once

#include <memory>
#include <ostream>

#include "mfsdp/comm/comm.h"
#include "mfsdp/train/pretrain_args.h"

namespace mfsdp {

struct PretrainResult {
  double first_loss = 0;  // first logged training loss (NaN when not trained)
  double final_loss = 0;  // last logged training loss
  double final_eval_loss = 0;
  double tokens_per_sec = 0;
  int64_t iterations = 0;
};

// Runs training (and evaluation) as `args` says; `args` must have passed validate_pretrain_args
// for comm->size() ranks. Logs on rank 0 to `log`. Collective over `comm`.
PretrainResult pretrain(const PretrainArgs& args, const std::shared_ptr<Communicator>& comm,
                        std::ostream& log);

}  // namespace mfsdp
