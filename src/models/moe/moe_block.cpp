// The MoE block (include/mfsdp/models/moe.h): route, sort the (token, expert) pairs by expert,
// run each expert over its contiguous tokens (or all of them as one grouped GEMM), weight and
// scatter back; the shared expert beside; the balancing losses into the gradient.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>

#include <string>

#include "mfsdp/fsdp/recompute.h"
#include "mfsdp/models/moe.h"

namespace mfsdp {
namespace {

// Megatron's MoEAuxLossAutoScaler: the output passes unchanged, and its backward gives the
// attached loss the gradient `scale`, so the loss trains the router without the trainer seeing
// it, and within this block's backward (inside its FSDP unit's gradient window).
struct AttachLoss : public torch::autograd::Function<AttachLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& output, const at::Tensor& loss,
                            double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["loss_dtype"] = static_cast<int64_t>(loss.scalar_type());
    return output.view_as(output);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["loss_dtype"].toInt());
    return {grad[0], at::full({}, scale, grad[0].options().dtype(dtype)), at::Tensor()};
  }
};

std::vector<int64_t> to_vector(const c10::IValue& v) { return v.toIntVector(); }

// all_to_all_single of rows as an autograd function: the backward sends the gradients back the
// way the rows came (the splits swapped).
struct AllToAll : public torch::autograd::Function<AllToAll> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, std::vector<int64_t> send,
                            std::vector<int64_t> recv, Communicator* comm) {
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm);
    return exchange(*comm, input.contiguous(), send, recv);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    auto* comm = reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
    at::Tensor back = exchange(*comm, grad[0].contiguous(), to_vector(ctx->saved_data["recv"]),
                               to_vector(ctx->saved_data["send"]));
    return {back, at::Tensor(), at::Tensor(), at::Tensor()};
  }
  static at::Tensor exchange(Communicator& comm, const at::Tensor& input, const std::vector<int64_t>& send,
                             const std::vector<int64_t>& recv) {
    int64_t rows = 0;
    for (int64_t r : recv) rows += r;
    std::vector<int64_t> shape = input.sizes().vec();
    shape[0] = rows;
    at::Tensor out = at::empty(shape, input.options());
    AllToAllOptions o;
    o.input_split_sizes = send;
    o.output_split_sizes = recv;
    comm.all_to_all_single(out, input, o);
    return out;
  }
};

// The experts' weights stacked [n, ...] pass unchanged; the backward gives every expert without
// rows (counts[j] == 0) exactly zero. CUDA's grouped GEMM leaves the weight gradient of a
// zero-length group to its kernel, which on some GPUs writes garbage there (PyTorch issue
// 172439, Blackwell); a `where`, not a product, so garbage that is NaN becomes zero too.
struct ZeroIdleExperts : public torch::autograd::Function<ZeroIdleExperts> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& stacked,
                            const at::Tensor& counts) {
    ctx->saved_data["busy"] = counts.gt(0).view({-1, 1, 1}).to(stacked.device());
    return stacked.view_as(stacked);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    return {at::where(ctx->saved_data["busy"].toTensor(), grad[0], 0), at::Tensor()};
  }
};

// The order that groups rows arrived from `sources` ranks (source q's rows by local expert j,
// `counts` [sources x local] rows each, on the rows' device) by expert j, then source q: a
// stable sort of each row's key j * sources + q, on the device.
at::Tensor expert_major_order(const at::Tensor& counts, int64_t sources, int64_t local, int64_t rows) {
  const at::Tensor group = at::arange(sources * local, counts.options());  // q * local + j
  const at::Tensor key = at::repeat_interleave(group.remainder(local) * sources + at::div(group, local, "floor"),
                                               counts, /*dim=*/0, rows);
  return std::get<1>(key.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
}

}  // namespace

ExpertMlpImpl::ExpertMlpImpl(int64_t hidden, int64_t intermediate, bool mixtral_names, bool deferred) {
  // Registered in Hugging Face's order of the three (gate, up, down).
  gate = register_module(mixtral_names ? "w1" : "gate_proj", LlamaLinear(hidden, intermediate, deferred));
  up = register_module(mixtral_names ? "w3" : "up_proj", LlamaLinear(hidden, intermediate, deferred));
  down = register_module(mixtral_names ? "w2" : "down_proj", LlamaLinear(intermediate, hidden, deferred));
}

