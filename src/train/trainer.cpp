#include "train/trainer.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>

#include "mfsdp/fully_shard.h"
#include "mfsdp/generate.h"
#include "mfsdp/gpt_dataset.h"
#include "mfsdp/llama.h"
#include "mfsdp/optim.h"
#include "mfsdp/simulated_comm.h"
#include "mfsdp/tokenizer.h"
#include "train/metrics.h"
#include "train/trainer_checkpoint.h"

namespace mfsdp {
namespace {

using Clock = std::chrono::steady_clock;

LlamaConfig model_config(const PretrainArgs& a) {
  LlamaConfig c;
  c.vocab_size = a.padded_vocab_size;
  c.hidden_size = a.hidden_size;
  c.intermediate_size = a.ffn_hidden_size;
  c.num_layers = a.num_layers;
  c.num_attention_heads = a.num_attention_heads;
  c.num_key_value_heads = a.num_query_groups;
  c.max_position_embeddings = a.max_position_embeddings;
  c.rope_theta = a.rotary_base;
  c.rms_norm_eps = a.norm_epsilon;
  c.tie_word_embeddings = !a.untie_embeddings_and_output_weights;
  c.init_std = a.init_method_std;
  c.validate();
  return c;
}

FullyShardOptions shard_options(const PretrainArgs& a, const std::shared_ptr<Communicator>& comm) {
  FullyShardOptions o;
  o.comm = comm;
  o.strategy = parse_sharding_strategy(a.data_parallel_sharding_strategy);
  o.prefetch = !a.no_fsdp_prefetch;
  o.all_gather_in_start_param_sync = !a.no_fsdp_all_gather_in_start_param_sync;
  if (a.fsdp_double_buffer) o.buffer_allocator = BufferAllocatorKind::kDoubleBuffer;
  if (a.fsdp_trace_pool) o.buffer_allocator = BufferAllocatorKind::kTracePool;
  if (a.bf16) o.mixed_precision.param_dtype = at::kBFloat16;
  if (a.grad_reduce_in_bf16) o.mixed_precision.grad_comm_dtype = at::kBFloat16;
  // Per-token loss: the loss is already divided by the global token count.
  o.gradient_scaling =
      a.calculate_per_token_loss ? GradientScaling::kNone : GradientScaling::kDivideByWorld;
  return o;
}

// Builds the model and shards it. With deferred init every layer is materialised and sharded in
// turn, so no rank ever holds the whole model.
std::pair<LlamaForCausalLM, FsdpHandle> build_model(const PretrainArgs& a,
                                                    const std::shared_ptr<Communicator>& comm) {
  LlamaOptions options;
  options.deferred_init = a.init_model_with_meta_device;
  options.recompute_layers = a.recompute_activations;
  options.init_seed = static_cast<uint64_t>(a.seed);
  LlamaForCausalLM model(model_config(a), options);
  for (int64_t i = 0; i < model->model->num_layers(); ++i)
    model->model->layer(i).self_attn->use_sdpa = a.attention_backend != "unfused";
  FullyShardOptions shard = shard_options(a, comm);
  for (int64_t i = 0; i < model->model->num_layers(); ++i) {
    if (a.init_model_with_meta_device) model->materialize_and_init_layer(i);
    fully_shard(model->model->layer(i), shard);
  }
  if (a.init_model_with_meta_device) model->init_root();
  FsdpHandle root = shard_llama_root(model, shard);
  return {model, root};
}

std::string hms(double seconds) {
  int s = static_cast<int>(std::max(0.0, seconds));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02d:%02d:%02d", s / 3600, s / 60 % 60, s % 60);
  return buf;
}

double all_reduce_mean(Communicator& comm, double value) {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kDouble).device(comm.device()));
  comm.all_reduce(t, {ReduceOp::kAvg});
  return t.item<double>();
}

