#include "mfsdp/train/trainer.h"

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
#include "mfsdp/train/model_memory_plan.h"
#include "mfsdp/train/train_loop.h"
#include "mfsdp/train/training_run.h"

namespace mfsdp {
namespace {

std::string hms(double seconds) {
  int s = static_cast<int>(std::max(0.0, seconds));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02d:%02d:%02d", s / 3600, s / 60 % 60, s % 60);
  return buf;
}

// --sample-prompt: gathers the full model (collective) and, on rank 0, prints a sample.
void print_sample(const PretrainingSection& a, const TokenizerSection& tokenizer_flags, TrainingRun& run,
                  std::ostream& log) {
  // Every expert too, under expert parallelism; on the host, as the sample model is built there.
  auto state = run.gather_full_weights(/*all_ranks=*/false, /*cpu_offload=*/true);
  if (run.comm()->rank() != 0) return;
  ModelBuildOptions options;
  options.moe = moe_training_from_args(run.args());
  std::shared_ptr<CausalLM> plain = run.config().spec->build(run.config(), options);
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : model_tensors(*plain)) t.copy_(state.at(name));
  }
  const TokenizerSection& k = tokenizer_flags;
  TokenizerOptions t{k.tokenizer_type, k.tokenizer_model, k.vocab_file, k.merge_file};
  auto tokenizer = make_torch_safe_tokenizer(t);
  if (!tokenizer) {
    log << " sample: needs ByteLevelTokenizer, GPT2BPETokenizer or HuggingFaceTokenizer (use mfsdp-generate --prompt-ids)\n";
    return;
  }
  GenerateOptions g;
  g.max_new_tokens = a.sample_tokens;
  g.top_k = 20;
  g.temperature = 0.8;
  g.seed = static_cast<uint64_t>(run.args().seed);
  g.stop_id = tokenizer->eod();
  g.vocab_size = tokenizer->vocab_size();  // not the padded rows (Megatron's sampling clamps to it too)
  auto ids = generate(*plain, tokenizer->encode(a.sample_prompt), g);
  if (!ids.empty() && ids.back() == tokenizer->eod()) ids.pop_back();
  log << " sample: " << a.sample_prompt << tokenizer->decode(ids) << "\n";
}

}  // namespace

namespace {

// mfsdp-pretrain's part of the loop (train_loop.h): GPT batches of the corpus, the language-model
// loss, Megatron's log line.
class Pretrainer : public MicroBatchTrainer {
 public:
  Pretrainer(TrainingRun& run, const GPTDatasets& datasets, PretrainResult& result)
      : MicroBatchTrainer(run),
        a_(run.args()),
        datasets_(datasets),
        result_(result),
        dims_(run.mesh().dims()),
        dp_rank_(run.mesh().coordinate("dp")),
        context_parallel_(run.mesh().split("cp")),
        tensor_parallel_(run.mesh().split("tp")),
        layout_{a_.micro_batch_size, dims_.dp(), a_.num_micro_batches},
        tokens_per_global_batch_(static_cast<double>(a_.global_batch_size * a_.seq_length)),
        // A tensor divisor for the reported loss: CUDA divides by a host scalar as a multiply by
        // its reciprocal, which can round otherwise than the host's division it has always been.
        micro_batches_(at::scalar_tensor(static_cast<double>(a_.num_micro_batches),
                                         at::TensorOptions().dtype(at::kDouble).device(run.comm()->device()))),
        flops_per_iter_(run.config().spec->flops_per_iteration(run.config(), a_.global_batch_size, a_.seq_length)) {}

  at::Tensor forward_backward(int64_t iteration, int64_t m) override {
    auto [loss, reported] = micro_loss(datasets_.train->micro_batch(layout_, iteration - 1, m, dp_rank_));
    loss.backward();
    return reported;
  }

  ChunkOutput forward_chunk(int64_t iteration, int chunk, int64_t m, const at::Tensor& input) override {
    return chunk_loss(datasets_.train->micro_batch(layout_, iteration - 1, m, dp_rank_), chunk, input);
  }

