"""torch.optim.Muon's results for tests/reference/muon_reference_test.cpp.

Writes into OUT_DIR raw little-endian float32 files: init_<p>.bin (initial weights),
grad_<step>_<p>.bin (the gradient of each step), and per configuration <config>_weight_<p>.bin and
<config>_momentum_<p>.bin after STEPS steps of torch.optim.Muon (lr 0.02 * (1 + step % 2),
weight decay 0.1, momentum 0.95). Configurations: adjust_lr_fn original / match_rms_adamw /
spectral_unclamped, nesterov on / off.

usage: muon_reference.py OUT_DIR
"""
import sys

import torch

SHAPES = {"wide": (16, 24), "tall": (40, 12), "square": (9, 9)}
STEPS = 5


def save(path, tensor):
    tensor.detach().to(torch.float32).contiguous().numpy().tofile(path)


def main():
    out = sys.argv[1]
    gen = torch.Generator().manual_seed(1234)
    init = {p: torch.randn(s, generator=gen) for p, s in SHAPES.items()}
    grads = [{p: torch.randn(s, generator=gen) for p, s in SHAPES.items()} for _ in range(STEPS)]
    for p in SHAPES:
        save(f"{out}/init_{p}.bin", init[p])
        for k in range(STEPS):
            save(f"{out}/grad_{k}_{p}.bin", grads[k][p])
    for adjust in ("original", "match_rms_adamw", "spectral_unclamped"):
        for nesterov in (True, False):
            params = {p: torch.nn.Parameter(init[p].clone()) for p in SHAPES}
            opt = torch.optim.Muon(list(params.values()), lr=0.02, weight_decay=0.1, momentum=0.95,
                                   nesterov=nesterov, adjust_lr_fn=adjust)
            for k in range(STEPS):
                for g in opt.param_groups:
                    g["lr"] = 0.02 * (1 + k % 2)
                for p in SHAPES:
                    params[p].grad = grads[k][p].clone()
                opt.step()
            config = f"{adjust}_{'nesterov' if nesterov else 'plain'}"
            for p in SHAPES:
                save(f"{out}/{config}_weight_{p}.bin", params[p])
                save(f"{out}/{config}_momentum_{p}.bin", opt.state[params[p]]["momentum_buffer"])
    print("torch", torch.__version__, "wrote", out)


if __name__ == "__main__":
    main()
