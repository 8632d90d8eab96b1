#include "train/sft.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "mfsdp/checkpoint/tensor_source.h"
#include "mfsdp/data/chat_template.h"
#include "mfsdp/data/verifiable_tasks.h"
#include "mfsdp/models/batched_generate.h"
#include "mfsdp/models/context_parallel.h"
#include "mfsdp/models/lm_loss.h"
#include "mfsdp/models/tensor_parallel.h"
#include "mfsdp/models/token_stats.h"
#include "mfsdp/train/policy_loss.h"
#include "train/chat_eval.h"
#include "train/sft_data.h"
#include "train/task_source.h"
#include "train/tool_flags.h"
#include "train/training_run.h"

namespace mfsdp {

ToolFlags sft_tool_flags(SftArgs& a) {
  ToolFlags t;
  t.program = "mfsdp-sft";
  // Not the pretraining corpus (--max-length is the sequence length) nor mfsdp-pretrain's own
  // section (the loss is always normalised by global counts: --loss-agg-mode).
  t.sections = {Section::kModel,      Section::kMoe,       Section::kTokenizer, Section::kTraining, Section::kOptimizer,
                Section::kCheckpoint, Section::kFsdp,      Section::kRuntime,  Section::kLogging,
                Section::kProfiling};
  t.extra_title = "SFT: the conversations and the loss";
  t.extra = task_source_flags(a.data, "conversations",
                              "{\"messages\": [{\"role\", \"content\"}...]} or {\"prompt\", \"response\"} per line, "
                              "or pre-tokenized {\"input_ids\", \"loss_mask\" or \"labels\"}");
  const std::vector<ToolFlag> own = {
      string_flag("--messages-key", a.messages_key, "JSONL key of the message list"),
      string_flag("--prompt-key", a.prompt_key, "JSONL key of the prompt (a string or a message list)"),
      string_flag("--response-key", a.response_key, "JSONL key of the response"),
      string_flag("--chat-template", a.chat_template,
                  "conversation format (auto: the one the tokenizer's special tokens call for; docs/data.md)",
                  chat_template_choices()),
      int_flag("--max-length", a.max_length, "longest sequence in tokens (the model's --seq-length)"),
      string_flag("--truncation", a.truncation, "a longer conversation is an error, or loses its start (left) "
                                                "or its end (right)",
                  {"error", "left", "right"}),
      string_flag("--loss-on", a.loss_on, "tokens trained on: assistant messages and their end token, or all",
                  {"assistant", "all"}),
      bool_flag("--packing", a.packing,
                "pack conversations into rows of --max-length (positions restart, attention stays within each)"),
      string_flag("--loss-agg-mode", a.loss_agg_mode,
                  "loss over the global batch: mean over its target tokens, or mean over conversations of "
                  "their token means",
                  {"token-mean", "seq-mean-token-mean"}),
      string_flag("--hf-load", a.hf_load, "start from this Hugging Face model folder (config.json, safetensors)"),
      int_flag("--val-generate-samples", a.val_generate_samples,
               "held-out conversations answered greedily for exact match at each evaluation (0: none)"),
      int_flag("--max-new-tokens", a.max_new_tokens, "longest generated answer in exact-match evaluation"),
  };
  t.extra.insert(t.extra.end(), own.begin(), own.end());
  return t;
}

SftArgs parse_sft_args(const std::vector<std::string>& argv) {
  SftArgs a;
  a.base = parse_pretrain_args(argv, sft_tool_flags(a));
  check_task_source(a.data);
  if (a.max_length < 2) flag_error("--max-length", "must be >= 2, got " + std::to_string(a.max_length));
  if (a.max_length > kMaxSequenceLength)
    flag_error("--max-length", "must be at most " + std::to_string(kMaxSequenceLength) + ", got " +
                                   std::to_string(a.max_length));
  if (a.val_generate_samples < 0) flag_error("--val-generate-samples", "must be >= 0");
  if (a.max_new_tokens < 1) flag_error("--max-new-tokens", "must be >= 1");
  if (a.max_new_tokens > kMaxSequenceLength)
    flag_error("--max-new-tokens", "must be at most " + std::to_string(kMaxSequenceLength) + " (a model's longest "
                                   "sequence), got " + std::to_string(a.max_new_tokens));
  if (!a.hf_load.empty() && a.base.finetune) flag_error("--finetune", "conflicts with --hf-load (it starts from the folder)");
  if (!a.hf_load.empty() && !is_hf_folder(a.hf_load))
    flag_error("--hf-load", "'" + a.hf_load + "' is not a Hugging Face model folder (config.json and model.safetensors)");
  a.base.seq_length = a.max_length;
  a.base.calculate_per_token_loss = true;
  a.base.load_requires_checkpoint = true;
  return a;
}

namespace {

using Clock = std::chrono::steady_clock;

struct SftData {
  std::vector<SftExample> examples;  // none for pre-tokenized files
  bool pretokenized = false;
  int64_t sequences = 0;
  std::vector<SftRow> rows;
  int64_t target_tokens = 0;
};

// The examples of `split` ("train" or "test"): the file (conversations, or pre-tokenized
// sequences when its first line has "input_ids"), or the generated split.
SftData load_sft_data(const std::string& split, const SftArgs& a, const Tokenizer& tokenizer,
                      const std::string& chat_template) {
  SftData d;
  const TaskSource& source = a.data;
  SftTokenizeOptions o;
  o.chat_template = chat_template;
  o.max_length = a.max_length;
  o.truncation = a.truncation;
  o.loss_on_all = a.loss_on == "all";
  std::vector<SftSequence> sequences;
  if (source.generated()) {
    const TaskGenOptions t = source.generator(split);
    if (t.count > 0) d.examples = generate_sft_tasks(t);
  } else if (is_pretokenized_sft_jsonl(source.describe(split))) {
    d.pretokenized = true;
    sequences = read_pretokenized_sft_jsonl(source.describe(split), tokenizer.vocab_size(), o);
  } else {
    d.examples = read_sft_jsonl(source.describe(split), {a.messages_key, a.prompt_key, a.response_key});
  }
  if (!d.pretokenized) {
    if (d.examples.empty()) return d;
    sequences = tokenize_sft_examples(d.examples, tokenizer, o, source.describe(split));
  }
  d.sequences = static_cast<int64_t>(sequences.size());
  for (const auto& s : sequences)
    for (uint8_t m : s.loss_mask) d.target_tokens += m;
  d.rows = make_sft_rows(sequences, a.max_length, a.packing);
  return d;
}

// Rows right-padded to a multiple of `multiple` tokens (context parallelism cuts every row into
// 2 x CP chunks, sequence parallelism each rank's part into TP slices): padding is no key and no
// target, so the loss is that of the unpadded batch.
SftBatch pad_to_multiple(SftBatch b, int64_t multiple, int64_t pad) {
  const int64_t length = b.input_ids.size(1);
  const int64_t extra = (multiple - length % multiple) % multiple;
  if (extra == 0) return b;
  auto grow = [&](const at::Tensor& t, double value) {
    return at::cat({t, at::full({t.size(0), extra}, value, t.options())}, 1);
  };
  b.input_ids = grow(b.input_ids, static_cast<double>(pad));
  b.labels = grow(b.labels, static_cast<double>(pad));
  b.label_mask = grow(b.label_mask, 0);
  b.attention_mask = grow(b.attention_mask, 0);
  b.position_ids = grow(b.position_ids, 0);
  b.segment_ids = grow(b.segment_ids, -1);
  return b;
}

// How a micro-batch is split over the model-parallel ranks of its replica.
struct Split {
  Communicator* tensor_parallel = nullptr;   // vocabulary-parallel logits: the loss across the group
  Communicator* context_parallel = nullptr;  // each rank its load-balanced chunks of every row
  int64_t multiple = 1;                      // rows are padded to a multiple of this many tokens
};
Split split_of(const ParallelGroups& g, const PretrainArgs& a) {
  Split s;
  s.tensor_parallel = g.tensor_parallel.get();
  s.context_parallel = g.context_parallel.get();
  if (s.context_parallel) s.multiple *= 2 * g.cp;
  if (s.tensor_parallel && a.sequence_parallel) s.multiple *= g.tp;
  return s;
}

// This rank's part of a full [B, L] tensor: its context-parallel chunks (Megatron's load-balanced
// 2 x CP split, as the model cuts its positions), or all of it.
at::Tensor local_part(const at::Tensor& full, const Split& split) {
  return split.context_parallel ? context_parallel::shard_sequence(full, 1, split.context_parallel->size(),
                                                                   split.context_parallel->rank())
                                : full;
}

// -log p(label) per token of this rank's part of the (padded) micro-batch, [B, L / CP] fp32. Under
// tensor parallelism from the vocabulary slices (no rank forms full-vocabulary logits). Every
// tensor is copied to the device before the forward, none after it: a copy from pageable memory
// would hold the host until the forward has run, with the backward not yet queued.
at::Tensor token_losses(std::shared_ptr<CausalLM>& model, const SftBatch& cpu, const Split& split,
                        const at::Device& device) {
  SequenceLayout layout;
  layout.position_ids = to_device(local_part(cpu.position_ids, split), device);
  layout.attention_mask = to_device(local_part(cpu.attention_mask, split), device);
  layout.segment_ids = to_device(local_part(cpu.segment_ids, split), device);
  const at::Tensor input = to_device(local_part(cpu.input_ids, split), device);
  const at::Tensor labels = to_device(local_part(cpu.labels, split), device);
  at::Tensor logits = model->call(input, layout);
  return split.tensor_parallel ? tensor_parallel::vocab_parallel_cross_entropy(logits, labels, *split.tensor_parallel)
                               : -token_log_probs(logits, labels);
}

// Per-token loss of a micro-batch as a [sequences, L] matrix (one row per packed conversation,
// so seq-mean modes average per conversation, not per packed row) with its target mask. Only
// without context parallelism: a rank then holds whole rows.
struct SequenceLosses {
  at::Tensor loss;  // [S, L] fp32
  at::Tensor mask;  // [S, L] fp32
};
SequenceLosses sequence_losses(std::shared_ptr<CausalLM>& model, const SftBatch& cpu, const Split& split,
                               const at::Device& device) {
  // The number of conversations from the host copy: read from the device it would be a sync
  // after the forward. Inputs are copied before the forward starts.
  const int64_t segments = std::max<int64_t>(1, cpu.segment_ids.max().item<int64_t>() + 1);
  const at::Tensor segment_ids = to_device(cpu.segment_ids, device);
  const at::Tensor mask = to_device(per_sequence(cpu.label_mask, cpu.segment_ids), device);
  const at::Tensor loss = token_losses(model, cpu, split, device);  // [B, L]
  return {per_sequence(loss, segment_ids, segments), mask};
}

// The weight of every token of a full micro-batch [B, L] in the loss (what agg_loss computes,
// as a weighted sum): token-mean mask / global tokens; seq-mean-token-mean mask / (its
// conversation's target tokens x global conversations). Under context parallelism each rank
// weights its chunks with its part of these, so the sum over the ranks is the loss of whole
// conversations, whose token counts no one rank sees.
at::Tensor token_weights(const SftBatch& cpu, LossAggMode agg, const LossNormalizer& norm) {
  at::Tensor w = cpu.label_mask.to(at::kDouble).clone();
  if (agg == LossAggMode::kTokenMean) return (w / norm.global_tokens).to(at::kFloat);
  auto weight = w.accessor<double, 2>();
  auto seg = cpu.segment_ids.accessor<int64_t, 2>();
  for (int64_t b = 0; b < w.size(0); ++b) {
    std::map<int64_t, double> tokens;
    for (int64_t t = 0; t < w.size(1); ++t) tokens[seg[b][t]] += weight[b][t];
    for (int64_t t = 0; t < w.size(1); ++t)
      if (weight[b][t] != 0) weight[b][t] /= tokens[seg[b][t]] * norm.global_sequences;
  }
  return w.to(at::kFloat);
}

double sum_over(Communicator& group, double value) {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kDouble).device(group.device()));
  group.all_reduce(t, {ReduceOp::kSum});
  return t.item<double>();
}

