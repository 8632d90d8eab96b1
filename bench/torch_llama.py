#!/usr/bin/env python3
"""PyTorch peers of mfsdp-pretrain (DDP, FSDP2, Megatron-FSDP): the same Llama, optimizer and
batch layout, one process per rank.

    .venv/bin/python bench/torch_llama.py --impl fsdp2 --nproc 2 --threads 1 \
        --num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 \
        --num-query-groups 8 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 \
        --vocab-size 1024 --train-iters 30 --warmup-iters 5

    python3 bench/torch_llama.py --device cuda --bf16 --nproc 1 ...   # GPUs (bench/gpu_step_time.sh)
    .venv/bin/python bench/torch_llama.py --check-hf --num-layers 2 ...  # the model is HF's Llama
    .venv/bin/python bench/torch_llama.py --impl fsdp2 --num-experts 8 --moe-router-topk 2 \
        --moe-ffn-hidden-size 256 --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 2 ...  # MoE
    .venv/bin/python bench/torch_llama.py --impl fsdp2 --num-experts 4 ... --expert-model-parallel-size 2 \
        --check-ep --fixed-batch --lr 1e-3 --train-iters 6        # EP 2 trains as EP 1

--impl ddp (default): DistributedDataParallel; no_sync() on all micro-batches but the last.
--bf16: the forward and the loss under torch.autocast(bfloat16) -- fp32 parameters, gradients,
reduction and AdamW state, bf16 matmuls.
--impl fsdp2: torch.distributed.fsdp.fully_shard on every decoder layer, then on the root, with
FSDP2's defaults (reshard_after_forward=True, its own implicit prefetching); gradients are
reduce-scattered after every micro-batch (FSDP2's default; mfsdp's trainers, like Megatron's
training loop, hold unsharded gradients until the last micro-batch of a step). --bf16 is
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=--reduce-dtype): fp32 sharded parameters
(the main weights), fp32 gradients and AdamW state, bf16 compute; no autocast.
--impl megatron_fsdp: the megatron-fsdp package (0.6.1) as its README uses it: fully_shard_model
with every DecoderLayer an FSDP unit, zero_dp_strategy "optim_grads_params" (ZeRO-3), then
fully_shard_optimizer; gradients reduce-scattered after every micro-batch. --bf16: bf16 model
weights and compute, fp32 main weights and main gradients (its MixedPrecisionPolicy),
--reduce-dtype on the wire. CUDA only: on CPU, MegatronFSDP.__init__ calls
torch.cuda.current_device() (megatron_fsdp.py:234, "Found no NVIDIA driver"), and past its CUDA
streams the gradient reduce-scatter uses ReduceOp.PREMUL_SUM, which gloo refuses.
In every case --bf16 leaves what HF keeps in fp32 in fp32: the RMSNorm arithmetic, the softmax
of --attention-backend unfused and the cross entropy of the logits.

--num-experts E (mixture of experts, the peer of mfsdp-pretrain --num-experts; bench/
moe_step_time.sh): every decoder layer's MLP is a TorchTitan-style MoE computing what mfsdp's
MoeBlock computes (src/models/moe/, docs/moe.md): a router Linear(H, E, bias=False); softmax of
its logits in fp32 over all experts, top --moe-router-topk, renormalised to sum to one; dropless;
the (token, expert) pairs sorted by expert, then token; SwiGLU experts of width
--moe-ffn-hidden-size held stacked ([E_local, ...], TorchTitan's GroupedExperts); each output row
times its routing weight, summed back per token. The Switch load-balancing loss
E / (k T^2) sum_e (sum_t p_te) tokens_e over each rank's own T tokens, per layer, times
--moe-aux-loss-coeff, is added to the loss scaled like the lm loss (1 / micro-batches: mfsdp's
aux_loss_scale); the logged loss is the lm loss alone, as mfsdp logs it.
--expert-model-parallel-size EP (--impl fsdp2; ddp runs EP 1): rank r holds experts
[(r % EP) E / EP, ...) of every layer (every rank draws every expert's initial weights, then keeps
its own: the same model at any EP); the per-expert row counts go to the experts' ranks by
all_to_all_single, then the rows by torch.distributed._functional_collectives'
all_to_all_single_autograd (works on gloo; its backward returns the gradients the way the rows
came), and back after the experts. Sharding as TorchTitan's apply_fsdp (wrap_fsdp2_moe): under
EP > 1 a 2-D DeviceMesh ["edp", "ep"] of [world / EP, EP], each layer's experts fully_shard over
"edp" with set_gradient_divide_factor(world), so that expert gradients are, like the dense ones,
the mean over all data-parallel ranks; at EP 1 the experts are part of their layer's unit; the
layers and the root over a 1-D mesh of every rank. No z-loss (mfsdp computes it for its log
only unless --moe-z-loss-coeff), no capacity factor, no --moe-router-pre-softmax, no shared
expert gate.

DeepSeek-V3-style model (the peer of mfsdp-pretrain with the same Megatron flags; bench/
moe_step_time.sh MODEL=deepseek):
--multi-latent-attention with --q-lora-rank (0: a plain q_proj), --kv-lora-rank, --qk-head-dim
(the no-RoPE part), --qk-pos-emb-head-dim (the RoPE part), --v-head-dim: every layer's attention
is transformers' DeepseekV3Attention (MLAttention; mfsdp's MlaAttention): q_a_proj ->
RMSNorm(eps 1e-6) -> q_b_proj, kv_a_proj_with_mqa -> latent RMSNorm(eps 1e-6) -> kv_b_proj, RoPE
(plain, --rotary-base; no YaRN: --rotary-scaling-factor other than 1 is refused) on the rotary
parts only with the pairs interleaved, one rotary key per token shared by every head, causal
attention at scale (qk-head-dim + qk-pos-emb-head-dim)^-0.5, o_proj. Checked against
DeepseekV3Attention holding the same weights (an ad-hoc check, fp32, transformers 5.23): max
|output diff| 1.5e-7 with --q-lora-rank, 1.2e-7 without.
--moe-router-score-function sigmoid, --moe-router-enable-expert-bias (--moe-router-bias-update-
rate, default 1e-3), --moe-router-num-groups / --moe-router-group-topk,
--moe-router-topk-scaling-factor: DeepSeek-V3's routing as mfsdp's route() (MoE.route): sigmoid
scores in fp32, the top-k chosen by scores + an fp32 expert-bias buffer (no gradient, whole on
every rank, not sharded by FSDP2) and weighted by the scores alone, renormalised to sum to one
when k > 1 (norm_topk_prob), times the scaling factor; groups: each group of E / G consecutive
experts scored by the sum of its two best choice scores, the top-k chosen within the best
group-topk groups. The bias moves once per step, after the backward and before clipping and the
optimizer step (Megatron's finalize_model_grads): every MoE layer's routed pairs per expert, summed
over the step's micro-batches and all-reduced over every rank (one all-reduce), bias += rate x
sign(mean - tokens_e). The balancing loss with sigmoid scores uses the scores normalised to sum
to one per token, and with the bias or groups counts each token's plain top-k of them (Megatron's
and mfsdp's choice; the loss still trains the router through the scores).
--moe-shared-expert-intermediate-size N: an ungated SwiGLU MLP of width N ("shared_experts",
DeepSeek-V3's) over every token, added to the routed output; a dense parameter of its layer's FSDP
unit, like the router. --moe-layer-freq: an int N (every N-th layer from layer 0 an MoE layer; 1,
the default: all) or Megatron's Python list expression, "[0,1]", "([0]*1+[1]*3)" (1: MoE); a dense
layer has the plain SwiGLU MLP of --ffn-hidden-size and no experts (its FSDP2 unit is the whole
layer at any EP).
--moe-expert-impl: grouped_mm (default) runs each projection of all local experts as one
torch._grouped_mm (it runs on CPU fp32 in torch 2.15, bit-identical to the loop), loop runs one
GEMM per expert; grouped_mm measured faster on CPU (2-vCPU VM, 1 thread per rank, the default
shape of bench/moe_step_time.sh). Forward + backward of one layer's 8 experts over 1024 rows:
17.0 ms grouped_mm, 18.1 ms loop over unbound weights, 31 ms loop indexing w[e] (TorchTitan's
_run_experts_for_loop: each expert's backward zero-fills a gradient of the whole stack). Whole
FSDP2 iterations, medians of 3 interleaved rounds x 9 timed iterations, two sessions on a shared,
noisy machine: EP 2 664 / 682 ms grouped_mm vs 1046 / 848 ms loop; EP 1 720 / 1264 ms vs
1270 / 1307 ms.
--check-ep trains EP 1 and EP --expert-model-parallel-size from the same initial weights and
tokens and compares every step's lm loss and gradient norm (the moe_step_time.sh shape, 2 ranks,
EP 2: losses within 4.8e-7 and norms within 1.2e-7 over 12 steps; 4 ranks of a smaller model,
EP 2 x EDP 2 and EP 4: within 6e-8); the gradient norm, unlike the AdamW-normalised loss,
catches a wrong expert-gradient scale (halved expert gradients, a 2-layer d64 model: 2e-3 at
step 1).

--adamw-impl auto is fused=True on CPU for both DDP and FSDP2: optimizer.step() alone at the
default bench shape (4 layers x d256, vocabulary 1024, 2 ranks x 1 thread, gloo, median of 40
steps, the 2-vCPU VM): DDP 5.3 ms fused, 14.9 ms foreach, 9.8 ms for_loop; FSDP2 (DTensor
shards) 3.0 ms fused, 9.6 ms foreach, 12.3 ms for_loop. Whole iterations (global batch 16, two
runs of 10 timed iterations each) agree within their noise: DDP 424 ms fused, 443 ms foreach,
454 ms for_loop; FSDP2 587 / 628 / 602 ms. On GPUs auto leaves torch's default (foreach), which
was not measured against fused.

Spawns --nproc processes itself (torch.multiprocessing, rendezvous over tcp://127.0.0.1:PORT; no
torchrun), each with torch.set_num_threads(--threads), trains on uniform random tokens and prints
one JSON line at the end (rank 0), with these keys:

    impl             "torch_ddp" | "torch_fsdp2" | "torch_megatron_fsdp"
    nproc, threads, device, bf16, precision (in words), adamw (AdamW's kernel arguments), torch
    iter_time_s      median of the timed iterations (after --warmup-iters); iter_times_s: all of them
    timed_iters      their count
    tokens_per_sec   global batch x seq / iter_time_s
    tflops_per_rank  Megatron's model FLOPs per iteration (bench/llama_flops.py, as mfsdp's
                     metrics) / iter_time_s / nproc / 1e12
    peak_rss_mib     [every rank's getrusage ru_maxrss, MiB]
    peak_gpu_mib     [every rank's torch.cuda.max_memory_allocated, MiB] on cuda, else null
    memory_mib       rank 0's own bytes after the last step, MiB: {"params", "grads", "optimizer"}
                     (DTensors: the local shard; Megatron-FSDP: its weight buffers, compute and
                     main, and main-gradient buffer)
    first_loss, final_loss, config (the model and batch settings)
    with --num-experts also: losses (every step's lm loss), balance_losses (every step's
    load-balancing loss before its coefficient, averaged over MoE layers, micro-batches and
    ranks, as mfsdp's load_balancing_loss), grad_norms (before clipping), moe (the MoE settings,
    moe_layers the 0/1 per layer); the tflops count the active MLP width, top-k x
    --moe-ffn-hidden-size plus the shared expert in an MoE layer, --ffn-hidden-size in a dense
    one, as mfsdp's metrics (MLA as mfsdp counts it: as Llama attention of hidden / heads
    channels per head); config also has the MLA settings with --multi-latent-attention

--device cpu (the default): gloo, CPU tensors. --device cuda: rank r runs on cuda:r (one process
per GPU, --nproc <= GPUs), nccl; the weights are initialised on the GPU, the tokens drawn on the
CPU and copied over.

What it mirrors from mfsdp (src/models/*.cpp, src/train/trainer.cpp):
  - model: embedding -> N x [RMSNorm -> GQA attention with HF RoPE (rotate_half, theta) and
    causal scaled_dot_product_attention (--attention-backend auto, mfsdp's default) or the
    explicit matmul / masked_fill / softmax(fp32) / matmul path (unfused) -> residual -> RMSNorm ->
    SwiGLU MLP -> residual] -> RMSNorm -> lm_head (tied to the embedding unless --untie); no
    biases; RoPE tables computed once per forward; RMSNorm normalises in fp32 as HF does.
  - init: normal(0, --init-method-std) for projections and the embedding, ones for norms.
  - vocabulary padded to a multiple of --make-vocab-size-divisible-by (Megatron).
  - batches: micro-batches per step = global / (micro x ranks); each micro-batch loss is mean
    token cross entropy (fp32) / micro-batches; gradients are averaged over ranks (Megatron's
    1/dp).
  - step: gradient norm clipping to --clip-grad (torch's clip_grad_norm_; Megatron-FSDP: over
    the local shards, clip_disjoint_shards_), AdamW (torch.optim.AdamW) with weight decay on >= 2-D
    parameters only, linear LR decay to --min-lr.
  - timing: from the start of an iteration to after the optimizer step, zero_grad and the
    all-reduce of the logged loss (mfsdp reduces the loss every --log-interval 1 iteration); on
    a GPU the clock stops after torch.cuda.synchronize().
"""

