// Muon over flat shards (include/mfsdp/optim/muon.h, docs/optimizer.md "Muon").
//
// Construction plans where every matrix lives: each rank lists the Muon pieces of its sharded
// shards (name, shape, offsets), the lists are all-gathered once, and every rank derives the same
// global order of matrices, their owners (round-robin) and the all_to_all layouts. A step then:
//  1. momentum and the (nesterov-blended) update, elementwise on each rank's own elements;
//  2. one all_to_all_single sends every piece to its matrix's owner (in ns_dtype: torch casts the
//     whole matrix to bf16 first, so casting the pieces is the same);
//  3. each owner puts its matrices together (all-gathered over the tensor-parallel group too, in
//     one collective, when they are TP slices), orthogonalises them, and writes its pieces back;
//  4. the reverse all_to_all_single returns every rank its elements of the result;
//  5. each rank decays and updates its own elements.
// Replicated shards (no_shard) skip 2 and 4: every rank holds the whole matrix. Every element that
// is not in a Muon matrix goes to an AdamW (src/optim/adamw.cpp) over the same shards whose
// segments leave the matrices out.
#include "mfsdp/optim/muon.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "optim/shard_optimizer.h"

namespace mfsdp {
namespace {

using MuonCoefficients = std::array<double, 3>;

[[noreturn]] void muon_fail(const std::string& what) { throw std::invalid_argument("Muon: " + what); }

// Megatron's coefficient sets (emerging_optimizers' muon_utils._COEFFICIENT_SETS) and its rules
// for stretching them over ns_steps; "simple" is torch.optim.Muon's set.
std::vector<MuonCoefficients> muon_coefficient_schedule(const MuonOptions& o) {
  static const std::map<std::string, std::vector<MuonCoefficients>> sets = {
      {"simple", {{3.4445, -4.7750, 2.0315}}},
      {"quintic",
       {{4.0848, -6.8946, 2.9270},
        {3.9505, -6.3029, 2.6377},
        {3.7418, -5.5913, 2.3037},
        {2.8769, -3.1427, 1.2046},
        {2.8366, -3.0525, 1.2012}}},
      {"polar_express",
       {{8.2051, -22.9019, 16.4607},
        {4.0664, -2.8612, 0.5184},
        {3.9096, -2.8234, 0.5250},
        {3.2856, -2.4153, 0.4853},
        {2.2779, -1.6198, 0.3985},
        {1.8726, -1.2307, 0.3585},
        {1.8564, -1.2132, 0.3568},
        {1.8750, -1.2500, 0.3750}}},
      {"aol",
       {{4.0098, -7.0585, 2.4635},
        {3.4585, -5.5479, 2.5959},
        {2.7573, -3.2939, 1.4254},
        {2.7215, -3.0494, 1.3169}}},
  };
  auto it = sets.find(o.coefficient_type);
  if (it == sets.end())
    muon_fail("coefficient_type '" + o.coefficient_type + "' is not one of simple, quintic, polar_express, aol");
  if (o.ns_steps < 1 || o.ns_steps >= 100)
    muon_fail("ns_steps must be in [1, 100), got " + std::to_string(o.ns_steps));
  const std::vector<MuonCoefficients>& set = it->second;
  const int n = static_cast<int>(set.size());
  std::vector<MuonCoefficients> out;
  if (o.coefficient_type == "polar_express") {
    if (o.ns_steps < n) muon_fail("polar_express needs ns_steps >= 8, got " + std::to_string(o.ns_steps));
    for (int i = 0; i < o.ns_steps; ++i) out.push_back(set[std::min(i, n - 1)]);
  } else {
    if (o.ns_steps % n != 0)
      muon_fail("coefficient_type '" + o.coefficient_type + "' needs ns_steps a multiple of " + std::to_string(n) +
                ", got " + std::to_string(o.ns_steps));
    for (int i = 0; i < o.ns_steps; ++i) out.push_back(set[i % n]);
  }
  return out;
}

void check_muon_options(const MuonOptions& o) {
  auto bad = [](const char* field, double v, const char* expected) {
    std::ostringstream msg;
    msg << "MuonOptions." << field << " must be " << expected << ", got " << v;
    muon_fail(msg.str());
  };
  if (!(o.momentum >= 0) || !std::isfinite(o.momentum)) bad("momentum", o.momentum, "finite and >= 0");
  if (!(o.eps >= 0) || !std::isfinite(o.eps)) bad("eps", o.eps, "finite and >= 0");
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay)) bad("weight_decay", o.weight_decay, "finite and >= 0");
  if (!std::isfinite(o.extra_scale_factor)) bad("extra_scale_factor", o.extra_scale_factor, "finite");
  if (o.ns_dtype != at::kBFloat16 && o.ns_dtype != at::kFloat)
    muon_fail(std::string("MuonOptions.ns_dtype must be BFloat16 or Float, got ") + c10::toString(o.ns_dtype));
  muon_coefficient_schedule(o);
  muon_update_scale(1, 1, o);  // rejects an unknown scale_mode
  if (o.tp_mode != "duplicated" && o.tp_mode != "distributed" && o.tp_mode != "blockwise")
    muon_fail("tp_mode '" + o.tp_mode + "' is not one of duplicated, distributed, blockwise");
  for (const auto& [name, dim] : o.tensor_parallel_split)
    if (dim != 0 && dim != 1)
      muon_fail("tensor_parallel_split of '" + name + "' must be 0 or 1, got " + std::to_string(dim));
}

