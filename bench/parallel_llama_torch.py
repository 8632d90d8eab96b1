#!/usr/bin/env python3
"""PyTorch's own tensor parallelism + FSDP2 on the shape of bench/parallel_llama, for
bench/parallel_llama.sh's torch_tp mode (mfsdp's tp mode beside it):

    .venv/bin/python bench/parallel_llama_torch.py [--nproc 2] [--dp 1] [--seq 256] [--hidden 512]
        [--ffn 2048] [--heads 8] [--layers 2] [--vocab 8192] [--batch 2] [--steps 4]
        [--no-loss-parallel] [--adamw fused|foreach|for_loop]

The model is the one bench/parallel_llama builds (mfsdp's Llama: untied embedding and output
layer, RMSNorm eps 1e-5, HF RoPE theta 10000, MHA, SwiGLU, no biases, fp32, normal(0, 0.02)
init, causal scaled_dot_product_attention), from bench/torch_llama.py's pieces. Spawns --nproc
processes (torch.multiprocessing, gloo over tcp://127.0.0.1, one thread each) on a 2-D
DeviceMesh ["dp", "tp"] of [--dp, nproc / --dp] (2 ranks: [1, 2], as mfsdp's tp mode).

Parallelism as TorchTitan's llama3 apply_tp / apply_fsdp with sequence parallelism off:
parallelize_module over the "tp" mesh with ColwiseParallel for q/k/v/gate/up, RowwiseParallel for
o/down (the attention's views take the local head count), the embedding RowwiseParallel
(vocabulary-sharded rows, Replicate in and out), the output layer ColwiseParallel with
output_layouts Shard(-1) and use_local_output False under loss_parallel (the vocabulary-parallel
cross entropy, torch.distributed.tensor.parallel.loss_parallel, forward and backward inside it),
else Replicate (the full logits on every rank; --no-loss-parallel). The norms stay plain
replicated tensors (no SequenceParallel without SP). Then fully_shard (FSDP2, fp32, defaults)
over the "dp" mesh: every decoder layer, then the root.

One step as bench/parallel_llama times it: barrier, forward, loss (mean token cross entropy,
fp32), backward, gradient-norm clipping to 1.0, AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8,
weight decay 0.01 on >= 2-D parameters only, as mfsdp's make_adamw), zero_grad, barrier. The
clipping norm is the squares of every rank's local gradient pieces summed over all ranks in one
all-reduce, the tensor-parallel-replicated ones (the norms) divided by the TP size so they count
once: torch's clip_grad_norm_ refuses to stack DTensors of two meshes (the TP weights live on
the 2-D mesh, the norms on the "dp" mesh alone after fully_shard).

Prints one line on rank 0 in parallel_llama's format:
  mode torch_tp ranks N step_s S tokens_per_s T persistent_mib P peak_rss_mib R loss L cpu_s C
step_s: the median step over the steps after the first; tokens_per_s: the job's (dp x batch x
seq per step); persistent_mib: rank 0's local parameter shards, as many gradient bytes (mfsdp
keeps its main grads; torch frees them at zero_grad, so this counts them at their peak) and
AdamW state; peak_rss_mib: rank 0's VmHWM from /proc/self/status, as parallel_llama reads it.
cpu_s (last): the median CPU seconds rank 0's process used per timed step (time.process_time,
CLOCK_PROCESS_CPUTIME_ID, all threads), as parallel_llama prints it.
--losses also prints every step's loss on rank 0 (a correctness check: the first should be about
ln(vocab), then decreasing on a fixed batch with --fixed-batch).
"""

import argparse
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_llama import MLP, RMSNorm, apply_rotary, repeat_kv, rotary_tables  # noqa: E402