import argparse
import collections
import contextlib
import json
import math
import os
import resource
import socket
import statistics
import sys
import time

try:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.multiprocessing as mp
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError as e:  # pragma: no cover - reported to the caller
    sys.stderr.write(
        "torch_llama.py: PyTorch is not importable by %s (%s).\n"
        "Install Debian's build with: sudo apt-get install python3-torch\n" % (sys.executable, e))
    sys.exit(3)


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_flops import megatron_flops_per_iteration  # noqa: E402

# ---- model ----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_tables(t, head_dim, theta, device):
    # As transformers (and src/models/rope.cpp): 1 / theta^(arange(0, d, 2) / d), fp32.
    positions = torch.arange(t, dtype=torch.long, device=device)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.long, device=device).to(torch.float32) / head_dim
    inv_freq = torch.reciprocal(torch.pow(theta, exponent))
    freqs = positions.to(torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    b, nkv, s, d = x.shape
    return x.unsqueeze(2).expand(b, nkv, n_rep, s, d).reshape(b, nkv * n_rep, s, d)


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, backend):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.backend = backend
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k = repeat_kv(k, self.heads // self.kv_heads)
        v = repeat_kv(v, self.heads // self.kv_heads)
        if self.backend == "auto":  # mfsdp's default: the device's fused kernels
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # explicit causal attention, as src/models/llama/attention.cpp --attention-backend unfused
            scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(self.head_dim))
            s = k.shape[2]
            future = torch.arange(s, device=x.device).unsqueeze(0) > torch.arange(t, device=x.device).unsqueeze(1)
            scores = scores.masked_fill(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(probs, v)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out)


def apply_rotary_interleaved(x, cos, sin):
    # transformers' apply_rotary_pos_emb_interleave (mfsdp's apply_rotary_interleaved): each pair
    # (x0, x1), (x2, x3), ... rotated by its angle (the first half of the cat(freqs, freqs)
    # tables), the rotated evens then the rotated odds.
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3) as transformers' DeepseekV3Attention and
    mfsdp's MlaAttention (src/models/llama/mla_attention.cpp), with their parameter names: the
    queries from q_proj (--q-lora-rank 0) or q_a_proj -> RMSNorm(eps 1e-6) -> q_b_proj; keys and
    values from kv_a_proj_with_mqa's latent of --kv-lora-rank features (RMSNorm, eps 1e-6) through
    kv_b_proj, each head's key [no-RoPE --qk-head-dim | RoPE --qk-pos-emb-head-dim], the rotary
    part of the key one per token, shared by every head; RoPE (plain, theta --rotary-base) on the
    rotary parts only, pairs interleaved (rope_interleave); causal attention with scale
    (nope + rope)^-0.5, values --v-head-dim wide; o_proj. No biases (attention_bias false)."""

    def __init__(self, a):
        super().__init__()
        hidden, heads = a.hidden_size, a.num_attention_heads
        self.heads, self.nope, self.rope = heads, a.qk_head_dim, a.qk_pos_emb_head_dim
        self.v_dim, self.kv_rank, self.backend = a.v_head_dim, a.kv_lora_rank, a.attention_backend
        qk = self.nope + self.rope
        self.q_lora = a.q_lora_rank > 0
        if not self.q_lora:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, a.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(a.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)
        self.scale = qk ** -0.5

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        heads, nope, rope = self.heads, self.nope, self.rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(b, t, heads, nope + rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_rank, rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rot = k_rot.view(b, 1, t, rope)
        q_rot = apply_rotary_interleaved(q_rot, cos, sin)
        k_rot = apply_rotary_interleaved(k_rot, cos, sin)
        kv = self.kv_b_proj(latent).view(b, t, heads, nope + self.v_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(b, heads, t, rope)), dim=-1)
        q = torch.cat((q_pass, q_rot), dim=-1)
        if self.backend == "auto":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # explicit causal attention, the softmax in fp32 (transformers' eager attention)
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
            future = torch.arange(t, device=x.device).unsqueeze(0) > torch.arange(t, device=x.device).unsqueeze(1)
            scores = scores.masked_fill(future, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, heads * self.v_dim))


class MLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    """TorchTitan's GroupedExperts (torchtitan/models/moe/moe.py): the SwiGLU experts' weights
    stacked, w1 (gate) [E, I, H], w2 (down) [E, H, I], w3 (up) [E, I, H]. Built with every expert
    (the same initial weights on every rank whatever the expert-parallel size); keep_local()
    narrows them to this rank's [first, first + count) before sharding. forward(x, counts): x
    [n, H] sorted by local expert, counts (a list) rows per local expert -> each row through its
    expert. --moe-expert-impl grouped_mm: torch._grouped_mm over the stacked weights (what
    TorchTitan runs); loop: one GEMM per expert over its rows (the weights unbound, not indexed:
    indexing gives each expert's backward a zero-filled gradient of the whole stack)."""

    def __init__(self, hidden, ffn, experts, impl):
        super().__init__()
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, hidden))

    def keep_local(self, first, count):
        for name in ("w1", "w2", "w3"):
            setattr(self, name, nn.Parameter(getattr(self, name).detach()[first:first + count].clone()))

    def forward(self, x, counts):
        if self.impl == "grouped_mm":
            offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets)
        out = []
        for xe, w1, w2, w3 in zip(torch.split(x, counts), self.w1.unbind(0), self.w2.unbind(0), self.w3.unbind(0)):
            out.append(F.linear(F.silu(F.linear(xe, w1)) * F.linear(xe, w3), w2))
        return torch.cat(out)


