// Context-parallel chunking and attention (include/mfsdp/models/context_parallel.h).
//
// The collectives work on flat contiguous tensors in rank order. All-gathered K/V stay in rank
// order (attention does not care where a key sits, only what the mask says about it, and the
// mask is built from the gathered global positions); only gather_sequence reorders to global
// order, for callers that want the sequence back.
#include "mfsdp/models/context_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/comm/comm.h"

namespace mfsdp::context_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::string shape_of(const at::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : "<undefined>"; }

int64_t checked_dim(const char* fn, const at::Tensor& x, int64_t dim) {
  const int64_t n = x.dim();
  if (dim < -n || dim >= n)
    throw std::invalid_argument(std::string(fn) + ": seq_dim " + std::to_string(dim) +
                                " is out of range for a tensor of shape " + shape_of(x));
  return dim < 0 ? dim + n : dim;
}

void check_layout(const char* fn, int64_t seq_len, int cp_size, int cp_rank) {
  if (cp_size < 1)
    throw std::invalid_argument(std::string(fn) + ": context-parallel size " + std::to_string(cp_size) +
                                " must be at least 1");
  if (cp_rank < 0 || cp_rank >= cp_size)
    throw std::invalid_argument(std::string(fn) + ": rank " + std::to_string(cp_rank) + " is not in [0, " +
                                std::to_string(cp_size) + ")");
  if (seq_len < 0 || seq_len % (2 * static_cast<int64_t>(cp_size)) != 0)
    throw std::invalid_argument(std::string(fn) + ": sequence length S = " + std::to_string(seq_len) +
                                " is not divisible by 2 x CP = " + std::to_string(2 * cp_size) +
                                " (CP = " + std::to_string(cp_size) + ")");
}

// The communicator rides in the autograd context as an integer (IValue holds no raw pointers);
// the header's contract keeps it alive until backward.
void keep(AutogradContext* ctx, Communicator& cp) { ctx->saved_data["cp"] = reinterpret_cast<int64_t>(&cp); }
Communicator& kept(AutogradContext* ctx) {
  return *reinterpret_cast<Communicator*>(ctx->saved_data["cp"].toInt());
}

// Every rank's x stacked in rank order: [world, *x.shape].
at::Tensor all_gather_stacked(const at::Tensor& x, Communicator& cp) {
  at::Tensor flat = at::empty({cp.size() * x.numel()}, x.options());
  cp.all_gather(flat, x.contiguous());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.insert(shape.begin(), cp.size());
  return flat.view(shape);
}

// The sum over ranks of `stacked` ([world, *shape], rank r's block at index r), of which this rank
// keeps block rank().
at::Tensor reduce_scatter_stacked(const at::Tensor& stacked, Communicator& cp) {
  at::Tensor out = at::empty(stacked.sizes().slice(1), stacked.options());
  cp.reduce_scatter(out, stacked.contiguous());
  return out;
}

// Global chunk j lives on rank j (first half of its part) for j < CP, else on rank 2 x CP - 1 - j
// (second half). Index of chunk j in the rank-major list of halves (rank r's halves at 2r, 2r+1).
std::vector<int64_t> half_of_chunk(int world) {
  std::vector<int64_t> order(2 * world);
  for (int j = 0; j < 2 * world; ++j) order[j] = j < world ? 2 * j : 2 * (2 * world - 1 - j) + 1;
  return order;
}

// [world, ..., 2c, ...] (rank parts, seq at dim + 1) -> [..., S, ...] in global order.
at::Tensor to_global_order(const at::Tensor& stacked, int64_t dim) {
  const int64_t world = stacked.size(0), part = stacked.size(dim + 1);
  std::vector<int64_t> halves = stacked.sizes().vec();
  halves[dim + 1] = part / 2;
  halves.insert(halves.begin() + dim + 1, 2);  // [world, ..., 2, c, ...]
  std::vector<int64_t> flat = stacked.sizes().vec();
  flat.erase(flat.begin());
  flat[dim] = part / 2;
  flat.insert(flat.begin(), 2 * world);  // [2 world, ..., c, ...]
  at::Tensor by_half = stacked.reshape(halves).movedim(dim + 1, 1).reshape(flat);
  at::Tensor order = at::tensor(half_of_chunk(static_cast<int>(world)), at::TensorOptions().dtype(at::kLong))
                         .to(stacked.device());
  std::vector<int64_t> full = stacked.sizes().vec();
  full.erase(full.begin());
  full[dim] = world * part;
  return by_half.index_select(0, order).movedim(0, dim).reshape(full);
}

