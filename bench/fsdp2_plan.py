#!/usr/bin/env python3
"""Per-rank memory of a Llama under PyTorch FSDP2, for bench/scale_plan.sh.

FSDP2's own sharding code decides the sizes: the Llama's parameters are built on the meta device
(nothing allocated) and torch.distributed.fsdp.fully_shard is applied with a fake process group
of N ranks, units as mfsdp makes them (every decoder layer, the untied embedding and output
layer, then the root holding the final norm). Rank 0's shards are read from FSDP2's parameters:
each parameter is chunked on dim 0 with torch.chunk and padded to ceil(dim0 / N) rows
(FSDPParam._sharded_param_data), per the fully_shard documentation ("FSDP2 chunks each parameter
on dim-0 across the data parallel workers (using torch.chunk(dim=0))").

Persistent per rank, with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for bf16 or
no policy for fp32: sharded fp32 parameters (they are the optimizer's weights), sharded fp32
gradients, AdamW exp_avg and exp_avg_sq (zeros_like the sharded parameters).

Transient per rank, from FSDP2's documented schedule (PyTorch PR #128884, which added explicit
prefetching: "In forward, it uses implicit prefetching and allows two all-gather output tensors
to be alive at once ... In backward, it uses explicit prefetching based on the reverse
post-forward order"; fully_shard's reshard_after_forward=None keeps the root unsharded): the
root's unsharded parameters and gradients, plus, at the worst block of the backward, that
block's all-gathered parameters (compute dtype, padded), the next block's prefetched ones, its
unsharded gradients (compute dtype) and the reduce-scatter input they are copied into before
they are freed (reduce dtype, padded; torch's foreach_reduce in _fsdp_collectives.py). It is a
model of the documented behaviour, not a measurement; FSDP2 may hold the previous block's
reduce-scatter input a little longer.

Prints one line per rank count and precision:
  ranks precision parameters params_bytes grads_bytes optim_bytes transient_bytes
"""
import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402


class Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        kv = a.kv_heads * (a.hidden // a.heads)
        self.q_proj = nn.Linear(a.hidden, a.hidden, bias=False)
        self.k_proj = nn.Linear(a.hidden, kv, bias=False)
        self.v_proj = nn.Linear(a.hidden, kv, bias=False)
        self.o_proj = nn.Linear(a.hidden, a.hidden, bias=False)
        self.gate_proj = nn.Linear(a.hidden, a.ffn, bias=False)
        self.up_proj = nn.Linear(a.hidden, a.ffn, bias=False)
        self.down_proj = nn.Linear(a.ffn, a.hidden, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(a.hidden))
        self.post_attention_layernorm = nn.Parameter(torch.ones(a.hidden))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList([Layer(a) for _ in range(a.layers)])
        self.norm = nn.Parameter(torch.ones(a.hidden))
        self.lm_head = None if a.tied else nn.Linear(a.hidden, a.vocab, bias=False)


def own_params(module):
    """The parameters FSDP2 manages for this unit (its FSDPParams)."""
    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    return group.fsdp_params if group is not None else []


def plan(a, ranks, bf16):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        mesh = init_device_mesh("cpu", (ranks,))
        with torch.device("meta"):
            model = Llama(a)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        units = list(model.layers)
        if model.lm_head is not None:
            units = [model.embed_tokens] + units + [model.lm_head]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        compute, reduce = (2, 4) if bf16 else (4, 4)
        params = grads = optim = numel = 0
        per_unit = []  # (all-gather output, unsharded grads, reduce-scatter input) bytes, forward order
        for unit in [model] + units:
            gathered = unsharded = rs_input = 0
            for fp in own_params(unit):
                padded = fp._sharded_param_data.numel()
                local = fp.sharded_param._local_tensor.numel()
                params += 4 * padded
                grads += 4 * padded
                optim += 2 * 4 * local
                numel += fp._orig_size.numel()
                gathered += compute * padded * ranks
                unsharded += compute * fp._orig_size.numel()
                rs_input += reduce * padded * ranks
            per_unit.append((gathered, unsharded, rs_input))
        root, blocks = per_unit[0], per_unit[1:]
        backward = list(reversed(blocks))
        worst = 0
        for k, (gathered, unsharded, rs_input) in enumerate(backward):
            prefetched = backward[k + 1][0] if k + 1 < len(backward) else 0
            worst = max(worst, gathered + prefetched + unsharded + rs_input)
        transient = root[0] + root[1] + worst
        return numel, params, grads, optim, transient
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--ranks", default="8,64,512")
    a = p.parse_args()
    for ranks in [int(r) for r in a.ranks.split(",")]:
        for bf16 in (False, True):
            numel, params, grads, optim, transient = plan(a, ranks, bf16)
            print(ranks, "bf16" if bf16 else "fp32", numel, params, grads, optim, transient)
    sys.stdout.flush()
    os._exit(0)  # the fake process group's teardown at interpreter exit is not needed


if __name__ == "__main__":
    main()
