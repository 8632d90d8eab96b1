#!/usr/bin/env python3
"""Writes the corpus of hostile tokenizer.json files and texts of tests/e2e/hostile_tokenizer_test.cpp.

    hostile_tokenizers.py OUT_DIR [--case NAME ...] [--list]

Each case is a folder OUT_DIR/NAME holding a tokenizer.json (a small valid tokenizer: byte-level
BPE or Metaspace + Unigram, with <|endoftext|> as the end-of-document token, plus one hostile
part), sometimes a tokenizer_config.json, and input.jsonl (one {"text": ...} per line).
OUT_DIR/manifest.json lists every case (whether or not its files were written this time):
name, group, what it probes, the tokenizer and input paths, and the expected outcome:
  "refused"   mfsdp-preprocess exits nonzero and its stderr holds every string of "contains"
              (the file and the JSON path) in a short message;
  "completes" it exits 0 and writes the dataset;
  "either"    a legitimate but extreme file: completes, or is refused as above.
Files are written only for the cases named by --case (all without it), so that a test process
that runs one case does not write the whole corpus (~30 MB). Standard library only; the files
are made at test time rather than committed (several are megabytes).
"""

import json
import os
import random
import sys

# GPT-2's pre-tokenizer regex (the ByteLevel pre-tokenizer's with use_regex), written as a Split.
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
SPLIT_PATH = "pre_tokenizer.pretokenizers[0].pattern.Regex"


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def split(pattern):
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