  void log(const LogWindow& w) override {
    double window_loss = 0;
    for (double step_loss : w.losses) {
      if (a_.calculate_per_token_loss) step_loss = step_loss * dims_.dp_cp() / tokens_per_global_batch_;
      window_loss += step_loss;
    }
    // Under pipeline parallelism only the last stage has the loss (the others report zero).
    const double loss = run_.all_reduce_mean(window_loss / static_cast<double>(w.steps)) * dims_.pp;
    const int64_t gbs = a_.global_batch_size;
    const double iter_s = w.seconds / static_cast<double>(w.steps);
    IterationRecord r;
    r.iteration = w.iteration;
    r.consumed_samples = w.iteration * gbs;
    r.lm_loss = loss;
    r.lr = w.last.lr;
    r.grad_norm = w.grad_norm;
    r.iter_time_s = iter_s;
    r.tokens_per_sec = gbs * a_.seq_length / iter_s;
    r.tflops_per_rank = flops_per_iter_ / iter_s / run_.comm()->size() / 1e12;
    r.mem_bytes = peak_memory_bytes(run_.comm()->device());
    run_.add_norms(r, w.last);
    // Pipeline parallelism: the stages' mean idle fraction in the window's last step (time waiting
    // for a receive), beside the schedule's ideal bubble (1F1B's (P - 1) / (m + P - 1)).
    char bubble[96] = "";
    if (dims_.pp > 1) {
      const PipelineTimes& t = w.last.pipeline;
      const double idle = run_.all_reduce_mean(t.seconds > 0 ? t.waiting / t.seconds : 0.0);
      // Interleaving divides the bubble by the chunks per stage V: (P - 1) / (V m + P - 1).
      const double v = run_.pipeline().virtual_stages;
      const double ideal = (dims_.pp - 1.0) / (v * static_cast<double>(a_.num_micro_batches) + dims_.pp - 1);
      r.extra.emplace_back("pipeline_bubble", idle);
      r.extra.emplace_back("pipeline_bubble_ideal", ideal);
      std::snprintf(bubble, sizeof bubble, " | pipeline bubble: %.1f%% (the schedule's ideal %.1f%%)", 100 * idle, 100 * ideal);
    }
    run_.record(r);
    if (std::isnan(result_.first_loss)) result_.first_loss = loss;
    result_.final_loss = loss;
    result_.tokens_per_sec = r.tokens_per_sec;
    if (!run_.prints()) return;
    // Megatron's order: grad norm, num zeros, params norm.
    char line[768];
    std::snprintf(line, sizeof line,
                  " iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per "
                  "iteration (ms): %.1f | learning rate: %.6E | global batch size: %5lld | "
                  "lm loss: %.6E | grad norm: %.3f%s | tokens/s: %.1f | TFLOP/s per rank: %.4f | "
                  "mem (MiB): %.1f%s | eta %s",
                  (long long)w.iteration, (long long)a_.train_iters, (long long)r.consumed_samples, iter_s * 1e3,
                  r.lr, (long long)gbs, loss, r.grad_norm, run_.norms_log_text(w.last).c_str(), r.tokens_per_sec,
                  r.tflops_per_rank, r.mem_bytes / 1048576.0, bubble,
                  hms(w.elapsed / (w.iteration - w.resumed_after) * (a_.train_iters - w.iteration)).c_str());
    run_.log() << line << "\n";
    run_.log().flush();
  }

  void evaluate(int64_t iteration) override { evaluation(iteration); }

