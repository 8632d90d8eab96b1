// What every trainer shares (mfsdp-pretrain, mfsdp-sft, mfsdp-grpo; docs/design.md "Trainers"):
// the model (of any registered family) sharded with fully_shard from Megatron's flags, the distributed optimizer and
// LR schedule, --load / --save / --exit-interval, the metrics file and its curve picture, and
// what happens at the end (final checkpoint, --export-hf, memory report).
// Each trainer owns only its data and its loss: it calls step() with a function that runs one
// micro-batch's forward and backward.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/models/model_spec.h"
#include "mfsdp/optim/optim.h"
#include "mfsdp/checkpoint/local_checkpoint.h"
#include "mfsdp/train/goodput.h"
#include "mfsdp/train/metrics.h"
#include "mfsdp/train/parallel_dims.h"
#include "mfsdp/train/pipeline_runner.h"
#include "mfsdp/train/pretrain_args.h"
#include "mfsdp/train/rerun_validation.h"
#include "mfsdp/train/rollout_model.h"
#include "mfsdp/train/step_profiler.h"
#include "mfsdp/train/tensorboard_writer.h"
#include "mfsdp/train/trainer_checkpoint.h"

namespace mfsdp {

// Megatron's model arguments (argparse names, as ModelSpec::config_from_megatron reads them)
// of the model the model and MoE sections describe, at `seq_length` with the vocabulary padded
// to `padded_vocab_size` (both derived by validation: --seq-length or a tool's --max-length; the
// tokenizer's vocabulary rounded up by --make-vocab-size-divisible-by).
nlohmann::json megatron_model_args(const ModelSection& model, const MoeSection& moe, int64_t seq_length,
                                   int64_t padded_vocab_size);
// The model the flags describe: the family that builds Megatron's model from those arguments.
ModelConfig model_config_from_args(const ModelSection& model, const MoeSection& moe, int64_t seq_length,
                                   int64_t padded_vocab_size);
// How MoE layers train, from the --moe-* flags (include/mfsdp/models/moe.h).
MoeTraining moe_training_from_args(const MoeSection& moe);
// fully_shard's options from the sharding, precision (--bf16) and buffer flags, without the
// groups (ParallelMesh::dense_shard_options and expert_shard_options add them). `per_token_loss`:
// the loss is already divided by the global count (no 1/dp in the gradient reduction).
FullyShardOptions shard_options_from_args(const FsdpSection& fsdp, const ParallelSection& parallel,
                                          const TrainingSection& training, bool per_token_loss);

struct ShardedModel {
  std::shared_ptr<CausalLM> model;
  FsdpHandle root;
  // --expert-model-parallel-size > 1: the ranks this rank's experts are split among (the mesh's
  // "ep"); null otherwise.
  std::shared_ptr<Communicator> expert_parallel;
};
// How the flags build the model (ModelBuildOptions but the groups): deferred init
// (--init-model-with-meta-device, or `values_loaded`: every value is about to be overwritten by
// a load), --recompute-activations, the seed, MoE training, --sequence-parallel, --cp-comm-type.
ModelBuildOptions model_build_options(const ModelSection& model, const MoeSection& moe, const TrainingSection& training,
                                      const FsdpSection& fsdp, const ParallelSection& parallel, bool values_loaded);
// Builds the model and shards it, layers then the root. With deferred init every layer is
// materialised and sharded in turn, so no rank ever holds the whole model (deferred init equals
// eager init bit for bit, docs/model.md). Under expert parallelism
// (--expert-model-parallel-size) each rank builds only its experts, and each layer's experts
// are a unit sharded over the expert-data-parallel group (the ranks holding the same experts).
// `mesh`: the model is built with its tensor-, context- and expert-parallel groups and sharded
// over its FSDP groups (`shard` gives the rest of the options); without it `shard` must name the
// communicator, and nothing is split (no sequence parallelism). `use_sdpa`: not
// --attention-backend unfused.
ShardedModel build_sharded_model(const ModelConfig& config, ModelBuildOptions options, bool use_sdpa,
                                 const FullyShardOptions& shard, const ParallelMesh* mesh = nullptr);

// Where fine-tuning starts (mfsdp-sft, mfsdp-grpo): the model config and, for a Hugging Face
// folder, where its weights are. In order: `load` (--load opened by open_training_checkpoint:
// its model_config; the weights are loaded by TrainingRun::start from the same reader),
// `hf_load` (config.json and the safetensors headers, checked by describe_hf_model; no weight is
// read here: TrainingRun::start streams each rank's ranges), `from_flags` (the model flags, with
// the tokenizer's padded vocabulary; `seed` for the log). Errors name the flag: a tokenizer with
// more ids than the model's vocabulary, a folder that is not a model, --export-hf of a model
// that cannot be exported.
struct StartingPoint {
  ModelConfig config;
  std::string hf_folder;    // the --hf-load folder the weights come from; empty otherwise
  std::string description;  // for the log
};
StartingPoint starting_point(const OpenedCheckpoint& load, const std::string& hf_load, const ModelConfig& from_flags,
                             int64_t seed, const std::string& export_hf, int64_t tokenizer_vocab);

// The file next to the metrics file with another extension (metrics.jsonl -> metrics.svg).
std::string sibling_path(const std::string& metrics_file, const std::string& extension);

// `host` on `device` without holding the host: on CUDA through pinned memory and a non-blocking
// copy (a pageable copy waits until the device has run everything queued before it); else
// `host.to(device)`.
at::Tensor to_device(const at::Tensor& host, const at::Device& device);

// Thrown by TrainingRun::step on every rank when --check-for-nan-in-loss-and-grad finds a NaN
// or Inf loss or gradient.
class NonFiniteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class TrainingRun {
 public:
  // Builds the sharded model, the optimizer (--optimizer) and the LR schedule. `tool` names the
  // trainer's own flags (recorded in checkpoints next to Megatron's). `hf_folder`: the Hugging
  // Face folder start() loads (StartingPoint::hf_folder). `load`: --load, opened once by
  // open_training_checkpoint (the same reader the starting point read). A run that loads its
  // weights (a checkpoint, or `hf_folder`) builds its skeleton with deferred init whatever
  // --init-model-with-meta-device says: the values are overwritten, so no rank needs the whole
  // model. The run holds the whole configuration (as TorchTitan's Trainer its JobConfig); what
  // it calls takes the sections it reads.
  TrainingRun(const PretrainArgs& args, const ModelConfig& config, std::shared_ptr<Communicator> comm,
              std::ostream& log, bool per_token_loss, ToolFlags tool = {}, std::string hf_folder = {},
              OpenedCheckpoint load = {});

