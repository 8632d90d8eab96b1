r"""The Hugging Face side of tests/unit/hf_tokenizer_test.cpp.

Run by the C++ test under the reference Python (CMake's MFSDP_PYTHON, which has `tokenizers` and
`transformers`):

  hf_tokenizer_reference.py OUT_DIR

Trains small tokenizers with the `tokenizers` library on generated, varied text (digits,
punctuation, newlines, accented and non-Latin scripts, emoji), in the layouts real models ship,
and saves each as OUT_DIR/<name>/tokenizer.json:

  gpt2         ByteLevel pre-tokenizer (GPT-2's regex), ByteLevel post-processor, as GPT-2/RoBERTa
  gpt2_prefix  the same model with ByteLevel(add_prefix_space=True)
  llama3       Sequence[Split(Llama-3's regex, Isolated), ByteLevel(use_regex=False)], BPE with
               ignore_merges, post-processor ByteLevel + TemplateProcessing "<|begin_of_text|> $A"
  qwen2        the same with Qwen2's regex (one digit per pre-token), its own merges, no BOS
  llama2       SentencePiece-style BPE with byte_fallback and <0xNN> pieces: normalizer
               Sequence[Prepend("▁"), Replace(" ", "▁")], no pre-tokenizer, decoder
               Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)], "<s> $A"; plus
               added tokens with lstrip / rstrip / single_word / normalized
  mistral      the llama2 model as newer conversions lay it out: Metaspace(prepend_scheme="first",
               split=False), decoder Sequence[ByteFallback, Metaspace]
  unigram      a Unigram model (Metaspace(split=True)), byte_fallback, post-processor "$A </s>"
  split_*      the gpt2 model behind Split pre-tokenizers: every behavior with and without invert,
               and patterns of other models and Oniguruma features (GPT-4o, DeepSeek, \w, \b, ^,
               \h, \uHHHH, {,n}, empty matches, lookarounds, (?m), String patterns)
  unicode_*    the gpt2 model behind each Unicode normalizer (NFC, NFD, NFKC, NFKD, Lowercase,
               StripAccents, BertNormalizer with its options, Nmt, and Sequences of them)
  sp_bpe_nfkc  tokenizers' own SentencePieceBPETokenizer (normalizer NFKC, Metaspace), trained
  sp_charsmap  a SentencePiece unigram model trained by `sentencepiece` with its nmt_nfkc rule,
               as tokenizer.json: the library's Precompiled normalizer over the model's charsmap
  pre_*, norm_*, dec_*, proc_*, ...  the llama2 / gpt2 models behind the other pre-tokenizers
               (Digits, Whitespace, WhitespaceSplit, Punctuation, CharDelimiterSplit,
               BertPreTokenizer, ByteLevel after another), normalizers (Strip, Replace with a
               regex, ByteLevel), decoders (BPEDecoder), post-processors (Roberta, Bert) and the
               older Metaspace fields

and writes OUT_DIR/reference.json:

  {"tokenizers": {NAME: {
       "vocab_size": N,                    # Tokenizer.get_vocab_size(with_added_tokens=True)
       "special": {"<|im_end|>": id, ...}, # its added tokens
       "cases": [{"text": T,
                  "ids": [...],            # Tokenizer.encode(T, add_special_tokens=False).ids
                  "ids_special": [...],    # Tokenizer.encode(T, add_special_tokens=True).ids
                  "decoded": D,            # Tokenizer.decode(ids, skip_special_tokens=False)
                  "decoded_special": D2}],  # the same for ids_special
       "decode": [{"ids": [...], "text": D}],  # pieces of encodings (cut characters, single ids)
       "transformers": [{"text": T, "ids": [...]}]}},  # PreTrainedTokenizerFast(...)(T).input_ids
   "chat": {NAME: [{"messages": [...], "add_generation_prompt": b, "ids": [...]}, ...]},
   "chat_masks": {NAME: [{"messages": [...], "ids": [...], "mask": [...]}]}}

where "chat" holds the ids transformers' PreTrainedTokenizerFast.apply_chat_template gives with
the standard ChatML Jinja template (Qwen2's format, docs/data.md "Chat templates"), and
"chat_masks" the library's ids of a ChatML conversation under an NFKC tokenizer with the SFT mask
taken from the library's offsets: 1 on the tokens inside an assistant message's content (offsets
into the original text) and on the <|im_end|> that closes it.
"""