bool muon_matrix(const ShardParam& p, const MuonOptions& o) {
  if (p.shape.size() != 2) return false;
  for (const std::string& s : o.exclude)
    if (!s.empty() && p.name.find(s) != std::string::npos) return false;
  return true;
}

// A piece of a Muon matrix on this rank.
struct LocalPiece {
  size_t shard = 0;
  int64_t shard_offset = 0, length = 0;
  int64_t buffer_offset = 0;  // in the step's send buffer (sharded), or in the matrix (replicated)
  int matrix = -1;            // replicated: index into matrices_; sharded: -1
  double scale = 1.0;         // muon_update_scale of the (whole) matrix
};

// A matrix this rank orthogonalises: one it owns (put together from received pieces) or a
// replicated one of its own shards.
struct OrthoMatrix {
  std::string name;
  int64_t rows = 0, cols = 0;  // as this rank's data-parallel group holds it (a TP slice maybe)
  int split = -1;              // tensor-parallel dim to all-gather along, -1: none
  std::vector<std::array<int64_t, 3>> parts;  // owned: {recv offset, param offset, length}
};

// One rank's sharded Muon pieces: "name\trows\tcols\tparam_offset\tlength\tsplit\n" per piece.
// The split (the holder's tensor-parallel dim, -1: none) travels with the piece: an owner may
// hold no piece of a matrix it owns (an expert of another expert-parallel rank), so only the
// holders know from their plan how it is split.
struct WirePiece {
  std::string name;
  int64_t rows, cols, param_offset, length;
  int split;
};

std::string encode_pieces(const std::vector<WirePiece>& pieces) {
  std::ostringstream s;
  for (const WirePiece& p : pieces)
    s << p.name << '\t' << p.rows << '\t' << p.cols << '\t' << p.param_offset << '\t' << p.length << '\t' << p.split
      << '\n';
  return s.str();
}

std::vector<WirePiece> decode_pieces(const std::string& text) {
  std::vector<WirePiece> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t tab = line.find('\t');
    WirePiece p;
    p.name = line.substr(0, tab);
    std::istringstream nums(line.substr(tab + 1));
    nums >> p.rows >> p.cols >> p.param_offset >> p.length >> p.split;
    out.push_back(p);
  }
  return out;
}