// The inverse: [..., S, ...] -> [world, ..., 2c, ...], rank r's part at index r.
at::Tensor to_rank_order(const at::Tensor& full, int64_t dim, int64_t world) {
  const int64_t chunk = full.size(dim) / (2 * world);
  std::vector<int64_t> chunks = full.sizes().vec();
  chunks[dim] = chunk;
  chunks.insert(chunks.begin() + dim, 2 * world);  // [..., 2 world, c, ...]
  const std::vector<int64_t> order = half_of_chunk(static_cast<int>(world));
  std::vector<int64_t> inverse(order.size());
  for (size_t j = 0; j < order.size(); ++j) inverse[order[j]] = static_cast<int64_t>(j);
  at::Tensor index = at::tensor(inverse, at::TensorOptions().dtype(at::kLong)).to(full.device());
  at::Tensor halves = full.reshape(chunks).movedim(dim, 0).index_select(0, index);  // [2 world, ..., c, ...]
  std::vector<int64_t> split = halves.sizes().vec();
  split[0] = 2;
  split.insert(split.begin(), world);  // [world, 2, ..., c, ...]
  std::vector<int64_t> parts = full.sizes().vec();
  parts[dim] = 2 * chunk;
  parts.insert(parts.begin(), world);
  return halves.reshape(split).movedim(1, dim + 1).reshape(parts);
}

struct GatherSequence : public torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, Communicator* cp, int64_t dim,
                            bool sum_grad) {
    keep(ctx, *cp);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["sum_grad"] = sum_grad;
    return to_global_order(all_gather_stacked(local, *cp), dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    Communicator& cp = kept(ctx);
    at::Tensor parts = to_rank_order(grad[0], ctx->saved_data["dim"].toInt(), cp.size());
    at::Tensor mine = ctx->saved_data["sum_grad"].toBool() ? reduce_scatter_stacked(parts, cp)
                                                           : parts.select(0, cp.rank()).contiguous();
    return {mine, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// ---- Attention helpers --------------------------------------------------------------------------

// [B, H, T, Dk], [B, H, T, Dv] -> [B, H, world * T, Dk], [B, H, world * T, Dv], every rank's
// block in rank order; backward reduce-scatters
// the gradient (each rank's queries give a partial gradient of every key) back to the owners.
// K and V travel together: one collective each way.
struct GatherKeysValues : public torch::autograd::Function<GatherKeysValues> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& k, const at::Tensor& v,
                               Communicator* cp) {
    keep(ctx, *cp);
    const int64_t world = cp->size(), b = k.size(0), h = k.size(1), t = k.size(2), dk = k.size(3);
    ctx->saved_data["key_width"] = dk;
    ctx->saved_data["value_width"] = v.size(3);
    // Side by side along the head width (values may be narrower or wider than keys, as in
    // multi-head latent attention): [world, B, H, T, Dk + Dv] -> [B, H, world, T, Dk + Dv].
    at::Tensor all = all_gather_stacked(at::cat({k, v}, -1), *cp).permute({1, 2, 0, 3, 4});
    all = all.reshape({b, h, world * t, all.size(-1)});
    return {all.narrow(-1, 0, dk).contiguous(), all.narrow(-1, dk, all.size(-1) - dk).contiguous()};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    Communicator& cp = kept(ctx);
    const int64_t world = cp.size(), dk = ctx->saved_data["key_width"].toInt();
    at::Tensor gk = grad[0], gv = grad[1];
    const at::Tensor& some = gk.defined() ? gk : gv;
    const int64_t b = some.size(0), h = some.size(1), s = some.size(2), t = s / world;
    if (!gk.defined()) gk = at::zeros({b, h, s, dk}, some.options());
    if (!gv.defined()) gv = at::zeros({b, h, s, ctx->saved_data["value_width"].toInt()}, some.options());
    at::Tensor both = at::cat({gk, gv}, -1);
    at::Tensor staged = both.view({b, h, world, t, both.size(-1)}).permute({2, 0, 1, 3, 4});
    at::Tensor mine = reduce_scatter_stacked(staged, cp);
    return {mine.narrow(-1, 0, dk).contiguous(), mine.narrow(-1, dk, mine.size(-1) - dk).contiguous(), at::Tensor()};
  }
};

// [Bx, T] per rank -> [Bx, world * T], rank order. Not differentiable (positions, masks).
at::Tensor gather_rows(const at::Tensor& x, Communicator& cp) {
  if (cp.size() == 1) return x;
  const int64_t rows = x.size(0), t = x.size(1);
  return all_gather_stacked(x, cp).permute({1, 0, 2}).reshape({rows, cp.size() * t});
}

// Which keys each query sees, as SequenceLayout::allowed_keys of the full sequence but by global
// positions: [Bm, 1, T, S] bool (Bm: 1 when nothing is per row).
at::Tensor allowed_keys(const at::Tensor& qpos, const at::Tensor& kpos, const at::Tensor& kreal,
                        const at::Tensor& qseg, const at::Tensor& kseg) {
  const at::Tensor q = qpos.unsqueeze(2), k = kpos.unsqueeze(1);
  at::Tensor allowed = k <= q;  // causal
  if (kreal.defined()) allowed = allowed & kreal.unsqueeze(1);
  if (qseg.defined()) allowed = allowed & qseg.unsqueeze(2).eq(kseg.unsqueeze(1));
  // Every query sees itself, so no row is empty: a padding query gets its own value, as in the
  // single-process model.
  allowed = allowed | k.eq(q);
  return allowed.unsqueeze(1);
}

at::Tensor repeat_heads(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, h, n_rep, s, d}).reshape({b, h * n_rep, s, d});
}