import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import (  # noqa: E402
    AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
    trainers)

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
# GPT-4o's (o200k), as Hugging Face conversions of it write it.
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
# DeepSeek-V3's three Split steps.
DEEPSEEK_PATTERNS = [
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# Patterns that exercise what oniguruma_to_pcre2 rewrites or passes through, each in a
# Split(Isolated) before ByteLevel(use_regex=False).
SPLIT_PATTERNS = {
    "split_o200k": O200K_PATTERN,
    "split_word": r"\w+|[^\w\s]+",
    "split_word_boundary": r"\b\p{L}+\b|\B.",
    "split_not_word": r"\W+",
    "split_anchors": r"^\s+|\s+$|^.",
    "split_hex": r"\h+|\H",
    "split_u_escape": r"[\u4e00-\u9fff\u3040-\u30ff]+|[\uac00-\ud7a3]",
    "split_lazy_interval": r"\p{L}{,3}?\p{L}|\p{N}{2,}",
    "split_empty": r"\p{N}*",
    "split_lookaround": r"(?<=\p{L})(?=\p{N})|(?<=\p{N})(?=\p{L})|\s",
    "split_dotall": r"(?m)[\r\n].",
    "split_case": r"(?i)(?:the|it's|ſ|k)",
    "split_white_space": r"\s",
    "split_script": r"\p{Han}+|\p{Hiragana}+|\p{Katakana}+|\p{Greek}+",
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
SP_SPECIAL = ["<unk>", "<s>", "</s>"]
BYTE_PIECES = ["<0x%02X>" % b for b in range(256)]
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

# A multilingual text with emoji, CJK, code and whitespace runs, and texts for the SentencePiece
# layouts: literal "▁" and "<0x41>", special tokens next to spaces, the added tokens of llama2.
TEXTS += [
    "Tokenizers 🤗 split text: English, Français (ça va?), Deutsch (Straße, Größe), Ελληνικά, "
    "русский, 日本語のテキスト、中文文本，한국어 텍스트, العربية, עברית, हिन्दी, ไทย — and emoji "
    "👩‍💻🧑🏾‍🚀🏳️‍🌈 ❤️ 1️⃣.\n\n```python\ndef f(x):\n\treturn x**2  # square\n```\n"
    "    four spaces,\t\ttabs,\r\n\r\nCRLF, and trailing   ",
    "{\"key\": [1, 2.5e-3, null], 'k2': \"v\\n\"} => x != y && a <= b; i++; /* c */ // done",
    "▁already▁marked and <0x41> <0xZZ> literal",
    "<s>Hello</s> <s> world</s>",
    " <s>leading space",
    "Hello <mask> world <mask>. New York New  York new york word words sword word.",
    "<|assistant|>   reply<|assistant|>\n",
    "long " + "a" * 300 + " " + "0123456789" * 20,
    "NEL\u0085split and nbsp\u00a0and ideographic\u3000space; ſ K ß ﬆ ǅ",
    "\u200d\u200c joiners, é́ marks, ①②③ ½ Ⅻ numbers",
    # What the normalizers change: precomposed and combining accents (e\u0301, a\u0308\u0304),
    # ligatures, full-width and compatibility forms, CJK and its compatibility ideographs, Hangul
    # syllables and conjoining jamo, emoji ZWJ and keycap sequences, Arabic with harakat,
    # Devanagari with nukta and virama, Turkish İ, Greek final sigma, ß, controls and format
    # characters, private use, U+FFFD.
    "Ünïcödé cafe\u0301 na\u0308\u0304ive ﬁnal ﬀ œuvre Æsir ǅemal ÅNGSTRÖM Å K İstanbul "
    "ΣΊΣΥΦΟΣ ὈΔΥΣΣΕΎΣ straße ẞ ＦＵＬＬ－ｗｉｄｔｈ　１２３！ ｶﾀｶﾅ ㎏ ℌ ℡ ① ⁵ ½ Ⅻ "
    "漢字 丽 丸 中文 한국어 \u1100\u1161\u11a8 \u1112\u1161\u11ab "
    "👩‍💻🧑🏾‍🚀👨‍👩‍👧‍👦 🏳️‍🌈 1️⃣ #️⃣ 🇫🇷🇯🇵 مَرْحَبًا بِالعَالَم क़िताब हिन्दी स्वागत "
    "ctl\x07bell\x00nul\u200bzw\ufeffbom\ue000pua\ufffdrep\u0085nel\x0bvt tab\tend",
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




def train_bpe(pre_tokenizer, texts, special=SPECIAL):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(special)
    return tok


def edited(tok, **fields):
    """A copy of `tok` with top-level tokenizer.json fields replaced (None: null)."""
    d = json.loads(tok.to_str())
    model = fields.pop("model", None)
    if model:
        d["model"].update(model)
    d.update(fields)
    return Tokenizer.from_str(json.dumps(d))


def to_json(component):
    """The tokenizer.json form of a normalizer / pre-tokenizer / decoder / post-processor."""
    t = Tokenizer(models.BPE())
    if isinstance(component, normalizers.Normalizer):
        t.normalizer = component
        return json.loads(t.to_str())["normalizer"]
    if isinstance(component, pre_tokenizers.PreTokenizer):
        t.pre_tokenizer = component
        return json.loads(t.to_str())["pre_tokenizer"]
    if isinstance(component, decoders.Decoder):
        t.decoder = component
        return json.loads(t.to_str())["decoder"]
    t.post_processor = component
    return json.loads(t.to_str())["post_processor"]


def sentencepiece_bpe(texts):
    """Llama-2's layout: a BPE trained on "▁"-marked words with <unk> <s> </s> and the 256 <0xNN>
    pieces at the start of the vocabulary, byte_fallback, characters outside a small alphabet."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=1800, min_frequency=2, show_progress=False,
                                  special_tokens=SP_SPECIAL + BYTE_PIECES, limit_alphabet=120)
    tok.train_from_iterator(texts, trainer=trainer)
    d = json.loads(tok.to_str())
    # The byte pieces are model pieces, not added tokens, in Llama-2's file.
    d["added_tokens"] = [t for t in d["added_tokens"] if t["content"] in SP_SPECIAL]
    d["model"].update({"byte_fallback": True, "unk_token": "<unk>", "fuse_unk": True})
    d["normalizer"] = to_json(normalizers.Sequence([normalizers.Prepend("▁"),
                                                    normalizers.Replace(" ", "▁")]))
    d["pre_tokenizer"] = None
    d["decoder"] = to_json(decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                              decoders.Fuse(), decoders.Strip(" ", 1, 0)]))
    d["post_processor"] = to_json(processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]))
    return Tokenizer.from_str(json.dumps(d))


def unigram(texts):
    tok = Tokenizer(models.Unigram())
    always = {"replacement": "▁", "prepend_scheme": "always", "split": True}
    tok.pre_tokenizer = pre_tokenizers.Metaspace(**always)
    tok.decoder = decoders.Metaspace(**always)
    trainer = trainers.UnigramTrainer(vocab_size=900, show_progress=False,
                                      special_tokens=SP_SPECIAL, unk_token="<unk>",
                                      max_piece_length=8)
    tok.train_from_iterator(texts, trainer=trainer)
    d = json.loads(tok.to_str())
    d["model"]["vocab"] += [[p, -20.0] for p in BYTE_PIECES]
    d["model"]["byte_fallback"] = True
    d["post_processor"] = to_json(processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 2)]))
    return Tokenizer.from_str(json.dumps(d))


def unicode_normalizers():
    """NAME -> the normalizers backed by Unicode's tables, alone and in Sequences."""
    n = normalizers
    return {
        "unicode_nfc": n.NFC(), "unicode_nfd": n.NFD(), "unicode_nfkc": n.NFKC(),
        "unicode_nfkd": n.NFKD(), "unicode_lowercase": n.Lowercase(),
        "unicode_strip_accents": n.StripAccents(),
        "unicode_nfd_strip_lower": n.Sequence([n.NFD(), n.StripAccents(), n.Lowercase()]),
        "unicode_nfkd_strip": n.Sequence([n.NFKD(), n.StripAccents()]),
        "unicode_bert": n.BertNormalizer(),
        "unicode_bert_cased": n.BertNormalizer(lowercase=False),
        "unicode_bert_clean_only": n.BertNormalizer(clean_text=True, handle_chinese_chars=False,
                                                    strip_accents=False, lowercase=False),
        "unicode_bert_strip_cased": n.BertNormalizer(strip_accents=True, lowercase=False),
        "unicode_bert_lower_keep_accents": n.BertNormalizer(strip_accents=False, lowercase=True),
        "unicode_nmt": n.Nmt(),
        "unicode_nmt_nfkc": n.Sequence([n.Nmt(), n.NFKC()]),
        "unicode_nfkc_then_replace": n.Sequence([n.NFKC(), n.Replace(Regex(r"\s+"), " "),
                                                  n.Lowercase()]),
    }


def sentencepiece_bpe_nfkc(texts):
    """tokenizers' SentencePieceBPETokenizer: normalizer NFKC, Metaspace, trained here."""
    from tokenizers.implementations import SentencePieceBPETokenizer

    tok = SentencePieceBPETokenizer(unk_token="<unk>")
    tok.train_from_iterator(texts, vocab_size=1200, min_frequency=2, show_progress=False,
                            special_tokens=SP_SPECIAL, limit_alphabet=200)
    return Tokenizer.from_str(tok.to_str())


def sentencepiece_charsmap(texts, workdir):
    """A unigram model trained by SentencePiece with its nmt_nfkc rule, as tokenizer.json with
    the library's Precompiled normalizer over the model's precompiled charsmap (what
    transformers' converters write for T5, ALBERT, XLM-R and the like)."""
    import sentencepiece as spm
    from transformers.utils import sentencepiece_model_pb2_new as pb2

    prefix = os.path.join(workdir, "sp_charsmap_model")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=900, model_type="unigram",
        normalization_rule_name="nmt_nfkc", character_coverage=0.9995, byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    proto = pb2.ModelProto()
    with open(prefix + ".model", "rb") as f:
        proto.ParseFromString(f.read())
    charsmap = proto.normalizer_spec.precompiled_charsmap
    assert len(charsmap) > 1000, "nmt_nfkc should bring a charsmap"
    vocab = [(p.piece, p.score) for p in proto.pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Precompiled(charsmap),
                                           normalizers.Replace(Regex(" {2,}"), " ")])
    always = {"replacement": "▁", "prepend_scheme": "always", "split": True}
    tok.pre_tokenizer = pre_tokenizers.Metaspace(**always)
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(**always)])
    tok.add_special_tokens(SP_SPECIAL)
    return Tokenizer.from_str(tok.to_str())


