#!/usr/bin/env python3
"""PyTorch's own pipeline parallelism, the peer of `mfsdp-pretrain --pipeline-model-parallel-size`
(bench/pipeline_step_time.sh): torch.distributed.pipelining's PipelineStage + Schedule1F1B, with
FSDP2 (fully_shard) inside each stage, over gloo, on the Llama of bench/torch_llama.py.

    .venv/bin/python bench/torch_pipeline.py --nproc 2 --pipeline-model-parallel-size 2 \
        --num-layers 4 --hidden-size 512 --ffn-hidden-size 1536 --num-attention-heads 8 \
        --seq-length 128 --micro-batch-size 1 --global-batch-size 8 --vocab-size 1024 --untie \
        --train-iters 10 --warmup-iters 3

Every model, batch and optimizer flag is bench/torch_llama.py's (its parse_args reads them; see
its docstring), plus:
  --pipeline-model-parallel-size P  stages (default 2); --nproc = P x DP ranks, pipeline outermost
                                    as in Megatron: rank r is stage r // DP, data-parallel rank r % DP
  --stage-wrap fsdp2|none           fsdp2 (default): fully_shard every decoder layer of the stage,
                                    then the stage, over the stage's "dp" mesh (1 rank when
                                    --nproc = P); none: the plain stage module (DP 1 only)

The model (torch_llama's pieces: DecoderLayer, RMSNorm, rotary_tables, lm_loss) is split by layers
as TorchTitan's pipeline_llama splits it: stage 0 holds the embedding and the first L / P decoder
layers, stage s layers [s L / P, (s + 1) L / P), the last stage also the final norm and the output
layer (and the loss: Schedule1F1B's loss_fn, mean token cross entropy in fp32 per micro-batch,
the gradients scaled by 1 / micro-batches: scale_grads=True, what torch_llama's loss / m does).
--num-layers must divide by P. Tied embeddings are refused (--untie is required): the output layer
and the embedding live on different stages, and neither torch.distributed.pipelining nor
TorchTitan keeps a tied copy in sync (mfsdp and Megatron do, with an all-reduce between the first
and last stage); bench/pipeline_step_time.sh unties every run. Only each stage's own parameters
are allocated (normal(0, --init-method-std), norms ones, a generator seeded by --seed and the
stage): no rank ever holds the whole model, so the peak RSS is the stage's. Other differences
from a whole-model torch_llama run: the initial weights are drawn per stage (the same
distribution, not the same values); no MoE, MLA or --check-* here.

FSDP2 inside a stage as TorchTitan applies it under PP: reshard_after_forward=False (the layers
stay gathered between a micro-batch's forward and backward instead of being gathered again per
micro-batch); the pipeline schedule turns gradient sync off for every micro-batch but the last and
finalises the reduction after the step (PipelineStage.perform_reduce_grad). --bf16:
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=--reduce-dtype) as torch_llama's fsdp2 (the
activations between stages are then bf16).

One step, timed from its start to after the optimizer step, zero_grad and the all-reduce of the
logged loss (torch_llama's timing): every data-parallel rank draws its micro-batches' tokens as
torch_llama does (uniform random, a generator per data-parallel rank, the same on every stage of
that pipeline, so the last stage has the first stage's labels); schedule.step (the first stage
gets the inputs, the last the targets; Schedule1F1B: stage s runs P - s warmup forwards, then one
backward and one forward, then the cooldown backwards); the gradient norm over all stages and
data-parallel shards clipped to --clip-grad (every rank's local squares summed in one all-reduce:
the stages' parameters are disjoint, torch's clip_grad_norm_ would see one stage only); AdamW
(fused on CPU, decay on >= 2-D parameters, linear decay), as torch_llama.

Per-stage busy time (what the pipeline bubble is measured against): the script times this rank's
PipelineStage.forward_one_chunk, backward_one_chunk and perform_reduce_grad calls and the loss
function (public methods, wrapped on the instance; the blocking receives of the schedule fall
outside them), and schedule.step itself (the pipeline phase). idle_fraction = 1 - busy / phase, per
rank, the median over the timed steps; in an ideal 1F1B with equal stages and free transfers it is
(P - 1) / (m + P - 1) on every stage.

Prints one JSON line on rank 0 with torch_llama's keys (impl "torch_pipeline_1f1b", iter_time_s,
iter_times_s after --warmup-iters, tokens_per_sec, tflops_per_rank, peak_rss_mib of every rank
(getrusage ru_maxrss), memory_mib (rank 0's local parameters, gradients and AdamW state),
first_loss, final_loss, config) plus "losses" (every step's) and "pipeline": pp, dp, schedule,
stage_wrap, micro_batches (per data-parallel rank), layers of each stage, stage_of_rank, per rank
busy_s, phase_s (medians per timed step) and idle_fraction, memory_mib of every rank, and
ideal_bubble.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_llama as tl  # noqa: E402
from llama_flops import megatron_flops_per_iteration  # noqa: E402


class StageModule(nn.Module):
    """One pipeline stage of torch_llama's LlamaForCausalLM: the embedding on the first stage,
    decoder layers [first, last) (ModuleDict keyed by their global index, as TorchTitan), the
    final norm and output layer on the last stage. forward: token ids (first stage) or hidden
    states -> hidden states, or logits on the last stage."""

    def __init__(self, a, first_layer, last_layer, is_first, is_last):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.padded_vocab_size, a.hidden_size) if is_first else None
        self.layers = nn.ModuleDict({str(i): tl.DecoderLayer(a, i) for i in range(first_layer, last_layer)})
        self.norm = tl.RMSNorm(a.hidden_size, a.norm_epsilon) if is_last else None
        self.lm_head = nn.Linear(a.hidden_size, a.padded_vocab_size, bias=False) if is_last else None
        with torch.no_grad():  # LlamaForCausalLM's init
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, a.init_method_std)

    def forward(self, x):
        a = self.args
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        cos, sin = tl.rotary_tables(x.shape[1], a.hidden_size // a.num_attention_heads, a.rotary_base, x.device)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.norm is not None:
            x = self.lm_head(self.norm(x))
        return x


def parse_args(argv=None):
    """Our flags, then torch_llama's parser for the rest (its checks of the model and batch, with
    --nproc the data-parallel size, so that its micro-batch count is the per-pipeline one)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    pre.add_argument("--stage-wrap", choices=("fsdp2", "none"), default="fsdp2")
    pre.add_argument("--nproc", type=int, default=2)
    pre.add_argument("-h", "--help", action="store_true")
    mine, rest = pre.parse_known_args(argv)
    if mine.help:
        print(__doc__)
        sys.exit(0)
    pp, world = mine.pipeline_model_parallel_size, mine.nproc

    def bad(why):
        sys.exit("torch_pipeline.py: " + why)

    if pp < 2:
        bad("--pipeline-model-parallel-size must be >= 2 (1 is bench/torch_llama.py)")
    if world < pp or world % pp:
        bad("--nproc %d must be a multiple of --pipeline-model-parallel-size %d" % (world, pp))
    dp = world // pp
    for flag in ("--impl", "--check-hf", "--check-ep", "--num-experts", "--multi-latent-attention", "--device"):
        if any(r == flag or r.startswith(flag + "=") for r in rest):
            bad("%s is not for the pipeline peer (CPU, dense Llama, FSDP2 or plain stages)" % flag)
    a = tl.parse_args(rest + ["--impl", "fsdp2", "--nproc", str(dp)])
    if not a.untie:
        bad("tied embeddings across stages are not kept in sync here: pass --untie (see the docstring)")
    if a.num_layers % pp:
        bad("--num-layers %d does not divide by %d stages" % (a.num_layers, pp))
    if a.num_micro_batches < pp:
        bad("Schedule1F1B needs at least as many micro-batches (%d = global / (micro x DP)) as stages (%d)"
            % (a.num_micro_batches, pp))
    if mine.stage_wrap == "none" and dp > 1:
        bad("--stage-wrap none has no gradient reduction over data-parallel ranks: use fsdp2 or DP 1")
    if mine.stage_wrap == "none" and a.bf16:
        bad("--bf16 is FSDP2's MixedPrecisionPolicy here: use --stage-wrap fsdp2")
    a.pp, a.dp, a.nproc, a.stage_wrap = pp, dp, world, mine.stage_wrap
    a.impl = "pipeline_1f1b"
    return a