// ---- Ring ---------------------------------------------------------------------------------------

// A tensor on its way from rank r - 1 to this rank (while this rank's goes to r + 1).
struct InFlight {
  WorkHandle work;
  at::Tensor arriving;
  at::Tensor leaving;  // kept alive until the exchange completes
  at::Tensor wait() {
    work->wait();
    leaving = at::Tensor();
    return arriving;
  }
};

InFlight shift_async(const at::Tensor& flat, Communicator& cp) {
  const int world = cp.size(), rank = cp.rank();
  AllToAllOptions o;
  o.input_split_sizes.assign(world, 0);
  o.output_split_sizes.assign(world, 0);
  o.input_split_sizes[(rank + 1) % world] = 1;
  o.output_split_sizes[(rank + world - 1) % world] = 1;
  InFlight f;
  f.leaving = flat.contiguous();
  f.arriving = at::empty_like(f.leaving);
  f.work = cp.all_to_all_single_async(f.arriving.view({1, -1}), f.leaving.view({1, -1}), o);
  return f;
}

// K and V of a block, one flat buffer, so a ring step is one exchange.
at::Tensor pack(const at::Tensor& k, const at::Tensor& v) { return at::cat({k.reshape(-1), v.reshape(-1)}); }
std::pair<at::Tensor, at::Tensor> unpack_float(const at::Tensor& flat, at::IntArrayRef k_shape,
                                               at::IntArrayRef v_shape) {
  const int64_t n = c10::multiply_integers(k_shape);
  return {flat.narrow(0, 0, n).view(k_shape).to(at::kFloat),
          flat.narrow(0, n, flat.numel() - n).view(v_shape).to(at::kFloat)};
}

