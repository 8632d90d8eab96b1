#!/usr/bin/env python3
"""PyTorch FSDP2 side of tests/reference/dcp_fsdp2_reference_test.cpp: checkpoints in the
fsdp_dtensor format (a PyTorch Distributed Checkpoint with Megatron-FSDP's key names) cross
between mfsdp and torch.distributed.fsdp.fully_shard, both ways, with the optimizer state.

    dcp_fsdp2_reference.py load  ITER_DIR CONFIG_JSON EXPECTED WORLD
        FSDP2 on WORLD Gloo ranks loads mfsdp's checkpoint with torch.distributed.checkpoint.load
        (model and AdamW state), then checks the logits of EVAL_IDS and the weights after one
        more AdamW step on batch 2 against EXPECTED (a safetensors file mfsdp wrote: "logits",
        "weights.<fqn>"). Exit 1 on a mismatch.
    dcp_fsdp2_reference.py save  SAVE_DIR CONFIG_JSON EXPECTED WORLD
        FSDP2 trains two AdamW steps (batches 0 and 1) from torch.manual_seed(0), saves with
        torch.distributed.checkpoint.save as SAVE_DIR/megatron/iter_0000002 (Megatron's names:
        {"model": {"module.<fqn>"}, "optimizer": {"state": {"module.module.module.<fqn>":
        {exp_avg, exp_avg_sq}}, "param_to_group_meta": {...: {"step"}}}, "iteration": 2}) and as
        SAVE_DIR/megatron/latest_checkpointed_iteration.txt, and as the bare folder SAVE_DIR/plain
        (PyTorch's own names: {"model": get_model_state_dict, "optimizer":
        get_optimizer_state_dict}; no iteration, no latest file: what dcp.save alone writes);
        then writes EXPECTED: the logits of EVAL_IDS and the weights after a step on batch 2.

The model is transformers' LlamaForCausalLM (fp32, eager attention) built from CONFIG_JSON (the
config.json mfsdp writes for its LlamaForCausalLM), with fully_shard on every decoder layer and
then the root, FSDP2's defaults. Keep in sync with the C++ test: batch(k), EVAL_IDS, the AdamW
hyperparameters (weight decay on parameters of 2 or more dimensions only, as mfsdp), 6 sequences
per step split evenly over the ranks, mean cross-entropy per rank, gradients averaged over ranks.
"""
import importlib
import json
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
ROWS = 6
SEQ = 9
# Logits and weights agree to these (both sides compute in fp32, in different orders).
LOGIT_TOL = 2e-5
WEIGHT_TOL = 1e-6


def batch(k, vocab):
    return (torch.arange(ROWS * SEQ, dtype=torch.long) * (2 * k + 3) + k).remainder(vocab).view(ROWS, SEQ)


def eval_ids(vocab):
    return (torch.arange(2 * 8, dtype=torch.long) * 5 + 1).remainder(vocab).view(2, 8)


def build(config_path, world):
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with open(config_path) as f:
        cfg = json.load(f)
    for key in ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version"):
        cfg.pop(key, None)
    config = transformers.LlamaConfig(**cfg, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    # A CPU mesh, as the gloo group: without one fully_shard takes the accelerator's (CUDA on a
    # GPU machine) and moves the model there, away from the CPU batches.
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS)
    return model, optimizer, config.vocab_size


def train_step(model, optimizer, k, vocab, rank, world):
    ids = batch(k, vocab)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    logits = model(input_ids=ids[rows, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, vocab), ids[rows, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def megatron_state(model, optimizer, step):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, optimizer)
    prefix = "module.module.module."
    state = {
        "model": {"module." + k: v for k, v in msd.items()},
        "optimizer": {
            "state": {prefix + k: {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}
                      for k, s in osd["state"].items()},
            "param_to_group_meta": {prefix + k: {"step": step} for k in osd["state"]},
        },
        "iteration": step,
    }
    return state, msd, osd


def full_weights(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def compare(name, got, want, tol):
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, want.double().abs().max().item()) if want.numel() else 1.0
    ok = got.shape == want.shape and diff <= tol * scale
    if not ok:
        print(f"MISMATCH {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}, max |diff| {diff:.3e}")
    return ok, diff


def worker(rank, world, port, mode, path, config_path, expected_path, results):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, optimizer, vocab = build(config_path, world)
    ok = True
    if mode == "load":
        state, msd, osd = megatron_state(model, optimizer, 0)
        dcp.load(state, checkpoint_id=path)
        step = state["optimizer"]["param_to_group_meta"]
        for k, s in osd["state"].items():
            s["step"] = torch.tensor(float(step["module.module.module." + k]["step"]))
        set_model_state_dict(model, msd)
        set_optimizer_state_dict(model, optimizer, osd)
        if rank == 0:
            print(f"FSDP2 on {world} ranks loaded {path}: iteration {state['iteration']}, "
                  f"{len(msd)} model tensors, AdamW step {int(next(iter(osd['state'].values()))['step'])}")
    else:
        for k in (0, 1):
            train_step(model, optimizer, k, vocab, rank, world)
        state, msd, osd = megatron_state(model, optimizer, 2)
        dcp.save(state, checkpoint_id=os.path.join(path, "megatron", "iter_0000002"))
        if rank == 0:
            with open(os.path.join(path, "megatron", "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("2\n")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(path, "plain"))
        dist.barrier()
    with torch.no_grad():
        logits = model(input_ids=eval_ids(vocab)).logits
    train_step(model, optimizer, 2, vocab, rank, world)
    weights = full_weights(model)
    if rank == 0:
        if mode == "load":
            want = load_file(expected_path)
            good, diff = compare("logits", logits, want["logits"], LOGIT_TOL)
            ok &= good
            worst = 0.0
            for k, v in weights.items():
                good, d = compare("weights." + k, v, want["weights." + k], WEIGHT_TOL)
                ok &= good
                worst = max(worst, d)
            print(f"logits max |diff| {diff:.3e}; weights after one more step: max |diff| {worst:.3e} "
                  f"over {len(weights)} tensors")
        else:
            out = {"logits": logits.contiguous()}
            out.update({"weights." + k: v.contiguous() for k, v in weights.items()})
            save_file(out, expected_path)
            print(f"FSDP2 on {world} ranks saved {path} and {expected_path}")
        results.put(ok)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    if len(sys.argv) != 6 or sys.argv[1] not in ("load", "save"):
        sys.exit(__doc__)
    mode, path, config_path, expected_path, world = sys.argv[1:6]
    print(f"torch {torch.__version__}")
    # Forked ranks, not spawned: a spawned rank imports torch and transformers afresh (~4 s of CPU
    # each on 2 cores, most of this script's time). They are imported here once, before the fork;
    # the parent holds no process group and runs torch on one thread.
    for module in ("safetensors.torch", "torch.distributed.checkpoint", "torch.distributed.fsdp",
                   "transformers.models.llama.modeling_llama"):
        importlib.import_module(module)
    torch.set_num_threads(1)
    ctx = mp.get_context("fork")
    results = ctx.SimpleQueue()
    mp.start_processes(worker, args=(int(world), free_port(), mode, path, config_path, expected_path, results),
                       nprocs=int(world), join=True, start_method="fork")
    ok = results.get()
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
