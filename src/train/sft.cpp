#include "mfsdp/train/sft.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "mfsdp/checkpoint/tensor_source.h"
#include "mfsdp/data/posttrain/chat_template.h"
#include "mfsdp/data/posttrain/verifiable_tasks.h"
#include "mfsdp/models/batched_generate.h"
#include "mfsdp/models/context_parallel.h"
#include "mfsdp/models/lm_loss.h"
#include "mfsdp/models/tensor_parallel.h"
#include "mfsdp/models/token_stats.h"
#include "mfsdp/train/policy_loss.h"
#include "mfsdp/train/chat_eval.h"
#include "mfsdp/train/sft_data.h"
#include "mfsdp/train/task_source.h"
#include "train/tool_flags.h"
#include "mfsdp/train/train_loop.h"
#include "mfsdp/train/training_run.h"

namespace mfsdp {

ToolFlags sft_tool_flags(SftArgs& a) {
  ToolFlags t;
  t.program = "mfsdp-sft";
  // Not the pretraining corpus (--max-length is the sequence length) nor mfsdp-pretrain's own
  // section (the loss is always normalised by global counts: --loss-agg-mode).
  t.sections = {Section::kModel,      Section::kMoe,       Section::kTokenizer, Section::kTraining, Section::kOptimizer,
                Section::kCheckpoint, Section::kParallel, Section::kFsdp,      Section::kRuntime,  Section::kLogging,
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
  // Rows are as long as each micro-batch's longest: between pipeline stages every activation's
  // shape goes ahead of it (Megatron's --variable-seq-lengths).
  a.base.variable_seq_lengths = true;
  a.base.calculate_per_token_loss = true;
  a.base.load_requires_checkpoint = true;
  return a;
}

namespace {

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
Split split_of(const ParallelMesh& mesh, const PretrainArgs& a) {
  Split s;
  s.tensor_parallel = mesh.split("tp").get();  // the mesh owns the groups for the whole run
  s.context_parallel = mesh.split("cp").get();
  if (s.context_parallel) s.multiple *= 2 * mesh.dims().cp;
  if (s.tensor_parallel && a.sequence_parallel) s.multiple *= mesh.dims().tp;
  return s;
}

// This rank's part of a full [B, L] tensor: its context-parallel chunks (Megatron's load-balanced
// 2 x CP split, as the model cuts its positions), or all of it.
at::Tensor local_part(const at::Tensor& full, const Split& split) {
  return split.context_parallel ? context_parallel::shard_sequence(full, 1, split.context_parallel->size(),
                                                                   split.context_parallel->rank())
                                : full;
}

// This rank's part of a (padded) micro-batch on the device: the model's input and layout, the
// labels. Every tensor is copied to the device before the forward, none after it: a copy from
// pageable memory would hold the host until the forward has run, with the backward not yet queued.
struct DeviceBatch {
  at::Tensor input, labels;
  SequenceLayout layout;
};
DeviceBatch on_device(const SftBatch& cpu, const Split& split, const at::Device& device) {
  DeviceBatch d;
  d.layout.position_ids = to_device(local_part(cpu.position_ids, split), device);
  d.layout.attention_mask = to_device(local_part(cpu.attention_mask, split), device);
  d.layout.segment_ids = to_device(local_part(cpu.segment_ids, split), device);
  d.input = to_device(local_part(cpu.input_ids, split), device);
  d.labels = to_device(local_part(cpu.labels, split), device);
  return d;
}

// -log p(label) per token of this rank's part of the micro-batch, [B, L / CP] fp32, from its
// logits: under tensor parallelism from the vocabulary slices (no rank forms full-vocabulary
// logits).
at::Tensor token_losses(const at::Tensor& logits, const at::Tensor& labels, const Split& split) {
  return split.tensor_parallel ? tensor_parallel::vocab_parallel_cross_entropy(logits, labels, *split.tensor_parallel)
                               : -token_log_probs(logits, labels);
}

// How a micro-batch's token losses become its loss, copied to the device before the forward.
// Under context parallelism each token's weight in the loss (token_weights); otherwise the rows
// regrouped one per packed conversation (so seq-mean modes average per conversation, not per
// packed row) with their target mask: a rank then holds whole rows.
struct LossTerms {
  at::Tensor weights;                // [B, L / CP] fp32, with context parallelism
  at::Tensor segment_ids, mask;      // [B, L] int64 and [S, L] fp32, without
  int64_t segments = 0;              // S: from the host copy (read from the device, a sync)
};

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

LossTerms loss_terms(const SftBatch& cpu, const Split& split, const at::Device& device, LossAggMode agg,
                     const LossNormalizer& norm) {
  LossTerms t;
  if (split.context_parallel) {
    t.weights = to_device(local_part(token_weights(cpu, agg, norm), split), device);
    return t;
  }
  t.segments = std::max<int64_t>(1, cpu.segment_ids.max().item<int64_t>() + 1);
  t.segment_ids = to_device(cpu.segment_ids, device);
  t.mask = to_device(per_sequence(cpu.label_mask, cpu.segment_ids), device);
  return t;
}

// The target tokens of each conversation of a micro-batch (per_sequence's rows, on the host).
at::Tensor target_tokens(const SftBatch& cpu) { return per_sequence(cpu.label_mask, cpu.segment_ids).sum(1); }

std::vector<const SftRow*> pick(const std::vector<SftRow>& rows, const std::vector<int64_t>& index) {
  std::vector<const SftRow*> out;
  for (int64_t i : index) out.push_back(&rows[static_cast<size_t>(i)]);
  return out;
}

}  // namespace

namespace {

// mfsdp-sft's part of the loop (train_loop.h): the sampler's rows, the loss normalised by the
// global batch's counts, validation loss and greedy exact match.
class SftTrainer : public MicroBatchTrainer {
 public:
  SftTrainer(TrainingRun& run, const SftArgs& args, const SftData& train, const SftData& val, const Tokenizer& tokenizer,
             const std::string& chat_template, SftResult& result)
      : MicroBatchTrainer(run),
        args_(args),
        a_(args.base),
        train_(train),
        val_(val),
        tokenizer_(tokenizer),
        chat_template_(chat_template),
        result_(result),
        agg_(parse_loss_agg_mode(args.loss_agg_mode)),
        mesh_(run.mesh()),
        split_(split_of(mesh_, a_)),
        device_(run.comm()->device()),
        pad_(tokenizer.eod()),
        sampler_(static_cast<int64_t>(train.rows.size()), a_.micro_batch_size, mesh_.dims().dp(), a_.num_micro_batches,
                 static_cast<uint64_t>(a_.seed)),
        row_counts_(train.rows.size()) {}

  // The global batch's denominators, before any micro-batch runs (the loss is then the same
  // whatever the split into micro-batches and ranks), from every rank's rows: the sampler tells
  // each rank the others' rows, so no collective and no device read is needed.
  TrainingRun::StepStats train_step(int64_t iteration) override {
    norm_ = LossNormalizer{};
    for (int64_t i : sampler_.global_batch(iteration)) {
      const auto [tokens, sequences] = counts_of_row(i);
      norm_.global_tokens += tokens;
      norm_.global_sequences += sequences;
    }
    batches_.clear();
    for (int64_t m = 0; m < a_.num_micro_batches; ++m)
      batches_.push_back(batch_of(train_.rows, sampler_.rows(iteration, m, mesh_.coordinate("dp"))));
    window_tokens_ += norm_.global_tokens;
    return MicroBatchTrainer::train_step(iteration);
  }

  at::Tensor forward_backward(int64_t, int64_t m) override {
    const ChunkOutput out = forward(batches_[static_cast<size_t>(m)], {}, /*training=*/true);
    out.loss.backward();
    return out.reported;
  }

  ChunkOutput forward_chunk(int64_t, int chunk, int64_t m, const at::Tensor& input) override {
    run_.model()->select_pipeline_chunk(chunk);
    return forward(batches_[static_cast<size_t>(m)], input, /*training=*/true);
  }

  void log(const LogWindow& w) override {
    // Each step's loss summed over the DP x CP ranks of this tensor-parallel coordinate (a TP
    // group's ranks hold the same loss), the window's steps in one all-reduce.
    at::Tensor losses = at::tensor(w.losses, at::kDouble).to(device_);
    mesh_.get("dp_cp")->all_reduce(losses, {ReduceOp::kSum});
    // Under pipeline parallelism the last stage's (the others' are zero).
    if (run_.pipeline().forward) run_.pipeline().forward->all_reduce(losses, {ReduceOp::kSum});
    double window_loss = 0;
    for (double step_loss : read_on_host({losses})) window_loss += step_loss;
    IterationRecord r;
    r.iteration = w.iteration;
    r.consumed_samples = w.iteration * a_.global_batch_size;
    r.lm_loss = window_loss / static_cast<double>(w.steps);
    r.lr = w.last.lr;
    r.grad_norm = w.grad_norm;
    r.iter_time_s = w.seconds / static_cast<double>(w.steps);
    r.tokens_per_sec = window_tokens_ / w.seconds;  // target tokens
    r.mem_bytes = peak_memory_bytes(device_);
    r.extra.emplace_back("train/loss", r.lm_loss);
    run_.add_norms(r, w.last);
    run_.record(r);
    window_tokens_ = 0;
    if (std::isnan(result_.first_loss)) result_.first_loss = r.lm_loss;
    result_.final_loss = r.lm_loss;
    if (!run_.prints()) return;
    char line[512];
    std::snprintf(line, sizeof line,
                  " iteration %6lld/%6lld | consumed samples: %8lld | elapsed time per iteration (ms): %.1f | "
                  "learning rate: %.6E | global batch size: %4lld | loss: %.6E | grad norm: %.3f%s | "
                  "target tokens/s: %.1f | mem (MiB): %.1f",
                  (long long)w.iteration, (long long)a_.train_iters, (long long)r.consumed_samples,
                  r.iter_time_s * 1e3, r.lr, (long long)a_.global_batch_size, r.lm_loss, r.grad_norm,
                  run_.norms_log_text(w.last).c_str(), r.tokens_per_sec, r.mem_bytes / 1048576.0);
    run_.log() << line << "\n";
    run_.log().flush();
  }

  void evaluate(int64_t iteration) override { evaluation(iteration); }

  // Validation: the loss over held-out conversations (rank r takes every dp-th row) and greedy
  // exact match of the last assistant message.
  IterationRecord evaluation(int64_t iteration) {
    IterationRecord r;
    r.iteration = iteration;
    r.consumed_samples = iteration * a_.global_batch_size;
    r.eval = true;
    r.lm_loss = std::nan("");
    if (val_.rows.empty()) return r;
    const int rank = mesh_.coordinate("dp"), dp = mesh_.dims().dp();
    // Loss sum (token-mean) or sum of sequence means, tokens, sequences: summed on the device
    // (the counts of context-parallel rows on the host, from the batch), read once.
    // Every rank runs the same number of (sharded, collective) forwards; a rank whose share ran
    // out runs row 0 and counts nothing.
    const int64_t limit = a_.eval_iters > 0 ? std::min<int64_t>(a_.eval_iters * a_.global_batch_size,
                                                                static_cast<int64_t>(val_.rows.size()))
                                            : static_cast<int64_t>(val_.rows.size());
    const int64_t per_round = dp * a_.micro_batch_size;
    std::vector<SftBatch> batches;
    std::vector<bool> idle;
    for (int64_t round = 0; round * per_round < limit; ++round) {
      std::vector<int64_t> index;
      const int64_t first = round * per_round + rank * a_.micro_batch_size;
      for (int64_t i = first; i < std::min(first + a_.micro_batch_size, limit); ++i) index.push_back(i);
      idle.push_back(index.empty());
      if (index.empty()) index.push_back(0);
      batches.push_back(batch_of(val_.rows, index));
    }
    // Megatron's interleaved schedule takes micro-batches in groups of the pipeline's stages: the
    // rounds are made up to a multiple with idle ones.
    const PipelineLayout& pipeline = run_.pipeline();
    while (pipeline.virtual_stages > 1 && batches.size() % static_cast<size_t>(pipeline.stages) != 0) {
      idle.push_back(true);
      batches.push_back(batch_of(val_.rows, {0}));
    }
    // The loss sum (token-mean) or sum of conversation means on the device, from the ranks
    // holding the output layer; the counts on the host, once per context-parallel group.
    at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
    {
      torch::NoGradGuard no_grad;
      const auto round = [&](int64_t m, const at::Tensor& input) {
        ChunkOutput out = forward(batches[static_cast<size_t>(m)], input, /*training=*/false);
        if (out.reported.defined() && idle[static_cast<size_t>(m)]) out.reported = at::zeros_like(out.reported);
        return out;
      };
      if (run_.pipeline().forward) {
        loss_sum += run_forward_pipeline(run_.pipeline(), static_cast<int64_t>(batches.size()),
                                         [&](int chunk, int64_t m, const at::Tensor& input) {
                                           run_.model()->select_pipeline_chunk(chunk);
                                           return round(m, input);
                                         });
      } else {
        for (size_t m = 0; m < batches.size(); ++m) loss_sum += round(static_cast<int64_t>(m), {}).reported;
      }
    }
    double tokens = 0, conversations = 0;
    const bool counts = run_.model()->holds_output() && (!split_.context_parallel || split_.context_parallel->rank() == 0);
    for (size_t m = 0; m < batches.size() && counts; ++m) {
      if (idle[m]) continue;
      const at::Tensor t = target_tokens(batches[m]);
      tokens += t.sum().item<double>();
      conversations += (t > 0).sum().item<double>();
    }
    at::Tensor sums = at::stack({loss_sum, at::scalar_tensor(tokens, loss_sum.options()),
                                 at::scalar_tensor(conversations, loss_sum.options())});
    mesh_.get("dp_cp")->all_reduce(sums, {ReduceOp::kSum});
    if (run_.pipeline().forward) run_.pipeline().forward->all_reduce(sums, {ReduceOp::kSum});  // the last stage's
    const at::Tensor t = sums.cpu();
    const double loss = t[0].item<double>() / std::max(1.0, t[agg_ == LossAggMode::kTokenMean ? 1 : 2].item<double>());
    r.lm_loss = loss;
    r.extra.emplace_back("val/loss", loss);
    std::string detail;
    if (args_.val_generate_samples > 0 && !val_.examples.empty()) {  // pre-tokenized: no prompts to answer
      ChatEvalOptions e;
      e.chat_template = chat_template_;
      e.max_new_tokens = args_.max_new_tokens;
      e.samples = args_.val_generate_samples;
      const ChatEvalResult m = greedy_exact_match(run_, val_.examples, tokenizer_, e);
      r.extra.emplace_back("val/exact_match", m.accuracy);
      char buf[96];
      std::snprintf(buf, sizeof buf, " | exact match: %.4f (%lld of %lld)", m.accuracy, (long long)m.correct,
                    (long long)m.total);
      detail = buf;
    }
    r.mem_bytes = peak_memory_bytes(device_);
    if (run_.prints()) {
      char line[160];
      std::snprintf(line, sizeof line, " validation at iteration %lld | loss: %.6E", (long long)iteration, loss);
      run_.log() << line << detail << "\n";
      run_.log().flush();
    }
    run_.record(r);
    return r;
  }

 private:
  // One micro-batch's forward on this rank: the whole model, or under pipeline parallelism the
  // chunk selected, from `received` hidden states unless it holds the embedding. Where the output
  // layer is, the loss: in training the micro-batch's share of the global batch's (`loss`, and
  // `reported` detached); in evaluation `reported` alone, the sum of token losses (token-mean) or
  // of conversation means. Elsewhere the hidden states (`output`).
  ChunkOutput forward(const SftBatch& batch, const at::Tensor& received, bool training) {
    const std::optional<PipelineChunk> chunk = run_.model()->pipeline_chunk();
    const bool loss_here = !chunk || chunk->output;
    const DeviceBatch d = on_device(batch, split_, device_);
    LossTerms terms;
    if (loss_here) terms = loss_terms(batch, split_, device_, agg_, training ? norm_ : LossNormalizer{1, 1, 0});
    const at::Tensor in = received.defined() ? received : d.input;
    if (!loss_here) return {run_.model()->call(in, d.layout), {}, {}};
    const at::Tensor losses = output_token_losses(in, d);  // [B, L / CP]
    at::Tensor loss;
    if (split_.context_parallel) {
      loss = (losses * terms.weights).sum();
    } else {
      const at::Tensor per_conversation = per_sequence(losses, terms.segment_ids, terms.segments);
      if (training) {
        loss = agg_loss(per_conversation, terms.mask, agg_, norm_);
      } else {
        const at::Tensor masked = per_conversation * terms.mask;
        loss = agg_ == LossAggMode::kTokenMean ? masked.sum() : (masked.sum(1) / terms.mask.sum(1).clamp_min(1)).sum();
      }
    }
    if (!training) return {{}, {}, loss.to(at::kDouble)};
    return {{}, loss, loss.detach()};
  }

  // -log p(label) per token of this rank's part of the micro-batch, from the output layer fused
  // with the loss (--cross-entropy-loss-fusion) or from the logits.
  at::Tensor output_token_losses(const at::Tensor& in, const DeviceBatch& d) {
    if (!a_.cross_entropy_loss_fusion) return token_losses(run_.model()->call(in, d.layout), d.labels, split_);
    ChunkedOutputOptions o;
    o.chunk_elements = a_.cross_entropy_chunk_elements;
    return -run_.model()->token_stats(in, d.layout, d.labels, o).log_probs;
  }

  SftBatch batch_of(const std::vector<SftRow>& rows, const std::vector<int64_t>& index) const {
    return pad_to_multiple(collate_sft_rows(pick(rows, index), pad_), split_.multiple, pad_);
  }

  // A training row's target tokens and conversations with targets (per_sequence's rows beyond a
  // row's own sequences are empty and are not conversations), computed once per row.
  std::pair<double, double> counts_of_row(int64_t i) {
    std::optional<std::pair<double, double>>& c = row_counts_[static_cast<size_t>(i)];
    if (!c) {
      const SftBatch one = collate_sft_rows(pick(train_.rows, {i}), pad_);
      const at::Tensor tokens = per_sequence(one.label_mask, one.segment_ids).sum(1);
      c = std::pair{tokens.sum().item<double>(), (tokens > 0).sum().item<double>()};
    }
    return *c;
  }

  const SftArgs& args_;
  const PretrainArgs& a_;
  const SftData& train_;
  const SftData& val_;
  const Tokenizer& tokenizer_;
  const std::string& chat_template_;
  SftResult& result_;
  LossAggMode agg_;
  const ParallelMesh& mesh_;
  Split split_;
  at::Device device_;
  int64_t pad_;
  SftSampler sampler_;
  std::vector<std::optional<std::pair<double, double>>> row_counts_;
  // The current step's.
  LossNormalizer norm_;
  std::vector<SftBatch> batches_;
  double window_tokens_ = 0;
};

}  // namespace

SftResult run_sft(SftArgs args, const std::shared_ptr<Communicator>& comm, std::ostream& log) {
  const PretrainArgs& a = args.base;
  torch::manual_seed(a.seed);
  auto tokenizer = make_torch_safe_tokenizer({a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file});
  if (!tokenizer)
    flag_error("--tokenizer-type", "mfsdp-sft needs a text tokenizer: ByteLevelTokenizer, GPT2BPETokenizer or "
                            "HuggingFaceTokenizer");
  const std::string chat_template = resolve_chat_template(args.chat_template, *tokenizer);
  const SftData train = load_sft_data("train", args, *tokenizer, chat_template);
  SftData val;
  if (args.data.generated() || !args.data.val_files.empty()) val = load_sft_data("test", args, *tokenizer, chat_template);

  OpenedCheckpoint load = open_training_checkpoint(a);
  StartingPoint start = starting_point(load, args.hf_load, model_config_from_args(a, a, a.seq_length, a.padded_vocab_size),
                                       a.seed, a.export_hf, tokenizer->vocab_size());
  TrainingRun run(a, start.config, comm, log, /*per_token_loss=*/true, sft_tool_flags(args), start.hf_folder,
                  std::move(load));
  const ResumePoint resume = run.start();
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

  SftResult result;
  result.first_loss = std::nan("");
  SftTrainer trainer(run, args, train, val, *tokenizer, chat_template, result);
  const Trainer::Outcome end = trainer.train(resume);
  result.iterations = end.last;
  if (end.stopped) return result;
  const IterationRecord final_eval = trainer.evaluation(end.last);
  result.final_val_loss = final_eval.lm_loss;
  for (const auto& [key, value] : final_eval.extra)
    if (key == "val/exact_match") result.val_exact_match = value;
  run.finish(end.last, "SFT loss");
  return result;
}

}  // namespace mfsdp
