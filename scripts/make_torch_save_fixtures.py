#!/usr/bin/env python3
"""Writes the torch.save fixtures for tests/unit/torch_save_test.cpp and tests/e2e/ckpt_tool_test.cpp.

    make_torch_save_fixtures.py OUT_DIR

ctest runs it first (the TorchSaveFixtures setup test in tests/CMakeLists.txt) with the pinned
torch of the project's environment (.venv), so the C++ reader is checked against what the torch
users run writes today, not against stored bytes. Every tensor
comes from arange and exactly representable arithmetic, so the C++ test recomputes the expected
values with at::arange instead of trusting a second copy of the data. Keep the formulas here and
in the test in sync.

  state_dict.pt  OrderedDict from a Linear(4, 3) + LayerNorm(3) module (has _metadata: BUILD),
                 saved by path, so the archive folder is the file stem "state_dict/".
  nested.pt      {"model": {...}, "optim": {...}, "iteration": 7, "args": "x", ...} saved through
                 a buffer (archive folder "archive/"): bf16/fp16/int/bool dtypes, a one-entry
                 dict, views sharing one storage (a row, a transposed slice), a tied tensor, a
                 0-d and an empty tensor, an int dict key, and non-tensor leaves.
  evil.pt        a torch-layout zip whose hand-written data.pkl calls os.system (GLOBAL 'os
                 system' + REDUCE). Never load it with pickle/torch.load.
  legacy.pt      state_dict.pt's content in the pre-1.6 (non-zip) format.
  dcp/           a PyTorch Distributed Checkpoint (torch.distributed.checkpoint.save, one
                 process) of dcp_state_dict(): nested dicts, fp32/bf16/int64/0-d tensors, bytes
                 and plain Python values (for tests/unit/dcp_test.cpp).
"""
import io
import os
import pickletools
import sys
import zipfile
from collections import OrderedDict

import torch
from torch import nn



class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)


def tiny_state_dict():
    m = Tiny()
    with torch.no_grad():
        m.proj.weight.copy_(torch.arange(12.0).reshape(3, 4) / 8)  # [[0, .125, .25, .375], ...]
        m.proj.bias.copy_(torch.arange(3.0) - 1)                     # [-1, 0, 1]
        m.norm.weight.copy_(torch.arange(3.0) * 0.5 + 1)             # [1, 1.5, 2]
        m.norm.bias.copy_(-torch.arange(3.0) / 4)                    # [0, -.25, -.5]
    sd = m.state_dict()
    assert isinstance(sd, OrderedDict) and hasattr(sd, "_metadata")
    return sd


def nested():
    base = torch.arange(24.0).reshape(4, 6)
    model = {
        "bf16": (torch.arange(6.0).reshape(2, 3) - 2.5).to(torch.bfloat16),
        "fp16": (torch.arange(8.0) / 4).reshape(2, 4).to(torch.float16),
        "i64": torch.arange(5, dtype=torch.int64) * (1 << 40) + 3,
        "i16": torch.arange(3, dtype=torch.int16) * -300,
        "i8": torch.arange(-2, 2, dtype=torch.int8),
        "u8": torch.arange(4, dtype=torch.uint8) + 250,
        "flag": torch.tensor([True, False, True]),
        "one": {"only": torch.arange(4, dtype=torch.int32)},        # one-entry dict: SETITEM
        "base": base,                                                 # storage shared with the two views
        "row": base[2],                                               # offset 12, shape [6]
        "t_slice": base.t()[1:4, ::2],                                # shape [3, 2], stride [1, 12], offset 1
        "tied": base,                                                 # the same object: BINGET
        "scalar": torch.tensor(3.25, dtype=torch.float64),            # 0-d
        "empty": torch.zeros(0, 3),
    }
    assert not model["t_slice"].is_contiguous() and model["t_slice"].storage_offset() == 1
    return {
        "model": model,
        "optim": {"state": {0: {"exp_avg": torch.arange(2.0) - 0.5}}, "param_groups": [{"lr": 0.5, "params": [0]}]},
        "iteration": 7,
        "args": "x",
        "lr": 0.25,
        "none": None,
        "done": True,
        "big": 1 << 70,
        "names": ["a", "b"],
    }


def evil_pickle():
    # {"x": os.system("echo pwned")} in protocol 2, written by hand: PROTO 2, EMPTY_DICT, key,
    # GLOBAL 'os system', arg tuple, REDUCE, SETITEM, STOP.
    arg = b"echo pwned"
    data = (b"\x80\x02}q\x00X\x01\x00\x00\x00x" + b"cos\nsystem\nq\x01" +
            b"X" + len(arg).to_bytes(4, "little") + arg + b"\x85q\x02Rq\x03s.")
    pickletools.dis(data, out=io.StringIO())  # well-formed (disassembly only; nothing runs)
    return data


def write_evil(path):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in [("evil/data.pkl", evil_pickle()), ("evil/byteorder", b"little"), ("evil/version", b"3\n")]:
            z.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)


def dcp_state_dict():
    """Values the C++ test recomputes: w = arange(12).reshape(3, 4) / 4, b = arange(5) bf16 - 2,
    steps = arange(6) int64 * 3, scalar = 2.5."""
    return {
        "model": {
            "module.layer.w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4,
            "module.layer.b": (torch.arange(5, dtype=torch.float32) - 2).to(torch.bfloat16),
        },
        "optimizer": {"state": {"module.layer.w": {"step": torch.tensor(2.5)}}},
        "steps": torch.arange(6, dtype=torch.int64) * 3,
        "iteration": 7,
        "blob": io.BytesIO(b"raw bytes"),
    }


def write_dcp(out):
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(dcp_state_dict(), checkpoint_id=out, no_dist=True)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_torch_save_fixtures.py OUT_DIR")
    OUT = sys.argv[1]
    os.makedirs(OUT, exist_ok=True)
    torch.save(tiny_state_dict(), os.path.join(OUT, "state_dict.pt"))
    buf = io.BytesIO()
    torch.save(nested(), buf)
    with open(os.path.join(OUT, "nested.pt"), "wb") as f:
        f.write(buf.getvalue())
    write_evil(os.path.join(OUT, "evil.pt"))
    torch.save(tiny_state_dict(), os.path.join(OUT, "legacy.pt"), _use_new_zipfile_serialization=False)
    write_dcp(os.path.join(OUT, "dcp"))
    for name in sorted(os.listdir(OUT)):
        path = os.path.join(OUT, name)
        if os.path.isfile(path):
            print(f"{name}: {os.path.getsize(path)} bytes (torch {torch.__version__})")


if __name__ == "__main__":
    main()
