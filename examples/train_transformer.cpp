// A small decoder-only transformer trained with fully_shard: each block is a unit, the root holds
// the embeddings, the final norm and the output head. Every rank trains on its own slice of each
// global batch of synthetic sequences (a fixed random permutation rule, with noise), accumulates
// gradients over micro-batches without communication until the last one, clips by the global
// norm and takes a distributed AdamW step with Megatron's warmup + cosine schedule.
//
//   mfsdp-run --nproc-per-node 2 build/mfsdp-example-train-transformer [--strategy S] [--bf16] ...
//
// Rank 0 prints the loss (mean over ranks and over the steps since the previous line), learning
// rate, gradient norm and throughput, then the memory each role holds on rank 0 and
// "final loss X (first Y)": X is the mean loss of the last 10 steps, Y the loss of step 1. The
// program fails (exit 1) when X is not below Y, so a broken runtime cannot pass as a demo.
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"

namespace {

using at::Tensor;

constexpr const char* kUsage = R"(usage: mfsdp-run --nproc-per-node N train_transformer [FLAGS]

  --strategy S          no_shard, optim, optim_grads or optim_grads_params (default:
                        optim_grads_params)
  --steps N             optimizer steps (default 150)
  --micro-batches M     micro-batches per step, gradients synchronised on the last (default 2)
  --micro-batch-size B  sequences per micro-batch and rank (default 8)
  --lr X                peak learning rate: 10 warmup steps, cosine to X/10 (default 3e-3)
  --clip-grad X         global gradient-norm clip, 0 disables (default 1.0)
  --bf16                bf16 model weights for forward/backward (fp32 main weights and grads)
  --log-interval K      print every K steps (default 10)
  --d-model D           model width (default 64)
  --heads H             attention heads, must divide D (default 4)
  --layers L            transformer blocks (default 2)
  --seq-len T           tokens per sequence (default 32)
  --seed S              model and data seed (default 1234)
  -h, --help            show this help
)";

constexpr int64_t kVocab = 64;
constexpr double kNoise = 0.1;  // probability that the next token is uniform instead of the rule's

struct Config {
  mfsdp::ShardingStrategy strategy = mfsdp::ShardingStrategy::kOptimGradsParams;
  int64_t steps = 150;
  int64_t micro_batches = 2;
  int64_t micro_batch_size = 8;
  double lr = 3e-3;
  double clip_grad = 1.0;
  bool bf16 = false;
  int64_t log_interval = 10;
  int64_t d_model = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  int64_t seq_len = 32;
  int64_t seed = 1234;
  bool help = false;
};

struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

int64_t parse_positive_int(const std::string& flag, const std::string& value) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || v <= 0)
    throw UsageError(flag + ": expected a positive integer, got '" + value + "'");
  return v;
}

double parse_double(const std::string& flag, const std::string& value, bool allow_zero) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const bool bad_value = !std::isfinite(v) || v < 0 || (!allow_zero && v == 0);
  if (used != value.size() || value.empty() || bad_value)
    throw UsageError(flag + ": expected a " + (allow_zero ? "non-negative" : "positive") +
                     " number, got '" + value + "'");
  return v;
}