namespace {
// SwiGLU's activation silu(gate) * up; selective recompute's moe_act checkpoints it (it reads no
// parameter), keeping gate and up instead of silu(gate) beside them.
at::Tensor expert_activation(const at::Tensor& gate_out, const at::Tensor& up_out, bool checkpoint) {
  const RecomputeFn act = [](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{at::silu(in[0]) * in[1]};
  };
  return checkpoint ? recompute(act, {gate_out, up_out})[0] : act({gate_out, up_out})[0];
}
}  // namespace

at::Tensor ExpertMlpImpl::forward(const at::Tensor& x) {
  const at::Tensor in = parallel_boundary.enter(x);
  return parallel_boundary.leave(down(expert_activation(gate(in), up(in), recompute_activation)));
}

MoeExpertsImpl::MoeExpertsImpl(int64_t hidden, int64_t width, bool mixtral_names, int64_t first, int64_t count,
                               bool deferred)
    : first_(first) {
  for (int64_t j = first; j < first + count; ++j)
    local_.push_back(register_module(std::to_string(j), ExpertMlp(hidden, width, mixtral_names, deferred)));
}

void MoeExpertsImpl::keep(int64_t first, int64_t count) {
  if (first < first_ || count < 0 || first + count > first_ + this->count())
    throw std::logic_error("MoeExperts::keep: experts [" + std::to_string(first) + ", " +
                           std::to_string(first + count) + ") are not among those held, [" + std::to_string(first_) +
                           ", " + std::to_string(first_ + this->count()) + ")");
  std::vector<ExpertMlp> kept;
  for (int64_t j = first_; j < first_ + this->count(); ++j) {
    if (j >= first && j < first + count) {
      kept.push_back(local_[static_cast<size_t>(j - first_)]);
    } else {
      unregister_module(std::to_string(j));
    }
  }
  local_ = std::move(kept);
  first_ = first;
}

at::Tensor MoeExpertsImpl::forward(const at::Tensor& tokens, const at::Tensor& counts, bool grouped) {
  const int64_t n = count();
  if (grouped) {
    // One GEMM over every expert's rows: the weights stacked [n, H, I] per call. CUDA's kernel
    // wants every row 16-byte aligned.
    if (tokens.is_cuda() && n > 0) {
      const int64_t item = tokens.element_size(), hidden = tokens.size(1), width = local_[0]->gate->weight.size(0);
      if ((hidden * item) % 16 != 0 || (width * item) % 16 != 0)
        throw std::invalid_argument("--moe-grouped-gemm: at::_grouped_mm on CUDA needs the hidden size (" +
                                    std::to_string(hidden) + ") and the expert width (" + std::to_string(width) +
                                    ") to be multiples of " + std::to_string(16 / item) + " in " +
                                    c10::toString(tokens.scalar_type()) + "; run without --moe-grouped-gemm");
    }
    // Each weight as it is stored ([out, in], what the per-expert path multiplies by its
    // transpose), stacked [n, out, in] (a plain copy: the experts are separate parameters, named
    // one by one in checkpoints), and passed transposed: the column-major operand _grouped_mm
    // takes as it is. The offsets stay on the tokens' device, so nothing here waits for the GPU.
    std::vector<at::Tensor> g, u, d;
    for (const ExpertMlp& e : local_) {
      g.push_back(e->gate->weight);
      u.push_back(e->up->weight);
      d.push_back(e->down->weight);
    }
    const at::Tensor offsets = counts.to(tokens.device()).cumsum(0).to(at::kInt);
    auto stacked = [&](const std::vector<at::Tensor>& w) {
      at::Tensor s = at::stack(w);
      if (s.is_cuda()) s = ZeroIdleExperts::apply(s, counts);  // CPU's _grouped_mm gives zero itself
      return s.transpose(1, 2);
    };
    at::Tensor h = expert_activation(at::_grouped_mm(tokens, stacked(g), offsets),
                                     at::_grouped_mm(tokens, stacked(u), offsets), recompute_activation);
    return at::_grouped_mm(h, stacked(d), offsets);
  }
  // One GEMM per expert over its rows: the row counts on the host (one copy from the device).
  const at::Tensor host = counts.to(at::kCPU, at::kLong).contiguous();
  const int64_t* rows = host.data_ptr<int64_t>();
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t j = 0; j < n; ++j) {
    local_[j]->recompute_activation = recompute_activation;
    parts.push_back(local_[j]->forward(tokens.narrow(0, start, rows[j])));
    start += rows[j];
  }
  return at::cat(parts);
}