  // --load (resume, or --finetune for weights only) from the opened checkpoint, whose reader is
  // then released; else the Hugging Face folder given to the constructor, each rank reading only
  // the element ranges it holds (load_hf_shards). Collective.
  ResumePoint start();

  struct StepStats {
    // The sum of the micro-batches' reported losses on this rank (fp64, 0-dim) and the global
    // gradient norm before clipping (fp64, one element): on the model's device, not read by the
    // step. --check-for-nan-in-loss-and-grad reads both (with its flags) into the *_on_host values.
    at::Tensor loss;
    at::Tensor grad_norm;
    std::optional<double> loss_on_host, grad_norm_on_host;
    // The values on the host: the ones read already, else read now (one read_on_host each).
    double loss_value() const;
    double grad_norm_value() const;
    double lr = 0;
    double params_norm = 0;        // with --log-params-norm: L2 norm of every parameter after the step
    int64_t num_zeros_in_grad = 0;  // with --log-num-zeros-in-grad: gradient elements == 0 after clipping
    // MoE models: Megatron's log fields over the step's micro-batches and every rank, the balancing
    // losses before their coefficients (mean over MoE layers and forwards), and per MoE layer.
    struct MoeLayer {
      int64_t layer = 0;
      double load_balancing_loss = 0;
      double z_loss = 0;
      std::vector<int64_t> tokens_per_expert;  // (token, expert) pairs routed to each expert
    };
    std::vector<MoeLayer> moe_layers;
    // Pipeline parallelism: this rank's time in the schedule and the part of it waiting for a
    // receive (pipeline_runner.h).
    PipelineTimes pipeline;
    double load_balancing_loss = 0;
    double z_loss = 0;
  };
  // One optimizer step of `iteration` (1-based): micro_batch(m) for m = 0 .. micro_batches - 1
  // runs that micro-batch's forward and backward (gradients are reduced after the last one
  // only) and returns the loss it reports on this rank, a scalar tensor on the model's device
  // (any dtype and scale; summed in fp64 into StepStats::loss); then clip (--clip-grad), step at
  // the schedule's lr, zero the gradients. Profiled with --profile.
  // The losses and the gradient norm stay on the device (the clip factor is applied there), so
  // nothing in the step waits for the device to drain; the loop reads them at log steps
  // (train_loop.h). --check-for-nan-in-loss-and-grad reads them once, after the last backward,
  // in the same copy as its flags: when a rank's loss or a reduced gradient is NaN or Inf,
  // every rank throws NonFiniteError (the same message: the iteration, the ranks of the losses,
  // the parameters whose shards hold the values) before the optimizer step. Collective.
  StepStats step(int64_t iteration, int64_t micro_batches, const std::function<at::Tensor(int64_t)>& micro_batch);
  // The same step under pipeline parallelism (--pipeline-model-parallel-size > 1): the
  // micro-batches run by Megatron's 1F1B schedule (pipeline_schedule.h), `forward` running this
  // stage's forward of each (pipeline_runner.h); the activations and their gradients cross the
  // stages point to point. A tied embedding's gradient is summed over its first- and last-stage
  // copies; the gradient norm spans the stages. StepStats::loss is zero on stages without the
  // output layer. Collective.
  StepStats pipeline_step(int64_t iteration, int64_t micro_batches, const ChunkForward& forward);
  // Pipeline parallelism: the stages' layout (null `forward` group without it).
  const PipelineLayout& pipeline() const { return pipeline_; }
  // The " | num zeros: N | params norm: X" of the log line (empty when neither flag is given),
  // and the same values into a metrics record (num_zeros_in_grad, params_norm); for an MoE model
  // also " | load_balancing_loss: X | z_loss: Y" (with --moe-per-layer-logging each layer's loss
  // and tokens per expert in the record).
  std::string norms_log_text(const StepStats& stats) const;
  void add_norms(IterationRecord& record, const StepStats& stats) const;