Config parse_args(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    bool inline_value = false;
    if (auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      inline_value = true;
    }
    auto next = [&]() -> std::string {
      if (inline_value) return value;
      if (i + 1 >= argc) throw UsageError(flag + ": missing value");
      return argv[++i];
    };
    auto no_value = [&] {
      if (inline_value) throw UsageError(flag + ": takes no value, got '" + value + "'");
    };
    if (flag == "-h" || flag == "--help") {
      no_value();
      c.help = true;
    } else if (flag == "--strategy") {
      std::string v = next();
      try {
        c.strategy = mfsdp::parse_sharding_strategy(v);
      } catch (const std::exception& e) {
        throw UsageError(flag + ": " + e.what());
      }
    } else if (flag == "--steps") {
      c.steps = parse_positive_int(flag, next());
    } else if (flag == "--micro-batches") {
      c.micro_batches = parse_positive_int(flag, next());
    } else if (flag == "--micro-batch-size") {
      c.micro_batch_size = parse_positive_int(flag, next());
    } else if (flag == "--lr") {
      c.lr = parse_double(flag, next(), /*allow_zero=*/false);
    } else if (flag == "--clip-grad") {
      c.clip_grad = parse_double(flag, next(), /*allow_zero=*/true);
    } else if (flag == "--bf16") {
      no_value();
      c.bf16 = true;
    } else if (flag == "--log-interval") {
      c.log_interval = parse_positive_int(flag, next());
    } else if (flag == "--d-model") {
      c.d_model = parse_positive_int(flag, next());
    } else if (flag == "--heads") {
      c.heads = parse_positive_int(flag, next());
    } else if (flag == "--layers") {
      c.layers = parse_positive_int(flag, next());
    } else if (flag == "--seq-len") {
      c.seq_len = parse_positive_int(flag, next());
    } else if (flag == "--seed") {
      c.seed = parse_positive_int(flag, next());
    } else {
      throw UsageError("unknown flag '" + flag + "' (see --help)");
    }
  }
  if (c.d_model % c.heads != 0)
    throw UsageError("--heads: " + std::to_string(c.heads) + " does not divide --d-model " +
                     std::to_string(c.d_model));
  return c;
}

// ---- the model ---------------------------------------------------------------------------------

// RMSNorm; the statistics are computed in fp32 also when the weights are bf16.
struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t d) { weight = register_parameter("weight", torch::ones({d})); }
  Tensor forward(const Tensor& x) {
    Tensor xf = x.to(torch::kFloat);
    Tensor normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + 1e-6);
    return normed.to(x.scalar_type()) * weight;
  }
  Tensor weight;
};
TORCH_MODULE(RMSNorm);

// Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(.)). A fully_shard unit: called as
// block->call(x) so that its weights are gathered before and freed after its forward.
struct BlockImpl : mfsdp::ShardedModule<BlockImpl> {
  BlockImpl(int64_t d, int64_t heads) : heads(heads) {
    norm1 = register_module("norm1", RMSNorm(d));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    norm2 = register_module("norm2", RMSNorm(d));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }

  // Causal multi-head self-attention with plain matmuls and a masked softmax (in fp32).
  Tensor attention(const Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), D = x.size(2), hd = D / heads;
    auto split = [&](const Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
    auto parts = qkv(x).chunk(3, /*dim=*/-1);
    Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);  // [B, H, T, hd]
    Tensor scores = q.matmul(k.transpose(-2, -1)).to(torch::kFloat) / std::sqrt(double(hd));
    Tensor future = torch::ones({T, T}, torch::kBool).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    Tensor weights = torch::softmax(scores, -1).to(v.scalar_type());
    Tensor out = weights.matmul(v).transpose(1, 2).reshape({B, T, D});
    return proj(out);
  }

  Tensor forward(Tensor x) {
    x = x + attention(norm1(x));
    return x + fc2(torch::gelu(fc1(norm2(x))));
  }

  int64_t heads;
  RMSNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// The root unit: token and positional embeddings, the blocks, the final norm and the head.
struct TransformerImpl : mfsdp::ShardedModule<TransformerImpl> {
  explicit TransformerImpl(const Config& c) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, c.d_model));
    pos = register_parameter("pos", torch::randn({c.seq_len, c.d_model}) * 0.02);
    for (int64_t i = 0; i < c.layers; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), Block(c.d_model, c.heads)));
    norm = register_module("norm", RMSNorm(c.d_model));
    head = register_module("head", torch::nn::Linear(c.d_model, kVocab));
    torch::NoGradGuard no_grad;
    embed->weight.normal_(0, 0.02);
  }

  // tokens: [B, T] int64 -> logits [B, T, vocab]
  Tensor forward(const Tensor& tokens) {
    const int64_t T = tokens.size(1);
    Tensor h = embed(tokens) + pos.narrow(0, 0, T);
    for (auto& block : blocks) h = block->call(h);
    return head(norm(h));
  }

  torch::nn::Embedding embed{nullptr};
  Tensor pos;
  std::vector<Block> blocks;
  RMSNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Transformer);

// ---- the data ----------------------------------------------------------------------------------

