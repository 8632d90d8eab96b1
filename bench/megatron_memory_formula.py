#!/usr/bin/env python3
"""Megatron-LM's theoretical memory formula for a GPT (Llama, MoE, DeepSeek-V3) model, as arithmetic.

Megatron-LM's megatron/training/theoretical_memory_usage.py estimates one rank's memory as
"weights and optimizer" plus "activations" (Korthikanti et al. 2022, Table 2). This file redoes
that arithmetic (it is not Megatron's code), so that bench/scale_plan_tp.sh,
bench/scale_plan_deepseek.sh and bench/scale_plan_pp.sh can print it next to mfsdp's --memory-plan.
Pipeline size 1 (the default) is described first; --pp P (and --vp) at the end. With --pp 1 the
output is that of the version before --pp, byte for byte.

Dense model (no --num-experts, no --mla; the output of the first version of this file, unchanged):

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

Mixture of experts and multi-head latent attention (--num-experts, --mla; Megatron's newer form of
the formula, which splits the parameters by how a rank holds them):

* attention per layer. Grouped-query: 2 h^2 (1 + kv_heads / heads) (heads x head_dim / h), as
  above. MLA (DeepSeek-V2/V3): the query is q_down [q_lora, h] + its RMSNorm (q_lora) + q_up
  [heads (qk_head_dim + qk_pos_emb_head_dim), q_lora], or one [heads (qk + pos), h] matrix without
  q_lora; the key/value latent kv_down [kv_lora + qk_pos_emb_head_dim, h] (the RoPE key is shared
  by all heads) + its RMSNorm (kv_lora) + kv_up [heads (qk_head_dim + v_head_dim), kv_lora]; the
  output projection [h, heads v_head_dim]. Megatron counts the two latent norms with the
  attention, so / TP;
* MLP per layer: a dense layer 2 h ffn x 1.5 (SwiGLU's three matrices; 1 with --gelu); an MoE
  layer the routed experts 2 h moe_ffn x 1.5 x E, the shared expert 2 h shared_ffn x 1.5, the
  router [E, h] (and a shared-expert gate of h with --shared-expert-gate). DeepSeek-V3's expert
  bias is a buffer, no parameter: not counted. Which layers are MoE: --moe-layer-freq (an
  interval N, every N-th layer from 0; or a list such as [0,0,1,1]; or Megatron's expression
  such as "([0]*3+[1]*58)");
* per-layer norms 2 h; final norm h; embedding h V, and the output layer h V again when untied;
* multi-token prediction (--mtp-layers, default 0): as Megatron counts it, that many more layers
  of the last layer's kind (Megatron's formula leaves out the MTP block's own [h, 2h] projection
  and its norms; it shares the embedding and the output layer);
* how a rank holds them: the attention, dense MLPs, shared experts and the embeddings are split
  over TP; the per-layer norms, routers, shared-expert gates and the final norm are replicated
  (whole on every rank); the routed experts are split over ETP x EP (each rank holds E / EP
  experts of every MoE layer, each cut ETP ways);
* bytes per parameter: 18 without the distributed optimizer; with it 6 + 12 / DP for the
  TP-split and replicated parameters (DP = world / TP) and 6 + 12 / EDP for the experts (expert
  data parallel, EDP = world / (ETP x EP)): Megatron's distributed optimizer shards the main
  weights and Adam's moments over the ranks that hold the same parameter, never the bf16
  weights or the fp32 gradient buffer;
* activations: Megatron's formula does not look at experts or MLA: s b h (18 + 4 ffn / h) per
  layer with the dense ffn for every layer, as above (with sequence parallelism and selective
  recompute), and megatron_activations_nosp_gib, the form Megatron prints otherwise (always at TP
  1, where it turns sequence parallelism off): s b h (10 + 24 / TP) per layer, the embedding's
  input and dropout, and (s b V / TP + s b h) x 2 bytes for the logits and the final norm's
  output, all x 1.05.

Pipeline parallelism (--pp P > 1, optionally --vp V virtual stages per pipeline rank; --dp is
Megatron's data-parallel size, world / (TP x PP); the world is DP x TP x PP):

* parameters on the most loaded model shard (compute_weight_and_optimizer_memory): the transformer
  block / PP (Megatron assumes an even share, final norm included, whatever the real split is)
  plus one embedding, / TP; the untied output layer is added only at PP 1, since with PP > 1 it
  sits on the last stage, not the first. The MoE/MLA form keeps its split: TP-split parameters
  (block / PP + the MTP block whole + one embedding) / TP, replicated ones block / PP + MTP's,
  routed experts (block / PP + MTP's) / (ETP x EP), and EDP = world / (ETP x EP x PP). The dense
  form keeps its first-version convention (everything / TP, norms too). Bytes per parameter as at
  PP 1. megatron_params_other_shards: Megatron's count for the other stages, block / PP only;
* activations (compute_activation_memory, and compute_activation_memory_without_sp): still the
  first stage's and still every one of the L layers (P in-flight micro-batches x L / P layers
  each); the embedding's input (8 s b) and dropout (s b h) times P in flight; interleaved (--vp V):
  everything x 1 + (P - 1) / (P V); non-interleaved with --num-microbatches m < P: x m / P; no
  output-layer term (that is on the last stage);
* outside Megatron's formula (mfsdp's own arithmetic, for the comparison): pp_stage_layers, the
  decoder layers of each pipeline rank as Megatron's get_num_layers_to_build splits them
  (--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split,
  summed over a rank's virtual chunks); stage_params_exact, what a TP rank of each stage holds
  (its layers' matrices / TP with their norms whole, the embedding / TP on the first stage, the
  final norm and the output layer / TP on the last, where a tied embedding keeps its copy too;
  dense form only); stage_activations_sp_gib (non-interleaved only), Megatron's per-layer and
  embedding terms applied to each stage's real layers and 1F1B's in-flight micro-batches
  min(P - s, m) on stage s, plus the output layer's input and cross-entropy (4 s b h (1 + V / h))
  once on the last stage, / TP. exact_params_per_tp_rank stays the whole model's (all stages).

Prints one JSON object. MoE/MLA runs add the split (dense, expert) and the active parameters;
--pp > 1 adds the keys of the pipeline (pp, vp, stage lists, ...).
"""
import argparse
import json
import math
import re


