"""Byte-level BPE ("gpt2" GGUF tokenizer model) built with the `tokenizers` library.

The GGUF stores the vocabulary in the byte-level alphabet of GPT-2 (every byte 0..255 is mapped to
a printable character, e.g. space -> "Ġ"), the merge list as "left right" strings, and names the
pre-tokenizer (the regex that splits text into words before BPE) in `tokenizer.ggml.pre`.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from .errors import GGUFError

# Pre-tokenizer regexes, keyed by the `tokenizer.ggml.pre` names that use them. These are the
# patterns published in the models' own tokenizer.json files.
_GPT2_PATTERN = None  # the ByteLevel pre-tokenizer's built-in GPT-2 regex
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> (regex or None for the GPT-2 default, ignore_merges)
# ignore_merges: a word that is itself in the vocabulary is emitted as one token without running
# the merges (Llama 3's tokenizer.json sets it; Qwen2's and GPT-2's do not).
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (_GPT2_PATTERN, False),
    "gpt2": (_GPT2_PATTERN, False),
    "gpt-2": (_GPT2_PATTERN, False),
    "qwen2": (_QWEN2_PATTERN, False),
    "llama-bpe": (_LLAMA3_PATTERN, True),
    "llama3": (_LLAMA3_PATTERN, True),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# str.translate table: byte-level character -> the character whose code point is the byte value,
# so that `text.translate(_UNBYTE).encode("latin-1")` gives the token's bytes.
_UNBYTE = {ord(c): b for b, c in _bytes_to_unicode().items()}


def byte_level_to_bytes(text: str) -> bytes:
    """Bytes of a token written in the byte-level alphabet. Characters outside that alphabet
    (possible in hand-made vocabularies) are taken as their own UTF-8 encoding."""
    mapped = text.translate(_UNBYTE)
    try:
        return mapped.encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(bytes([ord(c)]) if ord(c) < 256 else c.encode("utf-8") for c in mapped)


def build_bpe(tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
              pre: str, source: str) -> HFTokenizer:
    """A `tokenizers` Tokenizer that turns plain text (no special tokens) into ids."""
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(source, f"tokenizer.ggml.pre = {pre!r}: unknown pre-tokenizer "
                                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    pattern, ignore_merges = PRE_TOKENIZERS[pre]

    vocab: dict[str, int] = {}
    # Normal tokens first so that, if a text appears twice, the normal token wins.
    for want_normal in (True, False):
        for i, (text, ttype) in enumerate(zip(tokens, token_types)):
            if (int(ttype) == 1) == want_normal and text not in vocab:
                vocab[text] = i

    pairs = []
    for k, m in enumerate(merges):
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise GGUFError(source, f"tokenizer.ggml.merges[{k}] = {m!r} is not 'left right'")
        pairs.append((left, right))

    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, byte_fallback=False)
    tok = HFTokenizer(model)
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return tok