// Sequences from a fixed random rule: the next token is perm_even[token] when the token before
// it is even, perm_odd[token] when it is odd (perm_even for the first step), and with
// probability kNoise a uniform token instead. The rule is the same on every rank; each rank draws
// its own sequences (its slice of every global batch) from a rank-dependent generator.
// Losses (nats): ln 64 = 4.16 knowing nothing; about 1.0 from the current token alone (the
// embeddings and head learn that first; the current token often pins down the parity of the one
// before); about 0.73, the entropy of the noise, once attention looks one token back.
class SyntheticData {
 public:
  SyntheticData(int64_t seed, int rank, int64_t seq_len)
      : seq_len_(seq_len),
        gen_(at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed) * 1000003u +
                                                      7919u * static_cast<uint64_t>(rank + 1))) {
    auto rule = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
    perm_even_ = at::randperm(kVocab, rule, torch::kLong);
    perm_odd_ = at::randperm(kVocab, rule, torch::kLong);
  }

  // inputs and targets, both [batch, seq_len] int64
  std::pair<Tensor, Tensor> next(int64_t batch) {
    std::vector<Tensor> cols;
    cols.push_back(at::randint(kVocab, {batch}, gen_, torch::kLong));
    for (int64_t t = 0; t < seq_len_; ++t) {
      const Tensor& cur = cols.back();
      Tensor follow = perm_even_.index_select(0, cur);
      if (t > 0) {
        Tensor odd = cols[cols.size() - 2].remainder(2).to(torch::kBool);
        follow = torch::where(odd, perm_odd_.index_select(0, cur), follow);
      }
      Tensor random = at::randint(kVocab, {batch}, gen_, torch::kLong);
      Tensor noisy = at::rand({batch}, gen_) < kNoise;
      cols.push_back(torch::where(noisy, random, follow));
    }
    Tensor seq = torch::stack(cols, 1);  // [batch, seq_len + 1]
    return {seq.narrow(1, 0, seq_len_), seq.narrow(1, 1, seq_len_)};
  }

 private:
  int64_t seq_len_;
  at::Generator gen_;
  Tensor perm_even_, perm_odd_;
};

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

