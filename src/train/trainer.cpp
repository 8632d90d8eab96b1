#include "train/trainer.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>

#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/data/gpt_dataset.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/models/generate.h"
#include "mfsdp/models/context_parallel.h"
#include "mfsdp/models/lm_loss.h"
#include "mfsdp/models/tensor_parallel.h"
#include "train/model_memory_plan.h"
#include "train/training_run.h"

namespace mfsdp {
namespace {

using Clock = std::chrono::steady_clock;

std::string hms(double seconds) {
  int s = static_cast<int>(std::max(0.0, seconds));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02d:%02d:%02d", s / 3600, s / 60 % 60, s % 60);
  return buf;
}

// --sample-prompt: gathers the full model (collective) and, on rank 0, prints a sample.
void print_sample(const PretrainArgs& a, TrainingRun& run, std::ostream& log) {
  // Every expert too, under expert parallelism; on the host, as the sample model is built there.
  auto state = run.gather_full_weights(/*all_ranks=*/false, /*cpu_offload=*/true);
  if (run.comm()->rank() != 0) return;
  ModelBuildOptions options;
  options.moe = moe_training_from_args(a);
  std::shared_ptr<CausalLM> plain = run.config().spec->build(run.config(), options);
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : model_tensors(*plain)) t.copy_(state.at(name));
  }
  TokenizerOptions t{a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file};
  auto tokenizer = make_torch_safe_tokenizer(t);
  if (!tokenizer) {
    log << " sample: needs ByteLevelTokenizer, GPT2BPETokenizer or HuggingFaceTokenizer (use mfsdp-generate --prompt-ids)\n";
    return;
  }
  GenerateOptions g;
  g.max_new_tokens = a.sample_tokens;
  g.top_k = 20;
  g.temperature = 0.8;
  g.seed = static_cast<uint64_t>(a.seed);
  g.stop_id = tokenizer->eod();
  auto ids = generate(*plain, tokenizer->encode(a.sample_prompt), g);
  if (!ids.empty() && ids.back() == tokenizer->eod()) ids.pop_back();
  log << " sample: " << a.sample_prompt << tokenizer->decode(ids) << "\n";
}

}  // namespace