  // Appends to the metrics file (rank 0) and the history the curve is drawn from.
  void record(const IterationRecord& r);
  // Saves at --save-interval; true when --exit-interval, a signal under --exit-signal-handler or
  // --exit-duration-in-mins says to stop here (saved first; the signal and the time agreed over
  // every rank, a collective each iteration when either flag is given). With
  // --check-for-nan-in-loss-and-grad, a checkpoint of NaN or Inf weights is refused
  // (NonFiniteError naming the parameters) before anything is written.
  bool after_iteration(int64_t iteration);
  // With --save: the checkpoint of the last iteration, unless it is saved already. Collective.
  void finish_checkpoint(int64_t last_iteration);
  // The end: the last checkpoint (when not saved yet), the curve picture (`curve_title` of
  // lm_loss; none when empty), --export-hf, the memory report. Collective.
  void finish(int64_t last_iteration, const std::string& curve_title = "lm loss");

  // The plain copy generation runs on (GRPO's rollout, greedy evaluation), built once per run on
  // first use; load_from() / release() it around each use.
  RolloutModel& rollout_model();
  // rollout_model() loaded with the current weights (collective), never holding a second full
  // copy on the device: the shards stream into it one group at a time, or under tensor or expert
  // parallelism the whole tensors are joined through the host.
  RolloutModel& load_rollout_model();

  // Full weights by HF name (collective), in fp32: on every rank, or with all_ranks false at
  // least on rank 0 (others may get an empty map). cpu_offload: each tensor moved to the host as
  // it is gathered, so the device holds one group (or tensor) at a time, not the whole model.
  std::map<std::string, at::Tensor> gather_full_weights(bool all_ranks = true, bool cpu_offload = false) const;
  // Prints on rank 0 only (every rank in a simulated run).
  bool prints() const { return print_; }
  double all_reduce_mean(double value) const;
  double all_reduce_sum(double value) const;
  double all_reduce_max(double value) const;

  const PretrainArgs& args() const { return args_; }
  const std::shared_ptr<Communicator>& comm() const { return comm_; }
  // The job's layout and groups: the data-parallel size and this rank's replica (its share of
  // the data, coordinate("dp")), the tensor- and context-parallel groups (split("tp"), null when
  // not split).
  const ParallelMesh& mesh() const { return mesh_; }
  std::ostream& log() const { return log_; }
  std::shared_ptr<CausalLM>& model() { return sharded_.model; }
  FsdpHandle& root() { return sharded_.root; }
  DistributedOptimizer& optimizer() { return *optimizer_; }
  const ModelConfig& config() const { return config_; }
  const std::vector<IterationRecord>& history() const { return history_; }
  MetricsWriter& metrics() { return metrics_; }

