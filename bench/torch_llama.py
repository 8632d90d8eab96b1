#!/usr/bin/env python3
"""PyTorch peers of mfsdp-pretrain (DDP, FSDP2, Megatron-FSDP): the same Llama, optimizer and
batch layout, one process per rank.

    .venv/bin/python bench/torch_llama.py --impl fsdp2 --nproc 2 --threads 1 \
        --num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 \
        --num-query-groups 8 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 \
        --vocab-size 1024 --train-iters 30 --warmup-iters 5

    python3 bench/torch_llama.py --device cuda --bf16 --nproc 1 ...   # GPUs (bench/gpu_step_time.sh)
    .venv/bin/python bench/torch_llama.py --check-hf --num-layers 2 ...  # the model is HF's Llama

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
    import torch.multiprocessing as mp
    import torch.nn as nn
    import torch.nn.functional as F
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


class MLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.self_attn = Attention(a.hidden_size, a.num_attention_heads, a.num_query_groups, a.attention_backend)
        self.mlp = MLP(a.hidden_size, a.ffn_hidden_size)
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
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
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
        cos, sin = rotary_tables(input_ids.shape[1], a.hidden_size // a.num_attention_heads,
                                 a.rotary_base, input_ids.device)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        hidden = self.norm(hidden)
        if self.lm_head is not None:
            # Called as a module: Megatron-FSDP all-gathers a non-unit module's weight in that
            # module's pre-forward hook; a bare F.linear on the weight would get it gathered only
            # by sharing a bucket with another module's (the final norm's, as it happens).
            return self.lm_head(hidden)
        return F.linear(hidden, self.embed_tokens.weight)


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
    """Runs --train-iters steps; returns (iteration times, logged losses, memory_mib after the
    last step)."""
    data_gen = torch.Generator().manual_seed(a.seed * 1000 + rank)  # different tokens per rank
    times, losses = [], []
    for it in range(1, a.train_iters + 1):
        start = time.perf_counter()
        step_loss = 0.0
        for m in range(a.num_micro_batches):
            tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1),
                                   generator=data_gen).to(device)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            with wrapped.sync(m == a.num_micro_batches - 1):
                with wrapped.autocast():
                    loss = lm_loss(wrapped.model(inputs), labels) / a.num_micro_batches
                loss.backward()
            step_loss += loss.item()
        if a.clip_grad > 0:
            wrapped.clip()
        for g in optimizer.param_groups:
            g["lr"] = lr_at(a, it)
        optimizer.step()
        if it == a.train_iters:  # gradients still held: the runtime's own figures
            memory = local_memory_mib(wrapped.model, optimizer, a.impl)
        optimizer.zero_grad()
        reported = torch.tensor([step_loss], device=device)
        dist.all_reduce(reported)  # the logged loss (mfsdp: all_reduce_mean every log interval)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        losses.append(reported.item() / a.nproc)
        if rank == 0 and a.verbose:
            print("iteration %d/%d | iter time (ms): %.1f | lm loss: %.6E"
                  % (it, a.train_iters, elapsed * 1e3, losses[-1]), file=sys.stderr, flush=True)
    return times, losses, memory


def report(a, rank, device, times, losses, memory):
    """Gathers every rank's peak memory; rank 0 prints the JSON result line."""
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
    flops = megatron_flops_per_iteration(
        a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads,
        a.num_query_groups, a.seq_length, a.padded_vocab_size, a.global_batch_size)
    print(json.dumps({
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
    }), flush=True)


def worker(rank, a):
    device = init_rank(rank, a)
    wrapped, optimizer = build(a, rank, device)
    times, losses, memory = train(a, rank, device, wrapped, optimizer)
    report(a, rank, device, times, losses, memory)
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
    p.add_argument("--check-hf", action="store_true",
                   help="no training: compare this model's logits with transformers' LlamaForCausalLM "
                        "holding the same weights; exit 1 above --check-tolerance")
    p.add_argument("--check-tolerance", type=float, default=1e-4)
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


def main():
    a = parse_args()
    if a.check_hf:
        return check_hf(a)
    mp.spawn(worker, args=(a,), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