// Every rank's string, in rank order (two all-gathers: the lengths, then the bytes).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const int world = comm.size();
  if (world == 1) return {mine};
  const auto dev = comm.device();
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::TensorOptions().dtype(at::kLong).device(dev));
  at::Tensor lens = at::empty({world}, len.options());
  comm.all_gather(lens, len);
  const at::Tensor lens_cpu = lens.cpu();
  std::vector<int64_t> counts(lens_cpu.data_ptr<int64_t>(), lens_cpu.data_ptr<int64_t>() + world);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  at::Tensor bytes = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  std::copy(mine.begin(), mine.end(), bytes.data_ptr<uint8_t>());
  at::Tensor all = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(dev));
  AllGatherOptions opts;
  opts.counts = counts;
  comm.all_gather(all, bytes.to(dev), opts);
  const at::Tensor all_cpu = all.cpu();
  std::vector<std::string> out;
  int64_t pos = 0;
  for (int64_t c : counts) {
    out.emplace_back(reinterpret_cast<const char*>(all_cpu.data_ptr<uint8_t>()) + pos, c);
    pos += c;
  }
  return out;
}

class Muon final : public ShardOptimizer {
 public:
  Muon(std::vector<OptimizerShard> shards, std::shared_ptr<Communicator> comm, const MuonOptions& options,
       std::function<void()> after_step)
      : ShardOptimizer("Muon", std::move(shards), comm, std::move(after_step)), options_(options), comm_(comm) {
    check_muon_options(options_);
    if (options_.tensor_parallel && options_.tensor_parallel->size() > 1) tp_ = options_.tensor_parallel;
    for (const OptimizerShard& s : shards_)
      momentum_.push_back(at::zeros({s.main_weight.numel()}, s.main_weight.options()));
    plan_local_pieces();
    plan_exchange();
    check_tensor_parallel();
    make_scalar_optimizer();
  }

  std::vector<std::pair<std::string, std::vector<at::Tensor>>> state() const override {
    auto out = adamw_->state();
    out.insert(out.begin(), std::make_pair(std::string("momentum_buffer"), momentum_));
    return out;
  }

 private:
  // Muon pieces of every shard, checked; the replicated ones become matrices of their own.
  void plan_local_pieces() {
    const int rank = comm_->rank();
    for (size_t i = 0; i < shards_.size(); ++i) {
      const OptimizerShard& s = shards_[i];
      const int64_t n = s.main_weight.numel();
      if (s.params.empty() && !runs_[i].empty())
        muon_fail("OptimizerShard " + std::to_string(i) + " on rank " + std::to_string(rank) +
                  " has segments but no params: Muon needs to know which matrices its elements are "
                  "(FsdpHandle::optimizer_shards() fills OptimizerShard::params)");
      int64_t end = 0;
      for (const ShardParam& p : s.params) {
        int64_t numel = 1;
        for (int64_t d : p.shape) numel *= d;
        if (p.length <= 0 || p.shard_offset < end || p.shard_offset + p.length > n || p.param_offset < 0 ||
            p.param_offset + p.length > numel)
          muon_fail("OptimizerShard " + std::to_string(i) + " on rank " + std::to_string(rank) + ": param '" +
                    p.name + "' piece [" + std::to_string(p.shard_offset) + ", +" + std::to_string(p.length) +
                    ") at parameter offset " + std::to_string(p.param_offset) +
                    " is empty, out of range or overlaps the previous piece");
        end = p.shard_offset + p.length;
        if (!muon_matrix(p, options_)) continue;
        // The update must land on elements an optimizer may write: inside one segment run.
        bool inside = false;
        for (const SegmentRun& r : runs_[i])
          inside |= p.shard_offset >= r.offset && p.shard_offset + p.length <= r.offset + r.length;
        if (!inside)
          muon_fail("OptimizerShard " + std::to_string(i) + ": matrix '" + p.name + "' piece lies outside its segments");
        LocalPiece piece{i, p.shard_offset, p.length, 0, -1, 1.0};
        if (s.replicated) {
          if (p.param_offset != 0 || p.length != numel)
            muon_fail("replicated OptimizerShard " + std::to_string(i) + " holds only part of matrix '" + p.name + "'");
          piece.matrix = static_cast<int>(matrices_.size());
          matrices_.push_back({p.name, p.shape[0], p.shape[1], split_of(p.name), {}});
        } else {
          wire_.push_back({p.name, p.shape[0], p.shape[1], p.param_offset, p.length, split_of(p.name)});
        }
        pieces_.push_back(piece);
      }
    }
  }