def build(texts, workdir):
    """NAME -> Tokenizer, every layout the C++ test compares."""
    out = {}
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def split_then_byte_level(*splits):
        return pre_tokenizers.Sequence(list(splits) + [byte_level])

    gpt2 = train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), texts)
    gpt2.post_processor = processors.ByteLevel(trim_offsets=True)
    out["gpt2"] = gpt2
    out["gpt2_prefix"] = edited(
        gpt2, pre_tokenizer=to_json(pre_tokenizers.ByteLevel(add_prefix_space=True)))
    llama3 = train_bpe(split_then_byte_level(
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False)), texts)
    bos = ("<|begin_of_text|>", llama3.token_to_id("<|begin_of_text|>"))
    template = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                             pair="<|begin_of_text|> $A $B", special_tokens=[bos])
    out["llama3"] = edited(llama3, model={"ignore_merges": True}, post_processor=to_json(
        processors.Sequence([processors.ByteLevel(trim_offsets=False), template])))
    qwen2 = train_bpe(split_then_byte_level(
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False)), texts)
    qwen2.post_processor = processors.ByteLevel(trim_offsets=False)
    out["qwen2"] = qwen2

    llama2 = sentencepiece_bpe(texts)
    out["llama2"] = llama2
    added = Tokenizer.from_str(llama2.to_str())
    added.add_tokens([AddedToken("New York", normalized=True),
                      AddedToken("word", single_word=True)])
    added.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True, special=True),
                              AddedToken("<|assistant|>", rstrip=True, special=True)])
    out["llama2_added"] = added
    first = {"replacement": "▁", "prepend_scheme": "first", "split": False}
    out["mistral"] = edited(
        llama2, normalizer=None, pre_tokenizer=to_json(pre_tokenizers.Metaspace(**first)),
        decoder=to_json(decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(**first)])))
    # Files from before prepend_scheme: add_prefix_space alone means "always".
    legacy = {"type": "Metaspace", "replacement": "▁", "add_prefix_space": True, "str_rep": "▁"}
    out["metaspace_legacy"] = edited(llama2, normalizer=None, pre_tokenizer=legacy,
                                     decoder=dict(legacy))
    out["unigram"] = unigram(texts)

    for behavior in ["removed", "isolated", "merged_with_previous", "merged_with_next",
                     "contiguous"]:
        for invert in (False, True):
            split = pre_tokenizers.Split(Regex(r"\p{N}|\s+|[.,!?]"), behavior=behavior,
                                         invert=invert)
            out["split_%s%s" % (behavior, "_invert" if invert else "")] = edited(
                gpt2, pre_tokenizer=to_json(split_then_byte_level(split)))
    for name, pattern in SPLIT_PATTERNS.items():
        out[name] = edited(gpt2, pre_tokenizer=to_json(split_then_byte_level(
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"))))
    out["split_deepseek"] = edited(gpt2, pre_tokenizer=to_json(split_then_byte_level(
        *[pre_tokenizers.Split(Regex(p), behavior="isolated") for p in DEEPSEEK_PATTERNS])))
    # Gemma's: a String pattern, the space kept with the word before it.
    out["split_string"] = edited(gpt2, pre_tokenizer=to_json(split_then_byte_level(
        pre_tokenizers.Split(" ", behavior="merged_with_previous"))))
    # ByteLevel's own regex and add_prefix_space on each piece another pre-tokenizer cut.
    out["byte_level_after_digits"] = edited(gpt2, pre_tokenizer=to_json(pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=True)])))

    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    for name, pre in {"pre_digits": pre_tokenizers.Digits(individual_digits=False),
                      "pre_whitespace": pre_tokenizers.Whitespace(),
                      "pre_whitespace_split": pre_tokenizers.WhitespaceSplit(),
                      "pre_punctuation": pre_tokenizers.Punctuation(behavior="contiguous"),
                      "pre_delimiter": pre_tokenizers.CharDelimiterSplit("-"),
                      "pre_bert": pre_tokenizers.BertPreTokenizer()}.items():
        out[name] = edited(llama2, normalizer=None,
                           pre_tokenizer=to_json(pre_tokenizers.Sequence([pre, metaspace])))
    out["norm_strip_regex"] = edited(llama2, normalizer=to_json(normalizers.Sequence([
        normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(r"\s+"), " "),
        normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])))
    out["norm_byte_level"] = edited(gpt2, normalizer=to_json(normalizers.ByteLevel()),
                                    pre_tokenizer=None)
    for name, normalizer in unicode_normalizers().items():
        out[name] = edited(gpt2, normalizer=to_json(normalizer))
    out["sp_bpe_nfkc"] = sentencepiece_bpe_nfkc(texts)
    out["sp_charsmap"] = sentencepiece_charsmap(texts, workdir)
    out["llama3_nfkc"] = edited(out["llama3"], normalizer=to_json(normalizers.NFKC()))
    out["dec_bpe"] = edited(llama2, decoder=to_json(decoders.BPEDecoder(suffix="▁")))
    out["proc_roberta"] = edited(gpt2, post_processor=to_json(processors.RobertaProcessing(
        ("<|endoftext|>", gpt2.token_to_id("<|endoftext|>")),
        ("<|im_start|>", gpt2.token_to_id("<|im_start|>")))))
    out["proc_bert"] = edited(llama2, post_processor=to_json(
        processors.BertProcessing(("</s>", 2), ("<s>", 1))))
    return out


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


