"""The transformers side of tests/reference/sft_export_reference_test.cpp.

Run by the C++ test under the reference Python (CMake's MFSDP_PYTHON, which has torch,
transformers, tokenizers and safetensors):

  sft_export_reference.py train-tokenizer OUT_DIR
      Trains a tiny byte-level BPE with the `tokenizers` library (Qwen2's layout: a Split with
      Llama-3's regex, then ByteLevel; the special tokens <|endoftext|>, <|im_start|>, <|im_end|>
      added after training, so their ids follow the vocabulary) and writes OUT_DIR/tokenizer.json
      and OUT_DIR/tokenizer_config.json with eos_token <|im_end|> and the ChatML chat_template
      inline, as Qwen2 instruct folders on the Hub have it. This is the --tokenizer-model that
      mfsdp-sft trains with and copies into its --export-hf folder.

  sft_export_reference.py check HF_DIR REQUEST_JSON OUT_DIR
      Loads HF_DIR (what mfsdp-sft --export-hf wrote) with AutoModelForCausalLM in float32, and
      REQUEST_JSON = {"ids": [[...], ...], "conversations": [[{"role", "content"}, ...], ...]}.
      Writes OUT_DIR/logits.safetensors, tensor "logits_<i>" [T_i, vocab] float32 for row i of
      "ids", each row run alone (batch of one, no padding), and OUT_DIR/report.json:
        {"transformers": version, "class": model class name, "model_type", "vocab_size",
         "tie_word_embeddings", "dtype": the config's dtype as written in the folder,
         "lm_head_is_embedding": whether lm_head.weight is the embedding's tensor,
         "tokenizer": null, or when "conversations" is given, {"class", "len", "chat_template":
         whether AutoTokenizer found one, "chat_ids": [[...]] from apply_chat_template with the
         folder's own template, "special": {token: id}}}
      The C++ test compares these with mfsdp's own reading of the folder.
"""

import json
import os
import random
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: never reach the network
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The standard ChatML Jinja template (Qwen2's format without its default system message),
# the same as tests/reference/hf_tokenizer_reference.py uses.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def corpus(seed=7, lines=400):
    """Short varied English-ish lines with numbers, so the merges cover words and digits."""
    rng = random.Random(seed)
    words = ("what is the sum of and plus equals answer question user assistant system you are a "
             "helpful short reply add numbers please thanks hello world it's don't café über "
             "= + - ? . , ! : \n").split(" ")
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(3, 12)):
            parts.append(str(rng.randint(0, 999)) if rng.random() < 0.25 else rng.choice(words))
        out.append(" ".join(parts))
    return out


def train_tokenizer(out_dir):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # 256 byte symbols + ~100 merges: a vocabulary (and so an embedding) that stays tiny.
    trainer = trainers.BpeTrainer(vocab_size=360, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    # Written by hand (not save_pretrained, which in transformers 5 puts the template in a
    # separate chat_template.jinja): the template inline in tokenizer_config.json, as the Hub's
    # Qwen2 folders have it.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML,
        "model_max_length": 64,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    print(f"sft_export_reference: trained a byte-level BPE of {tok.get_vocab_size(with_added_tokens=True)} "
          f"tokens into {out_dir}")
    return 0


def check(hf_dir, request_file, out_dir):
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    with open(request_file, encoding="utf-8") as f:
        request = json.load(f)

    # eager attention: the plain matmul-softmax reference.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    config = model.config
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)  # the dtype as the folder declares it (the loaded model is fp32 by request)
    report = {
        "transformers": transformers.__version__,
        "class": type(model).__name__,
        "model_type": config.model_type,
        "vocab_size": int(config.vocab_size),
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "dtype": str(raw.get("dtype", raw.get("torch_dtype"))),
        "lm_head_is_embedding": model.lm_head.weight.data_ptr()
        == model.get_input_embeddings().weight.data_ptr(),
        "loaded_dtype": str(model.dtype),
        "tokenizer": None,
    }

    logits = {}
    with torch.no_grad():
        for i, row in enumerate(request["ids"]):
            out = model(torch.tensor([row], dtype=torch.long)).logits[0].float().contiguous()
            logits[f"logits_{i}"] = out
    os.makedirs(out_dir, exist_ok=True)
    save_file(logits, os.path.join(out_dir, "logits.safetensors"))

    conversations = request.get("conversations")
    if conversations:
        tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
        chat_ids = []
        if tok.chat_template:
            for messages in conversations:
                ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
                if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                    ids = ids["input_ids"]
                chat_ids.append([int(x) for x in ids])
        report["tokenizer"] = {
            "class": type(tok).__name__,
            "len": len(tok),
            "chat_template": bool(tok.chat_template),
            "chat_ids": chat_ids,
            "special": {s: tok.convert_tokens_to_ids(s) for s in SPECIAL},
            "eos_token": tok.eos_token,
        }

    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"sft_export_reference: transformers {transformers.__version__} loaded {hf_dir} as "
          f"{report['class']} (model_type {report['model_type']}, vocab {report['vocab_size']}, "
          f"tie_word_embeddings {report['tie_word_embeddings']}, folder dtype {report['dtype']}); "
          f"{len(logits)} rows of logits")
    return 0


def main():
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "train-tokenizer":
        return train_tokenizer(args[1])
    if len(args) == 4 and args[0] == "check":
        return check(args[1], args[2], args[3])
    sys.exit("usage: sft_export_reference.py train-tokenizer OUT_DIR\n"
             "       sft_export_reference.py check HF_DIR REQUEST_JSON OUT_DIR")


if __name__ == "__main__":
    sys.exit(main())
