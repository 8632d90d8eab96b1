"""The transformers side of the reference tests (tests/reference/hf_reference_test.cpp).

Run by the C++ tests under the reference Python (CMake's MFSDP_PYTHON, made by scripts/setup.sh),
one process per test case because importing torch and transformers takes seconds:

  check-export HF LOGITS --prompt-ids 3,17,42 --mfsdp-ids 5,9,... --max-new-tokens 12 \\
      [--model-type llama|qwen2]
      Loads the folder `mfsdp-ckpt export-hf` wrote with AutoModelForCausalLM.from_pretrained
      (fp32), checks that transformers built the class of --model-type (LlamaForCausalLM by
      default, Qwen2ForCausalLM for qwen2), compares its logits over the prompt with
      mfsdp-generate's --logits-out file (max |diff| <= --atol) and its greedy continuation with
      mfsdp-generate's ids. Exit 1 on a mismatch.

  make-random HF --tied|--untied --seed S [--rope-theta T] [--model-type TYPE] --prompt-ids ... \\
      --max-new-tokens 12 --ids-out IDS --logits-out LOGITS
      Builds a small random model of TYPE (GQA; llama by default; qwen2 with q/k/v biases, qwen3
      with q/k norms and a head_dim unlike hidden / heads, qwen3_moe / qwen2_moe / mixtral with 4
      experts and top-2 routing; norms and biases set to non-default random values), saves it with save_pretrained (safetensors) and
      writes its greedy continuation (IDS: one line, comma-separated) and its fp32 logits over the
      prompt (LOGITS: safetensors, tensor "logits", [1, T, vocab]) for the C++ test to compare
      with mfsdp-generate on the same folder.

Everything printed says what was compared, so a failing C++ test shows it.
"""

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: never reach the network
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()

# The attention implementation both sides are compared under: eager is the plain matmul-softmax
# reference; in fp32 sdpa agrees with it to ~1e-7 either way.
ATTENTION = "eager"


def parse_ids(text):
    return [int(x) for x in text.split(",") if x != ""]


def ids_text(ids):
    return ",".join(str(i) for i in ids)


def prompt_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits.float()


def greedy(model, prompt, max_new_tokens):
    """HF's greedy continuation of `prompt`: exactly max_new_tokens ids, no EOS stop."""
    # The model's generation_config carries eos_token_id (2 for a fresh LlamaConfig); mfsdp's
    # models have no tokenizer and never stop early, so neither may this.
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    new = out[0, len(prompt):].tolist()
    if len(new) != max_new_tokens:
        raise SystemExit(f"transformers generated {len(new)} tokens, asked for {max_new_tokens}")
    return new


EXPECTED_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def check_export(a):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        a.hf, dtype=torch.float32, attn_implementation=ATTENTION
    ).eval()
    prompt = parse_ids(a.prompt_ids)
    biases = sorted(n for n, _ in model.named_parameters() if n.endswith(".bias"))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: loaded {a.hf} as "
          f"{type(model).__name__} (tie_word_embeddings={model.config.tie_word_embeddings}, "
          f"rope_theta={model.config.rope_parameters.get('rope_theta')}, dtype={model.dtype}, "
          f"{len(biases)} bias tensors)")
    ok = True
    want_class = EXPECTED_CLASS[a.model_type]
    if type(model).__name__ != want_class:
        print(f"MISMATCH model class: transformers built {type(model).__name__}, expected {want_class}")
        ok = False

    mfsdp_logits = load_file(a.logits)["logits"]
    hf_logits = prompt_logits(model, prompt)
    if tuple(mfsdp_logits.shape) != tuple(hf_logits.shape):
        print(f"MISMATCH logits shape: mfsdp {tuple(mfsdp_logits.shape)}, "
              f"transformers {tuple(hf_logits.shape)}")
        ok = False
    else:
        diff = (mfsdp_logits.float() - hf_logits).abs().max().item()
        scale = hf_logits.abs().max().item()
        verdict = "ok" if diff <= a.atol else "MISMATCH"
        print(f"{verdict} logits {tuple(hf_logits.shape)} over prompt {ids_text(prompt)}: "
              f"max |mfsdp - transformers| = {diff:.3e} (atol {a.atol:g}; max |logit| {scale:.3f})")
        ok = ok and diff <= a.atol

    hf_ids = greedy(model, prompt, a.max_new_tokens)
    mfsdp_ids = parse_ids(a.mfsdp_ids)
    verdict = "ok" if hf_ids == mfsdp_ids else "MISMATCH"
    print(f"{verdict} greedy {a.max_new_tokens} tokens:\n"
          f"  mfsdp        {ids_text(mfsdp_ids)}\n  transformers {ids_text(hf_ids)}")
    ok = ok and hf_ids == mfsdp_ids
    return 0 if ok else 1