  int split_of(const std::string& name) const {
    if (!tp_ || options_.tp_mode == "blockwise") return -1;
    auto it = options_.tensor_parallel_split.find(name);
    return it == options_.tensor_parallel_split.end() ? -1 : it->second;
  }

  // Every rank's sharded pieces -> the global matrices, their owners, the all_to_all layouts.
  void plan_exchange() {
    const int world = comm_->size(), rank = comm_->rank();
    std::vector<std::vector<WirePiece>> by_rank;
    for (const std::string& text : all_gather_strings(*comm_, encode_pieces(wire_)))
      by_rank.push_back(decode_pieces(text));
    struct Global {
      std::string name;
      int64_t rows, cols;
      int split;
      std::vector<std::array<int64_t, 3>> pieces;  // {rank, param offset, length}
    };
    std::vector<Global> globals;
    std::map<std::string, size_t> index;
    for (int r = 0; r < world; ++r)
      for (const WirePiece& p : by_rank[r]) {
        auto [it, fresh] = index.emplace(p.name, globals.size());
        if (fresh) globals.push_back({p.name, p.rows, p.cols, p.split, {}});
        Global& g = globals[it->second];
        if (g.rows != p.rows || g.cols != p.cols || g.split != p.split)
          muon_fail("matrix '" + p.name + "' is [" + std::to_string(g.rows) + ", " + std::to_string(g.cols) +
                    "] split along " + std::to_string(g.split) + " on one rank and [" + std::to_string(p.rows) + ", " +
                    std::to_string(p.cols) + "] split along " + std::to_string(p.split) + " on rank " +
                    std::to_string(r));
        g.pieces.push_back({r, p.param_offset, p.length});
      }
    // Each element of a sharded matrix must be held by exactly one rank of the communicator:
    // twice would mean two groups' copies (say TP ranks) mixed up in one matrix.
    for (Global& g : globals) {
      std::sort(g.pieces.begin(), g.pieces.end(), [](const auto& a, const auto& b) { return a[1] < b[1]; });
      int64_t pos = 0;
      for (const auto& p : g.pieces) {
        if (p[1] != pos)
          muon_fail("matrix '" + g.name + "': " +
                    (p[1] < pos ? "elements from " + std::to_string(p[1]) + " are held twice (again on rank " +
                                     std::to_string(p[0]) + "); the optimizer's communicator must be the group "
                                     "that shards it, with tensor-parallel slices in MuonOptions::tensor_parallel"
                               : "elements [" + std::to_string(pos) + ", " + std::to_string(p[1]) +
                                     ") are on no rank"));
        pos += p[2];
      }
      if (pos != g.rows * g.cols)
        muon_fail("matrix '" + g.name + "': elements from " + std::to_string(pos) + " are on no rank");
    }
    exchange_ = world > 1 && !globals.empty();
    // Owners round-robin in the global order; this rank's send order is (owner, matrix, offset),
    // an owner's receive order (source rank, matrix, offset): the same order seen from both ends.
    auto owner = [&](size_t k) { return static_cast<int>(k % world); };
    send_splits_.assign(world, 0);
    recv_splits_.assign(world, 0);
    std::vector<std::array<int64_t, 4>> mine;  // {owner, matrix, param offset, local piece index}
    size_t w = 0;
    for (size_t i = 0; i < pieces_.size(); ++i) {
      if (pieces_[i].matrix >= 0) continue;
      const WirePiece& p = wire_[w++];
      const size_t k = index.at(p.name);
      mine.push_back({owner(k), static_cast<int64_t>(k), p.param_offset, static_cast<int64_t>(i)});
      pieces_[i].scale = scale_of(p.name, p.rows, p.cols);
    }
    std::sort(mine.begin(), mine.end());
    int64_t pos = 0;
    for (const auto& m : mine) {
      pieces_[m[3]].buffer_offset = pos;
      pos += pieces_[m[3]].length;
      send_splits_[m[0]] += pieces_[m[3]].length;
    }
    send_total_ = pos;
    // Owned matrices, and where their pieces arrive.
    std::map<size_t, size_t> owned;  // global index -> position in matrices_
    for (size_t k = 0; k < globals.size(); ++k)
      if (owner(k) == rank) {
        owned[k] = matrices_.size();
        matrices_.push_back({globals[k].name, globals[k].rows, globals[k].cols, globals[k].split, {}});
      }
    pos = 0;
    for (int r = 0; r < world; ++r) {
      std::vector<std::array<int64_t, 3>> from;  // {matrix, param offset, length}
      for (const WirePiece& p : by_rank[r]) {
        const size_t k = index.at(p.name);
        if (owner(k) == rank) from.push_back({static_cast<int64_t>(k), p.param_offset, p.length});
      }
      std::sort(from.begin(), from.end());
      for (const auto& f : from) {
        matrices_[owned.at(f[0])].parts.push_back({pos, f[1], f[2]});
        pos += f[2];
        recv_splits_[r] += f[2];
      }
    }
    recv_total_ = pos;
    for (LocalPiece& p : pieces_)
      if (p.matrix >= 0) p.scale = scale_of(matrices_[p.matrix].name, matrices_[p.matrix].rows, matrices_[p.matrix].cols);
  }

