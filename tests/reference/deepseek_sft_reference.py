"""The transformers side of tests/reference/deepseek_sft_reference_test.cpp: supervised fine-tuning
of a random DeepseekV3ForCausalLM with torch.optim.AdamW, the run mfsdp-sft must reproduce.

Run by the C++ test under the reference Python (CMake's MFSDP_PYTHON):

  deepseek_sft_reference.py make HF_DIR --seed S
      Saves a small random DeepseekV3ForCausalLM (config.json + model.safetensors, fp32) to
      HF_DIR: multi-head latent attention with the query bottleneck (q_lora_rank) and YaRN, the
      first layer dense (first_k_dense_replace 1), then DeepSeek MoE layers: 8 routed experts in
      4 groups, top-2 within the 2 best groups, sigmoid scores with a random
      e_score_correction_bias, renormalised and scaled by routed_scaling_factor, and 2 shared
      experts. Norm weights are random too, so that a mix-up of the norms shows.

  deepseek_sft_reference.py train HF_DIR DATA.jsonl OUT_DIR --steps N --lr LR --weight-decay WD
      --adam-beta1 B1 --adam-beta2 B2 --adam-eps EPS --clip-grad C
      Loads HF_DIR in fp32 (eager attention and experts) and trains it N steps, each on every line of
      DATA.jsonl (pre-tokenized: {"input_ids": [...], "loss_mask": [...]}, mfsdp-sft's format):
        loss = sum over the target tokens t (loss_mask[t] == 1, t >= 1) of -log p(id_t | ids_<t)
               / the number of target tokens of the batch
      (mfsdp-sft's --loss-agg-mode token-mean), each sequence run alone (batch of one: no
      padding); then torch.nn.utils.clip_grad_norm_ over every parameter (max norm C) and
      torch.optim.AdamW with Megatron's two groups: weight decay on the matrices (dim >= 2), none
      on the 1-D parameters (the norms). A constant learning rate. The routing bias
      e_score_correction_bias is a buffer that transformers never updates.
      Writes OUT_DIR/report.json {"losses": [N], "grad_norms": [N] (before clipping),
      "target_tokens": n} and OUT_DIR/hf/ (save_pretrained: the final weights under the
      checkpoint names an --export-hf folder has).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: never reach the network
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
transformers.utils.logging.disable_progress_bar()


def make(a):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
        intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, rope_parameters=rope, num_mtp_layers=0, attention_dropout=0.0,
        attn_implementation="eager")
    torch.manual_seed(a.seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(a.hf, safe_serialization=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: saved a random "
          f"{type(model).__name__} (seed {a.seed}) to {a.hf}: {', '.join(sorted(os.listdir(a.hf)))}")
    return 0


def read_data(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append((torch.tensor(r["input_ids"], dtype=torch.long),
                             torch.tensor(r["loss_mask"], dtype=torch.bool)))
    return rows


def train(a):
    # Eager attention and the experts' plain per-expert loop: the reference implementations.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        a.hf, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    model.train()  # no dropout in this config; the router has no training-only path
    rows = read_data(a.data)
    # Targets: token t predicted from the tokens before it; the first token never is one.
    targets = [(ids[1:], mask[1:]) for ids, mask in rows]
    n_targets = sum(int(m.sum()) for _, m in targets)
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps,
                            foreach=False, fused=False)
    losses, norms = [], []
    for step in range(a.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for (ids, _), (tgt, mask) in zip(rows, targets):
            logits = model(ids.unsqueeze(0)).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, tgt, reduction="none")
            loss = (nll * mask).sum() / n_targets
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad)
        opt.step()
        losses.append(total)
        norms.append(norm.item())
        print(f"step {step + 1}: loss {total:.9e}, grad norm {norm.item():.9e}")
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(os.path.join(a.out, "hf"), safe_serialization=True)
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump({"losses": losses, "grad_norms": norms, "target_tokens": n_targets,
                   "transformers": transformers.__version__, "torch": torch.__version__}, f)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("hf")
    m.add_argument("--seed", type=int, required=True)
    t = sub.add_parser("train")
    t.add_argument("hf")
    t.add_argument("data")
    t.add_argument("out")
    t.add_argument("--steps", type=int, required=True)
    for flag in ("--lr", "--weight-decay", "--adam-beta1", "--adam-beta2", "--adam-eps", "--clip-grad"):
        t.add_argument(flag, type=float, required=True)
    a = p.parse_args()
    return make(a) if a.command == "make" else train(a)


if __name__ == "__main__":
    sys.exit(main())