NFKC_CONVERSATIONS = [
    [{"role": "user", "content": "Ｗｈａｔ ｉｓ １２ ＋ ３０？"},
     {"role": "assistant", "content": "１２ ＋ ３０ ＝ ４２．ﬁne ㎏ ①"}],
    [{"role": "system", "content": "Ｂｅ ｂｒｉｅｆ."},
     {"role": "user", "content": "Ligatures: ﬁ ﬂ ﬀ?"},
     {"role": "assistant", "content": "ﬁ → fi, ﬂ → fl.  cafe\u0301 ＡＢＣ"},
     {"role": "user", "content": "And Hangul \u1100\u1161\u11a8?"},
     {"role": "assistant", "content": "\u1100\u1161\u11a8 is 각 ｶﾀｶﾅ ℌ"}],
]


def chatml_masks(tok):
    """The library's ids of each NFKC_CONVERSATIONS conversation rendered in ChatML, and the mask
    from its offsets: 1 on tokens inside an assistant content span and on the <|im_end|> after it."""
    out = []
    im_end = tok.token_to_id("<|im_end|>")
    for messages in NFKC_CONVERSATIONS:
        text, spans = "", []
        for m in messages:
            text += "<|im_start|>" + m["role"] + "\n"
            if m["role"] == "assistant":
                spans.append((len(text), len(text) + len(m["content"])))
            text += m["content"] + "<|im_end|>" + "\n"
        enc = tok.encode(text, add_special_tokens=False)
        mask = []
        for k, (start, end) in enumerate(enc.offsets):
            inside = any(s <= start and end <= e and start < end for s, e in spans)
            closes = enc.ids[k] == im_end and any(e == start for s, e in spans)
            mask.append(1 if inside or closes else 0)
        out.append({"messages": messages, "ids": enc.ids, "mask": mask})
    return out


