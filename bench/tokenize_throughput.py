r"""Tokenizer throughput: mfsdp-preprocess (HuggingFaceTokenizer, one worker) side by side with the
`tokenizers` library encoding the same documents on one thread, interleaved round after round,
on tokenizer.json files trained at run time in three layouts (tests/reference/
hf_tokenizer_reference.py): llama3 (Split with Llama-3's regex + ByteLevel BPE), unicode_nfkc (the
GPT-2 model behind an NFKC normalizer) and sp_charsmap (a SentencePiece unigram model with its
nmt_nfkc precompiled charsmap). With OLD_BUILD (another commit's build folder) its mfsdp-preprocess
runs in the same rounds too, for a before/after of a change.

  .venv/bin/python bench/tokenize_throughput.py                 # 8 MB, 3 rounds
  MB=2 ROUNDS=2 OLD_BUILD=/tmp/old/build .venv/bin/python bench/tokenize_throughput.py

Prints one row per tokenizer: MB/s of each (median over rounds), the token counts (which must be
equal: a check that both encoded the same thing), and mfsdp's speed over the library's (and over
OLD_BUILD's). Times are wall clock of the whole tool for mfsdp (start-up, reading JSONL, writing
the dataset included) and of encode() alone for the library, so the ratio favours the library.
"""

import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))

import hf_tokenizer_reference as ref  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

LAYOUTS = ["llama3", "unicode_nfkc", "sp_charsmap"]
DTYPES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # Megatron .idx dtype code -> bytes


def documents(megabytes):
    """Multilingual documents (the reference corpus's lines and test texts) of about `megabytes`."""
    lines = ref.corpus(seed=7, lines=4000) + ref.TEXTS
    docs, size, k = [], 0, 0
    while size < megabytes * 1e6:
        doc = "\n".join(lines[(k + j) % len(lines)] for j in range(40))
        docs.append(doc)
        size += len(doc.encode())
        k += 40
    return docs, size


def tokens_written(prefix):
    with open(prefix + "_text_document.idx", "rb") as f:
        header = f.read(18)
    itemsize = DTYPES[header[17]]
    return os.path.getsize(prefix + "_text_document.bin") // itemsize


def run_mfsdp(binary, tokenizer_dir, jsonl, prefix, may_refuse=False):
    """(seconds, tokens), or None when `may_refuse` and the tool refuses the tokenizer (an
    OLD_BUILD from before a normalizer was supported)."""
    start = time.perf_counter()
    done = subprocess.run([binary, "--input", jsonl, "--output-prefix", prefix, "--tokenizer-type",
                           "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir, "--workers", "1",
                           "--log-interval", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if done.returncode != 0:
        if may_refuse:
            return None
        sys.exit(f"tokenize_throughput: {binary} failed:\n{done.stderr}")
    return time.perf_counter() - start, tokens_written(prefix)


def run_library(tokenizer_file, docs):
    tok = Tokenizer.from_file(tokenizer_file)
    start = time.perf_counter()
    count = sum(len(tok.encode(d, add_special_tokens=False).ids) for d in docs)
    return time.perf_counter() - start, count


def main():
    megabytes = float(os.environ.get("MB", "8"))
    rounds = int(os.environ.get("ROUNDS", "3"))
    new_bin = os.environ.get("MFSDP_PREPROCESS", os.path.join(ROOT, "build", "mfsdp-preprocess"))
    old_build = os.environ.get("OLD_BUILD")
    old_bin = os.path.join(old_build, "mfsdp-preprocess") if old_build else None
    with tempfile.TemporaryDirectory(prefix="mfsdp-tokbench-") as work:
        built = ref.build(ref.corpus(), work)
        docs, size = documents(megabytes)
        jsonl = os.path.join(work, "docs.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        times = {(name, who): [] for name in LAYOUTS for who in ("mfsdp", "library", "old")}
        counts = {}
        for r in range(rounds):
            for name in LAYOUTS:
                folder = os.path.join(work, name)
                os.makedirs(folder, exist_ok=True)
                built[name].save(os.path.join(folder, "tokenizer.json"))
                runs = [("mfsdp", lambda: run_mfsdp(new_bin, folder, jsonl, os.path.join(work, "new"))),
                        ("library", lambda: run_library(os.path.join(folder, "tokenizer.json"), docs))]
                if old_bin:
                    runs.append(("old", lambda: run_mfsdp(old_bin, folder, jsonl, os.path.join(work, "old"),
                                                          may_refuse=True)))
                if r % 2:
                    runs.reverse()  # interleaved: neither goes first every round
                for who, run in runs:
                    result = run()
                    if result is None:
                        continue  # OLD_BUILD refused this layout
                    times[(name, who)].append(result[0])
                    counts[(name, who)] = result[1]
        mb = size / 1e6
        print(f"tokenize_throughput: {mb:.1f} MB in {len(docs)} documents, {rounds} rounds, "
              f"one thread each (median MB/s)")
        head = f"{'tokenizer':<14}{'mfsdp MB/s':>12}{'library MB/s':>14}{'mfsdp/library':>15}"
        if old_bin:
            head += f"{'old MB/s':>10}{'new/old':>9}"
        print(head + f"{'tokens mfsdp':>14}{'tokens library':>16}")
        for name in LAYOUTS:
            speed = {w: mb / statistics.median(times[(name, w)]) for w in ("mfsdp", "library", "old")
                     if times[(name, w)]}
            row = (f"{name:<14}{speed['mfsdp']:>12.2f}{speed['library']:>14.2f}"
                   f"{speed['mfsdp'] / speed['library']:>15.2f}")
            if old_bin and "old" in speed:
                row += f"{speed['old']:>10.2f}{speed['mfsdp'] / speed['old']:>9.2f}"
            elif old_bin:
                row += f"{'refused':>10}{'':>9}"
            print(row + f"{counts[(name, 'mfsdp')]:>14}{counts[(name, 'library')]:>16}")
            if counts[(name, "mfsdp")] != counts[(name, "library")]:
                sys.exit(f"tokenize_throughput: {name}: token counts differ")


if __name__ == "__main__":
    main()
