#!/usr/bin/env python3
"""Fails when a file of one layer includes a header of a layer above it, or when a file above the
models layer includes a model family's header.

The layers, lowest first (docs/design.md, "Layers"): a file may include headers of its own layer
and of the layers its entry lists, never one above. Public headers live in
include/mfsdp/<layer>/, internal ones in src/<layer>/; tools/, tests/, bench/ and examples/ sit
on top. The tools are the library's first users: they include public headers only (a private
"train/..." header from a tool is an error), while tests may look inside. The build runs this check before compiling the library
(CMakeLists.txt), so an upward include fails the build; tests/layers/check_layers_test.sh shows
that it catches one.

Model families (docs/design.md, "Model families") live in src/models/<family>/, with public
headers include/mfsdp/models/<family>.h and <family>_*.h. The checkpoint and train layers and
tools/ reach a model only through the family-neutral ModelSpec and CausalLM
(include/mfsdp/models/model_spec.h), so adding a family touches none of them.

Usage: check_layers.py ROOT   (prints each upward include as FILE:LINE: ...; exit 1 if any)
"""
import os
import re
import sys

# Each layer and the layers below it that it may use. base (CRC-32C, folder walks, splitmix64, JSON),
# launch and data are torch-free (mfsdp-run and mfsdp-preprocess link only them), compat is
# header-only glue over LibTorch's versions.
BELOW = {
    "base": [],
    "launch": ["base"],
    "data": ["base"],
    "compat": [],
    "comm": ["launch", "compat", "base"],
    "optim": ["comm", "launch", "compat", "base"],
    "fsdp": ["optim", "comm", "launch", "compat", "base"],
    "models": ["fsdp", "optim", "comm", "launch", "compat", "data", "base"],
    "checkpoint": ["models", "fsdp", "optim", "comm", "launch", "compat", "data", "base"],
    "train": ["checkpoint", "models", "fsdp", "optim", "comm", "launch", "compat", "data", "base"],
}
TOP = ("tools", "tests", "bench", "examples")
# Who may not name a family: the layers above models, and the tools.
FAMILY_NEUTRAL = ("checkpoint", "train", "tools")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def layer_of_file(rel):
    parts = rel.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    if parts[:2] == ["include", "mfsdp"] and len(parts) > 3:
        return parts[2]
    return None


def layer_of_include(inc):
    parts = inc.split("/")
    if parts[0] == "mfsdp" and len(parts) > 2 and parts[1] in BELOW:
        return parts[1]
    if len(parts) > 1 and parts[0] in BELOW:
        return parts[0]
    return None


def private_header(inc):
    """A layer's internal header (src/<layer>/...), as opposed to its public mfsdp/<layer>/..."""
    return not inc.startswith("mfsdp/") and layer_of_include(inc) is not None


def families(root):
    models = os.path.join(root, "src", "models")
    return sorted(d for d in os.listdir(models) if os.path.isdir(os.path.join(models, d)))


def family_of_include(inc, names):
    parts = inc.split("/")
    if parts[:2] == ["mfsdp", "models"] and len(parts) == 3:
        stem = parts[2][:-2] if parts[2].endswith(".h") else parts[2]
        return next((f for f in names if stem == f or stem.startswith(f + "_")), None)
    if parts[0] == "models" and len(parts) > 2 and parts[1] in names:
        return parts[1]
    return None


def check(root):
    problems = []
    names = families(root)
    for top in ("src", "include", "tools"):
        for folder, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith((".h", ".cpp")):
                    continue
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, root)
                text = open(path, encoding="utf-8").read()
                neutral = top == "tools" or layer_of_file(rel) in FAMILY_NEUTRAL
                for m in INCLUDE.finditer(text) if neutral else ():
                    family = family_of_include(m.group(1), names)
                    if family is not None:
                        line = text.count("\n", 0, m.start()) + 1
                        problems.append(f"{rel}:{line}: includes \"{m.group(1)}\" of the {family} model family; "
                                        f"above the models layer a model is reached through its ModelSpec "
                                        f"(mfsdp/models/model_spec.h)")
                    elif top == "tools" and private_header(m.group(1)):
                        line = text.count("\n", 0, m.start()) + 1
                        problems.append(f"{rel}:{line}: includes the private header \"{m.group(1)}\" of the "
                                        f"{layer_of_include(m.group(1))} layer; tools use the public API "
                                        f"(include/mfsdp/<layer>/)")
                if top == "tools":
                    continue
                layer = layer_of_file(rel)
                if layer is None:
                    problems.append(f"{rel}: not inside a layer's folder (src/<layer>/ or include/mfsdp/<layer>/)")
                    continue
                if layer not in BELOW:
                    problems.append(f"{rel}: '{layer}' is not a layer ({', '.join(BELOW)})")
                    continue
                for m in INCLUDE.finditer(text):
                    used = layer_of_include(m.group(1))
                    if used is None or used == layer or used in BELOW[layer]:
                        continue
                    line = text.count("\n", 0, m.start()) + 1
                    problems.append(f"{rel}:{line}: the {layer} layer includes \"{m.group(1)}\" of the {used} "
                                    f"layer, which is not below it (it may use: {', '.join(BELOW[layer]) or 'none'})")
    return problems


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: check_layers.py ROOT")
    problems = check(sys.argv[1])
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} include(s) break the layering (scripts/check_layers.py)")
        sys.exit(1)


if __name__ == "__main__":
    main()