def group_limited_topk(choice, k, n_group, topk_group):
    """The top-k of `choice` [T, E] among the experts of each row's `topk_group` best groups of
    E / n_group consecutive experts, a group scored by the sum of its two highest choices
    (transformers' DeepseekV3TopkRouter, mfsdp's group_limited_topk in src/models/moe/router.cpp).
    Indices [T, k]."""
    tokens, experts = choice.shape
    per_group = experts // n_group
    grouped = choice.reshape(tokens, n_group, per_group)
    group_scores = torch.topk(grouped, min(2, per_group), dim=-1).values.sum(-1)  # [T, G]
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    kept = torch.zeros(tokens, n_group, dtype=torch.bool, device=choice.device).scatter(1, best, True)
    masked = choice.masked_fill(~kept.unsqueeze(-1).expand(tokens, n_group, per_group).reshape(tokens, experts),
                                float("-inf"))
    return torch.topk(masked, k, dim=-1).indices


class MoE(nn.Module):
    """The MoE MLP, as mfsdp's MoeBlock (src/models/moe/) computes it, in TorchTitan's pieces:
    router Linear(H, E, bias=False); scores = softmax(logits) in fp32 over every expert, top-k,
    renormalised to sum to one; dropless. The (token, expert) pairs sorted by expert, then token;
    each row through its expert (GroupedExperts), times its weight, summed back per token. With
    expert parallelism (ep_group set, size EP) the rows go to their experts' ranks: the per-expert
    counts first (all_to_all_single), then the rows (the functional collectives'
    all_to_all_single_autograd: its backward sends the gradients back the way the rows came),
    reordered from (source rank, expert) to (expert, source rank) for the experts, and back.
    self.balance: this forward's Switch load-balancing loss before its coefficient,
    E / (k T^2) sum_e (sum_t p_te) tokens_e over this rank's T tokens (mfsdp's
    load_balancing_loss, Megatron's switch_load_balancing_loss_func).
    DeepSeek-V3's routing (route(), as mfsdp's route() in src/models/moe/router.cpp):
    --moe-router-score-function sigmoid: scores sigmoid(logits) in fp32, the top-k weights
    renormalised to sum to one when k > 1 (norm_topk_prob); --moe-router-enable-expert-bias: the
    top-k chosen by scores + expert_bias (an fp32 buffer, no gradient), weighted by the scores
    alone, the bias moved once per step by update_expert_biases(); --moe-router-num-groups G > 1:
    group-limited top-k (group_limited_topk; softmax routing then chooses by the logits, as
    Megatron-Core and mfsdp do when renormalising); the weights times
    --moe-router-topk-scaling-factor. With sigmoid scores the balancing loss's p_te are the
    scores normalised to sum to one per token (Megatron's and mfsdp's); with the bias or groups its
    tokens_e count each token's plain top-k of those scores, not the experts it was routed to
    (Megatron's compute_routing_scores_for_aux_loss). --moe-shared-expert-intermediate-size: an
    ungated SwiGLU MLP over every token ("shared_experts", DeepSeek-V3's), added to the output."""

    def __init__(self, hidden, a):
        super().__init__()
        self.num_experts, self.top_k = a.num_experts, a.moe_router_topk
        self.score = a.moe_router_score_function
        self.n_group, self.topk_group = max(1, a.moe_router_num_groups), a.moe_router_group_topk
        self.scaling = a.moe_router_topk_scaling_factor or 1.0  # 0: unset (Megatron's None)
        self.router = nn.Linear(hidden, a.num_experts, bias=False)
        self.experts = GroupedExperts(hidden, a.moe_ffn_hidden_size, a.num_experts, a.moe_expert_impl)
        self.shared_experts = (MLP(hidden, a.moe_shared_expert_intermediate_size)
                               if a.moe_shared_expert_intermediate_size else None)
        if a.moe_router_enable_expert_bias:
            # fp32 whatever the compute dtype (FSDP2's MixedPrecisionPolicy casts parameters only),
            # whole on every rank; Megatron's router.expert_bias, HF's e_score_correction_bias.
            self.register_buffer("expert_bias", torch.zeros(a.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.tokens_per_expert = None  # routed pairs per expert since the last bias update
        self.ep_group = None  # set by wrap() under expert parallelism
        self.balance = None

    def route(self, logits):
        """DeepSeek-style routing (sigmoid scores, the expert bias, groups): (top-k weights [T, k],
        expert indices [T, k], the scores the balancing loss uses [T, E], the experts it counts
        [T, k] or None for the routed ones)."""
        k = self.top_k
        if self.score == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            choice = logits.detach().to(torch.float32)  # grouped only: softmax without groups is forward's
        else:
            scores = torch.sigmoid(logits.to(torch.float32))
            choice = scores.detach()
            if self.expert_bias is not None:
                choice = choice + self.expert_bias
        if self.n_group > 1:
            top_index = group_limited_topk(choice, k, self.n_group, self.topk_group)
        else:
            top_index = torch.topk(choice, k, dim=-1).indices
        top_values = scores.gather(1, top_index)
        if self.score == "softmax":
            top_values = top_values / top_values.sum(-1, keepdim=True)
        else:
            if k > 1:
                top_values = top_values / (top_values.sum(-1, keepdim=True) + 1e-20)
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)  # what the balancing loss balances
        counted = None
        if self.expert_bias is not None or self.n_group > 1:
            counted = torch.topk(scores.detach(), k, dim=-1).indices
        return top_values, top_index, scores, counted

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n, experts, k = tokens.shape[0], self.num_experts, self.top_k
        counted = None
        if self.score == "softmax" and self.n_group == 1:
            scores = torch.softmax(self.router(tokens), dim=-1, dtype=torch.float32)
            top_values, top_index = torch.topk(scores, k, dim=-1)
            top_values = top_values / top_values.sum(-1, keepdim=True)
        else:
            top_values, top_index, scores, counted = self.route(self.router(tokens))
        if self.scaling != 1.0:
            top_values = top_values * self.scaling
        flat = top_index.reshape(-1)
        counts = torch.bincount(flat, minlength=experts)
        balanced = counts if counted is None else torch.bincount(counted.reshape(-1), minlength=experts)
        self.balance = (scores.sum(0) * balanced.to(torch.float32)).sum() * (experts / (k * n * n))
        if self.expert_bias is not None:
            with torch.no_grad():
                self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        order = torch.argsort(flat, stable=True)  # by expert, then token
        token_of = order // k
        sorted_rows = tokens.index_select(0, token_of)
        weight = top_values.reshape(-1).index_select(0, order).to(tokens.dtype).unsqueeze(-1)
        if self.ep_group is None:
            out = self.experts(sorted_rows, counts.tolist())
        else:
            out = self.dispatch(sorted_rows, counts)
        y = torch.zeros_like(tokens).index_add(0, token_of, out * weight).view(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def dispatch(self, sorted_rows, counts):
        ep = dist.get_world_size(self.ep_group)
        local = self.num_experts // ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)  # [source rank, local expert]
        send = counts.view(ep, local).sum(1).tolist()
        recv_counts = received.view(ep, local)
        recv = recv_counts.sum(1).tolist()
        arrived = funcol.all_to_all_single_autograd(sorted_rows, recv, send, self.ep_group)
        # Arrived rows are grouped by (source rank, local expert); the experts want (local
        # expert, source rank).
        segment = torch.repeat_interleave(torch.arange(ep * local, device=counts.device), recv_counts.reshape(-1))
        by_expert = torch.argsort((segment % local) * ep + segment // local, stable=True)
        y = self.experts(arrived.index_select(0, by_expert), recv_counts.sum(0).tolist())
        back = y.index_select(0, torch.argsort(by_expert))
        return funcol.all_to_all_single_autograd(back, send, recv, self.ep_group)


def update_expert_biases(model, a, device):
    """The aux-loss-free balancing step (--moe-router-enable-expert-bias; Megatron's
    _update_router_expert_bias in finalize_model_grads, mfsdp's update_expert_bias): each MoE
    layer's routed (token, expert) pairs of this step's micro-batches, summed over every rank
    (one all-reduce for all layers), move its bias by rate x sign(mean - tokens_e). After the
    backward, before the optimizer step, as both do."""
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE) and layer.mlp.expert_bias is not None]
    if not blocks:
        return
    counts = torch.stack([b.tokens_per_expert if b.tokens_per_expert is not None
                          else torch.zeros(b.num_experts, dtype=torch.long, device=device) for b in blocks])
    counts = counts.to(torch.float64)
    dist.all_reduce(counts)
    with torch.no_grad():
        for b, tokens in zip(blocks, counts.to(torch.float32)):
            b.expert_bias.add_(torch.sign(tokens.mean() - tokens) * a.moe_router_bias_update_rate)
            b.tokens_per_expert = None


class DecoderLayer(nn.Module):
    def __init__(self, a, index=0):
        super().__init__()
        if a.multi_latent_attention:
            self.self_attn = MLAttention(a)
        else:
            self.self_attn = Attention(a.hidden_size, a.num_attention_heads, a.num_query_groups, a.attention_backend)
        moe = a.num_experts and a.moe_layers[index]  # --moe-layer-freq
        self.mlp = MoE(a.hidden_size, a) if moe else MLP(a.hidden_size, a.ffn_hidden_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.norm_epsilon)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.norm_epsilon)

    def forward(self, hidden, cos, sin):
        h = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.padded_vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.norm_epsilon)
        self.lm_head = None if not a.untie else nn.Linear(a.hidden_size, a.padded_vocab_size, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, a.init_method_std)

    def forward(self, input_ids):
        a = self.args
        hidden = self.embed_tokens(input_ids)
        rope_dim = a.qk_pos_emb_head_dim if a.multi_latent_attention else a.hidden_size // a.num_attention_heads
        cos, sin = rotary_tables(input_ids.shape[1], rope_dim, a.rotary_base, input_ids.device)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        hidden = self.norm(hidden)
        if self.lm_head is not None:
            # Called as a module: Megatron-FSDP all-gathers a non-unit module's weight in that
            # module's pre-forward hook; a bare F.linear on the weight would get it gathered only
            # by sharing a bucket with another module's (the final norm's, as it happens).
            return self.lm_head(hidden)
        return F.linear(hidden, self.embed_tokens.weight)

    def balance_losses(self):
        """The MoE layers' load-balancing losses of the last forward (before the coefficient)."""
        return [layer.mlp.balance for layer in self.layers if isinstance(layer.mlp, MoE)]