def transformers_ids(tokenizer_file, texts):
    """transformers' tokenizer(text).input_ids (add_special_tokens defaults to True)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    return [{"text": t, "ids": [int(i) for i in hf(t)["input_ids"]]} for t in texts]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: hf_tokenizer_reference.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    texts = corpus()
    ref = {"tokenizers": {}, "chat": {}, "chat_masks": {}}
    tokenizers = build(texts, out)
    for name, tok in tokenizers.items():
        os.makedirs(os.path.join(out, name), exist_ok=True)
        path = os.path.join(out, name, "tokenizer.json")
        tok.save(path)
        cases, pieces = [], []
        for t in TEXTS:
            ids = tok.encode(t, add_special_tokens=False).ids
            ids_special = tok.encode(t, add_special_tokens=True).ids
            cases.append({"text": t, "ids": ids, "ids_special": ids_special,
                          "decoded": tok.decode(ids, skip_special_tokens=False),
                          "decoded_special": tok.decode(ids_special, skip_special_tokens=False)})
            # Cut encodings: characters split between tokens decode to U+FFFD.
            for cut in (ids[1:], ids[:-1], ids[len(ids) // 2:]):
                pieces.append({"ids": cut, "text": tok.decode(cut, skip_special_tokens=False)})
        for i in cases[len(cases) - 10]["ids"]:
            pieces.append({"ids": [i], "text": tok.decode([i], skip_special_tokens=False)})
        entry = {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
                 "special": {t.content: i for i, t in tok.get_added_tokens_decoder().items()},
                 "cases": cases, "decode": pieces}
        if name in ("gpt2", "llama3", "qwen2", "llama2", "mistral", "unigram"):
            entry["transformers"] = transformers_ids(path, TEXTS)
        ref["tokenizers"][name] = entry
        if name in ("gpt2", "llama3"):
            ref["chat"][name] = chat_ids(path)
        if name == "llama3_nfkc":
            ref["chat_masks"][name] = chatml_masks(tok)
    with open(os.path.join(out, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False, indent=1)
    print(f"hf_tokenizer_reference: wrote {out}/reference.json ({len(TEXTS)} texts x "
          f"{len(tokenizers)} tokenizers, {len(CONVERSATIONS) * 2} conversations x 2)")


if __name__ == "__main__":
    main()