 private:
  void save(int64_t iteration);
  // --non-persistent-save-interval: a global or local non-persistent checkpoint of `iteration`.
  void save_non_persistent(int64_t iteration);
  // --non-persistent-ckpt-type local with --load: loads the newest valid local checkpoint when it
  // is newer than what --load holds (false: none is). Collective.
  bool load_local_checkpoint(ResumePoint& resume);
  // A restarted start's line and metrics: what the failure cost (goodput.h).
  void report_restart(const ResumePoint& resume);
  // step()'s parts before and after the micro-batches' forwards and backwards.
  void begin_step(int64_t iteration, int64_t micro_batches);
  // `rerun` runs the step's forwards and backwards again and returns its loss (result validation).
  StepStats finish_step(int64_t iteration, at::Tensor loss, const std::function<at::Tensor()>& rerun);
  // Result validation (rerun_validation.h) in place of check_finite when --check-for-spiky-loss
  // or --rerun-mode is on: every rank's loss in one all-reduce, read with the norm; the same
  // decisions on every rank. May rerun the step (replacing `s`), log, or throw NonFiniteError /
  // ResultValidationExit. Collective.
  void validate_step(int64_t iteration, StepStats& s, const std::function<at::Tensor()>& rerun);
  // Every rank's loss of this step (one all-reduce, one read, with the norm into s.*_on_host).
  std::vector<double> read_rank_losses(StepStats& s);
  bool validates_results() const;
  // Pipeline parallelism with tied embeddings: sums the gradient of the embedding weight over its
  // first- and last-stage copies (Megatron's embedding group). Collective over that group.
  void sum_tied_embedding_gradients();
  void set_up_pipeline();  // the constructor's: pipeline_ and embedding_group_
  // --optimizer muon over the model's shards, Megatron's --muon-* flags (the constructor's).
  std::unique_ptr<DistributedOptimizer> make_muon_optimizer(const PretrainArgs& args) const;
  // The MoE layers' router statistics of this step, summed over the ranks (collective; nothing
  // for a dense model).
  void collect_router_stats(StepStats& stats);
  // The start-up line of an MoE model: this rank's expert and dense main weights.
  void print_expert_buffers() const;
  // --check-for-nan-in-loss-and-grad after clipping (`s.loss`: this rank's summed loss on the
  // device; `s.grad_norm`: the global norm, the same on every rank). Reads both with the flags
  // in one copy (into s.*_on_host); throws NonFiniteError. Collective.
  void check_finite(int64_t iteration, StepStats& s);
  // --check-for-nan-in-loss-and-grad before a checkpoint is written: no NaN or Inf weights (a
  // step with finite gradients can still overflow them). Throws NonFiniteError. Collective.
  void check_finite_weights(int64_t iteration);
  void write_param_group_map();  // --dump-param-to-param-group-map
  // Why the job stops after this iteration, agreed over every rank (empty: it goes on): a signal
  // under --exit-signal-handler, or --exit-duration-in-mins passed on the slowest rank.
  // Collective when either flag is given.
  std::string stop_reason();

  PretrainArgs args_;
  ModelConfig config_;
  std::shared_ptr<Communicator> comm_;
  std::ostream& log_;
  ToolFlags tool_;
  std::string hf_folder_;  // loaded by start() unless --load holds a checkpoint
  OpenedCheckpoint load_;  // until start() has loaded it
  bool per_token_loss_;  // gradients summed over the ranks (no 1 / dp)
  bool print_;
  ParallelMesh mesh_;  // before sharded_, which is built over its groups
  ShardedModel sharded_;
  PipelineLayout pipeline_;  // pipeline parallelism: the stages' groups and activation shape
  // The FSDP units of each model chunk of this stage (all but the root).
  std::vector<std::vector<FsdpHandle>> chunk_units_;
  // The first and last pipeline stages (with tied embeddings split over them); null otherwise.
  std::shared_ptr<Communicator> embedding_group_;
  std::unique_ptr<DistributedOptimizer> optimizer_;
  LRSchedule schedule_;
  MetricsWriter metrics_;
  TensorBoardWriter tensorboard_;
  StepProfiler profiler_;  // --profile
  std::vector<IterationRecord> history_;
  std::unique_ptr<RolloutModel> rollout_;
  int64_t last_saved_ = -1;
  std::unique_ptr<LocalCheckpointer> local_;  // --non-persistent-ckpt-type local, made at the first save
  ProgressFile progress_;                     // mfsdp-run's MFSDP_PROGRESS_FILE (rank 0 writes)
  // Result validation: the mode, each rank's spike rule and error injector (every rank keeps all
  // of them, fed the same all-reduced losses, so all decide alike), the generator states at the
  // step's start (a rerun restores them), and the report_stats differences.
  RerunMode rerun_mode_ = RerunMode::kDisabled;
  std::vector<SpikeDetector> spikes_;
  std::vector<ErrorInjector> injectors_;
  std::vector<std::pair<at::Generator, at::Tensor>> step_generators_;
  DeterminismStats determinism_;
  bool first_step_validated_ = false;  // Megatron validates from the second step of a run
  std::optional<RestartCost> restart_cost_;   // a restarted start's, until its first metrics record
};

}  // namespace mfsdp
