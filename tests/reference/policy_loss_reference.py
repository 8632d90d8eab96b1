"""Second implementation of the post-training loss math in plain torch, written the way verl
(verl/trainer/ppo/core_algos.py: agg_loss, compute_policy_loss_vanilla, kl_penalty,
compute_grpo_outcome_advantage) and TRL (scale_rewards="batch") compute it, on whole batches.

tests/unit/policy_loss_test.cpp writes a batch as JSON, runs this script, and compares its numbers
with mfsdp's C++ functions (docs/policy_loss.md).

usage: policy_loss_reference.py INPUT.json
prints one line per quantity: `key v1 v2 ...` (flattened, row-major, repr of fp64 values).
"""
import json
import sys
from collections import defaultdict

import torch

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KL_TYPES = ["k1", "abs", "k2", "k3", "k3+"]


def masked_sum(values, mask, dim=None):
    # verl: NaN outside the mask must not reach the sum.
    valid = torch.where(mask.bool(), values, 0.0) * mask
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(values, mask):
    return masked_sum(values, mask) / (mask.sum() + 1e-8)


def agg_loss(loss_mat, loss_mask, mode, batch_num_tokens, global_batch_size, loss_scale_factor, dp_size=1):
    if mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if mode == "seq-mean-token-sum":
        seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)
        seq_mask = (loss_mask.sum(dim=-1) > 0).double()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    if mode == "seq-mean-token-mean":
        seq_tokens = loss_mask.sum(dim=-1)
        seq_losses = masked_sum(loss_mat, loss_mask, dim=-1) / (seq_tokens + 1e-8)
        seq_mask = (seq_tokens > 0).double()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    if mode == "seq-mean-token-sum-norm":
        return masked_sum(loss_mat, loss_mask, dim=-1).sum() / loss_scale_factor * dp_size
    raise ValueError(mode)


def policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, low, high, c, mode, norm):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).double(), mask)
    pg_losses3 = -advantages * c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).double(), mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return agg_loss(pg_losses, mask, mode, *norm), pg_clipfrac, ppo_kl, pg_clipfrac_lower


def kl_penalty(logprob, ref_logprob, kind):
    if kind == "k1":
        forward = logprob - ref_logprob
    elif kind == "abs":
        forward = (logprob - ref_logprob).abs()
    elif kind == "k2":
        forward = 0.5 * (logprob - ref_logprob).square()
    elif kind in ("k3", "k3+"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        forward = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    else:
        raise ValueError(kind)
    if kind != "k3+":
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


def grpo_advantage(scores, index, eps, scale):
    """verl's per-group loop (group / none); TRL's batch std for scale == "batch"."""
    id2score = defaultdict(list)
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    id2mean, id2std = {}, {}
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
        else:
            t = torch.stack(group)
            id2mean[idx], id2std[idx] = torch.mean(t), torch.std(t)
    batch_std = torch.std(scores) if len(scores) > 1 else torch.tensor(1.0, dtype=torch.float64)
    out = scores.clone()
    for i in range(len(scores)):
        centred = scores[i] - id2mean[index[i]]
        if scale == "group":
            out[i] = centred / (id2std[index[i]] + eps)
        elif scale == "batch":
            out[i] = centred / (batch_std + eps)
        else:
            out[i] = centred
    return out


def emit(key, t):
    values = t.detach().reshape(-1).tolist()
    print(key, " ".join(repr(float(v)) for v in values))


def main():
    torch.set_default_dtype(torch.float64)
    with open(sys.argv[1]) as f:
        data = json.load(f)
    T = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731

    if "agg" in data:
        d = data["agg"]
        mask = T(d["mask"])
        norm = (mask.sum(), mask.shape[0], d["norm_length"])  # whole-batch denominators
        for mode in MODES:
            loss = T(d["loss"]).requires_grad_()
            value = agg_loss(loss, mask, mode, *norm)
            value.backward()
            emit("agg/" + mode, value)
            emit("agg_grad/" + mode, loss.grad)

    if "clip" in data:
        d = data["clip"]
        mask = T(d["mask"])
        adv = T(d["adv"])
        if adv.dim() == 1:
            adv = adv.unsqueeze(-1).expand_as(mask)
        norm = (mask.sum(), mask.shape[0], d["norm_length"])
        for mode in MODES:
            logp = T(d["logp"]).requires_grad_()
            pg_loss, clipfrac, ppo_kl, lower = policy_loss_vanilla(
                T(d["old"]), logp, adv, mask, d["low"], d["high"], d["c"], mode, norm)
            pg_loss.backward()
            emit("clip/" + mode, pg_loss)
            emit("clip_grad/" + mode, logp.grad)
        emit("clip/pg_clipfrac", clipfrac)
        emit("clip/ppo_kl", ppo_kl)
        emit("clip/pg_clipfrac_lower", lower)

    if "kl" in data:
        d = data["kl"]
        for kind in KL_TYPES:
            logp = T(d["logp"]).requires_grad_()
            value = kl_penalty(logp, T(d["ref"]), kind)
            value.sum().backward()
            emit("kl/" + kind, value)
            emit("kl_grad/" + kind, logp.grad)

    if "adv" in data:
        d = data["adv"]
        for scale in ["group", "batch", "none"]:
            emit("adv/" + scale, grpo_advantage(T(d["scores"]), d["ids"], d["eps"], scale))


if __name__ == "__main__":
    main()
