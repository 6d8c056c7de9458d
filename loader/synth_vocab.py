"""A synthetic gpt2-style byte-level BPE vocabulary of any size (for `strata-lite synth` models).

    synth_vocab(n_vocab, specials) -> SynthVocab(tokens, token_types, merges)

Ids 0..255 are the 256 byte-level symbols (id = byte value), then merged tokens in order of length:
"Ġa".."Ġz", "aa".."zz", "Ġaa".."Ġzz", "aaa", "Ġaaa", ... (Ġ is the byte-level space), each with the merge
(token minus its last letter, last letter), so every prefix of a token is a token and the merges are
valid BPE; the special (control) tokens take the last ids. Lowercase words therefore encode to a few
multi-letter tokens and any other text falls back to bytes, as with a real vocabulary.
"""
from __future__ import annotations

import itertools
import string
from dataclasses import dataclass
from typing import Iterator

from .tokenizer_bpe import _bytes_to_unicode

NORMAL, CONTROL = 1, 3
SPACE = _bytes_to_unicode()[ord(" ")]      # "Ġ"


@dataclass(frozen=True)
class SynthVocab:
    tokens: list[str]
    token_types: list[int]     # 1 normal, 3 control (the specials)
    merges: list[str]          # "left right", in rank order


def _merged_tokens() -> Iterator[tuple[str, str]]:
    """(left, right) pairs whose concatenation is the next merged token, shortest tokens first."""
    for c in string.ascii_lowercase:
        yield SPACE, c
    for length in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            word = "".join(letters)
            yield word[:-1], word[-1]
            yield SPACE + word[:-1], word[-1]


def synth_vocab(n_vocab: int, specials: list[str]) -> SynthVocab:
    n_merged = n_vocab - 256 - len(specials)
    if n_merged < 0:
        raise ValueError(f"a vocabulary of {n_vocab} tokens cannot hold the 256 byte tokens and "
                         f"{len(specials)} special tokens")
    pairs = list(itertools.islice(_merged_tokens(), n_merged))
    byte_syms = _bytes_to_unicode()
    tokens = [byte_syms[b] for b in range(256)] + [left + right for left, right in pairs] + list(specials)
    types = [NORMAL] * (256 + n_merged) + [CONTROL] * len(specials)
    return SynthVocab(tokens, types, [f"{left} {right}" for left, right in pairs])