  // The update scale of a matrix: of the whole matrix when its TP slices are put together.
  double scale_of(const std::string& name, int64_t rows, int64_t cols) const {
    const int split = split_of(name);
    if (split == 0) rows *= tp_->size();
    if (split == 1) cols *= tp_->size();
    return muon_update_scale(rows, cols, options_);
  }

  // The TP all-gather is collective over the TP group: every rank of it must orthogonalise the
  // same TP-split matrices in the same order (same names and slice shapes). Checked once here,
  // so that a mismatch fails with a message instead of mixing matrices later.
  void check_tensor_parallel() {
    if (!tp_) return;
    std::ostringstream mine;
    for (const OrthoMatrix& m : matrices_)
      if (m.split >= 0) mine << m.name << ' ' << m.rows << ' ' << m.cols << ' ' << m.split << '\n';
    const std::vector<std::string> all = all_gather_strings(*tp_, mine.str());
    for (size_t r = 0; r < all.size(); ++r)
      if (all[r] != all[0])
        muon_fail("tensor-parallel ranks 0 and " + std::to_string(r) +
                  " orthogonalise different TP-split matrices (the TP group must join ranks with the same "
                  "data-parallel rank and layout); rank 0:\n" + all[0] + "rank " + std::to_string(r) + ":\n" + all[r]);
  }

