#include "mfsdp/train/grpo_trainer.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/hf_interop.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/checkpoint/tensor_source.h"
#include "mfsdp/data/posttrain/chat_template.h"
#include "mfsdp/data/posttrain/rewards.h"
#include "mfsdp/data/posttrain/verifiable_tasks.h"
#include "mfsdp/models/batched_generate.h"
#include "mfsdp/models/context_parallel.h"
#include "mfsdp/models/lm_loss.h"
#include "mfsdp/models/tensor_parallel.h"
#include "mfsdp/models/token_stats.h"
#include "mfsdp/train/policy_loss.h"
#include "mfsdp/train/chat_eval.h"
#include "mfsdp/train/rollout_model.h"
#include "mfsdp/train/sft_data.h"
#include "train/tool_flags.h"
#include "mfsdp/train/trainer_checkpoint.h"
#include "mfsdp/train/train_loop.h"
#include "mfsdp/train/training_run.h"

namespace mfsdp {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The reference policy: the same model, sharded like the policy, forward only (no optimizer, no
// gradients), loaded from --ref-load, --hf-load or the --load checkpoint (--finetune): a
// checkpoint by load_checkpoint, a Hugging Face folder by load_hf_shards, so each rank reads only
// its ranges into a skeleton built with deferred init (every value is overwritten).
// Under tensor parallelism it is split like the policy, each rank reading its slices.
ShardedModel load_reference(const GrpoArgs& g, const OpenedCheckpoint& load, const ModelConfig& config,
                            const std::shared_ptr<Communicator>& comm, const ParallelMesh& mesh) {
  const PretrainArgs& a = g.base;
  ModelBuildOptions options = model_build_options(a, a, a, a, a, /*values_loaded=*/true);
  options.recompute = RecomputeOptions{};  // forward only
  // The policy's mesh: the same groups, not made again.
  ShardedModel ref = build_sharded_model(config, options, a.attention_backend != "unfused",
                                         shard_options_from_args(a, a, a, /*per_token_loss=*/true), &mesh);
  const TensorSlices slices = model_parallel_checkpoint_slices(*ref.model, ref.root);
  CheckpointLoadOptions o;
  o.load_optimizer = false;
  o.load_rng = false;
  o.slices = slices;
  o.all_or_nothing = false;  // a failed load ends the run
  if (g.ref_load.empty() && g.hf_load.empty()) {
    if (!load.reader) throw std::logic_error("mfsdp-grpo: the reference policy has no --ref-load, --hf-load or --load");
    load_checkpoint(*load.reader, comm, ref.root, nullptr, o);
    return ref;
  }
  const std::string from = !g.ref_load.empty() ? g.ref_load : g.hf_load;
  if (is_checkpoint(from)) {
    load_checkpoint(from, comm, ref.root, nullptr, o);
  } else {
    load_hf_shards(from, ref.root, *comm, slices);
  }
  return ref;
}

// `multiple`: the length is rounded up to it (sequence parallelism splits the rows over the
// tensor-parallel ranks); the extra tokens are padding, no key and no target.
RolloutBatch collate_rollouts(const std::vector<Rollout>& rollouts, const std::vector<size_t>& rows,
                              const at::Tensor& advantages, int64_t pad, bool mask_truncated, int64_t multiple) {
  int64_t length = 2;
  for (size_t r : rows)
    length = std::max<int64_t>(length, static_cast<int64_t>(rollouts[r].prompt_ids.size() + rollouts[r].response_ids.size()));
  length = (length + multiple - 1) / multiple * multiple;
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

// The entropy [B, L] fp32 of vocabulary-parallel logits [B, L, V/tp] without assembling the
// vocabulary on any rank: with z = logits - max, S = sum exp z and E = sum z exp z summed over the
// group, entropy = log S - E / S. Differentiable: the sums leave the region by all-reduce
// (backward: identity), as Megatron's vocab-parallel cross entropy does.
at::Tensor vocab_parallel_entropy(const at::Tensor& logits_shard, Communicator& tp) {
  const at::Tensor z32 = logits_shard.to(at::kFloat);
  at::Tensor max = std::get<0>(z32.detach().max(-1, /*keepdim=*/true)).contiguous();
  tp.all_reduce(max, {ReduceOp::kMax});
  const at::Tensor z = z32 - max;
  const at::Tensor e = z.exp();
  const at::Tensor s = tensor_parallel::reduce_from_tensor_parallel_region(e.sum(-1), tp);
  const at::Tensor ez = tensor_parallel::reduce_from_tensor_parallel_region((e * z).sum(-1), tp);
  return s.log() - ez / s;
}

// log_softmax(logits / temperature) at the labels, [B, L] fp32 (verl's log-probs of the
// rollout distribution), and the entropy of that distribution when asked. Under tensor
// parallelism both from the vocabulary slices.
struct PolicyOutputs {
  at::Tensor log_probs;
  at::Tensor entropy;
};
PolicyOutputs policy_outputs(const CausalLM& model, at::Tensor logits, const at::Tensor& labels, double temperature,
                             bool entropy) {
  if (temperature != 1.0) logits = logits / temperature;
  PolicyOutputs out;
  if (const std::shared_ptr<Communicator> tp = model.tensor_parallel(); tp && tp->size() > 1) {
    out.log_probs = -tensor_parallel::vocab_parallel_cross_entropy(logits, labels, *tp);
    if (entropy) out.entropy = vocab_parallel_entropy(logits, *tp);
    return out;
  }
  out.log_probs = token_log_probs(logits, labels);
  if (entropy) out.entropy = token_entropy(logits);
  return out;
}

// The forward of `model` (the policy or the reference) on the rows of `batch` (on `device`
// already, or copied there), from the previous pipeline chunk's hidden states `received` unless
// the chunk selected holds the embedding: where the chunk ends in the output layer its policy
// outputs, from the output layer fused with them (--cross-entropy-loss-fusion: no full logits)
// or from the logits; elsewhere its hidden states (`hidden`).
struct RowsForward {
  at::Tensor hidden;
  PolicyOutputs out;
};
RowsForward forward_rows(CausalLM& model, const RolloutBatch& batch, const at::Device& device, const PretrainArgs& a,
                         double temperature, bool entropy, const at::Tensor& received = {}) {
  SequenceLayout layout;
  layout.attention_mask = batch.attention_mask.to(device);
  const at::Tensor in = received.defined() ? received : batch.input_ids.to(device);
  const std::optional<PipelineChunk> chunk = model.pipeline_chunk();
  if (chunk && !chunk->output) return {model.call(in, layout), {}};
  const at::Tensor labels = batch.labels.to(device);
  if (!a.cross_entropy_loss_fusion) return {{}, policy_outputs(model, model.call(in, layout), labels, temperature, entropy)};
  ChunkedOutputOptions o;
  o.temperature = temperature;
  o.entropy = entropy;
  o.chunk_elements = a.cross_entropy_chunk_elements;
  TokenStats s = model.token_stats(in, layout, labels, o);
  return {{}, {s.log_probs, s.entropy}};
}

// The log-probs of each micro-batch under `model`, without gradients: a forward each, or the
// forward pipeline over `pipeline`'s stages, where only the stage with the output layer has them
// (the others' are undefined).
std::vector<at::Tensor> micro_log_probs(CausalLM& model, const std::vector<RolloutBatch>& micro, double temperature,
                                        const at::Device& device, const PipelineLayout& pipeline, const PretrainArgs& a) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> out(micro.size());
  const auto forward = [&](int64_t k, const at::Tensor& received) -> ChunkOutput {
    const RolloutBatch& b = micro[static_cast<size_t>(k)];
    RowsForward f = forward_rows(model, b, device, a, temperature, /*entropy=*/false, received);
    if (f.hidden.defined()) return {f.hidden, {}, {}};
    out[static_cast<size_t>(k)] = f.out.log_probs;
    return {{}, {}, at::zeros({}, f.out.log_probs.options())};
  };
  if (pipeline.forward) {
    run_forward_pipeline(pipeline, static_cast<int64_t>(micro.size()), [&](int chunk, int64_t k, const at::Tensor& in) {
      model.select_pipeline_chunk(chunk);
      return forward(k, in);
    });
  } else {
    for (size_t k = 0; k < micro.size(); ++k) forward(static_cast<int64_t>(k), {});
  }
  return out;
}

// The tensors of `b` the update reads, on the device before its forward: a pageable copy after
// the forward would hold the host until the forward has run, with the backward not yet queued.
// This rank's chunks of every row of `b` (context_parallel::shard_sequence, as the model cuts
// its positions), with each whole row's trained tokens.
RolloutBatch context_parallel_part(const RolloutBatch& b, const Communicator& cp) {
  RolloutBatch part = b;
  part.row_tokens = b.mask.sum(1);
  for (at::Tensor* t : {&part.input_ids, &part.labels, &part.mask, &part.attention_mask, &part.response,
                        &part.rollout_log_probs})
    *t = context_parallel::shard_sequence(*t, 1, cp.size(), cp.rank()).contiguous();
  return part;
}

RolloutBatch on_device(const RolloutBatch& b, const at::Device& device) {
  RolloutBatch d = b;
  for (at::Tensor* t : {&d.input_ids, &d.labels, &d.mask, &d.attention_mask, &d.advantages}) *t = to_device(*t, device);
  return d;
}

}  // namespace


struct GrpoTrainer::ReferencePolicy {
  ShardedModel sharded;
};

double GrpoStep::metric(const std::string& name) const {
  for (const auto& [k, v] : metrics)
    if (k == name) return v;
  return std::nan("");
}

GrpoTrainer::GrpoTrainer(GrpoArgs args, std::shared_ptr<Communicator> comm, std::ostream& log)
    : g_(std::move(args)), comm_(std::move(comm)), log_(log) {
  const PretrainArgs& a = g_.base;
  torch::manual_seed(a.seed);
  tokenizer_ = make_torch_safe_tokenizer({a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file});
  if (!tokenizer_)
    flag_error("--tokenizer-type", "mfsdp-grpo needs a text tokenizer: ByteLevelTokenizer, GPT2BPETokenizer or "
                                   "HuggingFaceTokenizer");
  chat_template_ = resolve_chat_template(g_.chat_template, *tokenizer_);
  end_of_turn_ = chat_end_of_turn_id(*tokenizer_, chat_template_);
  pad_ = tokenizer_->eod();
  agg_ = parse_loss_agg_mode(g_.loss_agg_mode);
  scale_ = parse_scale_rewards(g_.scale_rewards);
  kl_type_ = parse_kl_type(g_.kl_loss_type);

  // Prompts.
  if (g_.data.generated()) {
    train_ = generate_tasks(g_.data.generator("train"));
    if (g_.data.gen_val_size > 0) val_ = generate_tasks(g_.data.generator("test"));
  } else {
    // Every prompt's data_source must have a reward before anything trains (--reward auto).
    const auto has_reward = [&](const RlExample& e) { check_reward_for(g_.reward, e.data_source); };
    train_ = read_rl_jsonl(g_.data.train_files, has_reward);
    if (!g_.data.val_files.empty()) val_ = read_rl_jsonl(g_.data.val_files, has_reward);
  }
  for (size_t i = 0; i < train_.size(); ++i) {
    std::vector<int64_t> ids = apply_chat_template(*tokenizer_, chat_template_, train_[i].prompt, true).ids;
    const auto n = static_cast<int64_t>(ids.size());
    if (n > g_.max_prompt_length) {
      if (g_.truncation == "error")
        flag_error("--max-prompt-length", g_.data.describe("train") +
                                              ": prompt " + std::to_string(i + 1) + " has " + std::to_string(n) +
                                              " tokens, more than " + std::to_string(g_.max_prompt_length) +
                                              " (--truncation left or right cuts it)");
      const int64_t from = g_.truncation == "left" ? n - g_.max_prompt_length : 0;
      ids = std::vector<int64_t>(ids.begin() + from, ids.begin() + from + g_.max_prompt_length);
    }
    train_prompts_.push_back(std::move(ids));
  }

  OpenedCheckpoint load = open_training_checkpoint(a);
  StartingPoint start = starting_point(load, g_.hf_load, model_config_from_args(a, a, a.seq_length, a.padded_vocab_size),
                                       a.seed, a.export_hf, tokenizer_->vocab_size());
  run_ = std::make_unique<TrainingRun>(a, start.config, comm_, log_, /*per_token_loss=*/true, grpo_tool_flags(g_),
                                       start.hf_folder, load);
  resume_iteration_ = run_->start().iteration;
  // The prompts split over the data-parallel replicas; the tensor-parallel ranks of a replica
  // generate and train on the same ones (the same seeds, so the same tokens).
  const int dp = run_->mesh().dims().dp();
  dp_rank_ = run_->mesh().coordinate("dp");
  replicas_ = run_->mesh().get("dp_cp");
  data_replicas_ = run_->mesh().get("dp");
  context_parallel_ = run_->mesh().split("cp");
  if (a.tensor_model_parallel_size > 1 && a.sequence_parallel) length_multiple_ = a.tensor_model_parallel_size;
  if (context_parallel_) length_multiple_ *= 2 * context_parallel_->size();  // the load-balanced chunks
  // The reference reads --load's checkpoint through the reader the policy read (no second parse).
  if (g_.use_kl_loss)
    ref_ = std::make_unique<ReferencePolicy>(ReferencePolicy{load_reference(g_, load, start.config, comm_, run_->mesh())});
  if (run_->prints()) {
    log_ << " mfsdp-grpo: " << train_.size() << " training prompts, " << val_.size() << " held out; "
         << g_.train_batch_size << " prompts x " << g_.rollout_n << " responses per step; chat template "
         << describe_chat_template(g_.chat_template, *tokenizer_) << "; rollout " << g_.rollout_mode
         << "; model: " << start.description << "\n";
    if (ref_) {
      const MemoryReport m = ref_->sharded.root.memory();
      double full_bytes = 0;
      for (const auto& [name, shape] : model_tensor_shapes(start.config)) {
        double numel = 1;
        for (int64_t d : shape) numel *= static_cast<double>(d);
        full_bytes += numel * 4;  // fp32
      }
      log_ << " reference policy per rank (MiB): weights " << (m.model_weights + m.main_weights) / 1048576.0
           << " of " << full_bytes / 1048576.0 << " for the whole model (sharded over "
           << dp / a.num_distributed_optimizer_instances << " ranks; no gradients, no optimizer state)\n";
    }
  }

  sampler_ = std::make_unique<SftSampler>(static_cast<int64_t>(train_prompts_.size()), g_.train_batch_size, 1, 1,
                                          static_cast<uint64_t>(a.seed));
  eval_options_.chat_template = chat_template_;
  eval_options_.max_new_tokens = g_.max_response_length;
  eval_options_.samples = g_.val_generate_samples;
  sampling_.max_new_tokens = g_.max_response_length;
  sampling_.temperature = g_.temperature;
  sampling_.top_k = g_.top_k;
  sampling_.top_p = g_.top_p;
  sampling_.stop_ids = {end_of_turn_};
  sampling_.pad_id = pad_;
  prompts_per_rank_ = g_.train_batch_size / dp;
  local_sequences_ = prompts_per_rank_ * g_.rollout_n;
  mini_batches_ = g_.train_batch_size / g_.ppo_mini_batch_size;
  local_per_mini_ = local_sequences_ / mini_batches_;
}

GrpoTrainer::~GrpoTrainer() = default;

double GrpoTrainer::validate(int64_t iteration) {
  if (val_.empty() || g_.val_generate_samples == 0) return -1.0;
  const ChatEvalResult r = greedy_reward(*run_, val_, *tokenizer_, g_.reward, eval_options_);
  IterationRecord rec;
  rec.iteration = iteration;
  rec.eval = true;
  rec.lm_loss = std::nan("");
  rec.extra.emplace_back("val/score", r.accuracy);
  rec.mem_bytes = peak_memory_bytes(comm_->device());
  run_->record(rec);
  if (run_->prints()) {
    char line[160];
    std::snprintf(line, sizeof line, " validation at iteration %lld | score: %.4f (%lld prompts, greedy)",
                  (long long)iteration, r.accuracy, (long long)r.total);
    log_ << line << "\n";
    log_.flush();
  }
  return r.accuracy;
}

GrpoStep GrpoTrainer::rollout(int64_t iteration) {
  const int rank = dp_rank_;
  const uint64_t seed = static_cast<uint64_t>(g_.base.seed);
  GrpoStep step;
  step.iteration = iteration;
  step.started = Clock::now();
  step.batch = sampler_->rows(iteration, 0, 0);
  std::vector<std::vector<int64_t>> gen_prompts;
  std::vector<uint64_t> seeds;
  for (int64_t p = rank * prompts_per_rank_; p < (rank + 1) * prompts_per_rank_; ++p)
    for (int64_t s = 0; s < g_.rollout_n; ++s) {
      Rollout r;
      r.prompt = p;
      r.prompt_ids = train_prompts_[static_cast<size_t>(step.batch[static_cast<size_t>(p)])];
      gen_prompts.push_back(r.prompt_ids);
      seeds.push_back(sample_seed(seed, iteration, step.batch[static_cast<size_t>(p)], s));
      step.rollouts.push_back(std::move(r));
    }
  const auto t0 = Clock::now();
  GeneratedBatch generated;
  {
    torch::NoGradGuard no_grad;
    if (g_.rollout_mode == "full") {
      RolloutModel& copy = run_->load_rollout_model();
      step.update_weights_s = seconds_since(t0);
      generated = generate_batch(copy.model(), gen_prompts, seeds, sampling_);
      copy.release();
    } else {
      generated = generate_batch(*run_->model(), gen_prompts, seeds, sampling_, comm_.get());
    }
  }
  step.gen_s = seconds_since(t0) - step.update_weights_s;
  for (size_t i = 0; i < step.rollouts.size(); ++i) {
    Rollout& r = step.rollouts[i];
    r.response_ids = generated.tokens[i];
    r.rollout_log_probs = generated.log_probs[i];
    r.truncated = generated.truncated[i] != 0;
  }
  return step;
}

void GrpoTrainer::score(GrpoStep& step) {
  const int rank = dp_rank_;
  // Scores of the whole batch on every rank (batch std).
  at::Tensor scores = at::zeros({g_.train_batch_size * g_.rollout_n}, at::kDouble);
  for (size_t i = 0; i < step.rollouts.size(); ++i) {
    Rollout& r = step.rollouts[i];
    const RlExample& e = train_[static_cast<size_t>(step.batch[static_cast<size_t>(r.prompt)])];
    r.score = compute_score_by_name(g_.reward, e.data_source, decode_generated(*tokenizer_, r.response_ids, end_of_turn_),
                                    e.ground_truth);
    scores[rank * local_sequences_ + static_cast<int64_t>(i)] = r.score;
  }
  {
    at::Tensor s = scores.to(comm_->device());
    data_replicas_->all_reduce(s, {ReduceOp::kSum});
    step.scores = s.cpu();
  }
  std::vector<int64_t> groups(static_cast<size_t>(step.scores.size(0)));
  for (size_t i = 0; i < groups.size(); ++i) groups[i] = static_cast<int64_t>(i) / g_.rollout_n;
  const at::Tensor all_advantages = grpo_advantages(step.scores.to(at::kFloat), groups, scale_);
  step.advantages = all_advantages.narrow(0, rank * local_sequences_, local_sequences_);

  // Response statistics over the whole batch.
  double lengths[3] = {0, 0, 0};  // sum, max, truncated
  for (const Rollout& r : step.rollouts) {
    lengths[0] += static_cast<double>(r.response_ids.size());
    lengths[1] = std::max(lengths[1], static_cast<double>(r.response_ids.size()));
    lengths[2] += r.truncated ? 1 : 0;
  }
  const double total_sequences = static_cast<double>(step.scores.size(0));
  at::Tensor sums = at::tensor({lengths[0], lengths[2]}, at::kDouble).to(comm_->device());
  data_replicas_->all_reduce(sums, {ReduceOp::kSum});
  sums = sums.cpu();
  step.response_tokens = sums[0].item<double>();
  const double length_max = run_->all_reduce_max(lengths[1]);
  const double truncated_count = sums[1].item<double>();
  const at::Tensor group_std = step.scores.view({-1, g_.rollout_n}).std(1, /*unbiased=*/g_.rollout_n > 1);
  auto& m = step.metrics;
  m.emplace_back("critic/score/mean", step.scores.mean().item<double>());
  m.emplace_back("critic/score/max", step.scores.max().item<double>());
  m.emplace_back("critic/score/min", step.scores.min().item<double>());
  m.emplace_back("critic/advantages/mean", all_advantages.mean().item<double>());
  m.emplace_back("critic/advantages/max", all_advantages.max().item<double>());
  m.emplace_back("critic/advantages/min", all_advantages.min().item<double>());
  m.emplace_back("frac_reward_zero_std", (group_std < 1e-12).to(at::kDouble).mean().item<double>());
  m.emplace_back("response_length/mean", step.response_tokens / total_sequences);
  m.emplace_back("response_length/max", length_max);
  m.emplace_back("response_length/clip_ratio", truncated_count / total_sequences);
}

void GrpoTrainer::log_probs(GrpoStep& step) {
  const PretrainArgs& a = g_.base;
  const at::Device device = comm_->device();
  // Per micro-batch of the update's split.
  for (int64_t first = 0; first < local_sequences_; first += a.micro_batch_size) {
    std::vector<size_t> rows;
    for (int64_t i = first; i < std::min(first + a.micro_batch_size, local_sequences_); ++i)
      rows.push_back(static_cast<size_t>(i));
    step.micro.push_back(
        collate_rollouts(step.rollouts, rows, step.advantages, pad_, g_.mask_truncated_completions, length_multiple_));
    if (context_parallel_) step.micro.back() = context_parallel_part(step.micro.back(), *context_parallel_);
  }
  auto t0 = Clock::now();
  const PipelineLayout& pipeline = run_->pipeline();
  step.old_log_probs = micro_log_probs(*run_->model(), step.micro, g_.temperature, device, pipeline, a);
  double diff_sum = 0, diff_max = 0, diff_tokens = 0, log_diff_max = 0;
  for (size_t k = 0; k < step.micro.size(); ++k) {
    if (!step.old_log_probs[k].defined()) continue;  // a pipeline stage without the output layer
    // How far generation and training disagree on the same tokens.
    const RolloutBatch& b = step.micro[k];
    const at::Tensor old_lp = step.old_log_probs[k].cpu(), rollout_lp = b.rollout_log_probs;
    const at::Tensor diff = (old_lp.exp() - rollout_lp.exp()).abs() * b.response;
    log_diff_max = std::max(log_diff_max, ((old_lp - rollout_lp).abs() * b.response).max().item<double>());
    diff_sum += diff.sum().item<double>();
    diff_max = std::max(diff_max, diff.max().item<double>());
    diff_tokens += b.response.sum().item<double>();
  }
  step.old_log_prob_s = seconds_since(t0);
  t0 = Clock::now();
  if (ref_) step.ref_log_probs = micro_log_probs(*ref_->sharded.model, step.micro, g_.temperature, device, pipeline, a);
  step.ref_s = seconds_since(t0);
  at::Tensor t = at::tensor({diff_sum, diff_tokens}, at::kDouble).to(device);
  replicas_->all_reduce(t, {ReduceOp::kSum});
  if (pipeline.forward) pipeline.forward->all_reduce(t, {ReduceOp::kSum});  // the last stage's
  t = t.cpu();
  step.metrics.emplace_back("training/rollout_probs_diff_mean", t[0].item<double>() / std::max(1.0, t[1].item<double>()));
  step.metrics.emplace_back("training/rollout_probs_diff_max", run_->all_reduce_max(diff_max));
  step.metrics.emplace_back("training/rollout_log_probs_diff_max", run_->all_reduce_max(log_diff_max));
}

void GrpoTrainer::update(GrpoStep& step) {
  const PretrainArgs& a = g_.base;
  const at::Device device = comm_->device();
  const auto t0 = Clock::now();
  const ClipOptions clip{g_.clip_ratio_low, g_.clip_ratio_high, g_.clip_ratio_c};
  const int64_t micro_per_mini = local_per_mini_ / a.micro_batch_size;
  // Every mini-batch's denominators over all ranks, before any micro-batch runs, in one
  // all-reduce; and each micro-batch's tokens. From the host's masks: nothing is read from the
  // device until the update's metrics at the end.
  std::vector<double> tokens_of;
  at::Tensor counts = at::zeros({2 * mini_batches_}, at::kDouble);
  for (int64_t k = 0; k < mini_batches_ * micro_per_mini; ++k) {
    LossNormalizer c = local_loss_counts(step.micro[static_cast<size_t>(k)].mask);
    // Under context parallelism the tokens are this rank's chunks' (they add up over the group);
    // every rank holds the same rows, counted on one.
    if (context_parallel_ && context_parallel_->rank() != 0) c.global_sequences = 0;
    tokens_of.push_back(c.global_tokens);
    counts[2 * (k / micro_per_mini)] += c.global_tokens;
    counts[2 * (k / micro_per_mini) + 1] += c.global_sequences;
  }
  counts = counts.to(device);
  replicas_->all_reduce(counts, {ReduceOp::kSum});
  counts = counts.cpu();
  // Sums over the update, on the device: pg_loss, kl_loss, entropy, then the token-weighted
  // clipfrac, clipfrac_lower and ppo_kl, and the tokens (divided by the tokens at the end).
  at::Tensor sums = at::zeros({7}, at::TensorOptions().dtype(at::kDouble).device(device));
  std::vector<at::Tensor> grad_norms;  // each optimizer step's, read with the sums at the end
  for (int64_t epoch = 0; epoch < g_.ppo_epochs; ++epoch)
    for (int64_t mb = 0; mb < mini_batches_; ++mb) {
      LossNormalizer norm;
      norm.global_tokens = counts[2 * mb].item<double>();
      norm.global_sequences = counts[2 * mb + 1].item<double>();
      norm.norm_length = static_cast<double>(g_.max_response_length);
      // Micro-batch k's loss from the policy's outputs, its metrics added to the sums.
      const auto loss_of = [&](size_t k, const RolloutBatch& b, const PolicyOutputs& out) {
        const at::Tensor adv = b.advantages.unsqueeze(1).expand_as(b.mask);
        LossNormalizer rows = norm;
        rows.row_tokens = b.row_tokens;  // whole rows' counts under context parallelism
        PolicyLossResult pg = clipped_policy_loss(step.old_log_probs[k], out.log_probs, adv, b.mask, clip, agg_, rows);
        at::Tensor loss = pg.pg_loss;
        const double tokens = tokens_of[k];
        const at::Tensor entropy = agg_loss(out.entropy, b.mask, agg_, rows);
        if (g_.entropy_coeff != 0) loss = loss - g_.entropy_coeff * entropy;
        at::Tensor kl = at::zeros({}, sums.options());
        if (ref_) {
          kl = agg_loss(kl_penalty(out.log_probs, step.ref_log_probs[k], kl_type_), b.mask, agg_, rows);
          loss = loss + g_.kl_loss_coef * kl;
        }
        auto f64 = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
        sums.add_(at::stack({f64(pg.pg_loss), f64(kl), f64(entropy), f64(pg.pg_clipfrac) * tokens,
                             f64(pg.pg_clipfrac_lower) * tokens, f64(pg.ppo_kl) * tokens,
                             at::full({}, tokens, sums.options())}));
        return loss;
      };
      const auto micro_batch = [&](int64_t m) { return static_cast<size_t>(mb * micro_per_mini + m); };
      const TrainingRun::StepStats stats =
          run_->pipeline().forward
              ? run_->pipeline_step(step.iteration, micro_per_mini,
                                    [&](int chunk, int64_t m, const at::Tensor& received) -> ChunkOutput {
                                      run_->model()->select_pipeline_chunk(chunk);
                                      const RolloutBatch b = on_device(step.micro[micro_batch(m)], device);
                                      RowsForward f = forward_rows(*run_->model(), b, device, a, g_.temperature,
                                                                   /*entropy=*/true, received);
                                      if (f.hidden.defined()) return {f.hidden, {}, {}};
                                      const at::Tensor loss = loss_of(micro_batch(m), b, f.out);
                                      return {{}, loss, loss.detach()};
                                    })
              : run_->step(step.iteration, micro_per_mini, [&](int64_t m) {
                  const RolloutBatch b = on_device(step.micro[micro_batch(m)], device);
                  const at::Tensor loss =
                      loss_of(micro_batch(m), b, forward_rows(*run_->model(), b, device, a, g_.temperature, true).out);
                  loss.backward();
                  return loss.detach();
                });
      grad_norms.push_back(stats.grad_norm);
      step.lr = stats.lr;
      step.last_stats = stats;
    }
  step.update_s = seconds_since(t0);
  replicas_->all_reduce(sums, {ReduceOp::kSum});
  if (run_->pipeline().forward) run_->pipeline().forward->all_reduce(sums, {ReduceOp::kSum});  // the last stage's
  grad_norms.insert(grad_norms.begin(), sums);
  const std::vector<double> read = read_on_host(grad_norms);  // the sums, then the norms
  const at::Tensor t = at::tensor(std::vector<double>(read.begin(), read.begin() + 7), at::kDouble);
  double grad_norm_sum = 0;
  for (size_t i = 7; i < read.size(); ++i) grad_norm_sum += read[i];
  const double updates = static_cast<double>(read.size() - 7);
  const double tokens = std::max(1.0, t[6].item<double>());
  step.grad_norm = grad_norm_sum / updates;
  auto& m = step.metrics;
  m.emplace_back("actor/pg_loss", t[0].item<double>() / updates);
  if (ref_) m.emplace_back("actor/kl_loss", t[1].item<double>() / updates);
  m.emplace_back("actor/entropy", t[2].item<double>() / updates);
  m.emplace_back("actor/pg_clipfrac", t[3].item<double>() / tokens);
  m.emplace_back("actor/pg_clipfrac_lower", t[4].item<double>() / tokens);
  m.emplace_back("actor/ppo_kl", t[5].item<double>() / tokens);
  m.emplace_back("actor/grad_norm", step.grad_norm);
  m.emplace_back("actor/lr", step.lr);
}

void GrpoTrainer::record(GrpoStep& step) {
  const int64_t it = step.iteration;
  const double step_s = seconds_since(step.started);
  auto& m = step.metrics;
  m.emplace_back("timing_s/gen", step.gen_s);
  m.emplace_back("timing_s/update_weights", step.update_weights_s);
  m.emplace_back("timing_s/old_log_prob", step.old_log_prob_s);
  m.emplace_back("timing_s/ref", step.ref_s);
  m.emplace_back("timing_s/update_actor", step.update_s);
  m.emplace_back("timing_s/step", step_s);
  m.emplace_back("perf/throughput", step.response_tokens / step_s / comm_->size());

  IterationRecord r;
  r.iteration = it;
  r.consumed_samples = it * g_.train_batch_size * g_.rollout_n;
  r.lm_loss = std::nan("");
  r.lr = step.lr;
  r.grad_norm = step.grad_norm;
  r.iter_time_s = step_s;
  r.tokens_per_sec = step.response_tokens / step_s;
  r.mem_bytes = peak_memory_bytes(comm_->device());
  r.extra = m;
  run_->add_norms(r, step.last_stats);
  run_->record(r);
}

void GrpoTrainer::print(const GrpoStep& step) const {
  const PretrainArgs& a = g_.base;
  if (run_->prints()) {
    char line[640];
    std::snprintf(line, sizeof line,
                  " step %5lld/%5lld | score: %.3f | zero-std groups: %.2f | response length: %.1f (clipped %.2f) | "
                  "pg_loss: %.4f | pg_clipfrac: %.3f | ppo_kl: %.2E | entropy: %.3f%s | grad norm: %.3f%s | "
                  "time (s): step %.2f, gen %.2f, update_weights %.3f, update_actor %.2f",
                  (long long)step.iteration, (long long)a.train_iters, step.metric("critic/score/mean"),
                  step.metric("frac_reward_zero_std"), step.metric("response_length/mean"),
                  step.metric("response_length/clip_ratio"), step.metric("actor/pg_loss"),
                  step.metric("actor/pg_clipfrac"), step.metric("actor/ppo_kl"), step.metric("actor/entropy"),
                  ref_ ? (" | kl_loss: " + std::to_string(step.metric("actor/kl_loss"))).c_str() : "", step.grad_norm,
                  run_->norms_log_text(step.last_stats).c_str(), step.metric("timing_s/step"), step.gen_s,
                  step.update_weights_s,
                  step.update_s);
    log_ << line << "\n";
    log_.flush();
  }
}

namespace {

// mfsdp-grpo's part of the loop (train_loop.h): an iteration is the stages of a GRPO step.
class GrpoLoop : public Trainer {
 public:
  GrpoLoop(GrpoTrainer& grpo, GrpoResult& result) : Trainer(grpo.run()), grpo_(grpo), result_(result) {}

