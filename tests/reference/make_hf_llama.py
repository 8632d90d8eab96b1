"""A random Llama written by transformers, for the streaming --hf-load tests and benchmark
(tests/reference/hf_stream_load_reference_test.cpp, bench/hf_load_memory.sh).

  make_hf_llama.py OUT --layers L --hidden H --ffn F --heads A --kv-heads K --vocab V \\
      [--dtype bf16|fp32|fp16] [--tied] [--max-shard-size 2MB] [--expected EXPECTED.safetensors]

Builds LlamaForCausalLM from a LlamaConfig with seed 0, randomises the norm weights (they start
at ones, so a mix-up would not show), saves it with save_pretrained in --dtype (several
safetensors shards and an index when the model is larger than --max-shard-size) and, with
--expected, writes every parameter as fp32 by torch's own conversion: the independent values a
load must give exactly. Local folders only: nothing is downloaded.
"""

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--ffn", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tied", action="store_true")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--expected", default="")
    a = p.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=512,
        tie_word_embeddings=a.tied, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("norm.weight"):
                t.uniform_(0.5, 1.5)
    model = model.to(DTYPES[a.dtype])
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size=a.max_shard_size)
    if a.expected:
        save_file({n: t.detach().float().contiguous() for n, t in model.named_parameters()}, a.expected)
    n = sum(t.numel() for t in model.parameters())
    print(f"transformers {transformers.__version__}: a random LlamaForCausalLM of {n} parameters in {a.dtype} "
          f"(tied={a.tied}) in {a.out}: {', '.join(sorted(os.listdir(a.out)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