// Block `owner`'s columns of the mask [Bm, 1, T, world * T], repeated for the G query heads that
// share a key head: [Bm, 1, G * T, T] (queries grouped as [B, Hkv, G * T, D]).
at::Tensor block_mask(const at::Tensor& allowed, int owner, int64_t t, int64_t g) {
  at::Tensor m = allowed.narrow(3, owner * t, t);
  const int64_t bm = m.size(0);
  return m.unsqueeze(2).expand({bm, 1, g, t, t}).reshape({bm, 1, g * t, t});
}

// Scores of the grouped queries against one block, invisible keys at -inf: [B, Hkv, G * T, T].
at::Tensor block_scores(const at::Tensor& qg, const at::Tensor& kb, const at::Tensor& mask, double scale) {
  return (at::matmul(qg, kb.transpose(2, 3)) * scale).masked_fill(mask.logical_not(), kNegInf);
}

// Online softmax over the ring: each block's attention is normalised on its own and merged by
// log-sum-exp. A block may hide every key from a query (lse -inf): it then adds nothing. Every
// query sees itself, so the final lse is finite. Forward and backward in fp32; the exchanged
// K/V keep the inputs' dtype, the travelling gradients are fp32.
struct RingAttention : public torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, Communicator* cp, const at::Tensor& allowed, double scale) {
    const int world = cp->size(), rank = cp->rank();
    const int64_t b = q.size(0), hq = q.size(1), t = q.size(2), d = q.size(3), hkv = k.size(1), g = hq / hkv;
    const int64_t dv = v.size(3);
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor qg = q.to(at::kFloat).reshape({b, hkv, g * t, d});
    at::Tensor out = at::zeros({b, hkv, g * t, dv}, f32);
    at::Tensor lse = at::full({b, hkv, g * t, 1}, kNegInf, f32);
    at::Tensor block = pack(k, v);
    for (int i = 0; i < world; ++i) {
      InFlight next;
      if (i + 1 < world) next = shift_async(block, *cp);  // the next block arrives during this one
      const int owner = (rank - i + world) % world;
      auto [kb, vb] = unpack_float(block, k.sizes(), v.sizes());
      at::Tensor s = block_scores(qg, kb, block_mask(allowed, owner, t, g), scale);
      at::Tensor m = std::get<0>(s.max(-1, /*keepdim=*/true));
      m = m.masked_fill(m.isneginf(), 0.0);  // a fully hidden row: exp(-inf) = 0 below, no NaN
      at::Tensor p = at::exp(s - m);
      at::Tensor l = p.sum(-1, /*keepdim=*/true);  // 0 (all hidden) or >= 1 (the max gives exp(0))
      at::Tensor block_lse = m + at::log(l);
      at::Tensor block_out = at::matmul(p, vb) / l.clamp_min(1.0);
      at::Tensor merged = at::logaddexp(lse, block_lse);
      const at::Tensor empty = merged.isneginf();
      out = out * at::exp(lse - merged).masked_fill(empty, 0.0) +
            block_out * at::exp(block_lse - merged).masked_fill(empty, 0.0);
      lse = merged;
      if (next.work) block = next.wait();
    }
    keep(ctx, *cp);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["out"] = out;
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["allowed"] = allowed;
    ctx->save_for_backward({q, k, v});
    return out.reshape({b, hq, t, dv}).to(q.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  }

