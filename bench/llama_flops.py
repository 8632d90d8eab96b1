"""Megatron's model FLOPs per training iteration for a Llama (GQA, SwiGLU), the formula of
megatron/training/training.py num_floating_point_operations, as the Llama family's
ModelSpec::flops_per_iteration (src/models/llama/llama_spec.cpp) computes it for mfsdp's metrics: the benchmarks use it for the
Python peers, so every TFLOP/s and MFU in a table is counted the same way."""


def megatron_flops_per_iteration(layers, hidden, ffn, heads, query_groups, seq, padded_vocab, batch,
                                 swiglu=True):
    # 3 (forward + 2 x backward) x 2 (multiply-add) x 2 (two GEMMs per block side) = 12.
    gated = 1.5 if swiglu else 1.0
    attention = 1.0 + query_groups / heads + seq / hidden
    mlp = ffn / hidden * gated
    logits = padded_vocab / (2.0 * layers * hidden)
    return 12.0 * batch * seq * layers * hidden * hidden * (attention + mlp + logits)
