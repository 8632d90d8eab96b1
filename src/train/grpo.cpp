#include "train/grpo.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "mfsdp/batched_generate.h"
#include "mfsdp/chat_template.h"
#include "mfsdp/checkpoint.h"
#include "mfsdp/hf_interop.h"
#include "mfsdp/policy_loss.h"
#include "mfsdp/rewards.h"
#include "mfsdp/tensor_source.h"
#include "mfsdp/token_stats.h"
#include "mfsdp/verifiable_tasks.h"
#include "train/chat_eval.h"
#include "train/rollout_model.h"
#include "train/sft_data.h"
#include "train/tool_flags.h"
#include "train/training_run.h"

namespace mfsdp {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The reference policy: the same model, sharded like the policy, forward only (no optimizer, no
// gradients), loaded from --ref-load, --hf-load or the --load checkpoint (--finetune).
struct ReferencePolicy {
  ShardedLlama sharded;
};
std::unique_ptr<ReferencePolicy> load_reference(const GrpoArgs& g, const LlamaConfig& config,
                                                const std::shared_ptr<Communicator>& comm,
                                                const std::map<std::string, at::Tensor>& start_weights) {
  auto ref = std::make_unique<ReferencePolicy>();
  PretrainArgs a = g.base;
  a.init_model_with_meta_device = false;
  a.recompute_activations = false;
  ref->sharded = build_sharded_llama(config, a, shard_options_from_args(a, comm, /*per_token_loss=*/true));
  const std::string from = !g.ref_load.empty() ? g.ref_load : !g.hf_load.empty() ? g.hf_load : g.base.load_dir;
  if (!g.ref_load.empty() || (from == g.base.load_dir && !from.empty())) {
    if (is_checkpoint(from)) {
      CheckpointLoadOptions o;
      o.load_optimizer = false;
      o.load_rng = false;
      load_checkpoint(from, comm, ref->sharded.root, nullptr, o);
      return ref;
    }
    ref->sharded.root.load_full_state_dict(load_full_weights(from));
    return ref;
  }
  ref->sharded.root.load_full_state_dict(start_weights);
  return ref;
}

// One response of the step.
struct Rollout {
  int64_t prompt = 0;  // index in the step's batch (global)
  std::vector<int64_t> prompt_ids;
  std::vector<int64_t> response_ids;
  std::vector<float> rollout_log_probs;
  bool truncated = false;
  double score = 0;
};

// The step's responses of this rank as training rows: prompt then response, right-padded; the
// loss mask covers the response (all of it, the stop token included), none of it for a
// truncated one with --mask-truncated-completions.
struct RolloutBatch {
  at::Tensor input_ids;      // [B, L]
  at::Tensor labels;         // [B, L] next token
  at::Tensor mask;           // [B, L] float: labels that are response tokens
  at::Tensor attention_mask; // [B, L]
  at::Tensor advantages;     // [B]
  at::Tensor response;           // [B, L] float: labels that are response tokens, trained or not
  at::Tensor rollout_log_probs;  // [B, L] the rollout's log-probs of those labels (0 elsewhere)
};
RolloutBatch collate_rollouts(const std::vector<Rollout>& rollouts, const std::vector<size_t>& rows,
                              const at::Tensor& advantages, int64_t pad, bool mask_truncated) {
  int64_t length = 2;
  for (size_t r : rows)
    length = std::max<int64_t>(length, static_cast<int64_t>(rollouts[r].prompt_ids.size() + rollouts[r].response_ids.size()));
  const auto b = static_cast<int64_t>(rows.size());
  auto i64 = at::TensorOptions().dtype(at::kLong);
  RolloutBatch out;
  out.input_ids = at::full({b, length}, pad, i64);
  out.labels = at::full({b, length}, pad, i64);
  out.mask = at::zeros({b, length}, at::kFloat);
  out.attention_mask = at::zeros({b, length}, i64);
  out.advantages = at::empty({b}, at::kFloat);
  out.response = at::zeros({b, length}, at::kFloat);
  out.rollout_log_probs = at::zeros({b, length}, at::kFloat);
  auto ids = out.input_ids.accessor<int64_t, 2>();
  auto labels = out.labels.accessor<int64_t, 2>();
  auto mask = out.mask.accessor<float, 2>();
  auto response = out.response.accessor<float, 2>();
  auto rollout_lp = out.rollout_log_probs.accessor<float, 2>();
  auto attn = out.attention_mask.accessor<int64_t, 2>();
  for (int64_t i = 0; i < b; ++i) {
    const Rollout& r = rollouts[rows[static_cast<size_t>(i)]];
    const auto p = static_cast<int64_t>(r.prompt_ids.size());
    const auto n = p + static_cast<int64_t>(r.response_ids.size());
    for (int64_t t = 0; t < n; ++t) {
      ids[i][t] = t < p ? r.prompt_ids[t] : r.response_ids[t - p];
      attn[i][t] = 1;
    }
    const bool trained = !(mask_truncated && r.truncated);
    for (int64_t t = p - 1; t + 1 < n; ++t) {
      labels[i][t] = ids[i][t + 1];
      mask[i][t] = trained ? 1.f : 0.f;
      response[i][t] = 1.f;
      rollout_lp[i][t] = r.rollout_log_probs[static_cast<size_t>(t - p + 1)];
    }
    out.advantages[i] = advantages[static_cast<int64_t>(rows[static_cast<size_t>(i)])];
  }
  return out;
}

// log_softmax(logits / temperature) at the labels, [B, L] fp32 (verl's log-probs of the
// rollout distribution), and the entropy of that distribution when asked.
struct PolicyOutputs {
  at::Tensor log_probs;
  at::Tensor entropy;
};
PolicyOutputs policy_outputs(LlamaForCausalLMImpl& model, const RolloutBatch& batch, double temperature,
                             const at::Device& device, bool entropy) {
  SequenceLayout layout;
  layout.attention_mask = batch.attention_mask.to(device);
  at::Tensor logits = model.call(batch.input_ids.to(device), layout);
  if (temperature != 1.0) logits = logits / temperature;
  PolicyOutputs out;
  out.log_probs = token_log_probs(logits, batch.labels.to(device));
  if (entropy) out.entropy = token_entropy(logits);
  return out;
}

}  // namespace

GrpoResult run_grpo(GrpoArgs g, const std::shared_ptr<Communicator>& comm, std::ostream& log) {
  const PretrainArgs& a = g.base;
  const int rank = comm->rank(), dp = comm->size();
  const at::Device device = comm->device();
  torch::manual_seed(a.seed);
  auto tokenizer = make_torch_safe_tokenizer({a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file});
  if (!tokenizer)
    flag_error("--tokenizer-type", "mfsdp-grpo needs a text tokenizer: ByteLevelTokenizer, GPT2BPETokenizer or "
                                   "HuggingFaceTokenizer");
  const std::string chat_template = resolve_chat_template(g.chat_template, *tokenizer);
  const int64_t end_of_turn = chat_end_of_turn_id(*tokenizer, chat_template);
  const int64_t pad = tokenizer->eod();
  const LossAggMode agg = parse_loss_agg_mode(g.loss_agg_mode);
  const ScaleRewards scale = parse_scale_rewards(g.scale_rewards);
  const KlType kl_type = parse_kl_type(g.kl_loss_type);

  // Prompts.
  std::vector<RlExample> train, val;
  if (g.data.generated()) {
    train = generate_tasks(g.data.generator("train"));
    if (g.data.gen_val_size > 0) val = generate_tasks(g.data.generator("test"));
  } else {
    train = read_rl_jsonl(g.data.train_files);
    if (!g.data.val_files.empty()) val = read_rl_jsonl(g.data.val_files);
  }
  std::vector<std::vector<int64_t>> train_prompts;
  for (size_t i = 0; i < train.size(); ++i) {
    std::vector<int64_t> ids = apply_chat_template(*tokenizer, chat_template, train[i].prompt, true).ids;
    const auto n = static_cast<int64_t>(ids.size());
    if (n > g.max_prompt_length) {
      if (g.truncation == "error")
        flag_error("--max-prompt-length", g.data.describe("train") +
                                              ": prompt " + std::to_string(i + 1) + " has " + std::to_string(n) +
                                              " tokens, more than " + std::to_string(g.max_prompt_length) +
                                              " (--truncation left or right cuts it)");
      const int64_t from = g.truncation == "left" ? n - g.max_prompt_length : 0;
      ids = std::vector<int64_t>(ids.begin() + from, ids.begin() + from + g.max_prompt_length);
    }
    train_prompts.push_back(std::move(ids));
  }

  StartingPoint start = starting_point(a, g.hf_load, tokenizer->vocab_size());
  TrainingRun run(a, start.config, comm, log, /*per_token_loss=*/true, grpo_tool_flags(g));
  const ResumePoint resume = run.start(start.weights.empty() ? nullptr : &start.weights);
  std::unique_ptr<ReferencePolicy> ref;
  if (g.use_kl_loss) ref = load_reference(g, start.config, comm, start.weights);
  start.weights.clear();
  const bool print = run.prints();
  if (print) {
    log << " mfsdp-grpo: " << train.size() << " training prompts, " << val.size() << " held out; "
        << g.train_batch_size << " prompts x " << g.rollout_n << " responses per step; chat template "
        << chat_template << "; rollout " << g.rollout_mode << "; model: " << start.description << "\n";
    if (ref) {
      const MemoryReport m = ref->sharded.root.memory();
      double full_bytes = 0;
      for (const auto& [name, shape] : llama_parameter_shapes(start.config)) {
        double numel = 1;
        for (int64_t d : shape) numel *= static_cast<double>(d);
        full_bytes += numel * 4;  // fp32
      }
      log << " reference policy per rank (MiB): weights " << (m.model_weights + m.main_weights) / 1048576.0
          << " of " << full_bytes / 1048576.0 << " for the whole model (sharded over " << dp
          << " ranks; no gradients, no optimizer state)\n";
    }
  }

  SftSampler sampler(static_cast<int64_t>(train_prompts.size()), g.train_batch_size, 1, 1,
                     static_cast<uint64_t>(a.seed));
  ChatEvalOptions eval_options;
  eval_options.chat_template = chat_template;
  eval_options.max_new_tokens = g.max_response_length;
  eval_options.samples = g.val_generate_samples;
  GrpoResult result;
  auto validate = [&](int64_t iteration) {
    if (val.empty() || g.val_generate_samples == 0) return -1.0;
    const ChatEvalResult r = greedy_reward(run, val, *tokenizer, g.reward, eval_options);
    IterationRecord rec;
    rec.iteration = iteration;
    rec.eval = true;
    rec.lm_loss = std::nan("");
    rec.extra.emplace_back("val/score", r.accuracy);
    rec.mem_bytes = peak_memory_bytes(device);
    run.record(rec);
    if (print) {
      char line[160];
      std::snprintf(line, sizeof line, " validation at iteration %lld | score: %.4f (%lld prompts, greedy)",
                    (long long)iteration, r.accuracy, (long long)r.total);
      log << line << "\n";
      log.flush();
    }
    return r.accuracy;
  };
  result.val_score_before = validate(resume.iteration);

  SamplingOptions sampling;
  sampling.max_new_tokens = g.max_response_length;
  sampling.temperature = g.temperature;
  sampling.top_k = g.top_k;
  sampling.top_p = g.top_p;
  sampling.stop_ids = {end_of_turn};
  sampling.pad_id = pad;
  RolloutModel& rollout_copy = run.rollout_model();
  const int64_t prompts_per_rank = g.train_batch_size / dp;
  const int64_t local_sequences = prompts_per_rank * g.rollout_n;
  const int64_t mini_batches = g.train_batch_size / g.ppo_mini_batch_size;
  const int64_t local_per_mini = local_sequences / mini_batches;

  int64_t it = resume.iteration + 1;
  for (; it <= a.train_iters; ++it) {
    const auto step_start = Clock::now();
    std::vector<std::pair<std::string, double>> metrics;
    // ---- Rollout: this rank's prompts, --rollout-n responses each.
    const std::vector<int64_t> batch = sampler.rows(it, 0, 0);
    std::vector<Rollout> rollouts;
    std::vector<std::vector<int64_t>> gen_prompts;
    std::vector<uint64_t> seeds;
    for (int64_t p = rank * prompts_per_rank; p < (rank + 1) * prompts_per_rank; ++p)
      for (int64_t s = 0; s < g.rollout_n; ++s) {
        Rollout r;
        r.prompt = p;
        r.prompt_ids = train_prompts[static_cast<size_t>(batch[static_cast<size_t>(p)])];
        gen_prompts.push_back(r.prompt_ids);
        seeds.push_back(sample_seed(static_cast<uint64_t>(a.seed), it, batch[static_cast<size_t>(p)], s));
        rollouts.push_back(std::move(r));
      }
    double update_weights_s = 0;
    auto t0 = Clock::now();
    GeneratedBatch generated;
    {
      torch::NoGradGuard no_grad;
      if (g.rollout_mode == "full") {
        rollout_copy.load_from(run.root());
        update_weights_s = seconds_since(t0);
        generated = generate_batch(rollout_copy.model(), gen_prompts, seeds, sampling);
        rollout_copy.release();
      } else {
        generated = generate_batch(*run.model(), gen_prompts, seeds, sampling, comm.get());
      }
    }
    const double gen_s = seconds_since(t0) - update_weights_s;
    // ---- Rewards and advantages (scores of the whole batch on every rank: batch std).
    at::Tensor scores = at::zeros({g.train_batch_size * g.rollout_n}, at::kDouble);
    for (size_t i = 0; i < rollouts.size(); ++i) {
      Rollout& r = rollouts[i];
      r.response_ids = generated.tokens[i];
      r.rollout_log_probs = generated.log_probs[i];
      r.truncated = generated.truncated[i] != 0;
      const RlExample& e = train[static_cast<size_t>(batch[static_cast<size_t>(r.prompt)])];
      r.score = compute_score_by_name(g.reward, e.data_source, decode_generated(*tokenizer, r.response_ids, end_of_turn),
                                      e.ground_truth);
      scores[rank * local_sequences + static_cast<int64_t>(i)] = r.score;
    }
    {
      at::Tensor s = scores.to(device);
      comm->all_reduce(s, {ReduceOp::kSum});
      scores = s.cpu();
    }
    std::vector<int64_t> groups(static_cast<size_t>(scores.size(0)));
    for (size_t i = 0; i < groups.size(); ++i) groups[i] = static_cast<int64_t>(i) / g.rollout_n;
    const at::Tensor all_advantages = grpo_advantages(scores.to(at::kFloat), groups, scale);
    const at::Tensor advantages = all_advantages.narrow(0, rank * local_sequences, local_sequences);

    // Response statistics over the whole batch.
    double lengths[3] = {0, 0, 0};  // sum, max, truncated
    for (const Rollout& r : rollouts) {
      lengths[0] += static_cast<double>(r.response_ids.size());
      lengths[1] = std::max(lengths[1], static_cast<double>(r.response_ids.size()));
      lengths[2] += r.truncated ? 1 : 0;
    }
    const double total_sequences = static_cast<double>(scores.size(0));
    const double length_sum = run.all_reduce_sum(lengths[0]);
    const double length_max = run.all_reduce_max(lengths[1]);
    const double truncated_count = run.all_reduce_sum(lengths[2]);
    const at::Tensor group_std = scores.view({-1, g.rollout_n}).std(1, /*unbiased=*/g.rollout_n > 1);
    metrics.emplace_back("critic/score/mean", scores.mean().item<double>());
    metrics.emplace_back("critic/score/max", scores.max().item<double>());
    metrics.emplace_back("critic/score/min", scores.min().item<double>());
    metrics.emplace_back("critic/advantages/mean", all_advantages.mean().item<double>());
    metrics.emplace_back("critic/advantages/max", all_advantages.max().item<double>());
    metrics.emplace_back("critic/advantages/min", all_advantages.min().item<double>());
    metrics.emplace_back("frac_reward_zero_std", (group_std < 1e-12).to(at::kDouble).mean().item<double>());
    metrics.emplace_back("response_length/mean", length_sum / total_sequences);
    metrics.emplace_back("response_length/max", length_max);
    metrics.emplace_back("response_length/clip_ratio", truncated_count / total_sequences);

    // ---- Old (and reference) log-probs, per micro-batch of the update's split.
    std::vector<std::vector<size_t>> micro_rows;
    for (int64_t first = 0; first < local_sequences; first += a.micro_batch_size) {
      std::vector<size_t> rows;
      for (int64_t i = first; i < std::min(first + a.micro_batch_size, local_sequences); ++i)
        rows.push_back(static_cast<size_t>(i));
      micro_rows.push_back(std::move(rows));
    }
    std::vector<RolloutBatch> micro;
    for (const auto& rows : micro_rows)
      micro.push_back(collate_rollouts(rollouts, rows, advantages, pad, g.mask_truncated_completions));
    std::vector<at::Tensor> old_log_probs, ref_log_probs;
    t0 = Clock::now();
    double diff_sum = 0, diff_max = 0, diff_tokens = 0, log_diff_max = 0;
    {
      torch::NoGradGuard no_grad;
      for (size_t k = 0; k < micro.size(); ++k) {
        old_log_probs.push_back(policy_outputs(*run.model(), micro[k], g.temperature, device, false).log_probs);
        // How far generation and training disagree on the same tokens.
        const at::Tensor old_lp = old_log_probs.back().cpu(), rollout_lp = micro[k].rollout_log_probs;
        const at::Tensor response = micro[k].response;
        const at::Tensor diff = (old_lp.exp() - rollout_lp.exp()).abs() * response;
        log_diff_max = std::max(log_diff_max, ((old_lp - rollout_lp).abs() * response).max().item<double>());
        diff_sum += diff.sum().item<double>();
        diff_max = std::max(diff_max, diff.max().item<double>());
        diff_tokens += response.sum().item<double>();
      }
    }
    const double old_log_prob_s = seconds_since(t0);
    t0 = Clock::now();
    if (ref) {
      torch::NoGradGuard no_grad;
      for (const RolloutBatch& b : micro)
        ref_log_probs.push_back(policy_outputs(*ref->sharded.model, b, g.temperature, device, false).log_probs);
    }
    const double ref_s = seconds_since(t0);
    {
      at::Tensor t = at::tensor({diff_sum, diff_tokens}, at::kDouble).to(device);
      comm->all_reduce(t, {ReduceOp::kSum});
      t = t.cpu();
      metrics.emplace_back("training/rollout_probs_diff_mean", t[0].item<double>() / std::max(1.0, t[1].item<double>()));
      metrics.emplace_back("training/rollout_probs_diff_max", run.all_reduce_max(diff_max));
      metrics.emplace_back("training/rollout_log_probs_diff_max", run.all_reduce_max(log_diff_max));
    }

    // ---- Actor update: --ppo-epochs passes, one optimizer step per mini-batch.
    t0 = Clock::now();
    const ClipOptions clip{g.clip_ratio_low, g.clip_ratio_high, g.clip_ratio_c};
    const int64_t micro_per_mini = local_per_mini / a.micro_batch_size;
    // Sums over the update of token-weighted metrics; divided by the tokens at the end.
    double pg_loss_sum = 0, kl_loss_sum = 0, entropy_sum = 0, clipfrac_sum = 0, clipfrac_lower_sum = 0,
           ppo_kl_sum = 0, token_sum = 0, grad_norm_sum = 0;
    int64_t optimizer_steps = 0;
    TrainingRun::StepStats last_stats;  // of the step's last optimizer step (num zeros, params norm)
    double lr = 0;
    for (int64_t epoch = 0; epoch < g.ppo_epochs; ++epoch)
      for (int64_t mb = 0; mb < mini_batches; ++mb) {
        // The mini-batch's denominators over all ranks, before its micro-batches run.
        double local[3] = {0, 0, 0};
        for (int64_t k = mb * micro_per_mini; k < (mb + 1) * micro_per_mini; ++k) {
          const LossNormalizer c = local_loss_counts(micro[static_cast<size_t>(k)].mask);
          local[0] += c.global_tokens;
          local[1] += c.global_sequences;
        }
        at::Tensor c = at::tensor({local[0], local[1]}, at::kDouble).to(device);
        comm->all_reduce(c, {ReduceOp::kSum});
        c = c.cpu();
        LossNormalizer norm;
        norm.global_tokens = c[0].item<double>();
        norm.global_sequences = c[1].item<double>();
        norm.norm_length = static_cast<double>(g.max_response_length);
        const auto stats = run.step(it, micro_per_mini, [&](int64_t m) {
          const size_t k = static_cast<size_t>(mb * micro_per_mini + m);
          const RolloutBatch& b = micro[k];
          const at::Tensor mask = b.mask.to(device);
          PolicyOutputs out = policy_outputs(*run.model(), b, g.temperature, device, /*entropy=*/true);
          const at::Tensor adv = b.advantages.to(device).unsqueeze(1).expand_as(mask);
          PolicyLossResult pg = clipped_policy_loss(old_log_probs[k], out.log_probs, adv, mask, clip, agg, norm);
          at::Tensor loss = pg.pg_loss;
          const double tokens = mask.sum().item<double>();
          const at::Tensor entropy = agg_loss(out.entropy, mask, agg, norm);
          if (g.entropy_coeff != 0) loss = loss - g.entropy_coeff * entropy;
          if (ref) {
            const at::Tensor kl = agg_loss(kl_penalty(out.log_probs, ref_log_probs[k], kl_type), mask, agg, norm);
            loss = loss + g.kl_loss_coef * kl;
            kl_loss_sum += kl.item<double>();
          }
          const double value = loss.item<double>();
          loss.backward();
          pg_loss_sum += pg.pg_loss.item<double>();
          entropy_sum += entropy.item<double>();
          clipfrac_sum += pg.pg_clipfrac.item<double>() * tokens;
          clipfrac_lower_sum += pg.pg_clipfrac_lower.item<double>() * tokens;
          ppo_kl_sum += pg.ppo_kl.item<double>() * tokens;
          token_sum += tokens;
          return value;
        });
        grad_norm_sum += stats.grad_norm;
        lr = stats.lr;
        last_stats = stats;
        ++optimizer_steps;
      }
    const double update_s = seconds_since(t0);
    {
      at::Tensor t = at::tensor({pg_loss_sum, kl_loss_sum, entropy_sum, clipfrac_sum, clipfrac_lower_sum, ppo_kl_sum,
                                 token_sum},
                                at::kDouble)
                         .to(device);
      comm->all_reduce(t, {ReduceOp::kSum});
      t = t.cpu();
      const double updates = static_cast<double>(optimizer_steps);
      const double tokens = std::max(1.0, t[6].item<double>());
      metrics.emplace_back("actor/pg_loss", t[0].item<double>() / updates);
      if (ref) metrics.emplace_back("actor/kl_loss", t[1].item<double>() / updates);
      metrics.emplace_back("actor/entropy", t[2].item<double>() / updates);
      metrics.emplace_back("actor/pg_clipfrac", t[3].item<double>() / tokens);
      metrics.emplace_back("actor/pg_clipfrac_lower", t[4].item<double>() / tokens);
      metrics.emplace_back("actor/ppo_kl", t[5].item<double>() / tokens);
      metrics.emplace_back("actor/grad_norm", grad_norm_sum / updates);
      metrics.emplace_back("actor/lr", lr);
    }
    const double step_s = seconds_since(step_start);
    metrics.emplace_back("timing_s/gen", gen_s);
    metrics.emplace_back("timing_s/update_weights", update_weights_s);
    metrics.emplace_back("timing_s/old_log_prob", old_log_prob_s);
    metrics.emplace_back("timing_s/ref", ref_s);
    metrics.emplace_back("timing_s/update_actor", update_s);
    metrics.emplace_back("timing_s/step", step_s);
    metrics.emplace_back("perf/throughput", (length_sum + 0.0) / step_s / dp);

    IterationRecord r;
    r.iteration = it;
    r.consumed_samples = it * g.train_batch_size * g.rollout_n;
    r.lm_loss = std::nan("");
    r.lr = lr;
    r.grad_norm = grad_norm_sum / static_cast<double>(optimizer_steps);
    r.iter_time_s = step_s;
    r.tokens_per_sec = length_sum / step_s;
    r.mem_bytes = peak_memory_bytes(device);
    r.extra = metrics;
    run.add_norms(r, last_stats);
    run.record(r);
    const double score_mean = scores.mean().item<double>();
    result.last_score_mean = score_mean;
    if (print && (it % a.log_interval == 0 || it == a.train_iters)) {
      auto get = [&](const char* key) {
        for (const auto& [k, v] : metrics)
          if (k == key) return v;
        return std::nan("");
      };
      char line[640];
      std::snprintf(line, sizeof line,
                    " step %5lld/%5lld | score: %.3f | zero-std groups: %.2f | response length: %.1f (clipped %.2f) | "
                    "pg_loss: %.4f | pg_clipfrac: %.3f | ppo_kl: %.2E | entropy: %.3f%s | grad norm: %.3f%s | "
                    "time (s): step %.2f, gen %.2f, update_weights %.3f, update_actor %.2f",
                    (long long)it, (long long)a.train_iters, score_mean, get("frac_reward_zero_std"),
                    get("response_length/mean"), get("response_length/clip_ratio"), get("actor/pg_loss"),
                    get("actor/pg_clipfrac"), get("actor/ppo_kl"), get("actor/entropy"),
                    ref ? (" | kl_loss: " + std::to_string(get("actor/kl_loss"))).c_str() : "", r.grad_norm,
                    run.norms_log_text(last_stats).c_str(), step_s,
                    gen_s, update_weights_s, update_s);
      log << line << "\n";
      log.flush();
    }
    if (it % a.eval_interval == 0 && it != a.train_iters) validate(it);
    if (run.after_iteration(it)) {
      result.iterations = it;
      return result;
    }
  }
  const int64_t last = std::max(a.train_iters, resume.iteration);
  result.iterations = last;
  run.finish_checkpoint(last);
  if (last > resume.iteration) result.val_score_after = validate(last);
  // The reward curve: mean training score per step, validation score.
  if (print && !a.metrics_file.empty()) {
    CurvePoints train_points, val_points;
    for (const IterationRecord& rec : run.history())
      for (const auto& [k, v] : rec.extra) {
        if (k == "critic/score/mean") train_points.emplace_back(static_cast<double>(rec.iteration), v);
        if (k == "val/score") val_points.emplace_back(static_cast<double>(rec.iteration), v);
      }
    const std::string svg = sibling_path(a.metrics_file, ".reward.svg");
    write_curve_svg(svg, "reward (train: mean score; validation: greedy)", train_points, val_points);
    log << " reward curve: " << svg << "\n";
  }
  run.finish(last, /*curve_title=*/"");  // no lm_loss: the reward curve above instead
  return result;
}

}  // namespace mfsdp