  // Each block's K/V gradient travels with it: rank r adds its queries' part to the block it
  // holds and passes both on; after a full turn each block's gradient is back with its owner.
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    Communicator& cp = kept(ctx);
    const int world = cp.size(), rank = cp.rank();
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor out = ctx->saved_data["out"].toTensor(), lse = ctx->saved_data["lse"].toTensor();
    const at::Tensor allowed = ctx->saved_data["allowed"].toTensor();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const int64_t b = q.size(0), hq = q.size(1), t = q.size(2), d = q.size(3), hkv = k.size(1), g = hq / hkv;
    at::Tensor qg = q.to(at::kFloat).reshape({b, hkv, g * t, d});
    at::Tensor dout = grad[0].to(at::kFloat).reshape({b, hkv, g * t, v.size(3)});
    at::Tensor delta = (dout * out).sum(-1, /*keepdim=*/true);  // rowsum(dO * O) of the softmax adjoint
    at::Tensor dq = at::zeros_like(qg);
    at::Tensor block = pack(k, v), own;
    InFlight travelling;  // the K/V gradient of the block this rank holds next
    for (int i = 0; i < world; ++i) {
      InFlight next;
      if (i + 1 < world) next = shift_async(block, cp);
      const int owner = (rank - i + world) % world;
      auto [kb, vb] = unpack_float(block, k.sizes(), v.sizes());
      at::Tensor p = at::exp(block_scores(qg, kb, block_mask(allowed, owner, t, g), scale) - lse);
      at::Tensor dv = at::matmul(p.transpose(2, 3), dout);
      at::Tensor ds = p * (at::matmul(dout, vb.transpose(2, 3)) - delta);
      dq.add_(at::matmul(ds, kb), scale);
      at::Tensor dk = at::matmul(ds.transpose(2, 3), qg) * scale;
      at::Tensor acc = pack(dk, dv);
      if (travelling.work) acc = travelling.wait() + acc;
      if (world == 1) {
        own = acc;
      } else {
        travelling = shift_async(acc, cp);
      }
      if (next.work) block = next.wait();
    }
    if (world > 1) own = travelling.wait();
    auto [dk, dv] = unpack_float(own, k.sizes(), v.sizes());
    return {dq.reshape({b, hq, t, d}).to(q.scalar_type()),
            dk.to(k.scalar_type()),
            dv.to(v.scalar_type()),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

// ---- Argument checks ----------------------------------------------------------------------------

// A [B, T] per-token tensor of cp_attention's options, on `device`.
at::Tensor per_token(const at::Tensor& x, const char* name, int64_t batch, int64_t t,
                     const at::Device& device) {
  if (!x.defined()) return x;
  if (x.dim() != 2 || x.size(0) != batch || x.size(1) != t)
    throw std::invalid_argument(std::string("cp_attention: ") + name + " has shape " + shape_of(x) +
                                ", expected [" + std::to_string(batch) + ", " + std::to_string(t) +
                                "] (batch, local tokens)");
  return x.to(device);
}

}  // namespace

// ---- Chunking -----------------------------------------------------------------------------------

at::Tensor cp_positions(int64_t seq_len, int cp_size, int cp_rank) {
  check_layout("cp_positions", seq_len, cp_size, cp_rank);
  const int64_t chunk = seq_len / (2 * cp_size);
  const auto longs = at::TensorOptions().dtype(at::kLong);
  return at::cat({at::arange(cp_rank * chunk, (cp_rank + 1) * chunk, longs),
                  at::arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, longs)});
}

at::Tensor shard_sequence(const at::Tensor& x, int64_t seq_dim, int cp_size, int cp_rank) {
  const int64_t dim = checked_dim("shard_sequence", x, seq_dim);
  check_layout("shard_sequence", x.size(dim), cp_size, cp_rank);
  const int64_t chunk = x.size(dim) / (2 * cp_size);
  return at::cat(
      {x.narrow(dim, cp_rank * chunk, chunk), x.narrow(dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)},
      dim);
}

at::Tensor unshard_sequence(const std::vector<at::Tensor>& parts, int64_t seq_dim) {
  if (parts.empty()) throw std::invalid_argument("unshard_sequence: no parts");
  const int64_t dim = checked_dim("unshard_sequence", parts[0], seq_dim);
  for (size_t r = 1; r < parts.size(); ++r)
    if (parts[r].sizes() != parts[0].sizes())
      throw std::invalid_argument("unshard_sequence: part " + std::to_string(r) + " has shape " +
                                  shape_of(parts[r]) + ", part 0 " + shape_of(parts[0]));
  if (parts[0].size(dim) % 2 != 0)
    throw std::invalid_argument("unshard_sequence: a part of " + std::to_string(parts[0].size(dim)) +
                                " tokens is not two equal chunks");
  return to_global_order(at::stack(parts), dim);
}