MoeBlockImpl::MoeBlockImpl(int64_t hidden, const MoeConfig& config, bool deferred) : config_(config) {
  gate = register_module("gate", LlamaLinear(hidden, config.num_experts, deferred));
  // A buffer, not a parameter: no gradient, no optimizer state, fp32 whatever the compute dtype
  // (Megatron keeps router.expert_bias in fp32 too), every rank holds it whole.
  if (config.expert_bias) gate->register_buffer("e_score_correction_bias", at::zeros({config.num_experts}, at::kFloat));
  // Every expert and the shared expert whole: a plan's expert parallelism keeps this rank's
  // experts, its tensor parallelism cuts each expert's slice of the width under expert tensor
  // parallelism, and the shared expert's (Megatron's SharedExpertMLP is a tensor-parallel MLP:
  // its boundary is the plan's region).
  experts = register_module("experts", MoeExperts(hidden, config.ffn_hidden_size, config.mixtral_names,
                                                  /*first=*/0, config.num_experts, deferred));
  if (config.shared_expert_intermediate_size > 0) {
    shared_expert = register_module(config.shared_experts_name ? "shared_experts" : "shared_expert",
                                    ExpertMlp(hidden, config.shared_expert_intermediate_size,
                                              /*mixtral_names=*/false, deferred));
    if (config.shared_expert_gate) shared_expert_gate = register_module("shared_expert_gate", LlamaLinear(hidden, 1, deferred));
  }
}

void MoeBlockImpl::parallelize_experts(const ExpertParallelism& groups) {
  ep_ = split_group(groups.expert);
  etp_ = split_group(groups.expert_tensor);
  sp_ = split_group(groups.sequence);
  tokens_ = split_group(groups.tokens);
  if (!ep_) return;
  const int64_t ep = ep_->size(), per_rank = config_.num_experts / ep;
  if (config_.num_experts % ep != 0)
    throw std::invalid_argument("MoeBlock: " + std::to_string(ep) + " expert-parallel ranks do not divide " +
                                std::to_string(config_.num_experts) + " experts");
  experts->keep(ep_->rank() * per_rank, per_rank);
}

at::Tensor MoeBlockImpl::run_experts(const at::Tensor& tokens, const Routing& r) {
  // The routed (token, expert) pairs sorted by expert, then token (the order of
  // r.map.t().nonzero()), found on the device without waiting for it: pair (t, e) goes to
  // position start[e] + (the tokens up to t routed to e) - 1; the unrouted pairs all go to one
  // slot past the end, dropped. Dropless routing gives every token exactly top_k experts, so the
  // number of pairs is known; with capacity dropping it is read from the device (one wait).
  const int64_t T = tokens.size(0), E = config_.num_experts;
  const at::Tensor routed = r.map.to(at::kLong);
  const at::Tensor counts = routed.sum(0);  // [E], rows per expert
  const int64_t pairs = training_options.capacity_factor > 0 ? counts.sum().item<int64_t>() : T * config_.top_k;
  const at::Tensor slot = at::where(r.map, routed.cumsum(0) - 1 + (counts.cumsum(0) - counts), pairs);
  const at::Tensor pair = at::empty({pairs + 1}, routed.options())
                              .scatter_(0, slot.view({-1}), at::arange(T * E, routed.options()))
                              .narrow(0, 0, pairs);  // t * E + e of each pair, in order
  const at::Tensor token_of = at::div(pair, E, "floor");
  at::Tensor sorted = tokens.index_select(0, token_of);
  at::Tensor weight = r.probs.reshape({-1}).index_select(0, pair).to(tokens.scalar_type()).unsqueeze(-1);
  at::Tensor out = ep_ ? dispatch(sorted, counts) : run_local(sorted, counts);
  return at::zeros_like(tokens).index_add(0, token_of, out * weight);
}