  // The validation loss after `iteration` (NaN without a validation set), logged and recorded.
  double evaluation(int64_t iteration) {
    if (!datasets_.valid || a_.eval_iters == 0) return std::nan("");
    torch::NoGradGuard no_grad;
    // Summed on the device, read once.
    at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(run_.comm()->device()));
    const int64_t batches_per_eval = a_.eval_iters;
    const int64_t first_batch = (iteration / a_.eval_interval) * batches_per_eval;
    for (int64_t b = 0; b < batches_per_eval; ++b) {
      if (run_.pipeline().forward) {
        total.add_(run_forward_pipeline(run_.pipeline(), a_.num_micro_batches, [&](int c, int64_t m, const at::Tensor& in) {
          return chunk_loss(datasets_.valid->micro_batch(layout_, first_batch + b, m, dp_rank_), c, in);
        }));
        continue;
      }
      for (int64_t m = 0; m < a_.num_micro_batches; ++m)
        total.add_(micro_loss(datasets_.valid->micro_batch(layout_, first_batch + b, m, dp_rank_)).second);
    }
    double mean = total.item<double>() / batches_per_eval;
    if (a_.calculate_per_token_loss) mean = mean * dims_.dp_cp() / tokens_per_global_batch_;  // sum -> mean
    mean = run_.all_reduce_mean(mean) * dims_.pp;  // the last stage's (see log)
    if (run_.prints()) {
      run_.log() << " validation loss at iteration " << iteration << " | lm loss: " << std::scientific
                 << std::setprecision(6) << mean << std::defaultfloat << "\n";
      run_.log().flush();
    }
    IterationRecord r;
    r.iteration = iteration;
    r.consumed_samples = iteration * a_.global_batch_size;
    r.lm_loss = mean;
    r.eval = true;
    r.mem_bytes = peak_memory_bytes(run_.comm()->device());
    run_.record(r);
    return mean;
  }

 private:
  // Loss of one micro-batch, scaled so that the gradients of a step are those of the mean loss
  // over the global batch (Megatron: mean per micro-batch / micro-batches, 1/dp in the
  // reduction; or, per token, sum / tokens of the global batch with no 1/dp scaling). Under
  // context parallelism each rank holds its chunks of the sequence (ids and labels alike) and
  // the reduction's 1/(dp x cp) averages the chunks' means; under tensor parallelism the logits
  // are this rank's vocabulary slice and the loss is computed across the group.
  // Returns that loss and the one reported (detached, fp64, on the device: no micro-batch reads
  // it, so the host never waits for the forward before queuing the backward).
  std::pair<at::Tensor, at::Tensor> micro_loss(const at::Tensor& cpu_tokens) {
    auto [input, labels] = inputs_and_labels(cpu_tokens);
    return output_loss(input, labels);
  }

  // The micro-batch's loss from the model's output layer: fused with it in chunks of the
  // vocabulary (--cross-entropy-loss-fusion, no full logits), or from the logits.
  std::pair<at::Tensor, at::Tensor> output_loss(const at::Tensor& input, const at::Tensor& labels) {
    if (!a_.cross_entropy_loss_fusion) return loss_of(run_.model()->call(input), labels);
    ChunkedOutputOptions o;
    o.chunk_elements = a_.cross_entropy_chunk_elements;
    const at::Tensor losses = -run_.model()->token_stats(input, {}, labels, o).log_probs;  // 0 where ignored
    const at::Tensor counted = labels.ne(-100).sum();
    if (a_.calculate_per_token_loss) {
      const at::Tensor sum = losses.sum();
      return std::pair{sum / tokens_per_global_batch_, sum.detach().to(at::kDouble)};
    }
    // 0 / 0 = NaN when every label is ignored, as lm_loss (torch's mean reduction).
    const at::Tensor loss = losses.sum() / counted.to(at::kFloat);
    return std::pair{loss / static_cast<double>(a_.num_micro_batches), loss.detach().to(at::kDouble) / micro_batches_};
  }