class Attention(nn.Module):
    """torch_llama's Attention with the head count taken from the projections' local width (-1),
    as TorchTitan's, so that ColwiseParallel's local outputs hold heads / tp heads."""

    def __init__(self, hidden, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k = repeat_kv(k, self.heads // self.kv_heads)
        v = repeat_kv(v, self.heads // self.kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.self_attn = Attention(a.hidden, a.heads, a.kv_heads)
        self.mlp = MLP(a.hidden, a.ffn)
        self.input_layernorm = RMSNorm(a.hidden, 1e-5)
        self.post_attention_layernorm = RMSNorm(a.hidden, 1e-5)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, 1e-5)
        self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        cos, sin = rotary_tables(ids.shape[1], self.a.hidden // self.a.heads, 10000.0, ids.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


def parallelize(model, mesh, a):
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Replicate(),
                                   output_layouts=Shard(-1) if a.loss_parallel else Replicate(),
                                   use_local_output=not a.loss_parallel),
    })
    for layer in model.layers:
        parallelize_module(layer, tp, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def tp_sharded(t):
    """Whether a DTensor is split over the "tp" mesh dimension (else replicated over it)."""
    names = t.device_mesh.mesh_dim_names or ()
    return "tp" in names and isinstance(t.placements[names.index("tp")], Shard)


def clip_grad_norm_(params, max_norm, tp_size):
    grads = [p.grad for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        s = torch.linalg.vector_norm(local, dtype=torch.float32).square()
        squares += s if isinstance(g, DTensor) and tp_sharded(g) else s / tp_size
    dist.all_reduce(squares)
    norm = squares.sqrt()
    coef = min(1.0, max_norm / (norm.item() + 1e-6))
    if coef < 1.0:
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm


def local_bytes(t):
    return (t.to_local() if isinstance(t, DTensor) else t).nbytes


def peak_rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def worker(rank, a, port):
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.nproc)
    tp_size = a.nproc // a.dp
    mesh = init_device_mesh("cpu", (a.dp, tp_size), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(1)  # every rank the same full weights before TP shards them
    model = Llama(a)
    parallelize(model, mesh, a)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[a.adamw]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.999), eps=1e-8, **kernel)
    times, cpu_times, losses = [], [], []
    for step in range(a.steps):
        gen = torch.Generator().manual_seed(0 if a.fixed_batch else 100 * step + dp_rank)
        tokens = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=gen)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        logits = model(ids)
        if a.loss_parallel:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
        clip_grad_norm_(model.parameters(), 1.0, tp_size)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        if step > 0:
            times.append(seconds)
            cpu_times.append(cpu_seconds)
        value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        losses.append(float(value))
    params = sum(local_bytes(p) for p in model.parameters())
    state = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0)
    persistent = (2 * params + state) / 1048576.0
    step_s = statistics.median_high(times)  # parallel_llama: times[size / 2] of the sorted times
    if rank == 0:
        if a.losses:
            print("losses " + " ".join("%.4f" % v for v in losses), flush=True)
        print("mode %s ranks %d step_s %.4f tokens_per_s %.1f persistent_mib %.2f peak_rss_mib %.1f loss %.4f "
              "cpu_s %.4f" % (a.mode_name, a.nproc, step_s, a.dp * a.batch * a.seq / step_s, persistent,
                              peak_rss_mib(), losses[-1], statistics.median_high(cpu_times)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("nproc", 2), ("dp", 1), ("seq", 256), ("hidden", 512), ("ffn", 2048), ("heads", 8),
                          ("kv-heads", 0), ("layers", 2), ("vocab", 8192), ("batch", 2), ("steps", 4),
                          ("threads", 1)):
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                   help="replicate the logits (full vocabulary on every rank) instead of loss_parallel")
    p.add_argument("--adamw", choices=("fused", "foreach", "for_loop"), default="fused")
    p.add_argument("--mode-name", default="torch_tp", help="the mode printed on the result line")
    p.add_argument("--fixed-batch", action="store_true", help="the same tokens every step (loss must fall)")
    p.add_argument("--losses", action="store_true", help="also print every step's loss")
    a = p.parse_args()
    a.kv_heads = a.kv_heads or a.heads
    tp = a.nproc // max(a.dp, 1)
    if a.dp < 1 or a.nproc % a.dp or a.heads % tp or a.kv_heads % tp or a.ffn % tp or a.vocab % tp:
        p.error("--nproc must be --dp x TP, and TP must divide --heads, --kv-heads, --ffn and --vocab")
    if a.steps < 2:
        p.error("--steps must be >= 2 (the first step is not timed)")
    mp.spawn(worker, args=(a, free_port()), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