at::Tensor MoeBlockImpl::dispatch(const at::Tensor& sorted, const at::Tensor& counts) {
  const int64_t ep = ep_->size(), local = config_.num_experts / ep;
  // Every rank learns how many rows it gets from each rank for each of its experts.
  at::Tensor received = at::empty_like(counts);
  ep_->all_to_all_single(received, counts);
  // The all-to-all's split sizes are host values: the one wait for the device in this layer,
  // both count vectors in one copy (Megatron's single D2H of the counts).
  const at::Tensor host = at::cat({counts, received}).to(at::kCPU, at::kLong).view({2, ep, local});
  const at::Tensor send_host = host[0].sum(1), recv_host = host[1].sum(1);
  const std::vector<int64_t> send(send_host.data_ptr<int64_t>(), send_host.data_ptr<int64_t>() + ep),
      recv(recv_host.data_ptr<int64_t>(), recv_host.data_ptr<int64_t>() + ep);
  int64_t rows = 0;
  for (int64_t r : recv) rows += r;
  at::Tensor arrived = AllToAll::apply(sorted, send, recv, ep_.get());
  // Arrived rows are grouped by source rank, then local expert; the experts want them by expert.
  const at::Tensor by_expert = expert_major_order(received, ep, local, rows);
  // Rows per local expert: on the device for the grouped GEMM, on the host for per-expert GEMMs.
  const at::Tensor per_expert = training_options.grouped_gemm ? received.view({ep, local}).sum(0) : host[1].sum(0);
  at::Tensor y = run_local(arrived.index_select(0, by_expert), per_expert);
  at::Tensor back = at::zeros_like(arrived).index_copy(0, by_expert, y);
  return AllToAll::apply(back, recv, send, ep_.get());
}

at::Tensor MoeBlockImpl::run_local(const at::Tensor& rows, const at::Tensor& per_expert) {
  const bool grouped = training_options.grouped_gemm;
  if (!etp_) return experts(rows, per_expert, grouped);
  // Megatron's alltoall dispatcher under expert tensor parallelism: every rank of the group runs
  // the rows of all of them through its slices (an all-gather), and each rank's rows get the sum
  // of the slices' partial outputs (a reduce-scatter). Rows per rank differ, so both are
  // all-to-alls: this rank sends its rows to every rank, and gets back its rows' partial outputs
  // from every rank. The group's counts first: one all-gather, read on the host (one wait).
  const int64_t group = etp_->size(), local = experts->count(), n = rows.size(0);
  const at::Tensor mine = per_expert.to(etp_->device(), at::kLong).contiguous();
  at::Tensor everyone = at::empty({group * local}, mine.options());
  etp_->all_gather(everyone, mine);
  const at::Tensor host = everyone.to(at::kCPU).view({group, local});
  const at::Tensor from_host = host.sum(1).contiguous();
  const std::vector<int64_t> from(from_host.data_ptr<int64_t>(), from_host.data_ptr<int64_t>() + group),
      each(static_cast<size_t>(group), n);
  int64_t total = 0;
  for (int64_t r : from) total += r;
  // The copies' gradients (one per rank) add up in the backward of repeat: each slice's part of
  // the rows' gradient.
  const at::Tensor gathered = AllToAll::apply(rows.repeat({group, 1}), each, from, etp_.get());
  const at::Tensor by_expert = expert_major_order(everyone.to(rows.device()), group, local, total);
  const at::Tensor counts = grouped ? everyone.view({group, local}).sum(0).to(rows.device()) : host.sum(0);
  at::Tensor y = experts(gathered.index_select(0, by_expert), counts, grouped);
  const at::Tensor back = at::zeros_like(gathered).index_copy(0, by_expert, y);
  return AllToAll::apply(back, from, each, etp_.get()).view({group, n, rows.size(1)}).sum(0);
}

at::Tensor MoeBlockImpl::shared(const at::Tensor& x) {
  // Under sequence parallelism (the plan's region) a tensor-parallel MLP over the gathered
  // sequence, its partial outputs reduce-scattered back to this rank's slice.
  at::Tensor s = shared_expert(x);
  if (shared_expert_gate) s = at::sigmoid(shared_expert_gate(x)) * s;
  return s;
}

