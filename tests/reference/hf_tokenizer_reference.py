"""The Hugging Face side of tests/unit/hf_tokenizer_test.cpp.

Run by the C++ test under the reference Python (CMake's MFSDP_PYTHON, which has `tokenizers` and
`transformers`):

  hf_tokenizer_reference.py OUT_DIR

Trains a small byte-level BPE with the `tokenizers` library on generated, varied text (digits,
punctuation, newlines, accented and non-Latin scripts, emoji), adds the special tokens
<|endoftext|>, <|im_start|>, <|im_end|> after training (so their ids follow the vocabulary, as in
Qwen2) and saves it three ways, each OUT_DIR/<name>/tokenizer.json:

  gpt2         ByteLevel(add_prefix_space=False) pre-tokenizer (GPT-2's regex), as GPT-2/RoBERTa
  gpt2_prefix  the same model with ByteLevel(add_prefix_space=True)
  llama3       Sequence[Split(Llama-3's regex, Isolated), ByteLevel(use_regex=False)], as
               Llama-3 and Qwen2 (trained with that pre-tokenizer, so its merges differ)

and writes OUT_DIR/reference.json:

  {"encode": {NAME: [{"text": T, "ids": [...]}, ...]},     # Tokenizer.encode(T, add_special_tokens=False)
   "vocab_size": {NAME: N},                                 # Tokenizer.get_vocab_size(with_added_tokens=True)
   "special": {NAME: {"<|im_end|>": id, ...}},
   "chat": {NAME: [{"messages": [...], "add_generation_prompt": b, "ids": [...]}, ...]}}

where "chat" holds the ids transformers' PreTrainedTokenizerFast.apply_chat_template gives with
the standard ChatML Jinja template (Qwen2's format, docs/data.md "Chat templates").
"""

import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus(seed=1234, lines=3000):
    """Varied text, so the merges cover words, numbers, punctuation runs and multi-byte scripts."""
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over lazy dog I you we they it's don't we'll they're "
             "IT'S DON'T WE'LL THEY'RE I'M YOU'VE SHE'D "
             "she'd I'm you've HELLO World Tokenizer merges byte-level pre-token text data "
             "café naïve résumé über straße façade año Ελληνικά γλώσσα Привет мир "
             "日本語 テキスト 中文 文本 مرحبا العالم नमस्ते दुनिया 🙂 🚀 👍🏽 ✓ € £ ¥ "
             "हिन्दी भाषा में स्वागत है। ภาษาไทย สวัสดี 안녕하세요 مَرْحَبًا "
             "x=1; y==2 && z!=3 (a+b)*c [0] {k: v} <tag> #hash @user $5.00 50% a/b c\\d").split()
    out = []
    for _ in range(lines):
        n = rng.randint(3, 14)
        parts = []
        for _ in range(n):
            r = rng.random()
            if r < 0.15:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 7))))
            elif r < 0.2:
                parts.append(rng.choice(["...", "!!", "?", ",", ";", ":", "--", "'", '"']))
            else:
                parts.append(rng.choice(words))
        sep = rng.choice([" ", " ", " ", "  ", "\t", "\n", "\r\n", "\n\n"])
        out.append(sep.join(parts))
    return out


# Edge cases: leading/multiple spaces, \r\n, long numbers, upper-case contractions, special tokens
# inside text, non-Latin scripts and emoji, a text that is only whitespace.
TEXTS = [
    "Hello world",
    " Hello world",
    "   leading spaces and  double  spaces ",
    "line one\nline two\r\nline three\n\n\nend",
    "tabs\tand\t\ttabs \t mixed",
    "numbers 1 12 123 1234 12345 1234567890 3.14159 -42",
    "IT'S I'M WE'LL THEY'RE YOU'VE SHE'D DON'T it's we'll they're",
    "Contractions: 'S 'T 'Re 'vE 'll 'D and quotes 'quoted'",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "text<|endoftext|>more text <|endoftext|> and <|im_end|><|im_start|>",
    "<|endoftext|>",
    "almost special <|im_end| and <|endoftext",
    "café naïve résumé über straße façade",
    "Ελληνικά γλώσσα, Привет мир!",
    "日本語のテキスト。中文文本，标点符号！",
    "مرحبا العالم नमस्ते दुनिया",
    "हिन्दी भाषा में स्वागत है। ภาษาไทย สวัสดี 안녕하세요 세계 مَرْحَبًا",
    "decomposed e\u0301 and precomposed \u00e9, digits \u0661\u0662\u0663\u0664 \u0967\u0968",
    "emoji 🙂🚀 👍🏽 ✓ € 50% $5.00",
    "code: x=1; y==2 && z!=3 (a+b)*c [0] {k: v} <tag> #hash @user a/b c\\d",
    "punctuation!!! ??? ... -- ;;; \"quoted\"\n  indented\n\tline",
    "   ",
    "\n",
    " \n \n",
    "trailing newline\n",
    "a",
    "",
    "unseen words: zyxwvut qqqq jjjj Ωμέγα ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"},
     {"role": "assistant", "content": "12 + 30 = 42."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Say hello in French and Japanese."},
     {"role": "assistant", "content": "Bonjour! こんにちは 🙂"},
     {"role": "user", "content": "Thanks. And in Greek?"},
     {"role": "assistant", "content": "Γειά σου, it's easy."}],
    [{"role": "user", "content": "Count: 1, 22, 333, 4444"}],
]


def train(pre_tokenizer, texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL)
    return tok


def chat_ids(tokenizer_file):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, eos_token="<|im_end|>")
    hf.chat_template = CHATML
    cases = []
    for messages in CONVERSATIONS:
        for gen in (False, True):
            ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            cases.append({"messages": messages, "add_generation_prompt": gen,
                          "ids": [int(i) for i in ids]})
    return cases


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: hf_tokenizer_reference.py OUT_DIR")
    out = sys.argv[1]
    texts = corpus()
    gpt2 = train(pre_tokenizers.ByteLevel(add_prefix_space=False), texts)
    llama3 = train(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), texts)
    gpt2_prefix = Tokenizer.from_str(gpt2.to_str())
    gpt2_prefix.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)

    ref = {"encode": {}, "vocab_size": {}, "special": {}, "chat": {}}
    for name, tok in (("gpt2", gpt2), ("gpt2_prefix", gpt2_prefix), ("llama3", llama3)):
        os.makedirs(os.path.join(out, name), exist_ok=True)
        path = os.path.join(out, name, "tokenizer.json")
        tok.save(path)
        ref["encode"][name] = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids}
                               for t in TEXTS]
        ref["vocab_size"][name] = tok.get_vocab_size(with_added_tokens=True)
        ref["special"][name] = {s: tok.token_to_id(s) for s in SPECIAL}
        if name != "gpt2_prefix":
            ref["chat"][name] = chat_ids(path)
    with open(os.path.join(out, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False, indent=1)
    print(f"hf_tokenizer_reference: wrote {out}/reference.json "
          f"({len(TEXTS)} texts x 3 tokenizers, {len(CONVERSATIONS) * 2} conversations x 2)")


if __name__ == "__main__":
    main()