def lm_loss(logits, labels):
    flat = logits.reshape(-1, logits.shape[-1]).to(torch.float32)
    return F.cross_entropy(flat, labels.reshape(-1))


# ---- training ---------------------------------------------------------------------------------


def lr_at(a, step):
    # src/optim/lr_schedule.cpp: linear warmup (--lr-warmup-iters), then decay to --min-lr.
    if a.lr_warmup_iters > 0 and step <= a.lr_warmup_iters:
        return a.lr * step / a.lr_warmup_iters
    decay = a.train_iters
    if a.lr_decay_style == "constant" or decay == 0:
        return a.lr
    if step > decay:
        return a.min_lr
    ratio = (step - a.lr_warmup_iters) / (decay - a.lr_warmup_iters)
    coeff = 1.0 - ratio if a.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return a.min_lr + coeff * (a.lr - a.min_lr)


# A model under --impl: model(inputs) -> logits; autocast() and sync(last micro-batch) are the
# contexts of a micro-batch's forward and of its forward and backward; clip() clips the gradients
# to --clip-grad.
Wrapped = collections.namedtuple("Wrapped", "model autocast sync clip")


def no_context(*_):
    return contextlib.nullcontext()


def wrap(model, a, rank, device):
    if a.impl == "megatron_fsdp":
        return wrap_megatron_fsdp(model, a, device)
    if a.impl == "fsdp2":
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if a.bf16 else None,
            reduce_dtype=(torch.bfloat16 if a.reduce_dtype == "bf16" else torch.float32) if a.bf16 else None)
        if a.num_experts:
            return wrap_fsdp2_moe(model, a, device, mp_policy)
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        return Wrapped(model, no_context, no_context,
                       lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad))
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if a.device == "cuda" else None)

    def autocast():  # bf16 compute with fp32 parameters (--bf16), else a no-op
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16)

    return Wrapped(ddp, autocast, lambda last: contextlib.nullcontext() if last else ddp.no_sync(),
                   lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), a.clip_grad))