at::Tensor gather_sequence(const at::Tensor& local, int64_t seq_dim, Communicator& cp, bool sum_grad) {
  const int64_t dim = checked_dim("gather_sequence", local, seq_dim);
  if (local.size(dim) % 2 != 0)
    throw std::invalid_argument("gather_sequence: a part of " + std::to_string(local.size(dim)) +
                                " tokens is not two equal chunks");
  if (cp.size() == 1) return local;
  return GatherSequence::apply(local, &cp, dim, sum_grad);
}

// ---- Attention ----------------------------------------------------------------------------------

at::Tensor cp_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& global_query_positions, Communicator& cp,
                        const CpAttentionOptions& options) {
  if (!q.defined() || !k.defined() || !v.defined() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4 ||
      k.sizes().slice(0, 3) != v.sizes().slice(0, 3))
    throw std::invalid_argument("cp_attention: q " + shape_of(q) + ", k " + shape_of(k) + " and v " +
                                shape_of(v) + " must be [B, Hq, T, D], [B, Hkv, T, D] and [B, Hkv, T, Dv]");
  const int64_t b = q.size(0), hq = q.size(1), t = q.size(2), d = q.size(3), hkv = k.size(1);
  if (k.size(0) != b || k.size(2) != t || k.size(3) != d || hkv == 0 || hq % hkv != 0)
    throw std::invalid_argument("cp_attention: q " + shape_of(q) + " does not fit k and v " + shape_of(k) +
                                " (same batch, tokens and head_dim; query heads a multiple of key heads)");
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
    throw std::invalid_argument("cp_attention: q, k and v have different dtypes");
  const at::Tensor& pos = global_query_positions;
  if (!pos.defined() || !(pos.dim() == 1 || (pos.dim() == 2 && pos.size(0) == b)) || pos.size(-1) != t ||
      at::isFloatingType(pos.scalar_type()))
    throw std::invalid_argument("cp_attention: global_query_positions has shape " + shape_of(pos) +
                                ", expected integer [" + std::to_string(t) + "] or [" + std::to_string(b) +
                                ", " + std::to_string(t) + "] for q " + shape_of(q));
  const at::Device device = q.device();
  const at::Tensor padding = per_token(options.key_padding_mask, "key_padding_mask", b, t, device);
  const at::Tensor segments = per_token(options.segment_ids, "segment_ids", b, t, device);
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));

  // Positions, padding and segments of every key: one small all-gather of int64 rows.
  at::Tensor qpos = (pos.dim() == 1 ? pos.unsqueeze(0) : pos).to(device, at::kLong);
  std::vector<at::Tensor> rows = {qpos};
  if (padding.defined()) rows.push_back(padding.ne(0).to(at::kLong));
  if (segments.defined()) rows.push_back(segments.to(at::kLong));
  at::Tensor keys = gather_rows(at::cat(rows), cp);
  int64_t at_row = 0;
  auto take = [&](int64_t n) {
    at::Tensor r = keys.narrow(0, at_row, n);
    at_row += n;
    return r;
  };
  at::Tensor kpos = take(qpos.size(0));
  at::Tensor kreal = padding.defined() ? take(b).ne(0) : at::Tensor();
  at::Tensor kseg = segments.defined() ? take(b) : at::Tensor();
  const at::Tensor qseg = segments.defined() ? segments.to(at::kLong) : segments;
  const at::Tensor allowed = allowed_keys(qpos, kpos, kreal, qseg, kseg);

  if (options.algorithm == CpAlgorithm::kRing) return RingAttention::apply(q, k, v, &cp, allowed, scale);

  at::Tensor k_all = k, v_all = v;
  if (cp.size() > 1) {
    variable_list kv = GatherKeysValues::apply(k, v, &cp);
    k_all = kv[0];
    v_all = kv[1];
  }
  k_all = repeat_heads(k_all, hq / hkv);
  v_all = repeat_heads(v_all, hq / hkv);
  return at::scaled_dot_product_attention(q, k_all, v_all, allowed, /*dropout_p=*/0.0, /*is_causal=*/false,
                                          scale);
}

}  // namespace mfsdp::context_parallel
