"""SentencePiece-style vocabularies ("llama" GGUF tokenizer model) built with `tokenizers`.

The GGUF gives pieces (spaces written as "▁"), a score per piece and `<0xNN>` byte tokens. The
SentencePiece BPE algorithm repeatedly joins the adjacent pair whose concatenation is a piece of
the vocabulary with the highest score; characters that no piece covers fall back to their UTF-8
bytes as `<0xNN>` tokens. That is a BPE whose merge list is every split `a + b` of every piece
(both halves in the vocabulary), ranked by the piece's score — which is what we give `tokenizers`.
"""

from __future__ import annotations

import re
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from .errors import GGUFError

SPACE = "\u2581"  # ▁
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _BYTE = 1, 2, 6


def spm_piece_bytes(text: str, ttype: int) -> bytes:
    """Bytes a normal/byte piece stands for."""
    if ttype == _BYTE:
        m = _BYTE_TOKEN.fullmatch(text)
        if m:
            return bytes([int(m.group(1), 16)])
    return text.replace(SPACE, " ").encode("utf-8")


def build_spm(tokens: Sequence[str], token_types: Sequence[int], scores, source: str) -> HFTokenizer:
    """A `tokenizers` Tokenizer encoding text that is already escaped (spaces -> "▁")."""
    if scores is None or len(scores) != len(tokens):
        raise GGUFError(source, "tokenizer.ggml.scores is missing or not one score per token "
                                "(needed by the 'llama' SentencePiece tokenizer)")
    vocab: dict[str, int] = {}
    for want_normal in (True, False):
        for i, (text, ttype) in enumerate(zip(tokens, token_types)):
            if (int(ttype) == _NORMAL) == want_normal and text not in vocab:
                vocab[text] = i

    ranked = []  # (-score, id, split position, left, right)
    for i, (text, ttype) in enumerate(zip(tokens, token_types)):
        if int(ttype) != _NORMAL or len(text) < 2 or vocab.get(text) != i:
            continue
        for k in range(1, len(text)):
            left, right = text[:k], text[k:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, k, left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]

    unk = next((t for t, ty in zip(tokens, token_types) if int(ty) == _UNKNOWN), None)
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    return HFTokenizer(model)