def timed(method, slot, key):
    """method, with its wall time added to slot[key] on every call."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            slot[key] += time.perf_counter() - start
    return wrapper


def worker(rank, a):
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % a.port, rank=rank, world_size=a.nproc)
    device = torch.device("cpu")
    mesh = init_device_mesh("cpu", (a.pp, a.dp), mesh_dim_names=("pp", "dp"))
    stage_index, dp_rank = rank // a.dp, rank % a.dp
    per_stage = a.num_layers // a.pp
    is_first, is_last = stage_index == 0, stage_index == a.pp - 1
    torch.manual_seed(a.seed * 100 + stage_index)  # the same stage weights on every data-parallel rank
    module = StageModule(a, stage_index * per_stage, (stage_index + 1) * per_stage, is_first, is_last)
    if a.stage_wrap == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if a.bf16 else None,
                                      reduce_dtype=(torch.bfloat16 if a.reduce_dtype == "bf16" else torch.float32)
                                      if a.bf16 else None)
        for layer in module.layers.values():
            fully_shard(layer, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
        fully_shard(module, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
    stage = PipelineStage(module, stage_index, a.pp, device, group=mesh["pp"].get_group())

    clock = {"busy": 0.0}
    loss_fn = timed(tl.lm_loss, clock, "busy")
    for name in ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad"):
        setattr(stage, name, timed(getattr(stage, name), clock, "busy"))
    schedule = Schedule1F1B(stage, n_microbatches=a.num_micro_batches, loss_fn=loss_fn, scale_grads=True)

    params = list(module.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=0.0, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps, **tl.adamw_impl_kwargs(a))

    data_gen = torch.Generator().manual_seed(a.seed * 1000 + dp_rank)  # as torch_llama, per pipeline
    times, losses, busy, phase = [], [], [], []
    memory = None
    for it in range(1, a.train_iters + 1):
        if a.fixed_batch:
            data_gen.manual_seed(a.seed * 1000 + dp_rank)
        start = time.perf_counter()
        tokens = torch.cat([torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1),
                                          generator=data_gen) for _ in range(a.num_micro_batches)])
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        clock["busy"] = 0.0
        step_losses = []
        phase_start = time.perf_counter()
        kwargs = {"target": labels, "losses": step_losses} if is_last else {}
        kwargs["return_outputs"] = False
        if is_first:
            schedule.step(inputs, **kwargs)
        else:
            schedule.step(**kwargs)
        phase.append(time.perf_counter() - phase_start)
        busy.append(clock["busy"])
        step_loss = float(sum(x.item() for x in step_losses)) / a.num_micro_batches if is_last else 0.0
        if a.clip_grad > 0:
            tl.clip_disjoint_shards_(module.parameters(), a.clip_grad, device)
        for g in optimizer.param_groups:
            g["lr"] = tl.lr_at(a, it)
        optimizer.step()
        if it == a.train_iters:
            memory = tl.local_memory_mib(module, optimizer, "fsdp2")
        optimizer.zero_grad()
        reported = torch.tensor([step_loss])
        dist.all_reduce(reported)  # the last stages' losses (the others add 0)
        times.append(time.perf_counter() - start)
        losses.append(reported.item() / a.dp)
        if rank == 0 and a.verbose:
            print("iteration %d/%d | iter time (ms): %.1f | lm loss: %.6E | busy %.1f ms of %.1f ms"
                  % (it, a.train_iters, times[-1] * 1e3, losses[-1], busy[-1] * 1e3, phase[-1] * 1e3),
                  file=sys.stderr, flush=True)
    report(a, rank, stage_index, times, losses, busy, phase, memory)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as torch_llama: no interpreter teardown racing gloo's threads


def report(a, rank, stage_index, times, losses, busy, phase, memory):
    w = a.warmup_iters
    idle = [1.0 - b / p for b, p in zip(busy[w:], phase[w:]) if p > 0]
    mine = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "stage": stage_index, "busy_s": statistics.median(busy[w:]), "phase_s": statistics.median(phase[w:]),
            "idle_fraction": statistics.median(idle), "memory_mib": memory}
    every = [None] * a.nproc
    dist.all_gather_object(every, mine)
    if rank != 0:
        return
    timed_iters = times[w:]
    median = statistics.median(timed_iters)
    flops = megatron_flops_per_iteration(a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads,
                                         a.num_query_groups, a.seq_length, a.padded_vocab_size, a.global_batch_size)
    m, p = a.num_micro_batches, a.pp
    result = {
        "impl": "torch_pipeline_1f1b", "nproc": a.nproc, "threads": a.threads, "device": "cpu", "bf16": a.bf16,
        "precision": tl.precision_text(argparse.Namespace(bf16=a.bf16, impl="fsdp2", reduce_dtype=a.reduce_dtype)),
        "peak_gpu_mib": None, "peak_rss_mib": [e["peak_rss_mib"] for e in every], "memory_mib": memory,
        "adamw": tl.adamw_impl_kwargs(a),
        "iter_time_s": median, "tokens_per_sec": a.global_batch_size * a.seq_length / median,
        "tflops_per_rank": flops / median / a.nproc / 1e12,
        "timed_iters": len(timed_iters), "iter_times_s": timed_iters,
        "first_loss": losses[0], "final_loss": losses[-1], "losses": losses, "torch": torch.__version__,
        "pipeline": {
            "pp": p, "dp": a.dp, "schedule": "Schedule1F1B", "stage_wrap": a.stage_wrap,
            "micro_batches": m, "layers_per_stage": a.num_layers // p,
            "stage_of_rank": [e["stage"] for e in every],
            "busy_s": [e["busy_s"] for e in every], "phase_s": [e["phase_s"] for e in every],
            "idle_fraction": [e["idle_fraction"] for e in every],
            "memory_mib": [e["memory_mib"] for e in every],
            "ideal_bubble": (p - 1) / (m + p - 1),
        },
        "config": {k: getattr(a, k) for k in (
            "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "seq_length", "micro_batch_size", "global_batch_size", "num_micro_batches", "vocab_size",
            "padded_vocab_size", "untie", "train_iters", "warmup_iters")},
    }
    print(json.dumps(result), flush=True)


def main():
    a = parse_args()
    mp.spawn(worker, args=(a,), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
