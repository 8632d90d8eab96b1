"""transformers' DeepSeek-V3 pieces run on inputs that a C++ test wrote, for the tests of mfsdp's
group-limited routing (tests/unit/moe_group_routing_test.cpp), YaRN tables
(tests/unit/yarn_rope_test.cpp) and multi-head latent attention (tests/unit/mla_attention_test.cpp).

usage: deepseek_v3_reference.py MODE CASES.json IN.safetensors OUT.safetensors
CASES.json is a list of configs (one Python start for all of a test's cases, which costs more
than the cases); case i reads the tensors "i.<name>" of IN and writes "i.<name>" to OUT.
  route: DeepseekV3TopkRouter on `logits` [T, E] (hidden size E, identity router weight: the
         logits pass through exactly) with optional `bias` [E] (e_score_correction_bias); writes
         `probs` [T, E], each token's weights at its chosen experts and zero elsewhere.
         With "score": "softmax", Megatron-Core's topk_softmax_with_capacity with num_groups /
         group_topk, written out below (transformers' router is sigmoid only).
  rope:  DeepseekV3RotaryEmbedding on `positions` [T]; writes `cos`, `sin` [T, d] (fp32) and
         `scaling` [1] (DeepseekV3Attention's softmax scale for the config).
  mla:   DeepseekV3Attention in fp32 with the weights of IN (HF names without "self_attn.") on
         `x` [B, T, H], causal, positions 0 .. T-1; writes `out` [B, T, H]; given `grad_out`,
         also the gradients of <out, grad_out>: `grad.x` and `grad.<parameter name>`.
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds


def make_config(c):
    return DeepseekV3Config(**c)


def megatron_softmax_route(logits, k, num_groups, group_topk, pre_softmax, scaling):
    # Megatron-Core moe_utils: group_limited_topk inside topk_softmax_with_capacity, except that
    # a group is scored by its top-2 (transformers' rule; Megatron's top_k / group_topk).
    tokens, experts = logits.shape

    def group_limited_topk(scores):
        group_scores = scores.view(tokens, num_groups, -1).topk(min(2, experts // num_groups), dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, -1)
        return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=k, dim=-1)

    if pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        probs, idx = group_limited_topk(scores)
    else:
        top_logits, idx = group_limited_topk(logits)
        probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    return probs * scaling, idx


def route(c, t):
    logits = t["logits"].float()
    tokens, experts = logits.shape
    if c.get("score", "sigmoid") == "softmax":
        weights, idx = megatron_softmax_route(logits, c["num_experts_per_tok"], c["n_group"], c["topk_group"],
                                              not c["norm_topk_prob"], c["routed_scaling_factor"])
    else:
        config = make_config(dict(c, hidden_size=experts, n_routed_experts=experts))
        router = ds.DeepseekV3TopkRouter(config)
        with torch.no_grad():
            router.weight.copy_(torch.eye(experts))
            if "bias" in t:
                router.e_score_correction_bias.copy_(t["bias"].float())
            _, weights, idx = router(logits)
    return {"probs": torch.zeros(tokens, experts).scatter(1, idx, weights.float())}


def rope(c, t):
    config = make_config(c)
    emb = ds.DeepseekV3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = emb(x, t["positions"].long().unsqueeze(0))
    attn = ds.DeepseekV3Attention(config, 0)
    return {"cos": cos[0].contiguous(), "sin": sin[0].contiguous(),
            "scaling": torch.tensor([attn.scaling], dtype=torch.float64)}


def mla(c, t):
    config = make_config(c)
    config._attn_implementation = "eager"
    attn = ds.DeepseekV3Attention(config, 0).float().eval()
    weights = {k: v for k, v in t.items() if k not in ("x", "grad_out")}
    attn.load_state_dict(weights, strict=True)  # every HF name, no other
    x = t["x"].float().requires_grad_()
    batch, length, _ = x.shape
    positions = torch.arange(length).unsqueeze(0).expand(batch, length)
    cos, sin = ds.DeepseekV3RotaryEmbedding(config)(x, positions)
    mask = torch.full((length, length), float("-inf")).triu(1).view(1, 1, length, length)
    out, _ = attn(x, (cos, sin), mask)
    result = {"out": out.detach().contiguous()}
    if "grad_out" in t:
        out.backward(t["grad_out"].float())
        result["grad.x"] = x.grad
        result.update({"grad." + name: p.grad for name, p in attn.named_parameters()})
    return result


def main():
    mode, config_path, in_path, out_path = sys.argv[1:5]
    torch.use_deterministic_algorithms(True)
    cases = json.load(open(config_path))
    tensors = load_file(in_path)
    run = {"route": route, "rope": rope, "mla": mla}[mode]
    out = {}
    for i, c in enumerate(cases):
        prefix = f"{i}."
        t = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        out.update({prefix + k: v for k, v in run(c, t).items()})
    save_file(out, out_path)


if __name__ == "__main__":
    main()
