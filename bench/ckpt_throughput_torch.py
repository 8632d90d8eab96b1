#!/usr/bin/env python3
"""PyTorch DCP side of bench/ckpt_throughput.sh: the model of bench/ckpt_throughput.cpp (`--layers`
Linear(width, width) units without bias plus an output Linear), FSDP2 fully_shard on every unit
and the root over gloo, AdamW after one step; saves {"model", "optimizer"} state dicts
(get_model_state_dict / get_optimizer_state_dict) with torch.distributed.checkpoint.save and a
FileSystemWriter(thread_count=--threads), or loads them with dcp.load and set_state_dict (any world
size). Launched by torchrun. Each rep is timed from a barrier to the slowest rank's end; rank 0
prints one JSON line per rep: {"impl", "op", "ranks", "bytes", "seconds"}, bytes = 12 x parameters
(fp32 weights and both moments), as the mfsdp side counts them. Each save rep writes into an emptied
folder (rank 0 removes the previous rep's before the timed region), as the mfsdp side does.
"""
import argparse
import json
import os
import shutil
import subprocess
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


class Layer(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.fc = torch.nn.Linear(w, w, bias=False)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Model(torch.nn.Module):
    def __init__(self, layers, w):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(w) for _ in range(layers)])
        self.out = torch.nn.Linear(w, w, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--op", choices=["save", "load"], required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="FileSystemWriter thread_count")
    p.add_argument("--drop-cache-cmd", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Model(args.layers, args.width)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, args.width)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    nbytes = 12 * (args.layers + 1) * args.width * args.width
    for _ in range(args.reps):
        if args.op == "load" and args.drop_cache_cmd and dist.get_rank() == 0:
            subprocess.run(args.drop_cache_cmd, shell=True, check=True)
        if args.op == "save" and dist.get_rank() == 0:
            shutil.rmtree(args.dir, ignore_errors=True)  # untimed, as the mfsdp side does
        dist.barrier()
        start = time.monotonic()
        if args.op == "save":
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
            dcp.save(state, storage_writer=dcp.FileSystemWriter(args.dir, thread_count=args.threads))
        else:
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
            dcp.load(state, storage_reader=dcp.FileSystemReader(args.dir))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        t = torch.tensor([time.monotonic() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print(json.dumps({"impl": f"torch dcp (threads {args.threads})", "op": args.op,
                              "ranks": dist.get_world_size(), "bytes": nbytes, "seconds": t.item()}), flush=True)
    dist.destroy_process_group()
    # Leave without running C++ static destructors: on this torch, now and then a writer thread
    # still joinable at interpreter exit aborts the process ("terminate called without an active
    # exception") after every result has been printed, which failed whole benchmark runs.
    os._exit(0)


if __name__ == "__main__":
    main()