  // AdamW over the same shards, its segments the elements outside every Muon matrix.
  void make_scalar_optimizer() {
    std::vector<OptimizerShard> rest = shards_;
    for (size_t i = 0; i < rest.size(); ++i) {
      std::vector<ElementRange> muon;
      for (const LocalPiece& p : pieces_)
        if (p.shard == i) muon.push_back({p.shard_offset, p.length});
      std::sort(muon.begin(), muon.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
      std::vector<ShardSegment> kept;
      for (const ShardSegment& seg : rest[i].segments) {
        int64_t pos = seg.offset;
        const int64_t end = seg.offset + seg.length;
        for (const ElementRange& m : muon) {
          const int64_t lo = std::max(pos, m.offset), hi = std::min(end, m.offset + m.length);
          if (hi <= lo) continue;
          if (lo > pos) kept.push_back({pos, lo - pos, seg.weight_decay});
          pos = hi;
        }
        if (end > pos) kept.push_back({pos, end - pos, seg.weight_decay});
      }
      rest[i].segments = std::move(kept);
      rest[i].params.clear();
    }
    adamw_ = make_adamw(std::move(rest), comm_, options_.adamw);
  }

  void update(double lr, int64_t step) override {
    adamw_->set_steps(step - 1);
    adamw_->step(lr);

    // 1. Momentum (torch: buf.lerp_(g, 1 - m)) and the update to orthogonalise
    // (nesterov: g.lerp(buf, m)), cast to ns_dtype into the send buffer or the replicated matrix.
    const at::TensorOptions wire = at::TensorOptions().dtype(options_.ns_dtype).device(comm_->device());
    at::Tensor send = at::empty({send_total_}, wire);
    std::vector<at::Tensor> full(matrices_.size());
    for (size_t k = 0; k < matrices_.size(); ++k)
      if (matrices_[k].parts.empty()) full[k] = at::empty({matrices_[k].rows * matrices_[k].cols}, wire);
    for (const LocalPiece& p : pieces_) {
      at::Tensor g = shards_[p.shard].main_grad.narrow(0, p.shard_offset, p.length);
      at::Tensor buf = momentum_[p.shard].narrow(0, p.shard_offset, p.length);
      buf.lerp_(g, 1 - options_.momentum);
      at::Tensor u = options_.nesterov ? g.lerp(buf, options_.momentum) : buf;
      (p.matrix >= 0 ? full[p.matrix] : send.narrow(0, p.buffer_offset, p.length)).copy_(u);
    }
    // 2. Every piece to its owner.
    at::Tensor recv = send;
    if (exchange_) {
      recv = at::empty({recv_total_}, wire);
      comm_->all_to_all_single(recv, send, {send_splits_, recv_splits_});
    }
    // 3. The owned matrices put together, orthogonalised, written back over their pieces.
    for (size_t k = 0; k < matrices_.size(); ++k) {
      if (matrices_[k].parts.empty()) continue;
      full[k] = at::empty({matrices_[k].rows * matrices_[k].cols}, wire);
      for (const auto& [pos, offset, length] : matrices_[k].parts)
        full[k].narrow(0, offset, length).copy_(recv.narrow(0, pos, length));
    }
    std::vector<at::Tensor> ortho = orthogonalize_all(full);
    for (size_t k = 0; k < matrices_.size(); ++k)
      for (const auto& [pos, offset, length] : matrices_[k].parts)
        recv.narrow(0, pos, length).copy_(ortho[k].narrow(0, offset, length));
    // 4. Every rank's elements of the results back.
    if (exchange_) comm_->all_to_all_single(send, recv, {recv_splits_, send_splits_});
    // 5. torch: p.mul_(1 - lr * wd); p.add_(O, alpha=-lr * scale), O still in ns_dtype.
    for (const LocalPiece& p : pieces_) {
      at::Tensor w = shards_[p.shard].main_weight.narrow(0, p.shard_offset, p.length);
      if (options_.weight_decay != 0) w.mul_(1 - lr * options_.weight_decay);
      w.add_(p.matrix >= 0 ? ortho[p.matrix] : send.narrow(0, p.buffer_offset, p.length), -lr * p.scale);
    }
  }

  // Newton-Schulz of every matrix (flat, [rows * cols]); results flat, of this rank's slice. The
  // TP-split ones are first all-gathered over the TP group, all in one collective.
  std::vector<at::Tensor> orthogonalize_all(const std::vector<at::Tensor>& full) {
    std::vector<at::Tensor> out(full.size());
    std::vector<size_t> split;
    for (size_t k = 0; k < full.size(); ++k) {
      if (matrices_[k].split >= 0) {
        split.push_back(k);
        continue;
      }
      out[k] = muon_orthogonalize(full[k].view({matrices_[k].rows, matrices_[k].cols}), options_).reshape({-1});
    }
    if (split.empty()) return out;
    std::vector<at::Tensor> slices;
    for (size_t k : split) slices.push_back(full[k]);
    at::Tensor local = at::cat(slices);
    const int tp = tp_->size(), tp_rank = tp_->rank();
    at::Tensor gathered = at::empty({local.numel() * tp}, local.options());
    tp_->all_gather(gathered, local);
    int64_t pos = 0;
    for (size_t k : split) {
      const OrthoMatrix& m = matrices_[k];
      std::vector<at::Tensor> parts;
      for (int t = 0; t < tp; ++t) parts.push_back(gathered.narrow(0, t * local.numel() + pos, m.rows * m.cols).view({m.rows, m.cols}));
      pos += m.rows * m.cols;
      // Megatron's duplicated mode: the whole matrix orthogonalised, this rank's chunk kept.
      at::Tensor whole = muon_orthogonalize(at::cat(parts, m.split), options_);
      out[k] = whole.narrow(m.split, tp_rank * (m.split == 0 ? m.rows : m.cols), m.split == 0 ? m.rows : m.cols)
                   .reshape({-1});
    }
    return out;
  }

  const MuonOptions options_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Communicator> tp_;  // null: no tensor parallelism
  std::vector<at::Tensor> momentum_;  // per shard: [n], like main_weight
  std::vector<LocalPiece> pieces_;    // Muon pieces of this rank's shards, in shard order
  std::vector<WirePiece> wire_;       // the sharded ones among them, in the same order
  std::vector<OrthoMatrix> matrices_;  // replicated ones first, then the owned ones
  bool exchange_ = false;             // any sharded matrix on any rank (and more than one rank)
  std::vector<int64_t> send_splits_, recv_splits_;
  int64_t send_total_ = 0, recv_total_ = 0;
  std::unique_ptr<DistributedOptimizer> adamw_;
};

}  // namespace