def wrap_fsdp2_moe(model, a, device, mp_policy):
    """FSDP2 with expert parallelism as TorchTitan applies it (torchtitan/models/llama4/
    infra/parallelize.py apply_fsdp): a 2-D mesh ["edp", "ep"] of [world / EP, EP] (the
    expert-parallel groups are runs of EP consecutive ranks, Megatron's and mfsdp's layout); under
    EP > 1 each layer's experts are an FSDP unit of their own over the "edp" mesh, with the
    gradient divide factor set to the whole data-parallel size (an expert's gradient already sums
    the tokens of its expert-parallel group: divided by EDP alone it would be EP times the dense
    layers' mean); the decoder layers (router, attention, norms) and the root over every rank.
    EP 1: the experts are part of their layer's unit, as in TorchTitan. On gloo, where the expert
    mesh has more than one rank, the expert units also force sum reductions (divided after): a
    divide factor other than the group's size is NCCL's PREMUL_SUM, which gloo refuses. Not on a
    1-rank expert mesh (EP = world): there torch 2.15 divides twice with both set (the 1-rank copy
    divides by the factor, then the forced sum's post-division again: expert gradients halved at
    world 2, seen as a gradient-norm gap by --check-ep); it runs no collective anyway. The gradient
    norm is summed over the ranks' disjoint shards (clip_disjoint_shards_, as TorchTitan clips
    under EP): torch's clip_grad_norm_ refuses to stack DTensors of two meshes ("All operands in
    aten.stack.default must have the same mesh"). AdamW (fused) takes both meshes' DTensors."""
    world, ep = a.nproc, a.expert_model_parallel_size
    dp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    if ep > 1:
        moe_mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("edp", "ep"))
        ep_group = moe_mesh["ep"].get_group()
    for layer in model.layers:
        if ep > 1 and isinstance(layer.mlp, MoE):  # a dense layer (--moe-layer-freq) has no experts
            layer.mlp.ep_group = ep_group
            experts = fully_shard(layer.mlp.experts, mesh=moe_mesh["edp"], mp_policy=mp_policy)
            experts.set_gradient_divide_factor(float(world))
            if device.type == "cpu" and world > ep:
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
    return Wrapped(model, no_context, no_context,
                   lambda: clip_disjoint_shards_(model.parameters(), a.clip_grad, device))


def wrap_megatron_fsdp(model, a, device):
    """Megatron-FSDP's own fully_shard (PyPI megatron-fsdp), ZeRO-3 with every decoder layer a
    unit, as its README shows. --bf16: bf16 model weights and compute, fp32 main weights and main
    gradients, --reduce-dtype on the wire: what mfsdp-pretrain --bf16 does; fp32: the model's
    weights are the main weights (no second copy), as in mfsdp, DDP and FSDP2. Gradients are
    reduce-scattered after every micro-batch (sync_model_each_microbatch, fully_shard's default).
    CUDA only: MegatronFSDP.__init__ calls torch.cuda.current_device() even for a CPU device
    (0.6.1), and its gradient reduce-scatter uses NCCL's PREMUL_SUM, which gloo lacks."""
    from megatron_fsdp import MixedPrecisionPolicy as MegatronPrecision, fully_shard_model
    if a.bf16:
        model.to(torch.bfloat16)
        policy = MegatronPrecision(
            main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
            grad_comm_dtype=torch.bfloat16 if a.reduce_dtype == "bf16" else torch.float32)
    else:
        policy = MegatronPrecision(main_params_dtype=None)
    wrapped = fully_shard_model(model, fsdp_unit_modules=[DecoderLayer], zero_dp_strategy="optim_grads_params",
                                device=device, mixed_precision_policy=policy)
    return Wrapped(wrapped, no_context, no_context,
                   lambda: clip_disjoint_shards_(wrapped.parameters(), a.clip_grad, device))


def inner_model(model):
    """The LlamaForCausalLM under a wrapper (DDP's .module; FSDP2 shards the model in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def local_tensor(t):
    """A DTensor's local shard; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def clip_disjoint_shards_(params, max_norm, device):
    """clip_grad_norm_ over gradients sharded without overlap, as Megatron-LM clips Megatron-FSDP's:
    the squares of every rank's local pieces summed over the ranks. Not torch's clip_grad_norm_:
    Megatron-FSDP leaves the gradient of a parameter with no elements on a rank None, so the
    ranks' lists differ and its one reduction per DTensor gradient would not match up."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares += torch.linalg.vector_norm(g, dtype=torch.float32).square()
    dist.all_reduce(squares)
    norm = squares.sqrt()
    if grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def adamw_impl_kwargs(a):
    # auto: what measured fastest on CPU (the docstring of --adamw-impl), torch's default on GPUs.
    impl = a.adamw_impl
    if impl == "auto":
        impl = "fused" if a.device == "cpu" else "default"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False},
            "default": {}}[impl]


def precision_text(a):
    if not a.bf16:
        return "fp32"
    if a.impl in ("fsdp2", "megatron_fsdp"):
        return "bf16 params/compute, fp32 main params and grads, %s reduce" % a.reduce_dtype
    return "autocast bf16 compute, fp32 params and grads, fp32 reduce"


def megatron_fsdp_buffer_bytes(wrapped):
    """(weights, gradients) bytes of Megatron-FSDP's persistent buffers on this rank: the compute
    weights' shard (bf16 under --bf16), the fp32 main weights' shard (--bf16 only) and the main
    gradients' shard; its parameters as the optimizer sees them are the main weights only."""
    def nbytes(buf):
        return buf.data.nbytes if buf is not None and buf.data is not None else 0
    groups = wrapped.param_and_grad_buffer.parameter_groups
    return (sum(nbytes(g.model_weight_buffer) + nbytes(g.main_weight_buffer) for g in groups),
            sum(nbytes(g.main_grad_buffer) for g in groups))


def local_memory_mib(model, optimizer, impl):
    """MiB this rank holds in parameters, gradients and AdamW state (DTensor: its shard)."""
    if impl == "megatron_fsdp":
        params, grads = megatron_fsdp_buffer_bytes(model)
    else:
        params = sum(local_tensor(p).nbytes for p in model.parameters())
        grads = sum(local_tensor(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    state = sum(local_tensor(v).nbytes for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    return {"params": params / 2**20, "grads": grads / 2**20, "optimizer": state / 2**20}


def init_rank(rank, a):
    """Joins the process group; returns this rank's device."""
    torch.set_num_threads(a.threads)
    init = "tcp://127.0.0.1:%d" % a.port
    if a.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=a.nproc,
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=a.nproc)
    return device


def build(a, rank, device):
    """(Wrapped model, AdamW) for --impl, the same initial weights on every rank."""
    torch.manual_seed(a.seed)  # same weights on every rank (DDP also broadcasts rank 0's)
    with device:  # initialised where it runs: no host copy of a GPU model per rank
        model = LlamaForCausalLM(a)
    if a.num_experts and a.expert_model_parallel_size > 1:
        # Every rank drew every expert's weights: keep this rank's share (experts
        # [r E / EP, (r + 1) E / EP) for expert-parallel rank r = rank % EP, as mfsdp).
        local = a.num_experts // a.expert_model_parallel_size
        for layer in model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.experts.keep_local(rank % a.expert_model_parallel_size * local, local)
    wrapped = wrap(model, a, rank, device)
    # Decay groups by shape, as mfsdp: >= 2-D parameters (FSDP2's and Megatron-FSDP's DTensors
    # keep their global shape).
    params = list(wrapped.model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    # lr is set before every step (lr_at); 0 until then keeps fully_shard_optimizer's
    # state-initialising step (zero gradients) from applying weight decay.
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.0, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps, **adamw_impl_kwargs(a))
    if a.impl == "megatron_fsdp":
        from megatron_fsdp import fully_shard_optimizer
        optimizer = fully_shard_optimizer(optimizer)
        # Its state-initialising step counted as a step: back to 0, so that AdamW's bias
        # correction starts as in the other runs (the moments are still 0: zero gradients).
        for state in optimizer.state.values():
            state["step"].zero_()
    return wrapped, optimizer


def train(a, rank, device, wrapped, optimizer):
    """Runs --train-iters steps; returns (iteration times, logged lm losses, memory_mib after
    the last step, (logged load-balancing losses, gradient norms before clipping)); the MoE
    figures are empty for a dense model. The load-balancing loss is mfsdp's load_balancing_loss:
    the mean over MoE layers, micro-batches and ranks, before the coefficient."""
    data_gen = torch.Generator().manual_seed(a.seed * 1000 + rank)  # different tokens per rank
    times, losses, balances, grad_norms = [], [], [], []
    for it in range(1, a.train_iters + 1):
        if a.fixed_batch:  # the same micro-batches every step
            data_gen.manual_seed(a.seed * 1000 + rank)
        start = time.perf_counter()
        step_loss, step_balance = 0.0, 0.0
        for m in range(a.num_micro_batches):
            tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1),
                                   generator=data_gen).to(device)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            with wrapped.sync(m == a.num_micro_batches - 1):
                with wrapped.autocast():
                    loss = lm_loss(wrapped.model(inputs), labels) / a.num_micro_batches
                    if a.num_experts:
                        # The MoE layers' balancing losses into the gradient, scaled as the lm loss
                        # (mfsdp's aux_loss_scale 1 / micro-batches); logged apart, as mfsdp does.
                        layers = inner_model(wrapped.model).balance_losses()
                        balance = torch.stack(layers).sum()
                        step_balance += balance.item() / len(layers) / a.num_micro_batches
                        total = loss + balance * (a.moe_aux_loss_coeff / a.num_micro_batches)
                    else:
                        total = loss
                total.backward()
            step_loss += loss.item()
        if a.moe_router_enable_expert_bias:
            update_expert_biases(inner_model(wrapped.model), a, device)
        if a.clip_grad > 0:
            norm = wrapped.clip()
            if a.num_experts:
                grad_norms.append(float(local_tensor(norm)))
        for g in optimizer.param_groups:
            g["lr"] = lr_at(a, it)
        optimizer.step()
        if it == a.train_iters:  # gradients still held: the runtime's own figures
            memory = local_memory_mib(wrapped.model, optimizer, a.impl)
        optimizer.zero_grad()
        reported = torch.tensor([step_loss, step_balance] if a.num_experts else [step_loss], device=device)
        dist.all_reduce(reported)  # the logged loss (mfsdp: all_reduce_mean every log interval)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        losses.append(reported[0].item() / a.nproc)
        if a.num_experts:
            balances.append(reported[1].item() / a.nproc)
        if rank == 0 and a.verbose:
            print("iteration %d/%d | iter time (ms): %.1f | lm loss: %.6E%s"
                  % (it, a.train_iters, elapsed * 1e3, losses[-1],
                     " | load_balancing_loss: %.6E" % balances[-1] if balances else ""),
                  file=sys.stderr, flush=True)
    return times, losses, memory, (balances, grad_norms)


