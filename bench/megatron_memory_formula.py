#!/usr/bin/env python3
"""Megatron-LM's theoretical memory formula for a dense GPT (Llama) model, as arithmetic.

Megatron-LM's megatron/training/theoretical_memory_usage.py estimates one rank's memory as
"weights and optimizer" plus "activations" (Korthikanti et al. 2022, Table 2). This file redoes
that arithmetic (it is not Megatron's code) for pipeline size 1 and a dense model, so that
bench/scale_plan_tp.sh can print it next to mfsdp's --memory-plan:

* parameters on the most loaded model shard = (transformer block + embedding + output layer when
  untied) / TP, with the vocabulary padded as Megatron pads it (to a multiple of
  --make-vocab-size-divisible-by x TP). Megatron divides everything by TP, the layer norms too
  (they are replicated on every TP rank, so this slightly undercounts; exact_per_tp_rank counts
  them whole);
* bytes per parameter: 18 without the distributed optimizer (bf16 weights 2, fp32 gradient
  buffer 4, fp32 main weights 4, Adam's two moments 8); 6 + 12 / DP with it (the 12 bytes of main
  weights and moments are sharded over the data-parallel ranks, weights and gradients are not);
* activations (with --sequence-parallel and selective recompute, the formula Megatron uses then):
  s b h (18 + 4 ffn / h) per layer, plus the embedding's input and dropout and the output layer's
  input and cross-entropy (4 s b h (1 + V / h)), all / TP.

Prints one JSON object.
"""
import argparse
import json


def padded_vocab(vocab, divisible_by, tp):
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--ffn", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--divisible-by", type=int, default=128)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--tied", action="store_true", help="embedding and output layer share one matrix")
    p.add_argument("--gelu", action="store_true", help="a two-matrix MLP instead of SwiGLU's three")
    a = p.parse_args()

    h, L, tp, dp = a.hidden, a.layers, a.tp, a.dp
    head_dim = h // a.heads
    vocab = padded_vocab(a.vocab, a.divisible_by, tp)
    gated = 1.0 if a.gelu else 1.5
    # One layer: q and o (h x heads*head_dim each), k and v (h x kv_heads*head_dim each), the MLP's
    # 2 (or 3) h x ffn matrices, two RMSNorm weights of h.
    q_ratio = a.heads * head_dim / h
    attention = 2 * h * h * (1 + a.kv_heads / a.heads) * q_ratio
    mlp = 2 * h * a.ffn * gated
    norms = 2 * h
    layer = attention + mlp + norms
    block = layer * L + h  # + the final norm
    embedding = h * vocab
    embeddings = embedding * (1 if a.tied else 2)
    total = block + embeddings
    megatron_shard = (block + embedding) / tp + (0 if a.tied else embedding / tp)
    # What a TP rank holds: matrices split over TP, norms whole.
    exact = (L * (attention + mlp) + embeddings) / tp + L * norms + h

    gib = 1024 ** 3
    weights = 2 * megatron_shard          # bf16 model weights
    grads = 4 * megatron_shard            # fp32 gradient buffer (bf16 runs accumulate in fp32)
    optimizer = 12 * megatron_shard       # fp32 main weights + Adam's exp_avg, exp_avg_sq
    s, b = a.seq, a.micro_batch
    activations = (s * b * h * (18 + 4 * a.ffn / h) * L + 8 * s * b + s * b * h
                   + s * b * h * 4 * (1 + vocab / h)) / tp
    print(json.dumps({
        "padded_vocab": vocab,
        "total_params": total,
        "megatron_params_per_shard": megatron_shard,
        "exact_params_per_tp_rank": exact,
        "megatron_weights_gib": weights / gib,
        "megatron_grads_gib": grads / gib,
        "megatron_optimizer_gib": optimizer / dp / gib,
        # compute_weight_and_optimizer_memory: 18 bytes/param, or 6 + 12 / DP with the distributed optimizer
        "megatron_ddp_gib": 18 * megatron_shard / gib,
        "megatron_distopt_gib": (6 + 12 / dp) * megatron_shard / gib,
        "megatron_activations_sp_gib": activations / gib,
    }))


if __name__ == "__main__":
    main()