double muon_update_scale(int64_t rows, int64_t cols, const MuonOptions& o) {
  const double a = static_cast<double>(rows), b = static_cast<double>(cols);
  const std::string& m = o.scale_mode;
  double scale;
  if (m == "original" || m == "shape_scaling") scale = std::sqrt(std::max(1.0, a / b));
  else if (m == "match_rms_adamw") scale = 0.2 * std::sqrt(std::max(a, b));
  else if (m == "spectral") scale = std::sqrt(std::max(a, b));
  else if (m == "spectral_unclamped" || m == "unit_rms_norm") scale = std::sqrt(a / b);
  else
    muon_fail("scale_mode '" + m + "' is not one of original, shape_scaling, match_rms_adamw, spectral, "
              "spectral_unclamped, unit_rms_norm");
  return scale * o.extra_scale_factor;
}

at::Tensor muon_orthogonalize(const at::Tensor& matrix, const MuonOptions& options) {
  // torch/optim/_muon.py _zeropower_via_newtonschulz, op for op (with Megatron's per-step
  // coefficient tables): cast, iterate on the wide orientation, normalise by the Frobenius norm.
  if (matrix.dim() != 2) muon_fail("muon_orthogonalize needs a matrix, got shape " + c10::str(matrix.sizes()));
  const std::vector<MuonCoefficients> coefficients = muon_coefficient_schedule(options);
  at::Tensor x = matrix.to(options.ns_dtype, /*non_blocking=*/false, /*copy=*/true);
  const bool tall = matrix.size(0) > matrix.size(1);
  if (tall) x = x.t();
  x.div_(at::linalg_vector_norm(x, 2).clamp_min(options.eps));
  for (const auto& [a, b, c] : coefficients) {
    at::Tensor gram = at::mm(x, x.t());
    at::Tensor poly = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    x = at::addmm(x, poly, x, /*beta=*/a);
  }
  return tall ? x.t() : x;
}

std::unique_ptr<DistributedOptimizer> make_muon(std::vector<OptimizerShard> shards,
                                                std::shared_ptr<Communicator> comm, const MuonOptions& options,
                                                std::function<void()> after_step) {
  if (!comm) muon_fail("make_muon needs a communicator");
  return std::make_unique<Muon>(std::move(shards), std::move(comm), options, std::move(after_step));
}

}  // namespace mfsdp
