r"""The transformers side of tests/unit/chat_template_test.cpp.

Run by the C++ test under the reference Python (CMake's MFSDP_PYTHON, which has `tokenizers`,
`transformers` and `jinja2`):

  chat_template_reference.py OUT_DIR

Trains two small byte-level BPE tokenizers with the `tokenizers` library, in the layouts of the
families whose chat templates mfsdp builds in, with those families' special tokens:

  llama3  Llama-3's Split regex + ByteLevel, ignore_merges, "<|begin_of_text|> $A" post-processor;
          <|begin_of_text|>, <|end_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eot_id|>,
          <|eom_id|>, <|python_tag|> (Llama-3.1's)
  qwen3   Qwen2's regex (one digit per pre-token); <|endoftext|>, <|im_start|>, <|im_end|>
          (special) and <think>, </think>, <tool_response>, </tool_response> (added, not special,
          as Qwen3's tokenizer.json has them)

saves each as OUT_DIR/<name>/tokenizer.json, and renders a set of conversations with
transformers' PreTrainedTokenizerFast.apply_chat_template running the PUBLISHED template texts
kept in tests/reference/chat_templates/ (their sources are in the README there; their sha256 is
checked below, so an edited copy is noticed). OUT_DIR/reference.json:

  {"cases": [{"template": "llama3" | "llama3.1" | "qwen3", "tokenizer": "llama3" | "qwen3",
              "messages": [...], "add_generation_prompt": b,
              "text": the rendered string (tokenize=False),
              "ids": apply_chat_template(tokenize=True)'s input_ids,
              "mask": 1 per token inside an assistant turn (below)}],
   "mutants": [{"template", "tokenizer", "messages", "add_generation_prompt", "ids", "change"}]}

The mask. transformers' return_assistant_tokens_mask needs {% generation %} markers, which the
published templates do not have, so the expected mask is computed here from the rendered text:
an assistant turn is the text after its header ("<|start_header_id|>assistant<|end_header_id|>\n\n"
/ "<|im_start|>assistant\n") through its end-of-turn token ("<|eot_id|>" / "<|im_end|>")
included; a token is 1 when its character span (return_offsets_mapping) lies inside one. A token
that straddles a turn's edge is an error: the mask would be ambiguous. The generation prompt's
header has no end token and is not a turn.

"mutants" are the same renderings through a copy of each published template with one small edit
("change" says which): the C++ test must find our ids differ from those, which shows that one
changed token is caught.
"""

import hashlib
import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import (  # noqa: E402
    AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers)

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = {  # name -> (file, sha256 of the published text)
    "llama3": ("llama3.jinja", "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122"),
    "llama3.1": ("llama3.1.jinja", "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65"),
    "qwen3": ("qwen3.jinja", "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"),
}
TOKENIZER_OF = {"llama3": "llama3", "llama3.1": "llama3", "qwen3": "qwen3"}
# One-edit copies of the templates, for "mutants": (old, new, what).
MUTATIONS = {
    "llama3": ("'<|end_header_id|>\n\n'+ message['content']", "'<|end_header_id|>\n'+ message['content']",
               "one \\n less after each header"),
    "llama3.1": ('"26 Jul 2024"', '"27 Jul 2024"', "another default date"),
    "qwen3": ("'\\n</think>\\n\\n' + content.lstrip('\\n')", "'\\n</think>\\n' + content.lstrip('\\n')",
              "one \\n less after </think>"),
}
TURNS = {  # template family -> (assistant header, end of turn)
    "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>"),
}

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ["<think>", "</think>", "<tool_response>", "</tool_response>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"},
     {"role": "assistant", "content": "12 + 30 = 42."}],
    # System first, two assistant turns; whitespace around contents (Llama's templates trim it,
    # Qwen3's keeps it), newlines and non-Latin text inside them.
    [{"role": "system", "content": "  You are a helpful assistant.\n"},
     {"role": "user", "content": "Say hello in French and Japanese.  "},
     {"role": "assistant", "content": " Bonjour!\nこんにちは 🙂\n\n"},
     {"role": "user", "content": "Thanks. And in Greek?"},
     {"role": "assistant", "content": "Γειά σου, it's easy."}],
    # Reasoning in the content: Qwen3 keeps the last turn's, drops the earlier one's.
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nI add two and two.\n</think>\n\n4"},
     {"role": "user", "content": "And 3*3?"},
     {"role": "assistant", "content": "<think>three threes</think>9, since 3+3+3 = 9."}],
    # A tool response as the last user message: Qwen3's last query is the user message before it,
    # so both assistant turns come after it.
    [{"role": "user", "content": "What is the weather in Paris?"},
     {"role": "assistant", "content": "<think>\nCall the tool.\n</think>\n\nLet me check."},
     {"role": "user", "content": "<tool_response>\n{\"temp\": 21}\n</tool_response>"},
     {"role": "assistant", "content": "It is 21 degrees."}],
    # A prompt only (a GRPO prompt with the generation prompt).
    [{"role": "system", "content": "Answer with a number."},
     {"role": "user", "content": "Count: 1, 22, 333, 4444"}],
    # Python's str.strip() whitespace (NBSP, ideographic space, tabs) around contents, an empty
    # assistant reply, a system message after the first turn.
    [{"role": "user", "content": "\u00a0\tHi there\u3000"},
     {"role": "assistant", "content": "\u3000Hello!\u00a0"},
     {"role": "system", "content": "Be brief from now on."},
     {"role": "user", "content": "Nothing to add?"},
     {"role": "assistant", "content": ""}],
]