// Gathers the full model (collective) and, on rank 0, saves it and/or prints a sample.
void finish_with_model(const PretrainArgs& a, LlamaForCausalLM& model, FsdpHandle& root,
                       std::ostream& log) {
  auto state = root.full_state_dict(/*all_ranks=*/false);
  if (state.empty()) return;  // not rank 0
  if (!a.save_final_model.empty()) {
    save_final_model(a.save_final_model, model->config(), a.tokenizer_type, state);
    log << " final model: " << a.save_final_model << " (mfsdp-generate --model "
        << a.save_final_model << ")\n";
  }
  if (a.sample_prompt.empty()) return;
  LlamaForCausalLM plain(model->config());
  {
    torch::NoGradGuard no_grad;
    for (auto& item : plain->named_parameters()) item.value().copy_(state.at(item.key()));
  }
  TokenizerOptions t{a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file};
  auto tokenizer = make_torch_safe_tokenizer(t);
  if (!tokenizer) {
    log << " sample: needs ByteLevelTokenizer or GPT2BPETokenizer (use mfsdp-generate --prompt-ids)\n";
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
  const int rank = comm->rank(), dp = comm->size();
  const bool simulated = is_simulated(*comm);
  const bool print = rank == 0 || simulated;
  if (simulated)
    log << " SIMULATED: this process plays rank " << rank << " of " << dp
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

  auto [model, root] = build_model(a, comm);
  std::unique_ptr<DistributedOptimizer> optimizer;
  if (a.optimizer == "adam") {
    AdamWOptions o;
    o.beta1 = a.adam_beta1;
    o.beta2 = a.adam_beta2;
    o.eps = a.adam_eps;
    o.weight_decay = a.weight_decay;
    optimizer = make_adamw(root, o);
  } else {
    SGDOptions o;
    o.momentum = a.sgd_momentum;
    o.weight_decay = a.weight_decay;
    optimizer = make_sgd(root, o);
  }
  LRSchedule schedule;
  schedule.max_lr = a.lr;
  schedule.min_lr = a.min_lr;
  schedule.warmup_steps = a.lr_warmup_iters;
  schedule.decay_steps = a.lr_decay_iters;
  schedule.style = a.lr_decay_style;
  const LlamaConfig config = model->config();
  ResumePoint resume;
  if (!a.load.empty())
    resume = load_training_checkpoint(a, config, comm, root, *optimizer, schedule, log);
  auto save = [&](int64_t iteration) {
    save_training_checkpoint(a, config, comm, root, *optimizer, schedule, iteration, log);
  };

  MetricsWriter metrics(print ? a.metrics_file : "");
  std::vector<IterationRecord> history;
  PretrainResult result;
  result.first_loss = std::nan("");

  // Loss of one micro-batch, scaled so that the gradients of a step are those of the mean loss
  // over the global batch (Megatron: mean per micro-batch / micro-batches, 1/dp in the
  // reduction; or, per token, sum / tokens of the global batch with no 1/dp scaling).
  const double tokens_per_global_batch = static_cast<double>(gbs * a.seq_length);
  auto micro_loss = [&](const at::Tensor& cpu_tokens, double* reported) {
    at::Tensor tokens = cpu_tokens.to(comm->device());  // the model's device (the communicator's)
    at::Tensor input = tokens.narrow(1, 0, a.seq_length);
    at::Tensor labels = tokens.narrow(1, 1, a.seq_length);
    at::Tensor logits = model->call(input);
    if (a.calculate_per_token_loss) {
      TokenLossSum s = lm_loss_sum(logits, labels);
      *reported += s.sum.item<double>();
      return s.sum / tokens_per_global_batch;
    }
    at::Tensor loss = lm_loss(logits, labels);
    *reported += loss.item<double>() / a.num_micro_batches;
    return loss / static_cast<double>(a.num_micro_batches);
  };

  auto evaluate = [&](int64_t iteration) {
    if (!datasets.valid || a.eval_iters == 0) return std::nan("");
    torch::NoGradGuard no_grad;
    double total = 0;
    const int64_t batches_per_eval = a.eval_iters;
    const int64_t first_batch = (iteration / a.eval_interval) * batches_per_eval;
    for (int64_t b = 0; b < batches_per_eval; ++b)
      for (int64_t m = 0; m < a.num_micro_batches; ++m) {
        double loss = 0;
        micro_loss(datasets.valid->micro_batch(layout, first_batch + b, m, rank), &loss);
        total += loss;
      }
    double mean = total / batches_per_eval;
    if (a.calculate_per_token_loss) mean = mean * dp / tokens_per_global_batch;  // sum -> mean
    mean = all_reduce_mean(*comm, mean);
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
    metrics.write(r);
    history.push_back(r);
    return mean;
  };

  if (a.skip_train) {
    result.final_eval_loss = evaluate(0);
    return result;
  }

  const double flops_per_iter = megatron_flops_per_iteration(a, gbs);
  const auto start = Clock::now();
  auto window_start = start;
  double window_loss = 0;
  int64_t window_iters = 0;
  int64_t last_saved = resume.iteration;
  int64_t it = resume.iteration + 1;
  if (it > a.train_iters && print)
    log << " checkpoint iteration " << resume.iteration << " reaches --train-iters " << a.train_iters
        << ": nothing to train\n";
  for (; it <= a.train_iters; ++it) {
    double step_loss = 0;
    for (int64_t m = 0; m < a.num_micro_batches; ++m) {
      root.set_requires_gradient_sync(m == a.num_micro_batches - 1);
      at::Tensor tokens = datasets.train->micro_batch(layout, it - 1, m, rank);
      micro_loss(tokens, &step_loss).backward();
    }
    const double norm = optimizer->clip_grad_norm(a.clip_grad);
    const double lr = schedule.lr_at(it);
    optimizer->step(lr);
    root.zero_grad();
    if (a.calculate_per_token_loss) step_loss = step_loss * dp / tokens_per_global_batch;
    window_loss += step_loss;
    ++window_iters;

    if (it % a.log_interval == 0 || it == a.train_iters) {
      const double loss = all_reduce_mean(*comm, window_loss / window_iters);
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
      r.tflops_per_rank = flops_per_iter / iter_s / dp / 1e12;
      r.mem_bytes = peak_memory_bytes(comm->device());
      metrics.write(r);
      history.push_back(r);
      if (std::isnan(result.first_loss)) result.first_loss = loss;
      result.final_loss = loss;
      result.tokens_per_sec = r.tokens_per_sec;
      if (print) {
        char line[512];
        std::snprintf(line, sizeof line,
                      " iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per "
                      "iteration (ms): %.1f | learning rate: %.6E | global batch size: %5lld | "
                      "lm loss: %.6E | grad norm: %.3f | tokens/s: %.1f | TFLOP/s per rank: %.4f | "
                      "mem (MiB): %.1f | eta %s",
                      (long long)it, (long long)a.train_iters, (long long)r.consumed_samples,
                      iter_s * 1e3, lr, (long long)gbs, loss, norm, r.tokens_per_sec,
                      r.tflops_per_rank, r.mem_bytes / 1048576.0,
                      hms(elapsed / (it - resume.iteration) * (a.train_iters - it)).c_str());
        log << line << "\n";
        log.flush();
      }
      window_loss = 0;
      window_iters = 0;
      window_start = Clock::now();
    }
    if (it % a.eval_interval == 0 && it != a.train_iters) evaluate(it);
    if (!a.save.empty() && a.save_interval > 0 && it % a.save_interval == 0) {
      save(it);
      last_saved = it;
    }
    if (a.exit_interval > 0 && it % a.exit_interval == 0 && it != a.train_iters) {
      if (!a.save.empty() && last_saved != it) save(it);
      if (print) log << " exiting at iteration " << it << " (--exit-interval " << a.exit_interval << ")\n";
      result.iterations = it;
      return result;
    }
  }
  const int64_t last = std::max(a.train_iters, resume.iteration);
  if (!a.save.empty() && last_saved != last) save(last);
  result.iterations = last;
  result.final_eval_loss = evaluate(last);
  if (print && !a.metrics_file.empty()) {
    // metrics.jsonl -> metrics.svg (next to the metrics file).
    std::string svg = a.metrics_file;
    const auto dot = svg.rfind('.'), slash = svg.rfind('/');
    if (dot != std::string::npos && (slash == std::string::npos || dot > slash)) svg.resize(dot);
    svg += ".svg";
    write_loss_curve_svg(svg, history);
    log << " loss curve: " << svg << "\n";
  }
  if (!a.save_final_model.empty() || !a.sample_prompt.empty()) finish_with_model(a, model, root, log);
  if (print) {
    MemoryReport m = root.memory();
    int64_t state = 0;
    for (auto& [name, tensors] : optimizer->state())
      for (auto& t : tensors) state += t.nbytes();
    log << (simulated ? " SIMULATED" : "") << " memory per rank (MiB): model weights " << m.model_weights / 1048576.0
        << ", main weights " << m.main_weights / 1048576.0 << ", main grads "
        << m.main_grads / 1048576.0 << ", optimizer state " << state / 1048576.0
        << ", transient peak " << m.transient_peak / 1048576.0 << ", buffer pool " << m.buffer_pool / 1048576.0 << ", process peak RSS "
        << peak_rss_bytes() / 1048576.0;
    if (comm->device().is_cuda())
      log << ", " << comm->device().str() << " peak allocated " << peak_memory_bytes(comm->device()) / 1048576.0;
    log << "\n";
  }
  return result;
}

}  // namespace mfsdp
