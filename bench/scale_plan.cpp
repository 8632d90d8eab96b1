// Per-rank memory of a Llama at a given scale, for every sharding strategy, from the layout code
// fully_shard itself uses (FlatLayout::build, src/fsdp/layout.h: per-unit packing and padding),
// next to the ZeRO paper's formula and PyTorch FSDP2's layout (per-parameter dim-0 shards).
// No tensors are allocated: it plans jobs far larger than this machine (Llama-3-8B on 8 ranks),
// and bench/scale_plan.sh checks it against what the simulated-rank mode of mfsdp-pretrain
// measures wherever such a run fits.
//
//   build/bench/scale_plan [--layers 32 --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8
//                           --vocab 128256 --tied 0] [--ranks 8,64,512] [--unit GiB|MiB]
//
// Units as shard_llama_root makes them: every decoder layer; the untied embedding and output
// layer each a unit of their own (a tied embedding stays in the root); the root holds the rest
// (the final norm). Parameters in registration order (src/models/llama.cpp).
// Per rank, with P = a unit's padded flat size and S = P / N (summed over units), compute dtype
// c (4 bytes fp32, 2 bf16), fp32 main weights, main grads and AdamW state (2 per element):
//   strategy            model    main (bf16 only)  grads   AdamW
//   no_shard            P c      P 4               P 4     2P 4
//   optim               P c      S 4               P 4     2S 4
//   optim_grads         P c      S 4               S 4     2S 4
//   optim_grads_params  S c      S 4               S 4     2S 4
// (fp32: the main weights are the model weights.) Transient, ZeRO-3: the largest unit's unsharded
// weights and gradients (compute dtype) plus one prefetched layer's weights; the other strategies
// keep weights unsharded and hold at most two units' unsharded gradients. bench/fsdp_memory.cpp and
// tests/dist/fully_shard_lifecycle_test.cpp (MemoryMatchesFormula) check the same table against
// the real buffers.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/layout.h"