def corpus(seed=29, lines=2500):
    """Varied text plus the templates' own words, so merges cover headers, dates and contents."""
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over lazy dog I you we they it's don't we'll you're "
             "system user assistant Cutting Knowledge Date December 2023 Today Jul 2024 think "
             "helpful answer number weather Paris degrees tool call check Say hello French "
             "Japanese Greek Thanks easy Bonjour こんにちは Γειά σου What is Count add two "
             "three threes since Be brief Nothing Hi there Hello café naïve über 日本語 中文 "
             "Привет мир 🙂 🚀 x=1; (a+b)*c [0] {k: v} <tag> #hash @user $5.00 50%").split()
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(3, 12)):
            r = rng.random()
            if r < 0.15:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 5))))
            elif r < 0.22:
                parts.append(rng.choice(["...", "!", "?", ",", ":", "=", "+", "*", '"', "{", "}"]))
            else:
                parts.append(rng.choice(words))
        out.append(rng.choice([" ", " ", " ", "\n", "\n\n", "\t"]).join(parts))
    return out


def train(pattern, texts, special, added=()):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def build(texts):
    llama3 = train(LLAMA3_PATTERN, texts, LLAMA3_SPECIAL)
    bos = ("<|begin_of_text|>", llama3.token_to_id("<|begin_of_text|>"))
    llama3.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                      special_tokens=[bos])])
    qwen3 = train(QWEN2_PATTERN, texts, QWEN3_SPECIAL, QWEN3_ADDED)
    qwen3.post_processor = processors.ByteLevel(trim_offsets=False)
    return {"llama3": llama3, "qwen3": qwen3}


def published(name):
    file, digest = TEMPLATES[name]
    with open(os.path.join(HERE, "chat_templates", file), "rb") as f:
        data = f.read()
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        sys.exit("chat_templates/%s: sha256 %s, not the published text's %s" % (file, got, digest))
    return data.decode("utf-8")


def hf_tokenizer(path, family):
    from transformers import PreTrainedTokenizerFast

    if family == "llama3":
        return PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<|begin_of_text|>",
                                       eos_token="<|eot_id|>")
    return PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def ids_of(out):
    if not isinstance(out, list):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(i) for i in out]


def assistant_mask(hf, family, text, ids):
    """1 on the tokens inside an assistant turn of the rendered text (see the docstring)."""
    header, end = TURNS[family]
    spans, at = [], 0
    while True:
        start = text.find(header, at)
        if start < 0:
            break
        first = start + len(header)
        stop = text.find(end, first)
        if stop < 0:  # the generation prompt
            break
        spans.append((first, stop + len(end)))
        at = stop
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    if [int(i) for i in enc["input_ids"]] != ids:
        raise SystemExit("tokenizing the rendered text differs from apply_chat_template's ids")
    mask = []
    for s, e in enc["offset_mapping"]:
        inside = any(a <= s and e <= b for a, b in spans)
        if not inside and any(s < b and a < e for a, b in spans):
            raise SystemExit("a token straddles an assistant turn's edge at %d..%d of %r" % (s, e, text))
        mask.append(1 if inside else 0)
    return mask


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: chat_template_reference.py OUT_DIR")
    out = sys.argv[1]
    hf = {}
    for name, tok in build(corpus()).items():
        os.makedirs(os.path.join(out, name), exist_ok=True)
        path = os.path.join(out, name, "tokenizer.json")
        tok.save(path)
        hf[name] = hf_tokenizer(path, name)
    ref = {"cases": [], "mutants": []}
    for template in TEMPLATES:
        text_of_template = published(template)
        family = TOKENIZER_OF[template]
        t = hf[family]
        old, new, change = MUTATIONS[template]
        if old not in text_of_template:
            sys.exit("mutation of %s: %r is not in the template" % (template, old))
        mutant = text_of_template.replace(old, new)
        for messages in CONVERSATIONS:
            for gen in (False, True):
                kw = {"add_generation_prompt": gen, "chat_template": text_of_template}
                text = t.apply_chat_template(messages, tokenize=False, **kw)
                ids = ids_of(t.apply_chat_template(messages, tokenize=True, **kw))
                ref["cases"].append({
                    "template": template, "tokenizer": family, "messages": messages,
                    "add_generation_prompt": gen, "text": text, "ids": ids,
                    "mask": assistant_mask(t, family, text, ids)})
                ref["mutants"].append({
                    "template": template, "tokenizer": family, "messages": messages,
                    "add_generation_prompt": gen, "change": change,
                    "ids": ids_of(t.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                                        chat_template=mutant))})
    with open(os.path.join(out, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