PretrainResult pretrain(const PretrainArgs& a, const std::shared_ptr<Communicator>& comm,
                        std::ostream& log) {
  // Data-parallel replicas: the world over the tensor- and context-parallel ranks, which share
  // their replica's micro-batches (parallel_groups.h).
  const int dp = comm->size() / static_cast<int>(a.tensor_model_parallel_size * a.context_parallel_size);
  const bool simulated = is_simulated(*comm);
  const bool print = comm->rank() == 0 || simulated;
  if (simulated)
    log << " SIMULATED: this process plays rank " << comm->rank() << " of " << comm->size()
        << " ranks; collectives are local copies, so memory and time per rank are those of the real job"
           " but losses are not\n";
  torch::manual_seed(a.seed);

  // Data.
  GPTDatasetOptions data;
  data.data_prefix = a.data_path;
  data.mock = a.mock_data;
  data.split = a.split;
  data.seq_length = a.seq_length;
  data.seed = static_cast<uint32_t>(a.seed);
  if (!a.mock_data) data.vocab_size = a.real_vocab_size;  // ids the tokenizer cannot produce are errors
  if (a.mock_data) {
    data.mock_options.vocab_size = a.vocab_size > 0 ? a.vocab_size : a.padded_vocab_size;
    data.mock_options.eod = data.mock_options.vocab_size - 1;
    data.mock_options.seed = static_cast<uint64_t>(a.seed);
  }
  const int64_t gbs = a.global_batch_size;
  const int64_t evals = a.skip_train ? 1 : a.train_iters / a.eval_interval + 1;
  GPTDatasets datasets = build_gpt_datasets(
      data, {a.train_iters * gbs, evals * a.eval_iters * gbs, a.eval_iters * gbs});
  BatchLayout layout{a.micro_batch_size, dp, a.num_micro_batches};

  // Every buffer each unit will hold on this rank, before any is allocated (as llm.c prints its
  // buffers): the plan is fully_shard's own layout, equal to what the run holds
  // (tests/dist/memory_plan_test.cpp), and the end-of-run report measures it again.
  if (print) log << format_memory_plan(plan_training_memory(a, comm->size()));
  TrainingRun run(a, model_config_from_args(a), comm, log, a.calculate_per_token_loss);
  std::shared_ptr<CausalLM>& model = run.model();
  const ResumePoint resume = run.start();
  const ParallelGroups& groups = run.groups();
  const int rank = groups.dp_rank;  // which replica's micro-batches this rank reads

  PretrainResult result;
  result.first_loss = std::nan("");

  // A tensor divisor for the reported loss: CUDA divides by a host scalar as a multiply by its
  // reciprocal, which can round otherwise than the host's division it has always been.
  const at::Tensor micro_batches = at::scalar_tensor(static_cast<double>(a.num_micro_batches),
                                                     at::TensorOptions().dtype(at::kDouble).device(comm->device()));
  // Loss of one micro-batch, scaled so that the gradients of a step are those of the mean loss
  // over the global batch (Megatron: mean per micro-batch / micro-batches, 1/dp in the
  // reduction; or, per token, sum / tokens of the global batch with no 1/dp scaling). Under
  // context parallelism each rank holds its chunks of the sequence (ids and labels alike) and
  // the reduction's 1/(dp x cp) averages the chunks' means; under tensor parallelism the logits
  // are this rank's vocabulary slice and the loss is computed across the group.
  // Returns that loss and the one reported (detached, fp64, on the device: no micro-batch reads
  // it, so the host never waits for the forward before queuing the backward).
  const double tokens_per_global_batch = static_cast<double>(gbs * a.seq_length);
  auto micro_loss = [&](const at::Tensor& cpu_tokens) -> std::pair<at::Tensor, at::Tensor> {
    at::Tensor tokens = to_device(cpu_tokens, comm->device());  // the model's device (the communicator's)
    at::Tensor input = tokens.narrow(1, 0, a.seq_length);
    at::Tensor labels = tokens.narrow(1, 1, a.seq_length);
    if (groups.context_parallel) {
      input = context_parallel::shard_sequence(input, 1, groups.cp, groups.context_parallel->rank());
      labels = context_parallel::shard_sequence(labels, 1, groups.cp, groups.context_parallel->rank());
    }
    at::Tensor logits = model->call(input);
    Communicator* tp = groups.tensor_parallel.get();
    if (a.calculate_per_token_loss) {
      TokenLossSum s = tp ? tensor_parallel::vocab_parallel_lm_loss_sum(logits, labels, *tp) : lm_loss_sum(logits, labels);
      return std::pair{s.sum / tokens_per_global_batch, s.sum.detach().to(at::kDouble)};
    }
    at::Tensor loss = tp ? tensor_parallel::vocab_parallel_lm_loss(logits, labels, *tp) : lm_loss(logits, labels);
    return std::pair{loss / static_cast<double>(a.num_micro_batches),
                     loss.detach().to(at::kDouble) / micro_batches};
  };

  auto evaluate = [&](int64_t iteration) {
    if (!datasets.valid || a.eval_iters == 0) return std::nan("");
    torch::NoGradGuard no_grad;
    // Summed on the device, read once.
    at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(comm->device()));
    const int64_t batches_per_eval = a.eval_iters;
    const int64_t first_batch = (iteration / a.eval_interval) * batches_per_eval;
    for (int64_t b = 0; b < batches_per_eval; ++b)
      for (int64_t m = 0; m < a.num_micro_batches; ++m)
        total.add_(micro_loss(datasets.valid->micro_batch(layout, first_batch + b, m, rank)).second);
    double mean = total.item<double>() / batches_per_eval;
    if (a.calculate_per_token_loss) mean = mean * groups.dp_cp() / tokens_per_global_batch;  // sum -> mean
    mean = run.all_reduce_mean(mean);
    if (print) {
      log << " validation loss at iteration " << iteration << " | lm loss: " << std::scientific
          << std::setprecision(6) << mean << std::defaultfloat << "\n";
      log.flush();
    }
    IterationRecord r;
    r.iteration = iteration;
    r.consumed_samples = iteration * gbs;
    r.lm_loss = mean;
    r.eval = true;
    r.mem_bytes = peak_memory_bytes(comm->device());
    run.record(r);
    return mean;
  };

  if (a.skip_train) {
    result.final_eval_loss = evaluate(0);
    return result;
  }

  const double flops_per_iter = run.config().spec->flops_per_iteration(run.config(), gbs, a.seq_length);
  const auto start = Clock::now();
  auto window_start = start;
  double window_loss = 0;
  int64_t window_iters = 0;
  int64_t it = resume.iteration + 1;
  if (it > a.train_iters && print)
    log << " checkpoint iteration " << resume.iteration << " reaches --train-iters " << a.train_iters
        << ": nothing to train\n";
  for (; it <= a.train_iters; ++it) {
    const TrainingRun::StepStats stats = run.step(it, a.num_micro_batches, [&](int64_t m) {
      auto [loss, reported] = micro_loss(datasets.train->micro_batch(layout, it - 1, m, rank));
      loss.backward();
      return reported;
    });
    const double norm = stats.grad_norm, lr = stats.lr;
    double step_loss = stats.loss;
    if (a.calculate_per_token_loss) step_loss = step_loss * groups.dp_cp() / tokens_per_global_batch;
    window_loss += step_loss;
    ++window_iters;

    if (it % a.log_interval == 0 || it == a.train_iters) {
      const double loss = run.all_reduce_mean(window_loss / window_iters);
      const auto now = Clock::now();
      const double iter_s = std::chrono::duration<double>(now - window_start).count() / window_iters;
      const double elapsed = std::chrono::duration<double>(now - start).count();
      IterationRecord r;
      r.iteration = it;
      r.consumed_samples = it * gbs;
      r.lm_loss = loss;
      r.lr = lr;
      r.grad_norm = norm;
      r.iter_time_s = iter_s;
      r.tokens_per_sec = gbs * a.seq_length / iter_s;
      r.tflops_per_rank = flops_per_iter / iter_s / comm->size() / 1e12;
      r.mem_bytes = peak_memory_bytes(comm->device());
      run.add_norms(r, stats);
      run.record(r);
      if (std::isnan(result.first_loss)) result.first_loss = loss;
      result.final_loss = loss;
      result.tokens_per_sec = r.tokens_per_sec;
      if (print) {
        // Megatron's order: grad norm, num zeros, params norm.
        char line[640];
        std::snprintf(line, sizeof line,
                      " iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per "
                      "iteration (ms): %.1f | learning rate: %.6E | global batch size: %5lld | "
                      "lm loss: %.6E | grad norm: %.3f%s | tokens/s: %.1f | TFLOP/s per rank: %.4f | "
                      "mem (MiB): %.1f | eta %s",
                      (long long)it, (long long)a.train_iters, (long long)r.consumed_samples,
                      iter_s * 1e3, lr, (long long)gbs, loss, norm, run.norms_log_text(stats).c_str(),
                      r.tokens_per_sec, r.tflops_per_rank, r.mem_bytes / 1048576.0,
                      hms(elapsed / (it - resume.iteration) * (a.train_iters - it)).c_str());
        log << line << "\n";
        log.flush();
      }
      window_loss = 0;
      window_iters = 0;
      window_start = Clock::now();
    }
    if (it % a.eval_interval == 0 && it != a.train_iters) evaluate(it);
    if (run.after_iteration(it)) {
      result.iterations = it;
      return result;
    }
  }
  const int64_t last = std::max(a.train_iters, resume.iteration);
  result.iterations = last;
  if (!a.save.empty()) run.finish_checkpoint(last);
  result.final_eval_loss = evaluate(last);
  if (!a.sample_prompt.empty()) print_sample(a, run, log);
  run.finish(last);
  return result;
}

}  // namespace mfsdp