BYTE_LEVEL_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def byte_level_bpe(pattern=GPT2_REGEX):
    """A byte-level BPE tokenizer (GPT-2's layout): 256 byte pieces and a few merges, including
    the ones that long runs of spaces, newlines and digits exercise."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    merges = []
    for left, right in [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ċ"), ("ĊĊ", "ĊĊ"), ("7", "7"), ("77", "77"),
                        ("t", "h"), ("th", "e"), ("Ġ", "the"), ("e", "r"), ("i", "n"), ("a", "a"),
                        ("Ã", "©")]:
        merged = left + right
        if merged not in vocab:
            vocab[merged] = len(vocab)
        merges.append(left + " " + right)
    eot_id = len(vocab)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": eot_id, "content": EOT, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split(pattern), BYTE_LEVEL_PRE]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def unigram(extra_pieces):
    """A Metaspace + Unigram tokenizer (SentencePiece's unigram layout)."""
    vocab = [["<unk>", 0.0], [EOT, 0.0], ["▁", -2.0]]
    vocab += [[c, -3.0] for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab += [[p, -5.0] for p in extra_pieces]
    metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 1, "content": EOT, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": metaspace,
        "post_processor": None,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        "model": {"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": False},
    }


def dumps(obj, raw=None):
    """JSON text of obj; raw maps placeholder strings to JSON text spliced in verbatim (nesting
    far deeper than Python's json module can write)."""
    text = json.dumps(obj, ensure_ascii=False)
    for key, value in (raw or {}).items():
        text = text.replace(json.dumps(key), value, 1)
    return text


def nested(kind, levels):
    """`levels` Sequences one inside the other, the innermost holding a working step."""
    key, inner = {
        "normalizer": ("normalizers", ""),
        "pre_tokenizer": ("pretokenizers", json.dumps(split(GPT2_REGEX)) + "," + json.dumps(BYTE_LEVEL_PRE)),
        "decoder": ("decoders", json.dumps({"type": "ByteLevel"})),
        "post_processor": ("processors", json.dumps({"type": "ByteLevel", "trim_offsets": False})),
    }[kind]
    head = '{"type": "Sequence", "%s": [' % key
    return head * levels + inner + "]}" * levels


def multilingual(size, seed=45):
    """About `size` bytes of mixed-script text: accented Latin and ligatures, full-width forms,
    CJK, Hangul (syllables and jamo), combining marks, emoji ZWJ sequences, Arabic, Devanagari,
    digits, punctuation and line breaks."""
    words = ["naïve", "café", "façade", "straße", "ﬁnance", "Ærøskøbing", "hello", "world", "the",
             "über", "ＡＢＣ", "１２３", "ｈｅｌｌｏ", "東京", "中文字符", "日本語のテキスト", "한국어",
             "안녕하세요", "\u1112\u1161\u11ab", "e\u0301", "a\u0308o\u0323", "👨\u200d👩\u200d👧\u200d👦",
             "👍🏽", "🏳️\u200d🌈", "مرحبا", "العربية", "नमस्ते", "हिन्दी", "2024", "3.14159", "١٢٣",
             ",", ".", "!?", "—", "“quoted”", "(paren)", "it's", "we'll", "\t"]
    rng = random.Random(seed)
    parts, n = [], 0
    while n < size:
        w = rng.choice(words)
        sep = "\n" if rng.random() < 0.02 else " "
        parts.append(w + sep)
        n += len(w.encode()) + 1
    return "".join(parts)


def text_line(text):
    return json.dumps({"text": text}, ensure_ascii=False) + "\n"


MB = 1_000_000


def cases():
    """(name, group, note, expect, contains, make); make() -> {file name: text}. In "contains",
    {tok} and {dir} stand for the tokenizer.json path and the case folder."""
    out = []

    def add(name, group, note, expect, contains, make):
        out.append((name, group, note, expect, contains, make))

    # Nested Sequences: the JSON nesting limit (a SAX-level check before anything is built).
    for kind in ["normalizer", "pre_tokenizer", "decoder", "post_processor"]:
        for levels in [100, 5000, 20000, 50000] if kind == "normalizer" else [100, 5000, 50000]:
            def make(kind=kind, levels=levels):
                t = byte_level_bpe()
                t[kind] = "@NESTED@"
                return {"tokenizer.json": dumps(t, {"@NESTED@": nested(kind, levels)}),
                        "input.jsonl": text_line("hello world, the théâtre")}
            add("nested_%s_%d" % (kind, levels), "nesting",
                "%d Sequence %ss one inside the other" % (levels, kind.replace("_", "-")),
                "either" if levels == 100 else "refused", ["{tok}", kind], make)

    # Deep JSON outside the Sequences: an unknown key of tokenizer.json, tokenizer_config.json,
    # and a JSONL line of the input.
    deep = "[" * 50000 + "]" * 50000

    def make_extra():
        t = byte_level_bpe()
        t["extra"] = "@DEEP@"
        return {"tokenizer.json": dumps(t, {"@DEEP@": deep}), "input.jsonl": text_line("hello")}
    add("nested_unknown_key_50000", "nesting", "an unknown key of tokenizer.json holding 50,000 nested arrays",
        "refused", ["{tok}", "extra"], make_extra)
    add("nested_tokenizer_config_50000", "nesting", "tokenizer_config.json holding 50,000 nested arrays",
        "refused", ["{dir}/tokenizer_config.json"],
        lambda: {"tokenizer.json": dumps(byte_level_bpe()),
                 "tokenizer_config.json": '{"eos_token": "%s", "extra": %s}' % (EOT, deep),
                 "input.jsonl": text_line("hello")})
    add("nested_jsonl_line_50000", "nesting", "an input JSONL line holding 50,000 nested arrays",
        "refused", ["{dir}/input.jsonl"],
        lambda: {"tokenizer.json": dumps(byte_level_bpe()),
                 "input.jsonl": text_line("hello") + '{"text": "world", "meta": %s}\n' % deep})

    # Regexes whose cost is superlinear in the text: refused (a work budget over the whole
    # find_all, or the pattern refused when read), naming the pattern's JSON path.
    word_space = r"(?:(\w)|\s)*$"
    for n in [20000, 40000]:
        add("regex_word_space_%dk" % (n // 1000), "regex", "%s on %d characters of words and spaces ending in '!'"
            % (word_space, n), "refused", ["{tok}", SPLIT_PATH],
            lambda n=n: {"tokenizer.json": dumps(byte_level_bpe(word_space)),
                         "input.jsonl": text_line(("hello world " * (n // 12 + 1))[:n - 1] + "!")})
    add("regex_a_star_1mb", "regex", "a*a*a*a*a*b on 1 MB of 'a'", "refused", ["{tok}", SPLIT_PATH],
        lambda: {"tokenizer.json": dumps(byte_level_bpe("a*a*a*a*a*b")), "input.jsonl": text_line("a" * MB)})
    add("regex_a_star_runs_1mb", "regex", "a*a*a*a*a*b on 1 MB of runs of 100 'a' between spaces "
        "(each start position under PCRE2's match limit, the whole text far over it)", "refused",
        ["{tok}", SPLIT_PATH],
        lambda: {"tokenizer.json": dumps(byte_level_bpe("a*a*a*a*a*b")),
                 "input.jsonl": text_line(("a" * 100 + " ") * (MB // 101))})
    add("regex_dot_star_5mb", "regex", "(.)* on a 5 MB line of ASCII words (PCRE2's heap)", "refused",
        ["{tok}", SPLIT_PATH],
        lambda: {"tokenizer.json": dumps(byte_level_bpe("(.)*")),
                 "input.jsonl": text_line(("the quick brown fox jumps over the lazy dog " * (5 * MB // 44 + 1))[:5 * MB])})
    add("regex_2mb_uncompilable", "regex", "a 2 MB regex that does not compile (an unclosed group)",
        "refused", ["{tok}", SPLIT_PATH],
        lambda: {"tokenizer.json": dumps(byte_level_bpe("(" + "a" * (2 * MB))), "input.jsonl": text_line("hello")})

    # PCRE2-only verbs, which Oniguruma reads otherwise.
    for name, pattern in [("crlf", "(*CRLF)a"), ("no_jit", "(*NO_JIT)a"), ("limit_match", "(*LIMIT_MATCH=1)a"),
                          ("accept", "a(*ACCEPT)"), ("commit", "a(*COMMIT)b")]:
        add("verb_%s" % name, "verbs", "the PCRE2 verb in %s (a Split regex)" % pattern, "refused",
            ["{tok}", SPLIT_PATH],
            lambda pattern=pattern: {"tokenizer.json": dumps(byte_level_bpe(pattern)),
                                     "input.jsonl": text_line("a banana\r\nab aab")})

    def make_verb_in_normalizer():
        t = byte_level_bpe()
        t["normalizer"] = {"type": "Replace", "pattern": {"Regex": "(*CRLF)a"}, "content": "b"}
        return {"tokenizer.json": dumps(t), "input.jsonl": text_line("a banana")}
    add("verb_in_normalizer", "verbs", "(*CRLF)a in a Replace normalizer's regex", "refused",
        ["{tok}", "normalizer.pattern.Regex"], make_verb_in_normalizer)

    # null steps in a Sequence.
    def make_null(kind, key, step):
        t = byte_level_bpe()
        if kind == "pre_tokenizer":
            t[kind]["pretokenizers"].insert(1, None)
        else:
            t[kind] = {"type": "Sequence", key: [step, None]}
        return {"tokenizer.json": dumps(t), "input.jsonl": text_line("hello world")}
    add("null_normalizer_entry", "null", "a null entry in a normalizer Sequence", "refused",
        ["{tok}", "normalizer.normalizers[1]"],
        lambda: make_null("normalizer", "normalizers", {"type": "Prepend", "prepend": " "}))
    add("null_pre_tokenizer_entry", "null", "a null entry in a pre-tokenizer Sequence", "refused",
        ["{tok}", "pre_tokenizer.pretokenizers[1]"], lambda: make_null("pre_tokenizer", None, None))
    add("null_decoder_entry", "null", "a null entry in a decoder Sequence", "refused",
        ["{tok}", "decoder.decoders[1]"], lambda: make_null("decoder", "decoders", {"type": "ByteLevel"}))

    # Unigram with pieces of 3,000 characters: the lattice work grows with the longest piece.
    def make_unigram():
        rng = random.Random(3000)
        pieces = ["a" * 3000, "a" * 2999, "a" * 1500]
        pieces += ["".join(rng.choice("ab") for _ in range(3000)) for _ in range(20)]
        return {"tokenizer.json": dumps(unigram(pieces)), "input.jsonl": text_line("a" * 20000)}
    add("unigram_long_pieces", "unigram", "Unigram pieces of 3,000 characters, 20 KB of 'a'", "either",
        ["{tok}", "model.vocab"], make_unigram)

    # Normalizer expansion.
    def make_replace(content, text):
        t = byte_level_bpe()
        t["normalizer"] = {"type": "Replace", "pattern": {"String": "x"}, "content": content}
        return {"tokenizer.json": dumps(t), "input.jsonl": text_line(text)}
    add("replace_expand_64k", "expansion", "Replace of 'x' by 64 KB on 180 KB of 'x'", "refused",
        ["{tok}", "normalizer"], lambda: make_replace("y" * 65536, "x" * 180000))
    add("replace_expand_2x", "expansion", "Replace of 'x' by 'yy' on 1 MB of mixed text", "completes", [],
        lambda: make_replace("yy", ("xx hello x " * (MB // 11 + 1))[:MB]))

    # Legitimate neighbours: a normal tokenizer on large and repetitive documents.
    add("gpt2_multilingual_5mb", "neighbours", "GPT-2's Split regex on a 5 MB multilingual document",
        "completes", [],
        lambda: {"tokenizer.json": dumps(byte_level_bpe()), "input.jsonl": text_line(multilingual(5 * MB))})
    for name, ch in [("spaces", " "), ("newlines", "\n"), ("digits", "7")]:
        add("run_%s_1mb" % name, "neighbours", "a 1 MB run of %r between two words" % ch, "completes", [],
            lambda ch=ch: {"tokenizer.json": dumps(byte_level_bpe()),
                           "input.jsonl": text_line("start" + ch * MB + "end")})
    return out


def main(argv):
    args = argv[1:]
    if "--list" in args:
        for c in cases():
            print(c[0])
        return 0
    if not args or args[0].startswith("--"):
        print(__doc__, file=sys.stderr)
        return 2
    root = os.path.abspath(args[0])
    wanted = set()
    rest = args[1:]
    while rest:
        if rest[0] == "--case" and len(rest) > 1:
            wanted.add(rest[1])
            rest = rest[2:]
        else:
            print("unknown argument %r\n%s" % (rest[0], __doc__), file=sys.stderr)
            return 2
    all_cases = cases()
    unknown = wanted - {c[0] for c in all_cases}
    if unknown:
        print("unknown case(s): %s" % ", ".join(sorted(unknown)), file=sys.stderr)
        return 2
    os.makedirs(root, exist_ok=True)
    manifest = []
    for name, group, note, expect, contains, make in all_cases:
        folder = os.path.join(root, name)
        tok = os.path.join(folder, "tokenizer.json")
        manifest.append({"name": name, "group": group, "note": note, "expect": expect,
                         "contains": [s.format(tok=tok, dir=folder) for s in contains],
                         "tokenizer": tok, "input": os.path.join(folder, "input.jsonl"),
                         "output_prefix": os.path.join(folder, "out", "data")})
        if wanted and name not in wanted:
            continue
        os.makedirs(os.path.join(folder, "out"), exist_ok=True)
        for file_name, text in make().items():
            with open(os.path.join(folder, file_name), "w", encoding="utf-8", newline="") as f:
                f.write(text)
    with open(os.path.join(root, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump({"cases": manifest}, f, indent=1, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