std::vector<const SftRow*> pick(const std::vector<SftRow>& rows, const std::vector<int64_t>& index) {
  std::vector<const SftRow*> out;
  for (int64_t i : index) out.push_back(&rows[static_cast<size_t>(i)]);
  return out;
}

}  // namespace

SftResult run_sft(SftArgs args, const std::shared_ptr<Communicator>& comm, std::ostream& log) {
  const PretrainArgs& a = args.base;
  torch::manual_seed(a.seed);
  auto tokenizer = make_torch_safe_tokenizer({a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file});
  if (!tokenizer)
    flag_error("--tokenizer-type", "mfsdp-sft needs a text tokenizer: ByteLevelTokenizer, GPT2BPETokenizer or "
                            "HuggingFaceTokenizer");
  const std::string chat_template = resolve_chat_template(args.chat_template, *tokenizer);
  const LossAggMode agg = parse_loss_agg_mode(args.loss_agg_mode);
  const SftData train = load_sft_data("train", args, *tokenizer, chat_template);
  SftData val;
  if (args.data.generated() || !args.data.val_files.empty()) val = load_sft_data("test", args, *tokenizer, chat_template);

  StartingPoint start = starting_point(a, args.hf_load, tokenizer->vocab_size());
  TrainingRun run(a, start.config, comm, log, /*per_token_loss=*/true, sft_tool_flags(args), start.hf_folder);
  const ResumePoint resume = run.start();
  std::shared_ptr<CausalLM>& model = run.model();
  const at::Device device = comm->device();
  const int64_t pad = tokenizer->eod();
  // Data-parallel replicas read their own rows; the tensor- and context-parallel ranks of a
  // replica read the same ones (parallel_groups.h). Sums of losses and counts run over the DP x CP
  // ranks of one tensor-parallel coordinate (a TP group's ranks hold the same loss).
  const ParallelGroups& groups = run.groups();
  const int rank = groups.dp_rank, dp = groups.dp;
  const Split split = split_of(groups, a);
  Communicator& replicas = *groups.fsdp;
  auto batch_of = [&](const std::vector<SftRow>& rows, const std::vector<int64_t>& index) {
    return pad_to_multiple(collate_sft_rows(pick(rows, index), pad), split.multiple, pad);
  };
  if (run.prints()) {
    // Pre-tokenized files were rendered upstream: the template applies to conversations only.
    const bool conversations = !train.pretokenized || !val.examples.empty();
    log << " mfsdp-sft: " << train.sequences
        << (train.pretokenized ? " pre-tokenized training sequences (" : " training conversations (")
        << train.rows.size() << (args.packing ? " packed rows" : " rows") << ", " << train.target_tokens
        << " target tokens), " << val.sequences << " held out" << (val.pretokenized ? " (pre-tokenized)" : "")
        << "; chat template "
        << (conversations ? describe_chat_template(args.chat_template, *tokenizer) : "unused (pre-tokenized data)")
        << "; model: " << start.description << "\n";
  }

  SftSampler sampler(static_cast<int64_t>(train.rows.size()), a.micro_batch_size, dp, a.num_micro_batches,
                     static_cast<uint64_t>(a.seed));

  // Validation: the loss over held-out conversations (rank r takes every dp-th row) and greedy
  // exact match of the last assistant message.
  auto evaluate = [&](int64_t iteration) {
    IterationRecord r;
    r.iteration = iteration;
    r.consumed_samples = iteration * a.global_batch_size;
    r.eval = true;
    r.lm_loss = std::nan("");
    if (val.rows.empty()) return r;
    // Loss sum (token-mean) or sum of sequence means, tokens, sequences: summed on the device
    // (the counts of context-parallel rows on the host, from the batch), read once.
    at::Tensor sums = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(device));
    {
      torch::NoGradGuard no_grad;
      const int64_t limit = a.eval_iters > 0 ? std::min<int64_t>(a.eval_iters * a.global_batch_size,
                                                                 static_cast<int64_t>(val.rows.size()))
                                             : static_cast<int64_t>(val.rows.size());
      // Every rank runs the same number of (sharded, collective) forwards; a rank whose share
      // ran out runs row 0 and counts nothing.
      const int64_t per_round = dp * a.micro_batch_size;
      for (int64_t round = 0; round * per_round < limit; ++round) {
        std::vector<int64_t> index;
        const int64_t first = round * per_round + rank * a.micro_batch_size;
        for (int64_t i = first; i < std::min(first + a.micro_batch_size, limit); ++i) index.push_back(i);
        const bool idle = index.empty();
        if (idle) index.push_back(0);
        const SftBatch batch = batch_of(val.rows, index);
        if (split.context_parallel) {
          // This rank's chunks, weighted by whole conversations' counts; the counts once per CP group.
          const at::Tensor loss = token_losses(model, batch, split, device);
          if (idle) continue;
          const at::Tensor w = to_device(local_part(token_weights(batch, agg, LossNormalizer{1, 1, 0}), split), device);
          sums[0] += (loss * w).sum().to(at::kDouble);
          if (split.context_parallel->rank() != 0) continue;
          const at::Tensor tokens = per_sequence(batch.label_mask, batch.segment_ids).sum(1);  // host
          sums[1] += tokens.sum().item<double>();
          sums[2] += (tokens > 0).sum().item<double>();
          continue;
        }
        SequenceLosses s = sequence_losses(model, batch, split, device);
        if (idle) continue;
        const at::Tensor tokens = s.mask.sum(1);
        sums[0] += agg == LossAggMode::kTokenMean ? (s.loss * s.mask).sum().to(at::kDouble)
                                                  : ((s.loss * s.mask).sum(1) / tokens.clamp_min(1)).sum().to(at::kDouble);
        sums[1] += tokens.sum().to(at::kDouble);
        sums[2] += (tokens > 0).sum().to(at::kDouble);
      }
    }
    replicas.all_reduce(sums, {ReduceOp::kSum});
    const at::Tensor t = sums.cpu();
    const double loss = t[0].item<double>() / std::max(1.0, t[agg == LossAggMode::kTokenMean ? 1 : 2].item<double>());
    r.lm_loss = loss;
    r.extra.emplace_back("val/loss", loss);
    std::string detail;
    if (args.val_generate_samples > 0 && !val.examples.empty()) {  // pre-tokenized: no prompts to answer
      ChatEvalOptions e;
      e.chat_template = chat_template;
      e.max_new_tokens = args.max_new_tokens;
      e.samples = args.val_generate_samples;
      const ChatEvalResult m = greedy_exact_match(run, val.examples, *tokenizer, e);
      r.extra.emplace_back("val/exact_match", m.accuracy);
      char buf[96];
      std::snprintf(buf, sizeof buf, " | exact match: %.4f (%lld of %lld)", m.accuracy, (long long)m.correct,
                    (long long)m.total);
      detail = buf;
    }
    r.mem_bytes = peak_memory_bytes(device);
    if (run.prints()) {
      char line[160];
      std::snprintf(line, sizeof line, " validation at iteration %lld | loss: %.6E", (long long)iteration, loss);
      log << line << detail << "\n";
      log.flush();
    }
    run.record(r);
    return r;
  };

  SftResult result;
  result.first_loss = std::nan("");
  const auto start_time = Clock::now();
  auto window_start = start_time;
  double window_loss = 0, window_tokens = 0;
  int64_t window_iters = 0;
  int64_t it = resume.iteration + 1;
  if (it > a.train_iters && run.prints())
    log << " checkpoint iteration " << resume.iteration << " reaches --train-iters " << a.train_iters
        << ": nothing to train\n";
  for (; it <= a.train_iters; ++it) {
    // The global batch's denominators, before any micro-batch runs: the loss is then the same
    // whatever the split into micro-batches and ranks.
    std::vector<SftBatch> batches;
    double counts[2] = {0, 0};
    for (int64_t m = 0; m < a.num_micro_batches; ++m) {
      batches.push_back(batch_of(train.rows, sampler.rows(it, m, rank)));
      // Conversations with targets: per_sequence's rows beyond a row's own sequences are empty
      // and are not conversations.
      const at::Tensor tokens = per_sequence(batches.back().label_mask, batches.back().segment_ids).sum(1);
      counts[0] += tokens.sum().item<double>();
      counts[1] += (tokens > 0).sum().item<double>();
    }
    // Every CP rank of a replica counted its whole micro-batches.
    at::Tensor c = at::tensor({counts[0], counts[1]}, at::kDouble).to(device);
    replicas.all_reduce(c, {ReduceOp::kSum});
    c = c.cpu() / static_cast<double>(groups.cp);
    LossNormalizer norm;
    norm.global_tokens = c[0].item<double>();
    norm.global_sequences = c[1].item<double>();
    const auto stats = run.step(it, a.num_micro_batches, [&](int64_t m) {
      const SftBatch& batch = batches[static_cast<size_t>(m)];
      at::Tensor loss;
      if (split.context_parallel) {
        const at::Tensor w = to_device(local_part(token_weights(batch, agg, norm), split), device);
        loss = (token_losses(model, batch, split, device) * w).sum();
      } else {
        SequenceLosses s = sequence_losses(model, batch, split, device);
        loss = agg_loss(s.loss, s.mask, agg, norm);
      }
      loss.backward();
      return loss.detach();
    });
    const double step_loss = sum_over(replicas, stats.loss);
    window_loss += step_loss;
    window_tokens += norm.global_tokens;
    ++window_iters;
    if (it % a.log_interval == 0 || it == a.train_iters) {
      const auto now = Clock::now();
      const double seconds = std::chrono::duration<double>(now - window_start).count();
      IterationRecord r;
      r.iteration = it;
      r.consumed_samples = it * a.global_batch_size;
      r.lm_loss = window_loss / window_iters;
      r.lr = stats.lr;
      r.grad_norm = stats.grad_norm;
      r.iter_time_s = seconds / window_iters;
      r.tokens_per_sec = window_tokens / seconds;  // target tokens
      r.mem_bytes = peak_memory_bytes(device);
      r.extra.emplace_back("train/loss", r.lm_loss);
      run.add_norms(r, stats);
      run.record(r);
      if (std::isnan(result.first_loss)) result.first_loss = r.lm_loss;
      result.final_loss = r.lm_loss;
      if (run.prints()) {
        char line[512];
        std::snprintf(line, sizeof line,
                      " iteration %6lld/%6lld | consumed samples: %8lld | elapsed time per iteration (ms): %.1f | "
                      "learning rate: %.6E | global batch size: %4lld | loss: %.6E | grad norm: %.3f%s | "
                      "target tokens/s: %.1f | mem (MiB): %.1f",
                      (long long)it, (long long)a.train_iters, (long long)r.consumed_samples, r.iter_time_s * 1e3,
                      r.lr, (long long)a.global_batch_size, r.lm_loss, r.grad_norm, run.norms_log_text(stats).c_str(),
                      r.tokens_per_sec, r.mem_bytes / 1048576.0);
        log << line << "\n";
        log.flush();
      }
      window_loss = window_tokens = 0;
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
  run.finish_checkpoint(last);
  IterationRecord final_eval = evaluate(last);
  result.final_val_loss = final_eval.lm_loss;
  for (const auto& [key, value] : final_eval.extra)
    if (key == "val/exact_match") result.val_exact_match = value;
  run.finish(last, "SFT loss");
  return result;
}

}  // namespace mfsdp