def random_config(a):
    """A small random config of --model-type: GQA, 3 layers; the MoE types with 4 experts, top-2."""
    common = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=a.rope_theta,
        # Wider than the default 0.02 so that the continuation is not one token repeated (a tied
        # model with small weights mostly predicts its own input).
        initializer_range=0.25,
        tie_word_embeddings=a.tied,
        attn_implementation=ATTENTION,
    )
    t = a.model_type
    if t == "llama":
        return transformers.LlamaConfig(intermediate_size=176, **common)
    if t == "qwen2":
        # Qwen2Config has no attention_bias field (its q/k/v biases are fixed) and writes
        # use_sliding_window false, sliding_window null.
        return transformers.Qwen2Config(intermediate_size=176, **common)
    if t == "qwen3":
        # head_dim 24: not hidden_size / heads (16), as Qwen3's 0.6B has 128 for 1024 / 16.
        return transformers.Qwen3Config(intermediate_size=176, head_dim=24, **common)
    if t == "qwen3_moe":
        # Layer 1 dense (mlp_only_layers), renormalised top-k: both paths of the family.
        return transformers.Qwen3MoeConfig(intermediate_size=176, moe_intermediate_size=40, num_experts=4,
                                           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                           head_dim=16, **common)
    if t == "qwen2_moe":
        # Qwen2-MoE's default: the top-k weights are not renormalised; a gated shared expert.
        return transformers.Qwen2MoeConfig(intermediate_size=176, moe_intermediate_size=40, num_experts=4,
                                           num_experts_per_tok=2, shared_expert_intermediate_size=56,
                                           **common)
    if t == "mixtral":
        return transformers.MixtralConfig(intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
                                          **common)
    if t == "deepseek_v3":
        # Multi-head latent attention (a q_lora_rank bottleneck, or a plain q_proj with
        # --q-lora-rank 0), YaRN past 32 positions, the first layer dense, then 8 experts in 4
        # groups (top-2 within the 2 best groups) and 2 shared experts; sigmoid routing with a
        # random e_score_correction_bias (make_random).
        common.update(num_hidden_layers=4, num_key_value_heads=4)
        rope = {"rope_type": "yarn", "rope_theta": a.rope_theta, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        del common["rope_theta"]
        return transformers.DeepseekV3Config(
            intermediate_size=176, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, q_lora_rank=a.q_lora_rank or None, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, rope_parameters=rope, num_mtp_layers=0, **common)
    raise SystemExit(f"unknown model type {t}")


def make_random(a):
    config = random_config(a)
    torch.manual_seed(a.seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Norm weights start at ones and biases at zeros; randomise them too so a mix-up of the norms
    # or a lost bias shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
        # DeepSeek-V3's routing bias is a buffer, zero at init: random, so that it must be loaded.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(a.hf, safe_serialization=True)
    prompt = parse_ids(a.prompt_ids)
    logits = prompt_logits(model, prompt)
    ids = greedy(model, prompt, a.max_new_tokens)
    save_file({"logits": logits.contiguous()}, a.logits_out)
    with open(a.ids_out, "w") as f:
        f.write(ids_text(ids) + "\n")
    saved = sorted(os.listdir(a.hf))
    n_bias = sum(1 for n, _ in model.named_parameters() if n.endswith(".bias"))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: saved a random "
          f"{type(model).__name__} (tie_word_embeddings={a.tied}, seed {a.seed}, {n_bias} bias tensors) "
          f"to {a.hf}: {', '.join(saved)}")
    print(f"transformers greedy {a.max_new_tokens} tokens after {ids_text(prompt)}: {ids_text(ids)}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check-export")
    c.add_argument("hf")
    c.add_argument("logits")
    c.add_argument("--prompt-ids", required=True)
    c.add_argument("--mfsdp-ids", required=True)
    c.add_argument("--max-new-tokens", type=int, required=True)
    c.add_argument("--atol", type=float, default=1e-5)
    c.add_argument("--model-type", choices=sorted(EXPECTED_CLASS), default="llama",
                   help="the architecture transformers must build from the folder")
    r = sub.add_parser("make-random")
    r.add_argument("hf")
    tie = r.add_mutually_exclusive_group(required=True)
    tie.add_argument("--tied", dest="tied", action="store_true")
    tie.add_argument("--untied", dest="tied", action="store_false")
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--rope-theta", type=float, default=10000.0, help="LlamaConfig's default unless given")
    r.add_argument("--q-lora-rank", type=int, default=32, help="deepseek_v3: the query bottleneck; 0: q_proj")
    r.add_argument("--model-type", choices=sorted(EXPECTED_CLASS), default="llama",
                   help="the family of the random model (qwen2: q/k/v biases; qwen3: q/k norms; the MoE types: "
                        "4 experts, top-2)")
    r.add_argument("--prompt-ids", required=True)
    r.add_argument("--max-new-tokens", type=int, required=True)
    r.add_argument("--ids-out", required=True)
    r.add_argument("--logits-out", required=True)
    a = p.parse_args()
    return check_export(a) if a.command == "check-export" else make_random(a)


if __name__ == "__main__":
    sys.exit(main())