def report(a, rank, device, times, losses, memory, moe_figures):
    """Gathers every rank's peak memory; rank 0 prints the JSON result line (and writes it to
    a.result_file when set: --check-ep)."""
    peak_rss = [None] * a.nproc  # every rank's own peak (KiB on Linux)
    dist.all_gather_object(peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    peak_gpu = [None] * a.nproc
    dist.all_gather_object(peak_gpu, torch.cuda.max_memory_allocated(device) / 2**20
                           if device.type == "cuda" else None)
    if rank != 0:
        return
    timed = times[a.warmup_iters:]
    median = statistics.median(timed)
    tokens = a.global_batch_size * a.seq_length
    # MoE: the active width, top-k x expert width plus the shared expert in an MoE layer, the
    # dense width in a dense one, averaged over the layers, as mfsdp's ModelSpec counts it
    # (llama_spec.cpp flops_per_iteration). Multi-head latent attention is counted as mfsdp counts
    # it too: as the Llama attention of --num-attention-heads heads of hidden / heads channels
    # each (key/value heads = heads), not its own projections.
    ffn = a.ffn_hidden_size
    if a.num_experts:
        moe_layers = sum(1 for m in a.moe_layers if m)
        ffn = ((a.num_layers - moe_layers) * a.ffn_hidden_size + moe_layers * (
            a.moe_router_topk * a.moe_ffn_hidden_size + a.moe_shared_expert_intermediate_size)) / a.num_layers
    flops = megatron_flops_per_iteration(
        a.num_layers, a.hidden_size, ffn, a.num_attention_heads,
        a.num_attention_heads if a.multi_latent_attention else a.num_query_groups, a.seq_length,
        a.padded_vocab_size, a.global_batch_size)
    result = {
        "impl": "torch_" + a.impl, "nproc": a.nproc, "threads": a.threads,
        "device": a.device, "bf16": a.bf16,
        "precision": precision_text(a),
        "peak_gpu_mib": peak_gpu if device.type == "cuda" else None,
        "peak_rss_mib": peak_rss, "memory_mib": memory,
        "adamw": adamw_impl_kwargs(a),
        "iter_time_s": median, "tokens_per_sec": tokens / median,
        "tflops_per_rank": flops / median / a.nproc / 1e12,
        "timed_iters": len(timed), "iter_times_s": timed,
        "first_loss": losses[0], "final_loss": losses[-1],
        "torch": torch.__version__,
        "config": {k: getattr(a, k) for k in (
            "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "seq_length", "micro_batch_size", "global_batch_size",
            "num_micro_batches", "vocab_size", "padded_vocab_size", "untie", "train_iters",
            "warmup_iters")},
    }
    if a.multi_latent_attention:
        result["config"].update({k: getattr(a, k) for k in (
            "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
            "v_head_dim")})
    if a.num_experts:
        result["losses"] = losses
        result["balance_losses"], result["grad_norms"] = moe_figures
        result["moe"] = {k: getattr(a, k) for k in (
            "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff",
            "expert_model_parallel_size", "moe_expert_impl", "moe_router_score_function",
            "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
            "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "moe_layer_freq")}
        result["moe"]["moe_layers"] = [int(m) for m in a.moe_layers]
    line = json.dumps(result)
    print(line, flush=True)
    if a.result_file:
        with open(a.result_file, "w") as f:
            f.write(line + "\n")


def worker(rank, a):
    device = init_rank(rank, a)
    wrapped, optimizer = build(a, rank, device)
    times, losses, memory, moe_figures = train(a, rank, device, wrapped, optimizer)
    report(a, rank, device, times, losses, memory, moe_figures)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: a gloo thread may still be releasing the last
    # collectives' tensors, and taking the GIL during Py_Finalize aborts the process (std::terminate
    # in ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> decref_pyobject; about 1 FSDP2 run in
    # 20 here with torch 2.15) after the result was printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moe_layer_pattern(text, num_layers):
    """--moe-layer-freq as Megatron reads it (mfsdp's MoeSection::moe_layer_pattern): a positive
    integer N, every N-th layer from layer 0 an MoE layer; or a Python expression of 0/1 lists
    ("[0,1]", "([0]*1+[1]*3)": list literals, a list times a count on either side, sums,
    parentheses), read by walking its syntax tree, not eval(). A list of bools (True: MoE);
    raises ValueError."""
    text = text.strip()
    if not text.startswith(("[", "(")):
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n <= 0:
            raise ValueError("expected a positive integer or a list such as [1,0,1,0], got '%s'" % text)
        return [i % n == 0 for i in range(num_layers)]
    import ast
    limit = 1 << 20

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            return node.value
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            if any(isinstance(i, list) or i not in (0, 1) for i in items):
                raise ValueError("a list holds 0 (dense) or 1 (MoE) per layer")
            return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                out = left + right
            elif isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
                lst, n = (left, right) if isinstance(left, list) else (right, left)
                if len(lst) * n > limit:
                    raise ValueError("lists more than 2^20 layers")
                out = lst * n
            else:
                raise ValueError("only list + list and list * count")
            if len(out) > limit:
                raise ValueError("lists more than 2^20 layers")
            return out
        raise ValueError("unexpected '%s'" % ast.dump(node))

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except SyntaxError as e:
        raise ValueError("cannot read '%s': %s" % (text, e.msg))
    if not isinstance(pattern, list):
        raise ValueError("'%s' is not a list" % text)
    if len(pattern) != num_layers:
        raise ValueError("lists %d layers, --num-layers is %d" % (len(pattern), num_layers))
    return [bool(m) for m in pattern]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=0, help="0: 4 x hidden")
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=0, help="key/value heads (0: = heads)")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=0, help="0: micro x nproc")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--untie", "--untie-embeddings-and-output-weights", dest="untie", action="store_true",
                   help="separate lm_head instead of the tied embedding")
    p.add_argument("--rotary-base", type=float, default=10000.0)
    p.add_argument("--norm-epsilon", type=float, default=1e-5)
    p.add_argument("--init-method-std", type=float, default=0.02)
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--warmup-iters", type=int, default=5, help="first iterations left out of the timing")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear")
    p.add_argument("--lr-warmup-iters", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--adam-beta1", type=float, default=0.9)
    p.add_argument("--adam-beta2", type=float, default=0.999)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes spawned here)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo; cuda: rank r on cuda:r, nccl")
    p.add_argument("--impl", choices=("ddp", "fsdp2", "megatron_fsdp"), default="ddp",
                   help="ddp: DistributedDataParallel; fsdp2: fully_shard per layer and the root; "
                        "megatron_fsdp: the megatron-fsdp package's fully_shard (CUDA only)")
    p.add_argument("--bf16", action="store_true",
                   help="ddp: forward and loss under torch.autocast(bfloat16); fsdp2: "
                        "MixedPrecisionPolicy(param_dtype=bf16); fp32 parameters either way")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="fsdp2 and megatron_fsdp with --bf16: the gradient reduction's dtype (FSDP2 "
                        "reduce_dtype, Megatron-FSDP grad_comm_dtype)")
    p.add_argument("--adamw-impl", choices=("auto", "fused", "foreach", "for_loop", "default"),
                   default="auto", help="torch.optim.AdamW's kernel (default: torch's own choice); "
                   "auto: fused on CPU (measured fastest there for DDP and FSDP2, see the module "
                   "docstring), torch's default on GPUs")
    p.add_argument("--attention-backend", choices=("auto", "unfused"), default="auto",
                   help="as mfsdp-pretrain's flag: auto = F.scaled_dot_product_attention (causal); "
                        "unfused = explicit matmul, mask, fp32 softmax, matmul")
    p.add_argument("--multi-latent-attention", action="store_true",
                   help="multi-head latent attention (DeepSeek-V3; transformers' DeepseekV3Attention)")
    p.add_argument("--q-lora-rank", type=int, default=0, help="MLA: the query's low-rank width (0: a plain q_proj)")
    p.add_argument("--kv-lora-rank", type=int, default=32, help="MLA: the key/value latent's width")
    p.add_argument("--qk-head-dim", type=int, default=128, help="MLA: each query/key head's width without RoPE")
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="MLA: each query/key head's RoPE width")
    p.add_argument("--v-head-dim", type=int, default=128, help="MLA: each value head's width")
    p.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="MLA: YaRN's factor; only 1 (plain RoPE) here")
    p.add_argument("--num-experts", type=int, default=0,
                   help="MoE: experts per layer in every decoder layer's MLP (0: dense)")
    p.add_argument("--moe-router-topk", type=int, default=2, help="MoE: experts per token")
    p.add_argument("--moe-ffn-hidden-size", type=int, default=0, help="MoE: each expert's width (0: --ffn-hidden-size)")
    p.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="MoE: weight of the Switch load-balancing loss added to the loss")
    p.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax",
                   help="MoE: router scores, softmax over the experts or sigmoid (DeepSeek-V3)")
    p.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="MoE: aux-loss-free balancing, an fp32 per-expert bias on the scores that choose the "
                        "experts (not on their weights), moved after each step toward equal token counts "
                        "(sigmoid scores)")
    p.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="MoE: how far the expert bias moves per step")
    p.add_argument("--moe-router-num-groups", type=int, default=0,
                   help="MoE: group-limited routing, the experts in this many groups (0: off; DeepSeek-V3's n_group)")
    p.add_argument("--moe-router-group-topk", type=int, default=0,
                   help="MoE: group-limited routing, the top-k chosen within this many best groups (topk_group)")
    p.add_argument("--moe-router-topk-scaling-factor", type=float, default=0.0,
                   help="MoE: multiply the top-k weights by this (0: no scaling; routed_scaling_factor)")
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, default=0,
                   help="MoE: width of the ungated SwiGLU shared expert every token also goes through (0: none)")
    p.add_argument("--moe-layer-freq", default="1",
                   help="MoE: which layers are MoE layers, every N-th from layer 0 or a Python list of 0 (dense, "
                        "--ffn-hidden-size) / 1 (MoE) per layer, e.g. [0,1] or ([0]*1+[1]*3), as Megatron reads it")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="MoE: ranks the experts are split over (all-to-all dispatch; --impl fsdp2)")
    p.add_argument("--moe-expert-impl", choices=("grouped_mm", "loop"), default="grouped_mm",
                   help="MoE: the experts as one torch._grouped_mm per projection (TorchTitan's), or one "
                        "GEMM per expert (measured slower on CPU, see the module docstring)")
    p.add_argument("--fixed-batch", action="store_true",
                   help="the same micro-batches every step (a memorisation check: the loss falls only "
                        "if the gradients reach the weights); default: new random tokens every step")
    p.add_argument("--check-ep", action="store_true",
                   help="MoE: train at expert-parallel size 1 and at --expert-model-parallel-size from "
                        "the same initial weights and compare the logged losses step by step; exit 1 "
                        "if they differ by more than --check-tolerance or the loss does not fall (on new "
                        "random tokens every step it barely moves: add --fixed-batch and a larger --lr)")
    p.add_argument("--check-hf", action="store_true",
                   help="no training: compare this model's logits with transformers' LlamaForCausalLM "
                        "holding the same weights; exit 1 above --check-tolerance")
    p.add_argument("--check-tolerance", type=float, default=1e-4,
                   help="--check-hf: max |logits diff|; --check-ep: max |lm loss diff| and max "
                        "|gradient norm diff| per step")
    p.add_argument("--port", type=int, default=0, help="rendezvous port on 127.0.0.1 (0: a free one)")
    p.add_argument("--verbose", action="store_true", help="rank 0 logs every iteration to stderr")
    a = p.parse_args(argv)

    def bad(flag, why):
        p.error("%s %s" % (flag, why))

    if a.ffn_hidden_size == 0:
        a.ffn_hidden_size = 4 * a.hidden_size
    if a.num_query_groups == 0:
        a.num_query_groups = a.num_attention_heads
    if a.hidden_size % a.num_attention_heads:
        bad("--num-attention-heads", "must divide --hidden-size")
    if (a.hidden_size // a.num_attention_heads) % 2:
        bad("--num-attention-heads", "must leave an even head dimension (RoPE)")
    if a.num_attention_heads % a.num_query_groups:
        bad("--num-query-groups", "must divide --num-attention-heads")
    if a.nproc < 1 or a.threads < 1:
        bad("--nproc/--threads", "must be >= 1")
    if a.moe_ffn_hidden_size == 0:
        a.moe_ffn_hidden_size = a.ffn_hidden_size
    if a.num_experts < 0:
        bad("--num-experts", "must be >= 0")
    if a.multi_latent_attention:
        # mfsdp's ModelSection::validate.
        for flag, v, least in (("--q-lora-rank", a.q_lora_rank, 0), ("--qk-head-dim", a.qk_head_dim, 0),
                               ("--kv-lora-rank", a.kv_lora_rank, 1), ("--v-head-dim", a.v_head_dim, 1),
                               ("--qk-pos-emb-head-dim", a.qk_pos_emb_head_dim, 1)):
            if v < least:
                bad(flag, "must be >= %d, got %d" % (least, v))
        if a.qk_pos_emb_head_dim % 2:
            bad("--qk-pos-emb-head-dim", "must be even for RoPE, got %d" % a.qk_pos_emb_head_dim)
        if a.check_hf:
            bad("--check-hf", "compares the dense Llama with transformers' (no --multi-latent-attention)")
    if a.rotary_scaling_factor != 1.0:
        bad("--rotary-scaling-factor", "%g: this peer has plain RoPE only (no YaRN); leave it at 1"
            % a.rotary_scaling_factor)
    try:
        a.moe_layers = moe_layer_pattern(a.moe_layer_freq, a.num_layers)
    except ValueError as e:
        bad("--moe-layer-freq", str(e))
    if a.num_experts:
        if not any(a.moe_layers):
            bad("--moe-layer-freq", "%s makes no layer an MoE layer" % a.moe_layer_freq)
        if a.moe_router_enable_expert_bias and a.moe_router_score_function != "sigmoid":
            bad("--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid (as in Megatron-LM)")
        for flag, v in (("--moe-router-num-groups", a.moe_router_num_groups),
                        ("--moe-router-group-topk", a.moe_router_group_topk),
                        ("--moe-shared-expert-intermediate-size", a.moe_shared_expert_intermediate_size)):
            if v < 0:
                bad(flag, "must be >= 0")
        for flag, v in (("--moe-router-topk-scaling-factor", a.moe_router_topk_scaling_factor),
                        ("--moe-router-bias-update-rate", a.moe_router_bias_update_rate)):
            if not v >= 0 or math.isinf(v):
                bad(flag, "must be a finite value >= 0")
        groups = a.moe_router_num_groups
        if groups > 0:
            if a.num_experts % groups:
                bad("--moe-router-num-groups", "%d does not divide --num-experts %d" % (groups, a.num_experts))
            if not 1 <= a.moe_router_group_topk <= groups:
                bad("--moe-router-group-topk", "must be 1 .. --moe-router-num-groups %d, got %d"
                    % (groups, a.moe_router_group_topk))
            if a.moe_router_topk > a.moe_router_group_topk * (a.num_experts // groups):
                bad("--moe-router-topk", "must be at most --moe-router-group-topk x experts per group (%d x %d)"
                    % (a.moe_router_group_topk, a.num_experts // groups))
    else:
        a.moe_layers = [False] * a.num_layers
    if a.num_experts:
        if not 1 <= a.moe_router_topk <= a.num_experts:
            bad("--moe-router-topk", "must be in [1, --num-experts]")
        if a.impl == "megatron_fsdp":
            bad("--num-experts", "has no megatron_fsdp peer here (--impl fsdp2, or ddp at EP 1)")
        ep = a.expert_model_parallel_size
        if ep < 1 or a.nproc % ep or a.num_experts % ep:
            bad("--expert-model-parallel-size", "must divide --nproc (%d) and --num-experts (%d)"
                % (a.nproc, a.num_experts))
        if ep > 1 and a.impl != "fsdp2":
            bad("--expert-model-parallel-size", "> 1 needs --impl fsdp2")
        if a.check_ep and ep == 1:
            bad("--check-ep", "compares EP 1 with --expert-model-parallel-size > 1")
        if a.check_hf:
            bad("--check-hf", "compares the dense Llama with transformers' (no --num-experts)")
    elif a.expert_model_parallel_size != 1 or a.check_ep:
        bad("--expert-model-parallel-size/--check-ep", "need --num-experts")
    if a.impl == "megatron_fsdp" and a.device != "cuda":
        bad("--impl", "megatron_fsdp needs --device cuda: megatron-fsdp 0.6.1's MegatronFSDP.__init__ "
            "calls torch.cuda.current_device() even when given a CPU device (megatron_fsdp.py:234)")
    if a.reduce_dtype == "bf16" and (a.impl == "ddp" or not a.bf16):
        bad("--reduce-dtype", "bf16 applies to --impl fsdp2 and megatron_fsdp with --bf16 (DDP and "
            "fp32 runs reduce their fp32 gradients)")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            bad("--device", "cuda: torch %s sees no GPU" % torch.__version__)
        if a.nproc > torch.cuda.device_count():
            bad("--nproc", "%d exceeds the %d GPU(s) (one rank per GPU)" % (a.nproc, torch.cuda.device_count()))
    if a.global_batch_size == 0:
        a.global_batch_size = a.micro_batch_size * a.nproc
    if a.global_batch_size % (a.micro_batch_size * a.nproc):
        bad("--global-batch-size", "must be a multiple of --micro-batch-size x --nproc")
    a.num_micro_batches = a.global_batch_size // (a.micro_batch_size * a.nproc)
    if not 0 <= a.warmup_iters < a.train_iters:
        bad("--warmup-iters", "must be in [0, --train-iters)")
    d = a.make_vocab_size_divisible_by
    a.padded_vocab_size = (a.vocab_size + d - 1) // d * d if d > 0 else a.vocab_size
    if a.port == 0:
        a.port = free_port()
    a.result_file = None  # --check-ep: where rank 0 also writes its result line
    return a


def check_hf(a):
    """This model and transformers' LlamaForCausalLM with the same weights give the same logits."""
    from transformers import LlamaConfig, LlamaForCausalLM as HfLlama
    torch.manual_seed(a.seed)
    ours = LlamaForCausalLM(a).eval()
    config = LlamaConfig(
        vocab_size=a.padded_vocab_size, hidden_size=a.hidden_size, intermediate_size=a.ffn_hidden_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_query_groups, rms_norm_eps=a.norm_epsilon, rope_theta=a.rotary_base,
        max_position_embeddings=a.seq_length, tie_word_embeddings=not a.untie, attention_bias=False,
        mlp_bias=False, hidden_act="silu", attn_implementation="eager")
    hf = HfLlama(config).eval()
    # Ours has no "model." prefix: embed_tokens, layers.N..., norm, lm_head.
    ours_state = ours.state_dict()
    loaded = {}
    for name in hf.state_dict():
        key = name[len("model."):] if name.startswith("model.") else name
        if key == "lm_head.weight" and not a.untie:
            key = "embed_tokens.weight"
        if key not in ours_state:
            raise SystemExit("check-hf: transformers' %s has no counterpart here" % name)
        loaded[name] = ours_state[key]
    hf.load_state_dict(loaded, strict=True)
    tokens = torch.randint(0, a.vocab_size, (2, a.seq_length), generator=torch.Generator().manual_seed(a.seed))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    ok = diff <= a.check_tolerance
    print("check-hf: max |logits - transformers' logits| = %.3g (tolerance %.1g): %s"
          % (diff, a.check_tolerance, "same model" if ok else "DIFFERENT"))
    sys.exit(0 if ok else 1)


def check_ep(a):
    """Trains the MoE model at EP 1 and at EP --expert-model-parallel-size (the same seed, so
    the same initial weights and tokens) and compares rank 0's logged losses step by step."""
    import copy
    import tempfile
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ep in (1, a.expert_model_parallel_size):
            b = copy.copy(a)
            b.expert_model_parallel_size, b.port = ep, free_port()
            b.result_file = os.path.join(tmp, "ep%d.json" % ep)
            mp.spawn(worker, args=(b,), nprocs=b.nproc, join=True)
            with open(b.result_file) as f:
                results[ep] = json.load(f)
    one, many = results[1], results[a.expert_model_parallel_size]
    print("check-ep: %d ranks, %d experts, top-%d, --moe-expert-impl %s, %s; columns per EP: lm loss, "
          "load-balancing loss, gradient norm"
          % (a.nproc, a.num_experts, a.moe_router_topk, a.moe_expert_impl,
             "the same batch every step" if a.fixed_batch else "new tokens every step"))
    print("%5s %32s %32s %10s %10s" % ("step", "EP 1", "EP %d" % a.expert_model_parallel_size,
                                       "|loss diff|", "|norm diff|"))
    worst = worst_norm = 0.0
    norms = [r["grad_norms"] or [float("nan")] * len(r["losses"]) for r in (one, many)]
    for i, (x, y) in enumerate(zip(one["losses"], many["losses"])):
        worst = max(worst, abs(x - y))
        worst_norm = max(worst_norm, abs(norms[0][i] - norms[1][i]))
        print("%5d %12.8f %9.6f %9.6f %12.8f %9.6f %9.6f %10.2e %10.2e"
              % (i + 1, x, one["balance_losses"][i], norms[0][i], y, many["balance_losses"][i], norms[1][i],
                 abs(x - y), abs(norms[0][i] - norms[1][i])))
    falls = all(r["losses"][-1] < r["losses"][0] for r in (one, many))
    # The gradient norm catches a wrong expert-gradient scale, which AdamW all but hides in the losses.
    ok = worst <= a.check_tolerance and not worst_norm > a.check_tolerance and falls
    print("check-ep: max |lm loss diff| %.3g, max |grad norm diff| %.3g (tolerance %.1g), loss %s: %s"
          % (worst, worst_norm, a.check_tolerance, "falls" if falls else "does NOT fall",
             "same training" if ok else "FAILED"))
    sys.exit(0 if ok else 1)


def main():
    a = parse_args()
    if a.check_hf:
        return check_hf(a)
    if a.check_ep:
        return check_ep(a)
    mp.spawn(worker, args=(a,), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