  // Pipeline parallelism: this stage's forward of model chunk `chunk` for one micro-batch
  // (pipeline_runner.h), from the token ids on the first chunk, else from the previous chunk's
  // hidden states `received`; the last chunk's output is the loss.
  ChunkOutput chunk_loss(const at::Tensor& cpu_tokens, int chunk, const at::Tensor& received) {
    auto [input, labels] = inputs_and_labels(cpu_tokens);
    run_.model()->select_pipeline_chunk(chunk);
    const at::Tensor in = received.defined() ? received : input;
    if (!run_.model()->pipeline_chunk()->output) return {run_.model()->call(in), {}, {}};
    auto [loss, reported] = output_loss(in, labels);
    return {{}, loss, reported};
  }

  // The model's input and the labels of a micro-batch's tokens [B, T + 1], on the model's device
  // (the communicator's); under context parallelism this rank's chunks of both.
  std::pair<at::Tensor, at::Tensor> inputs_and_labels(const at::Tensor& cpu_tokens) {
    at::Tensor tokens = to_device(cpu_tokens, run_.comm()->device());
    at::Tensor input = tokens.narrow(1, 0, a_.seq_length);
    at::Tensor labels = tokens.narrow(1, 1, a_.seq_length);
    if (context_parallel_) {
      input = context_parallel::shard_sequence(input, 1, dims_.cp, context_parallel_->rank());
      labels = context_parallel::shard_sequence(labels, 1, dims_.cp, context_parallel_->rank());
    }
    return {input, labels};
  }

  std::pair<at::Tensor, at::Tensor> loss_of(const at::Tensor& logits, const at::Tensor& labels) {
    Communicator* tp = tensor_parallel_.get();
    if (a_.calculate_per_token_loss) {
      TokenLossSum s = tp ? tensor_parallel::vocab_parallel_lm_loss_sum(logits, labels, *tp) : lm_loss_sum(logits, labels);
      return std::pair{s.sum / tokens_per_global_batch_, s.sum.detach().to(at::kDouble)};
    }
    at::Tensor loss = tp ? tensor_parallel::vocab_parallel_lm_loss(logits, labels, *tp) : lm_loss(logits, labels);
    return std::pair{loss / static_cast<double>(a_.num_micro_batches), loss.detach().to(at::kDouble) / micro_batches_};
  }

  const PretrainArgs& a_;
  const GPTDatasets& datasets_;
  PretrainResult& result_;
  const ParallelDims& dims_;
  const int dp_rank_;  // this rank's data-parallel replica: its share of every batch
  const std::shared_ptr<Communicator> context_parallel_, tensor_parallel_;  // null when not split
  BatchLayout layout_;
  double tokens_per_global_batch_;
  at::Tensor micro_batches_;
  double flops_per_iter_;
};

}  // namespace

PretrainResult pretrain(const PretrainArgs& a, const std::shared_ptr<Communicator>& comm,
                        std::ostream& log) {
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

  // Every buffer each unit will hold on this rank, before any is allocated (as llm.c prints its
  // buffers): the plan is fully_shard's own layout, equal to what the run holds
  // (tests/dist/memory_plan_test.cpp), and the end-of-run report measures it again.
  const ModelConfig config = model_config_from_args(a, a, a.seq_length, a.padded_vocab_size);
  if (print)  // rank 0: the first pipeline stage's
    log << format_memory_plan(plan_training_memory(config, a, parallel_dims(a, a, comm->size()),
                                                   shard_options_from_args(a, a, a, a.calculate_per_token_loss),
                                                   a.num_micro_batches));
  TrainingRun run(a, config, comm, log, a.calculate_per_token_loss, {}, {}, open_training_checkpoint(a));
  const ResumePoint resume = run.start();

  PretrainResult result;
  result.first_loss = std::nan("");
  Pretrainer trainer(run, datasets, result);
  if (a.skip_train) {
    result.final_eval_loss = trainer.evaluation(0);
    return result;
  }
  const Trainer::Outcome end = trainer.train(resume);
  result.iterations = end.last;
  if (end.stopped) return result;
  result.final_eval_loss = trainer.evaluation(end.last);
  if (!a.sample_prompt.empty()) print_sample(a, a, run, log);
  run.finish(end.last);
  return result;
}

}  // namespace mfsdp