int run(const Config& cfg) {
  at::set_num_threads(1);  // ranks x threads must not exceed the cores
  auto comm = mfsdp::init_communicator();
  const int rank = comm->rank(), world = comm->size();

  // The same initial model on every rank; fully_shard keeps each rank's part of it.
  torch::manual_seed(cfg.seed);
  Transformer model(cfg);
  int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();

  mfsdp::FullyShardOptions options;
  options.comm = comm;
  options.strategy = cfg.strategy;
  if (cfg.bf16) options.mixed_precision.param_dtype = at::kBFloat16;
  for (auto& block : model->blocks) mfsdp::fully_shard(*block, options);  // each block first,
  mfsdp::FsdpHandle root = mfsdp::fully_shard(*model, options);           // then the root

  mfsdp::AdamWOptions adamw;
  adamw.weight_decay = 0.01;
  auto opt = mfsdp::make_adamw(root, adamw);
  mfsdp::LRSchedule schedule;
  schedule.max_lr = cfg.lr;
  schedule.min_lr = cfg.lr / 10;
  schedule.warmup_steps = std::min<int64_t>(10, cfg.steps);
  schedule.decay_steps = cfg.steps;
  schedule.style = "cosine";

  const int64_t tokens_per_step = world * cfg.micro_batches * cfg.micro_batch_size * cfg.seq_len;
  if (rank == 0) {
    std::printf(
        "decoder-only transformer: %lld parameters (%.2f MiB fp32), d_model %lld, %lld heads, "
        "%lld blocks, seq %lld, vocab %lld\n",
        static_cast<long long>(n_params), mib(n_params * 4), static_cast<long long>(cfg.d_model),
        static_cast<long long>(cfg.heads), static_cast<long long>(cfg.layers),
        static_cast<long long>(cfg.seq_len), static_cast<long long>(kVocab));
    std::printf(
        "fully_shard %s on %d ranks, %s compute; %lld steps x %lld micro-batches x %lld "
        "sequences per rank = %lld tokens per step\n",
        mfsdp::to_string(cfg.strategy), world, cfg.bf16 ? "bf16" : "fp32",
        static_cast<long long>(cfg.steps), static_cast<long long>(cfg.micro_batches),
        static_cast<long long>(cfg.micro_batch_size), static_cast<long long>(tokens_per_step));
    std::fflush(stdout);
  }

  SyntheticData data(cfg.seed, rank, cfg.seq_len);
  // Losses are means over ranks. The log shows the mean over the steps since the previous line
  // (as Megatron does); the final loss is the mean over the last kFinalWindow steps.
  constexpr int64_t kFinalWindow = 10;
  double first_loss = 0, final_sum = 0, interval_loss = 0, interval_seconds = 0;
  int64_t interval_steps = 0;
  using Clock = std::chrono::steady_clock;
  for (int64_t step = 1; step <= cfg.steps; ++step) {
    const auto start = Clock::now();
    double local_loss = 0;
    for (int64_t m = 0; m < cfg.micro_batches; ++m) {
      // Gradients of all micro-batches but the last accumulate locally; the last backward
      // reduces everything accumulated.
      root.set_requires_gradient_sync(m == cfg.micro_batches - 1);
      auto [inputs, targets] = data.next(cfg.micro_batch_size);
      Tensor logits = model->call(inputs);
      Tensor loss = torch::cross_entropy_loss(logits.reshape({-1, kVocab}).to(torch::kFloat),
                                              targets.reshape({-1})) /
                    static_cast<double>(cfg.micro_batches);
      loss.backward();
      local_loss += loss.item<double>();
    }
    const double grad_norm = opt->clip_grad_norm(cfg.clip_grad);
    if (!std::isfinite(grad_norm))
      throw std::runtime_error("non-finite gradient norm at step " + std::to_string(step));
    const double lr = schedule.lr_at(step);
    opt->step(lr);
    root.zero_grad();
    Tensor loss = at::full({1}, local_loss, torch::kDouble);
    comm->all_reduce(loss, {mfsdp::ReduceOp::kAvg});
    const double global_loss = loss.item<double>();
    interval_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    interval_loss += global_loss;
    ++interval_steps;
    if (step == 1) first_loss = global_loss;
    if (step > cfg.steps - kFinalWindow) final_sum += global_loss;
    if (step == 1 || step % cfg.log_interval == 0 || step == cfg.steps) {
      const double seconds = interval_seconds / static_cast<double>(interval_steps);
      const double mean_loss = interval_loss / static_cast<double>(interval_steps);
      if (rank == 0) {
        std::printf(
            "step %4lld  loss %.4f  lr %.2e  grad norm %7.4f  %7.1f ms/step  %8.0f tokens/s\n",
            static_cast<long long>(step), mean_loss, lr, grad_norm, 1e3 * seconds,
            static_cast<double>(tokens_per_step) / seconds);
        std::fflush(stdout);
      }
      interval_seconds = interval_loss = 0;
      interval_steps = 0;
    }
  }

  const double final_loss = final_sum / static_cast<double>(std::min(kFinalWindow, cfg.steps));

  mfsdp::MemoryReport mem = root.memory();
  for (const auto& [name, tensors] : opt->state())
    for (const auto& t : tensors) mem.optimizer_state += static_cast<int64_t>(t.nbytes());
  if (rank == 0) {
    std::printf("memory on rank 0 (MiB, %s):\n", mfsdp::to_string(cfg.strategy));
    std::printf("  model weights    %8.3f\n", mib(mem.model_weights));
    std::printf("  main weights     %8.3f  (not counting main weights that alias model weights)\n",
                mib(mem.main_weights));
    std::printf("  optimizer state  %8.3f\n", mib(mem.optimizer_state));
    std::printf("  main grads       %8.3f\n", mib(mem.main_grads));
    std::printf("  transient peak   %8.3f  (unsharded weights and grads; now %.3f)\n",
                mib(mem.transient_peak), mib(mem.transient_now));
    std::printf("final loss %.4f (first %.4f)\n", final_loss, first_loss);
    std::fflush(stdout);
  }
  if (!(final_loss < first_loss)) {
    std::ostringstream msg;
    msg << "the loss did not fall: final " << final_loss << ", first " << first_loss;
    throw std::runtime_error(msg.str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config cfg = parse_args(argc, argv);
    if (cfg.help) {
      std::cout << kUsage;
      return 0;
    }
    return run(cfg);
  } catch (const std::exception& e) {
    std::cerr << "train_transformer: " << e.what() << std::endl;
    return 1;
  }
}