at::Tensor MoeBlockImpl::forward(const at::Tensor& x, const at::Tensor& valid) {
  const int64_t hidden = x.size(-1);
  at::Tensor tokens = x.reshape({-1, hidden});
  if (valid.defined() && valid.numel() != tokens.size(0))
    throw std::invalid_argument("MoeBlock: a token mask of " + std::to_string(valid.numel()) + " entries for " +
                                std::to_string(tokens.size(0)) + " tokens");
  Routing r = route(gate(tokens), config_, training_options.capacity_factor, expert_bias());
  at::Tensor y = run_experts(tokens, r).view(x.sizes());
  if (shared_expert) {
    // Selective recompute's shared_experts: the shared expert checkpointed (its parameters are
    // this layer's unit's).
    y = y + (recompute_shared_expert
                 ? recompute([this](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{shared(in[0])}; },
                             {x})[0]
                 : shared(x));
  }
  // The balancing losses, for the log always, for the gradient when their coefficient is set.
  at::Tensor balance;
  if (training_options.balancing == MoeTraining::Balancing::kAuxLoss) {
    balance = load_balancing_loss(r, config_.top_k, valid, tokens_.get());
  } else if (training_options.balancing == MoeTraining::Balancing::kSeqAuxLoss) {
    balance = sequence_load_balancing_loss(r, config_.top_k, x.dim() == 3 ? x.size(0) : 1, valid, tokens_.get());
  }
  at::Tensor z = z_loss(r.logits, valid, tokens_.get());
  // Counted once per forward: not again when activation recompute re-runs it in backward.
  if (!detail::in_recompute()) {
    // Kept on the device until take_stats: no host synchronisation per forward.
    at::NoGradGuard no_grad;
    const at::Tensor routed =
        (valid.defined() ? r.map.logical_and(valid.reshape({-1, 1}).to(r.map.device())) : r.map).sum(0);
    tally_.counts = tally_.counts.defined() ? tally_.counts + routed : routed;
    if (balance.defined())
      tally_.balance = tally_.balance.defined() ? tally_.balance + balance.detach() : balance.detach().clone();
    tally_.z = tally_.z.defined() ? tally_.z + z.detach() : z.detach().clone();
    ++tally_.forwards;
  }
  if (at::GradMode::is_enabled() && is_training()) {
    at::Tensor loss;
    if (balance.defined() && training_options.aux_loss_coeff > 0) loss = balance * training_options.aux_loss_coeff;
    if (training_options.z_loss_coeff > 0) {
      at::Tensor zl = z * training_options.z_loss_coeff;
      loss = loss.defined() ? loss + zl : zl;
    }
    // Each rank's losses are its share of the whole tokens' times the token group's size, so the
    // ranks' mean is the whole loss (what the log averages, and the context-parallel gradient
    // reduction). The sequence-parallel ranks sum their partial router gradients instead of
    // averaging them: there the gradient takes the share.
    if (loss.defined()) y = AttachLoss::apply(y, sp_ ? loss / sp_->size() : loss, aux_loss_scale);
  }
  return y;
}

at::Tensor MoeBlockImpl::expert_bias() const {
  if (!config_.expert_bias) return {};
  return *gate->named_buffers(/*recurse=*/false).find("e_score_correction_bias");
}

void MoeBlockImpl::update_expert_bias(const std::vector<int64_t>& tokens_per_expert) {
  if (!config_.expert_bias) return;
  at::NoGradGuard no_grad;
  at::Tensor bias = expert_bias();
  bias.copy_(updated_expert_bias(bias, tokens_per_expert, training_options.bias_update_rate));
}

RouterStats MoeBlockImpl::take_stats() {
  RouterStats s;
  s.forwards = tally_.forwards;
  if (tally_.balance.defined()) s.load_balancing_loss = tally_.balance.item<double>();
  if (tally_.z.defined()) s.z_loss = tally_.z.item<double>();
  if (tally_.counts.defined()) {
    at::Tensor c = tally_.counts.to(at::kCPU, at::kLong).contiguous();
    s.tokens_per_expert.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  }
  tally_ = Tally{};
  return s;
}

}  // namespace mfsdp