  TrainingRun::StepStats train_step(int64_t iteration) override {
    GrpoStep step = grpo_.rollout(iteration);
    grpo_.score(step);
    grpo_.log_probs(step);
    grpo_.update(step);
    grpo_.record(step);
    result_.last_score_mean = step.metric("critic/score/mean");
    last_ = std::move(step);
    return last_.last_stats;
  }
  // Every step is recorded (verl's metrics per step); the log step prints its line.
  void log(const LogWindow&) override { grpo_.print(last_); }
  void evaluate(int64_t iteration) override { grpo_.validate(iteration); }

 private:
  GrpoTrainer& grpo_;
  GrpoResult& result_;
  GrpoStep last_;
};

}  // namespace

GrpoResult GrpoTrainer::train() {
  const PretrainArgs& a = g_.base;
  GrpoResult result;
  result.val_score_before = validate(resume_iteration_);
  GrpoLoop loop(*this, result);
  const Trainer::Outcome end = loop.train({resume_iteration_, resume_iteration_ * g_.train_batch_size});
  result.iterations = end.last;
  if (end.stopped) return result;
  const int64_t last = end.last;
  if (last > resume_iteration_) result.val_score_after = validate(last);
  // The reward curve: mean training score per step, validation score.
  if (run_->prints() && !a.metrics_file.empty()) {
    CurvePoints train_points, val_points;
    for (const IterationRecord& rec : run_->history())
      for (const auto& [k, v] : rec.extra) {
        if (k == "critic/score/mean") train_points.emplace_back(static_cast<double>(rec.iteration), v);
        if (k == "val/score") val_points.emplace_back(static_cast<double>(rec.iteration), v);
      }
    const std::string svg = sibling_path(a.metrics_file, ".reward.svg");
    write_curve_svg(svg, "reward (train: mean score; validation: greedy)", train_points, val_points);
    log_ << " reward curve: " << svg << "\n";
  }
  run_->finish(last, /*curve_title=*/"");  // no lm_loss: the reward curve above instead
  return result;
}

GrpoResult run_grpo(GrpoArgs args, const std::shared_ptr<Communicator>& comm, std::ostream& log) {
  return GrpoTrainer(std::move(args), comm, log).train();
}

}  // namespace mfsdp