namespace {

using Shape = std::vector<int64_t>;

struct Model {
  int64_t layers = 32, hidden = 4096, ffn = 14336, heads = 32, kv_heads = 8, vocab = 128256;
  bool tied = false;
};

struct Unit {
  std::string name;
  std::vector<Shape> shapes;
  bool layer = false;
};

std::vector<Unit> llama_units(const Model& m) {
  const int64_t head_dim = m.hidden / m.heads, kv = m.kv_heads * head_dim;
  std::vector<Unit> units;
  for (int64_t i = 0; i < m.layers; ++i) {
    units.push_back({"layer", {{m.hidden, m.hidden}, {kv, m.hidden}, {kv, m.hidden}, {m.hidden, m.hidden},
                               {m.ffn, m.hidden}, {m.ffn, m.hidden}, {m.hidden, m.ffn}, {m.hidden}, {m.hidden}},
                     true});
  }
  Unit root{"root", {}, false};
  if (m.tied) {
    root.shapes = {{m.vocab, m.hidden}, {m.hidden}};
  } else {
    units.push_back({"embed_tokens", {{m.vocab, m.hidden}}, false});
    units.push_back({"lm_head", {{m.vocab, m.hidden}}, false});
    root.shapes = {{m.hidden}};
  }
  units.push_back(root);
  return units;
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

struct Bytes {
  double model = 0, main = 0, grads = 0, optim = 0, transient = 0;
  double persistent() const { return model + main + grads + optim; }
};

Bytes mfsdp_plan(const std::vector<Unit>& units, int ranks, const std::string& strategy, bool bf16) {
  const double c = bf16 ? 2 : 4;
  double P = 0, S = 0, largest = 0, largest_layer = 0;
  for (const Unit& u : units) {
    const mfsdp::FlatLayout layout = mfsdp::FlatLayout::build(u.shapes, ranks);
    P += static_cast<double>(layout.total());
    S += static_cast<double>(layout.shard);
    largest = std::max(largest, static_cast<double>(layout.total()));
    if (u.layer) largest_layer = std::max(largest_layer, static_cast<double>(layout.total()));
  }
  const bool no_shard = strategy == "no_shard", zero3 = strategy == "optim_grads_params";
  const bool sharded_grads = strategy == "optim_grads" || zero3;
  Bytes b;
  b.model = (zero3 ? S : P) * c;
  b.main = bf16 ? (no_shard ? P : S) * 4 : 0;
  b.grads = (sharded_grads ? S : P) * 4;
  b.optim = 2 * (no_shard ? P : S) * 4;
  b.transient = zero3 ? (2 * largest + largest_layer) * c : 2 * largest * c;
  return b;
}

// PyTorch FSDP2 (fully_shard, reshard_after_forward=True, MixedPrecisionPolicy(bf16, fp32 reduce)
// for bf16): every parameter a DTensor sharded on dim 0, padded to ceil(dim0 / N) rows per rank;
// fp32 sharded parameters, gradients and AdamW state. Transient: the all-gathered compute-dtype
// parameters of the current and the prefetched block, and one block's unsharded gradients (plus
// their fp32 copy for the reduce-scatter when computing in bf16).
Bytes fsdp2_plan(const std::vector<Unit>& units, int ranks, bool bf16) {
  double local = 0, largest = 0;
  for (const Unit& u : units) {
    double unit = 0;
    for (const Shape& s : u.shapes) {
      const int64_t rows = (s[0] + ranks - 1) / ranks;
      local += static_cast<double>(rows * (numel(s) / s[0]));
      unit += static_cast<double>(numel(s));
    }
    largest = std::max(largest, unit);
  }
  const double c = bf16 ? 2 : 4;
  Bytes b;
  b.model = local * 4;  // the sharded fp32 parameters are also the optimizer's weights
  b.grads = local * 4;
  b.optim = 2 * local * 4;
  b.transient = 2 * largest * c + largest * (bf16 ? c + 4 : c);
  return b;
}

// ZeRO (Rajbhandari et al. 2020), K = 12 bytes of optimizer state per parameter in mixed
// precision (fp32 copy + Adam's two moments); in fp32, 4-byte weights and grads and K = 8.
double zero_formula(double psi, int ranks, const std::string& strategy, bool bf16) {
  const double w = bf16 ? 2 : 4, g = bf16 ? 2 : 4, k = bf16 ? 12 : 8;
  if (strategy == "no_shard") return (w + g + k) * psi;
  if (strategy == "optim") return (w + g) * psi + k * psi / ranks;
  if (strategy == "optim_grads") return w * psi + (g + k) * psi / ranks;
  return (w + g + k) * psi / ranks;
}

std::vector<int> parse_ranks(const char* text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const int n = std::atoi(item.c_str());
    if (n < 1) {
      std::fprintf(stderr, "scale_plan: --ranks: '%s' is not a positive integer\n", item.c_str());
      std::exit(2);
    }
    out.push_back(n);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Model m;
  std::vector<int> ranks{8, 64, 512};
  std::string unit = "GiB";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "scale_plan: %s needs a value\n", flag.c_str());
      return 2;
    }
    const char* v = argv[++i];
    if (flag == "--layers") m.layers = std::atoll(v);
    else if (flag == "--hidden") m.hidden = std::atoll(v);
    else if (flag == "--ffn") m.ffn = std::atoll(v);
    else if (flag == "--heads") m.heads = std::atoll(v);
    else if (flag == "--kv-heads") m.kv_heads = std::atoll(v);
    else if (flag == "--vocab") m.vocab = std::atoll(v);
    else if (flag == "--tied") m.tied = std::strcmp(v, "0") != 0;
    else if (flag == "--ranks") ranks = parse_ranks(v);
    else if (flag == "--unit" && (std::strcmp(v, "GiB") == 0 || std::strcmp(v, "MiB") == 0)) unit = v;
    else {
      std::fprintf(stderr, "scale_plan: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (m.layers < 1 || m.hidden < 1 || m.ffn < 1 || m.heads < 1 || m.kv_heads < 1 || m.vocab < 1 ||
      m.hidden % m.heads != 0 || m.heads % m.kv_heads != 0) {
    std::fprintf(stderr, "scale_plan: inconsistent model (sizes >= 1, heads | hidden, kv-heads | heads)\n");
    return 2;
  }
  const std::vector<Unit> units = llama_units(m);
  double psi = 0;
  for (const Unit& u : units)
    for (const Shape& s : u.shapes) psi += static_cast<double>(numel(s));
  const double gib = unit == "GiB" ? 1024.0 * 1024.0 * 1024.0 : 1024.0 * 1024.0;
  std::printf("# Per-rank memory plan, %s: Llama %lld layers, d=%lld, ffn %lld, %lld/%lld heads, vocab %lld, %s; "
              "%.3fB parameters; AdamW\n\n",
              unit.c_str(), static_cast<long long>(m.layers), static_cast<long long>(m.hidden), static_cast<long long>(m.ffn),
              static_cast<long long>(m.heads), static_cast<long long>(m.kv_heads), static_cast<long long>(m.vocab),
              m.tied ? "tied" : "untied", psi / 1e9);
  std::printf("| ranks | precision | strategy | model | main | grads | AdamW | persistent | ZeRO formula | "
              "transient (bound) | FSDP2 persistent | FSDP2 transient |\n");
  std::printf("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int n : ranks) {
    for (bool bf16 : {false, true}) {
      for (const char* strategy : {"no_shard", "optim", "optim_grads", "optim_grads_params"}) {
        const Bytes b = mfsdp_plan(units, n, strategy, bf16);
        const bool zero3 = std::strcmp(strategy, "optim_grads_params") == 0;
        char fsdp2[64] = "-", fsdp2_transient[64] = "-";
        if (zero3) {
          const Bytes f = fsdp2_plan(units, n, bf16);
          std::snprintf(fsdp2, sizeof fsdp2, "%.2f", f.persistent() / gib);
          std::snprintf(fsdp2_transient, sizeof fsdp2_transient, "%.2f", f.transient / gib);
        }
        std::printf("| %d | %s | %s | %.2f | %.2f | %.2f | %.2f | **%.2f** | %.2f | %.2f | %s | %s |\n", n,
                    bf16 ? "bf16" : "fp32", strategy, b.model / gib, b.main / gib, b.grads / gib, b.optim / gib,
                    b.persistent() / gib, zero_formula(psi, n, strategy, bf16) / gib, b.transient / gib, fsdp2,
                    fsdp2_transient);
      }
    }
  }
  return 0;
}