def padded_vocab(vocab, divisible_by, tp):
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def moe_layer_pattern(freq, layers):
    """--moe-layer-freq as a list of 0/1 per layer: an interval, a list, or Megatron's expression."""
    text = freq.replace(" ", "")
    if re.fullmatch(r"[0-9]+", text):
        n = int(text)
        if n < 1:
            raise SystemExit("--moe-layer-freq: an interval must be >= 1")
        pattern = [1 if i % n == 0 else 0 for i in range(layers)]
    else:
        if text.startswith("(") and text.endswith(")"):
            text = text[1:-1]
        pattern = []
        for term in text.split("+"):
            m = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*([0-9]+))?", term)
            if not m:
                raise SystemExit(f"--moe-layer-freq: cannot read {term!r} (an interval, [0,1,..] or ([0]*3+[1]*58))")
            pattern += [int(v) for v in m.group(1).split(",")] * int(m.group(2) or 1)
    if len(pattern) != layers:
        raise SystemExit(f"--moe-layer-freq lists {len(pattern)} layers, --layers is {layers}")
    return pattern


def pipeline_split(a):
    """Decoder layers of each pipeline rank, as Megatron's get_num_layers_to_build (in
    megatron/core/transformer/transformer_block.py) splits them, summed over a rank's virtual chunks."""
    pp, layers = a.pp, a.layers
    first, last = a.first_stage_layers, a.last_stage_layers
    if first is not None or last is not None:
        if a.account_for_embedding or a.account_for_loss:
            raise SystemExit("--decoder-first/last-pipeline-num-layers cannot be combined with "
                             "--account-for-embedding/loss-in-pipeline-split (as in Megatron)")
        rest, stages = layers, pp
        if first is not None:
            rest, stages = rest - first, stages - 1
        if last is not None:
            rest, stages = rest - last, stages - 1
        if stages > 0 and rest % stages:
            raise SystemExit(f"the {rest} layers left do not split evenly over the {stages} middle stages")
        per_rank = rest // stages if stages > 0 else 0
        split = [per_rank] * pp
        if first is not None:
            split[0] = first
        if last is not None:
            split[-1] = last
    else:
        units = layers + (1 if a.account_for_embedding else 0) + (1 if a.account_for_loss else 0)
        if units % pp:
            raise SystemExit(f"{units} layers (embedding and loss counted as asked) do not split evenly over PP {pp}")
        split = [units // pp] * pp
    if a.vp and any(n % a.vp for n in split):
        raise SystemExit(f"a pipeline rank's layers {split} do not split evenly into --vp {a.vp} chunks")
    if a.first_stage_layers is None and a.account_for_embedding:
        split[0] -= 1
    if a.last_stage_layers is None and a.account_for_loss:
        split[-1] -= 1
    if min(split) < 0 or sum(split) != layers:
        raise SystemExit(f"the pipeline split {split} does not hold the {layers} layers")
    return split


def pipeline_activations(a, per_layer_sp, per_layer_nosp):
    """compute_activation_memory and compute_activation_memory_without_sp with PP > 1: the first
    stage, every layer (P micro-batches in flight x L / P layers), the embedding's input and dropout
    x P, the interleaving penalty or the discount for fewer micro-batches than P, no output layer."""
    s, b, h, pp = a.seq, a.micro_batch, a.hidden, a.pp
    embedding_terms = 8 * s * b * pp + s * b * h * pp
    sp = per_layer_sp * a.layers + embedding_terms
    nosp = per_layer_nosp * a.layers + embedding_terms
    if a.vp:
        penalty = 1 + (pp - 1) / (pp * a.vp)
        in_flight = math.ceil(penalty * pp)
        sp *= penalty
        nosp *= penalty
    else:
        penalty = 1
        in_flight = pp
        if a.num_microbatches is not None:
            sp *= min(1, a.num_microbatches / pp)
            nosp *= min(1, a.num_microbatches / pp)
            in_flight = min(a.num_microbatches, pp)
    return sp / a.tp, nosp * 1.05, penalty, in_flight


def stage_activations_sp(a, vocab, split, per_layer_sp):
    """Not Megatron's formula: its per-layer and embedding terms (sequence parallel, selective
    recompute) on each stage's real layers, with 1F1B's min(P - s, m) micro-batches in flight on
    stage s, and the output layer's input and cross-entropy once on the last stage; / TP."""
    s, b, h, pp = a.seq, a.micro_batch, a.hidden, a.pp
    m = a.num_microbatches if a.num_microbatches is not None else pp
    out = []
    for stage, layers in enumerate(split):
        in_flight = min(pp - stage, m)
        total = per_layer_sp * layers * in_flight
        if stage == 0:
            total += (8 * s * b + s * b * h) * in_flight
        if stage == pp - 1:
            total += s * b * h * 4 * (1 + vocab / h)
        out.append(total / a.tp)
    return out


def pipeline_keys(a, vocab, split, per_layer_sp, per_layer_nosp, most_loaded, other, world):
    """The keys --pp > 1 adds to the report."""
    gib = 1024 ** 3
    sp, nosp, penalty, in_flight = pipeline_activations(a, per_layer_sp, per_layer_nosp)
    keys = {
        "pp": a.pp,
        "vp": a.vp,
        "world": world,
        "num_microbatches": a.num_microbatches,
        "in_flight_microbatches": in_flight,
        "interleaved_penalty": penalty,
        "pp_stage_layers": split,
        "megatron_params_most_loaded_shard": most_loaded,
        "megatron_params_other_shards": other,
        "megatron_activations_sp_gib": sp / gib,
        "megatron_activations_nosp_gib": nosp / gib,
    }
    if not a.vp:
        keys["stage_activations_sp_gib"] = [x / gib for x in stage_activations_sp(a, vocab, split, per_layer_sp)]
    return keys


def dense_report(a):
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
    if a.pp == 1:
        megatron_shard = (block + embedding) / tp + (0 if a.tied else embedding / tp)
    else:
        # compute_weight_and_optimizer_memory, PP > 1: the block / PP plus one embedding (the first
        # stage's), all / TP; the untied output layer sits on the last stage and is not added.
        megatron_shard = (block / a.pp + embedding) / tp
    # What a TP rank holds: matrices split over TP, norms whole.
    exact = (L * (attention + mlp) + embeddings) / tp + L * norms + h

    gib = 1024 ** 3
    weights = 2 * megatron_shard          # bf16 model weights
    grads = 4 * megatron_shard            # fp32 gradient buffer (bf16 runs accumulate in fp32)
    optimizer = 12 * megatron_shard       # fp32 main weights + Adam's exp_avg, exp_avg_sq
    s, b = a.seq, a.micro_batch
    activations = (s * b * h * (18 + 4 * a.ffn / h) * L + 8 * s * b + s * b * h
                   + s * b * h * 4 * (1 + vocab / h)) / tp
    report = {
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
    }
    if a.pp > 1:
        split = pipeline_split(a)
        # What a TP rank of each stage holds: its layers (matrices / TP, norms whole), the embedding
        # / TP on the first stage, the final norm and the output layer / TP on the last (a tied
        # embedding keeps its copy there).
        per_layer = (attention + mlp) / tp + norms
        stage_exact = [n * per_layer for n in split]
        stage_exact[0] += embedding / tp
        stage_exact[-1] += h + embedding / tp
        report.update(pipeline_keys(a, vocab, split, s * b * h * (18 + 4 * a.ffn / h),
                                    s * b * h * (10 + 24 / tp), megatron_shard, block / (a.pp * tp),
                                    a.dp * tp * a.pp))
        report["stage_params_exact"] = stage_exact
    return report


def moe_mla_report(a):
    h, L, tp, dp = a.hidden, a.layers, a.tp, a.dp
    world = dp * tp
    etp = a.etp if a.etp else tp
    ep = a.ep
    if world % (etp * ep):
        raise SystemExit(f"ETP {etp} x EP {ep} does not divide the world DP x TP = {world}")
    edp = world // (etp * ep)
    vocab = padded_vocab(a.vocab, a.divisible_by, tp)
    gated = 1.0 if a.gelu else 1.5
    heads = a.heads

    # Attention of one layer (every layer has the same).
    if a.mla:
        if a.q_lora_rank:
            q = a.q_lora_rank * h + a.q_lora_rank + heads * (a.qk_head_dim + a.qk_pos_emb_head_dim) * a.q_lora_rank
        else:
            q = heads * (a.qk_head_dim + a.qk_pos_emb_head_dim) * h
        kv = ((a.kv_lora_rank + a.qk_pos_emb_head_dim) * h + a.kv_lora_rank
              + heads * (a.qk_head_dim + a.v_head_dim) * a.kv_lora_rank)
        out = heads * a.v_head_dim * h
        attention = q + kv + out
        latent_norms = (a.q_lora_rank or 0) + a.kv_lora_rank  # inside `attention`; Megatron splits them / TP
    else:
        head_dim = a.kv_channels or h // heads
        attention = 2 * h * h * (1 + a.kv_heads / heads) * (heads * head_dim / h)
        latent_norms = 0

    if a.num_experts:
        pattern = moe_layer_pattern(a.moe_layer_freq, L)
        if a.num_experts % ep:
            raise SystemExit(f"EP {ep} does not divide --num-experts {a.num_experts}")
    else:
        pattern = [0] * L
    moe_layers = sum(pattern)
    dense_layers = L - moe_layers
    moe_ffn = a.moe_ffn or a.ffn
    dense_mlp = 2 * h * a.ffn * gated
    expert = 2 * h * moe_ffn * gated                      # one routed expert
    routed = expert * a.num_experts                       # all routed experts of one MoE layer
    shared = 2 * h * a.moe_shared_ffn * gated             # the shared expert(s), one MLP
    router = h * a.num_experts if a.num_experts else 0
    shared_gate = h if (a.shared_expert_gate and a.moe_shared_ffn) else 0
    norms = 2 * h
    final_norm = h
    embedding = h * vocab
    embeddings = embedding * (1 if a.tied else 2)

    mtp_moe = a.mtp_layers * pattern[-1]
    mtp_dense = a.mtp_layers - mtp_moe
    n_dense, n_moe = dense_layers + mtp_dense, moe_layers + mtp_moe  # layers counted, MTP included

    dense_layer = attention + dense_mlp + norms
    moe_layer = attention + routed + shared + router + shared_gate + norms
    block = dense_layer * dense_layers + moe_layer * moe_layers + final_norm
    mtp_block = dense_layer * mtp_dense + moe_layer * mtp_moe
    total = block + mtp_block + embeddings
    active_moe_layer = attention + expert * a.moe_topk + shared + router + shared_gate + norms
    active = (dense_layer * dense_layers + active_moe_layer * moe_layers + final_norm
              + dense_layer * mtp_dense + active_moe_layer * mtp_moe + embeddings)

    # How a rank holds them.
    tp_split = (attention + dense_mlp) * n_dense + (attention + shared) * n_moe + embeddings
    replicated = norms * (n_dense + n_moe) + (router + shared_gate) * n_moe + final_norm
    expert_split = routed * n_moe
    dense_shard = tp_split / tp + replicated
    expert_shard = expert_split / (etp * ep)
    megatron_shard = dense_shard + expert_shard
    # Megatron splits the MLA latent norms over TP with the attention; a TP rank holds them whole.
    exact = dense_shard + latent_norms * (n_dense + n_moe) * (1 - 1 / tp) + expert_shard

    gib = 1024 ** 3
    s, b = a.seq, a.micro_batch
    activations = (s * b * h * (18 + 4 * a.ffn / h) * L + 8 * s * b + s * b * h
                   + s * b * h * 4 * (1 + vocab / h)) / tp
    activations_nosp = (s * b * h * (10 + 24 / tp) * L + 8 * s * b + s * b * h
                        + (s * b * vocab / tp + s * b * h) * 2) * 1.05
    report = {
        "padded_vocab": vocab,
        "total_params": total,
        "active_params": active,
        "mtp_params": mtp_block,
        "dense_layers": dense_layers,
        "moe_layers": moe_layers,
        "params_attention_per_layer": attention,
        "params_dense_layer": dense_layer,
        "params_moe_layer": moe_layer,
        "params_routed_experts_per_moe_layer": routed,
        "params_embeddings": embeddings,
        "world": world,
        "ep": ep,
        "etp": etp,
        "edp": edp,
        "megatron_dense_params_per_rank": dense_shard,
        "megatron_expert_params_per_rank": expert_shard,
        "megatron_params_per_shard": megatron_shard,
        "exact_params_per_tp_rank": exact,
        "megatron_weights_gib": 2 * megatron_shard / gib,
        "megatron_grads_gib": 4 * megatron_shard / gib,
        "megatron_optimizer_gib": (12 * dense_shard / dp + 12 * expert_shard / edp) / gib,
        "megatron_ddp_gib": 18 * megatron_shard / gib,
        "megatron_distopt_gib": ((6 + 12 / dp) * dense_shard + (6 + 12 / edp) * expert_shard) / gib,
        "megatron_activations_sp_gib": activations / gib,
        "megatron_activations_nosp_gib": activations_nosp / gib,
    }
    if a.pp > 1:
        # compute_weight_and_optimizer_memory, PP > 1: the most loaded shard holds the block / PP,
        # the MTP block whole and one embedding. (EDP = world / (ETP x EP x PP) = DP x TP / (ETP x EP),
        # the edp above.)
        pp = a.pp
        tp_split_block = (attention + dense_mlp) * dense_layers + (attention + shared) * moe_layers
        tp_split_mtp = (attention + dense_mlp) * mtp_dense + (attention + shared) * mtp_moe
        replicated_block = norms * L + (router + shared_gate) * moe_layers + final_norm
        replicated_mtp = norms * a.mtp_layers + (router + shared_gate) * mtp_moe
        dense_shard = (tp_split_block / pp + tp_split_mtp + embedding) / tp + replicated_block / pp + replicated_mtp
        expert_shard = (routed * moe_layers / pp + routed * mtp_moe) / (etp * ep)
        megatron_shard = dense_shard + expert_shard
        other = tp_split_block / (pp * tp) + replicated_block / pp + routed * moe_layers / (pp * etp * ep)
        report.update({
            "megatron_dense_params_per_rank": dense_shard,
            "megatron_expert_params_per_rank": expert_shard,
            "megatron_params_per_shard": megatron_shard,
            "megatron_weights_gib": 2 * megatron_shard / gib,
            "megatron_grads_gib": 4 * megatron_shard / gib,
            "megatron_optimizer_gib": (12 * dense_shard / dp + 12 * expert_shard / edp) / gib,
            "megatron_ddp_gib": 18 * megatron_shard / gib,
            "megatron_distopt_gib": ((6 + 12 / dp) * dense_shard + (6 + 12 / edp) * expert_shard) / gib,
        })
        report.update(pipeline_keys(a, vocab, pipeline_split(a), s * b * h * (18 + 4 * a.ffn / h),
                                    s * b * h * (10 + 24 / tp), megatron_shard, other, world * pp))
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--ffn", type=int, required=True, help="the dense MLP's width")
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query); required without --mla")
    p.add_argument("--kv-channels", type=int, default=0, help="head width (0: hidden / heads); MoE/MLA form only")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--divisible-by", type=int, default=128)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks; the world is DP x TP")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--tied", action="store_true", help="embedding and output layer share one matrix")
    pipe = p.add_argument_group("pipeline parallelism (Megatron's flags; --dp is then world / (TP x PP))")
    pipe.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    pipe.add_argument("--vp", type=int, default=0,
                      help="virtual pipeline stages per pipeline rank, the interleaved schedule (0: not interleaved)")
    pipe.add_argument("--num-microbatches", type=int, default=None,
                      help="micro-batches per step (default: at least PP, so PP in flight)")
    pipe.add_argument("--decoder-first-pipeline-num-layers", dest="first_stage_layers", type=int, default=None)
    pipe.add_argument("--decoder-last-pipeline-num-layers", dest="last_stage_layers", type=int, default=None)
    pipe.add_argument("--account-for-embedding-in-pipeline-split", dest="account_for_embedding", action="store_true")
    pipe.add_argument("--account-for-loss-in-pipeline-split", dest="account_for_loss", action="store_true")
    p.add_argument("--gelu", action="store_true", help="a two-matrix MLP instead of SwiGLU's three")
    moe = p.add_argument_group("mixture of experts and expert parallelism")
    moe.add_argument("--num-experts", type=int, default=0, help="routed experts per MoE layer (0: dense)")
    moe.add_argument("--moe-ffn", type=int, default=0, help="each routed expert's width (0: --ffn)")
    moe.add_argument("--moe-shared-ffn", type=int, default=0, help="the shared expert's width (0: none)")
    moe.add_argument("--shared-expert-gate", action="store_true", help="a sigmoid gate of h on the shared expert")
    moe.add_argument("--moe-topk", type=int, default=2, help="experts per token (for the active parameters)")
    moe.add_argument("--moe-layer-freq", default="1", help="an interval, a list [0,1,..] or ([0]*3+[1]*58)")
    moe.add_argument("--ep", type=int, default=1, help="expert-model-parallel size")
    moe.add_argument("--etp", type=int, default=0, help="expert-tensor-parallel size (0: TP, Megatron's default)")
    moe.add_argument("--mtp-layers", type=int, default=0, help="multi-token-prediction layers (Megatron's count)")
    mla = p.add_argument_group("multi-head latent attention")
    mla.add_argument("--mla", action="store_true")
    mla.add_argument("--q-lora-rank", type=int, default=0, help="0: a plain query projection")
    mla.add_argument("--kv-lora-rank", type=int, default=512)
    mla.add_argument("--qk-head-dim", type=int, default=128)
    mla.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    mla.add_argument("--v-head-dim", type=int, default=128)
    a = p.parse_args()
    if not a.mla and a.kv_heads is None:
        p.error("--kv-heads is required without --mla")
    if a.pp < 1 or a.vp < 0 or (a.num_microbatches is not None and a.num_microbatches < 1):
        p.error("--pp and --num-microbatches must be >= 1, --vp >= 0")
    if a.vp and a.pp == 1:
        p.error("--vp (the interleaved schedule) needs --pp > 1")
    if a.num_experts or a.mla:
        report = moe_mla_report(a)
    else:
        report = dense_report(a)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
