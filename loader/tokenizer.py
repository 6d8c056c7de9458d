"""Text <-> token ids for GGUF models.

`Tokenizer.from_gguf_metadata(meta)` builds the tokenizer described by the `tokenizer.ggml.*` keys:
"gpt2" (byte-level BPE, see tokenizer_bpe.py) or "llama" (SentencePiece, see tokenizer_spm.py).
The BPE/SPM algorithms run in the `tokenizers` library; special tokens, BOS/EOS and decoding are
handled here.

Token types (`tokenizer.ggml.token_type`): 1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte.

Decisions where llama.cpp and Hugging Face transformers disagree (we follow transformers):
  * A token is "special" exactly when the GGUF types it as control (3) or unknown (2). llama.cpp
    additionally re-types normal tokens that look like control tokens (Qwen2.5's 128247 "</s>") and
    then (1) matches them in the text when parse_special=True and (2) drops them from decoded text
    when special=False. We keep the GGUF's type: "<p>hello</s>" encodes as plain text with
    parse_special=True too, and decoding 128247 gives "</s>" either way.
  * (3) Unused tokens (type 5, e.g. "[PAD151665]") decode to their text in both modes (llama.cpp
    gives "").
  * Consequently "</s>" (a normal token in Qwen2.5) is not an end-of-generation id here, although
    llama.cpp lists it; see `eog_ids`.
"""

from __future__ import annotations

import re
from array import array
from typing import Any, Iterable, Mapping

import numpy as np

from .errors import GGUFError
from .tokenizer_bpe import build_bpe, byte_level_to_bytes
from .tokenizer_spm import SPACE, build_spm, spm_piece_bytes

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Texts of control / user-defined tokens that end a generation (besides the eos/eot/eom ids):
# end-of-turn markers of common chat formats and the Qwen FIM separators.
_EOG_TEXTS = frozenset({
    "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
    "<|end|>", "<end_of_turn>", "<EOT>", "<|EOT|>", "<end_of_utterance>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # <｜end▁of▁sentence｜> (DeepSeek)
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})


_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, str) for t in v)


def _is_numbers(kinds: str):
    """A 1-D array (or list) of numbers whose numpy dtype kind is one of `kinds`."""
    def check(v) -> bool:
        if not isinstance(v, (list, np.ndarray)) or len(v) == 0:
            return isinstance(v, (list, np.ndarray))
        if isinstance(v, list) and not all(isinstance(x, (int, float, np.number)) for x in v):
            return False
        return np.asarray(v).ndim == 1 and np.asarray(v).dtype.kind in kinds
    return check


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer))


# The value types a well-formed GGUF gives these keys (a corrupt or hand-made file may hold anything).
_FIELD_TYPES = (
    ("tokenizer.ggml.model", lambda v: isinstance(v, str), "a string"),
    ("tokenizer.ggml.pre", lambda v: isinstance(v, str), "a string"),
    ("tokenizer.ggml.tokens", _is_strings, "an array of strings"),
    ("tokenizer.ggml.merges", _is_strings, "an array of strings"),
    ("tokenizer.ggml.token_type", _is_numbers("iub"), "an array of integers"),
    ("tokenizer.ggml.scores", _is_numbers("iubf"), "an array of numbers"),
    *((f"tokenizer.ggml.{k}_token_id", _is_int, "an integer") for k in ("bos", "eos", "eot", "eom")),
    *((f"tokenizer.ggml.{k}", _is_int, "a boolean") for k in ("add_bos_token", "add_eos_token", "add_space_prefix")),
)


def _check_field_types(meta: Mapping[str, Any], source: str) -> None:
    for key, ok, what in _FIELD_TYPES:
        v = meta.get(key)
        if v is not None and not ok(v):
            raise GGUFError(source, f"{key} must be {what}, not {type(v).__name__}")


def _opt_int(meta: Mapping[str, Any], key: str) -> int | None:
    v = meta.get(key)
    return None if v is None else int(v)


class _Pieces:
    """Every token's bytes, pieces[i], held in one buffer: 151,936 bytes objects cost ~8 MiB, the buffer and
    its offsets ~2 MiB (docs/cpu.md, peak RSS)."""
    __slots__ = ("_blob", "_starts")

    def __init__(self, pieces: list[bytes]):
        self._blob = b"".join(pieces)
        starts = array("q", [0])
        at = 0
        for p in pieces:
            at += len(p)
            starts.append(at)
        self._starts = starts

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, i: int) -> bytes:
        """Bytes of token i (0 <= i < len: the callers check ids)."""
        s = self._starts
        return self._blob[s[i]:s[i + 1]]


class Tokenizer:
    """Encoder/decoder for one GGUF vocabulary. Build it with `from_gguf_metadata`."""

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]
    special_ids: frozenset[int]     # control, unknown and user-defined tokens
    add_bos: bool
    add_eos: bool

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "<gguf>") -> "Tokenizer":
        _check_field_types(meta, source)
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            missing = "tokenizer.ggml.model" if model is None else "tokenizer.ggml.tokens"
            raise GGUFError(source, f"{missing} is missing: the file has no tokenizer")
        tokens = list(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = np.full(len(tokens), NORMAL, dtype=np.int32)
        types = np.asarray(types, dtype=np.int32)
        if len(types) != len(tokens):
            raise GGUFError(source, f"tokenizer.ggml.token_type has {len(types)} entries for "
                                    f"{len(tokens)} tokens")
        if model == "gpt2":
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:
                raise GGUFError(source, "tokenizer.ggml.merges is missing (needed by 'gpt2' BPE)")
            pre = meta.get("tokenizer.ggml.pre", "default")
            try:
                backend = build_bpe(tokens, types, merges, pre, source)
            except GGUFError:
                raise
            except Exception as e:  # e.g. a merge naming a token that is not in the vocabulary
                raise GGUFError(source, f"cannot build the BPE tokenizer: {e}") from e
            kind, default_add_bos = "bpe", False
        elif model == "llama":
            try:
                backend = build_spm(tokens, types, meta.get("tokenizer.ggml.scores"), source)
            except GGUFError:
                raise
            except Exception as e:
                raise GGUFError(source, f"cannot build the SentencePiece tokenizer: {e}") from e
            kind, default_add_bos = "spm", True
        else:
            raise GGUFError(source, f"tokenizer.ggml.model = {model!r} is not supported "
                                    "(supported: 'gpt2', 'llama')")
        return cls(kind=kind, backend=backend, tokens=tokens, types=types, meta=meta,
                   default_add_bos=default_add_bos, source=source)

    def __init__(self, *, kind: str, backend, tokens: list[str], types: np.ndarray,
                 meta: Mapping[str, Any], default_add_bos: bool, source: str):
        self.kind, self.source = kind, source
        self._backend = backend     # the token texts are not kept (15 MiB for a 152K vocabulary): _pieces
        self._types = types
        self.n_vocab = len(tokens)

        def token_id(key: str) -> int | None:
            v = _opt_int(meta, key)
            if v is not None and not 0 <= v < self.n_vocab:
                raise GGUFError(source, f"{key} = {v} is outside the vocabulary (0..{self.n_vocab - 1})")
            return v

        self.bos_id = token_id("tokenizer.ggml.bos_token_id")
        self.eos_id = token_id("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = kind == "spm" and bool(meta.get("tokenizer.ggml.add_space_prefix", True))

        eog = {i for i in (self.eos_id, token_id("tokenizer.ggml.eot_token_id"),
                           token_id("tokenizer.ggml.eom_token_id")) if i is not None}
        for i in np.flatnonzero((types == CONTROL) | (types == USER_DEFINED)):
            if tokens[i] in _EOG_TEXTS:
                eog.add(int(i))
        self.eog_ids = frozenset(eog)

        # Bytes of every token, and which ones are dropped from decoded text unless special=True.
        if kind == "bpe":
            text_bytes = byte_level_to_bytes
        else:
            def text_bytes(t: str) -> bytes:
                return spm_piece_bytes(t, NORMAL)
        pieces = []
        for t, ty in zip(tokens, types.tolist()):
            if ty in (CONTROL, UNKNOWN, USER_DEFINED):
                pieces.append(t.encode("utf-8"))  # stored as raw text, not byte-level
            elif ty == BYTE:
                pieces.append(spm_piece_bytes(t, BYTE))
            else:  # normal, unused
                pieces.append(text_bytes(t))
        self._pieces = _Pieces(pieces)
        self._hidden = frozenset(np.flatnonzero((types == CONTROL) | (types == UNKNOWN)).tolist())

        # Special-token splitting: user-defined tokens always, control/unknown with parse_special.
        def alternation(ids) -> re.Pattern | None:
            texts = sorted({tokens[i] for i in ids if tokens[i]}, key=lambda s: (-len(s), s))
            return re.compile("|".join(map(re.escape, texts))) if texts else None

        user = np.flatnonzero(types == USER_DEFINED).tolist()
        ctrl = np.flatnonzero((types == CONTROL) | (types == UNKNOWN)).tolist()
        self.special_ids = frozenset(user + ctrl)
        self._special_re = {False: alternation(user), True: alternation(user + ctrl)}
        self._text_to_id = {}
        for i in user + ctrl:  # the first id wins when two special tokens share a text
            self._text_to_id.setdefault(tokens[i], i)

    # ------------------------------------------------------------------ encode

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special: add BOS/EOS as the GGUF asks (`add_bos_token`,
        `add_eos_token`). parse_special: match control tokens (e.g. "<|im_start|>") written in the
        text; user-defined tokens (e.g. "<tool_call>") are always matched."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, not {type(text).__name__}")
        bad = _SURROGATE.search(text)
        if bad:     # e.g. undecodable bytes in a command line (surrogateescape); no encoding carries them
            raise ValueError(f"the text holds a lone surrogate U+{ord(bad.group()):04X} at character "
                             f"{bad.start()}, which is not Unicode text")
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        pattern = self._special_re[bool(parse_special)]
        pos, prev_special = 0, True
        if pattern is not None:
            for m in pattern.finditer(text):
                if m.start() > pos:
                    ids += self._encode_plain(text[pos:m.start()], prev_special)
                ids.append(self._text_to_id[m.group()])
                pos, prev_special = m.end(), True
        if pos < len(text):
            ids += self._encode_plain(text[pos:], prev_special)
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _encode_plain(self, text: str, after_special: bool) -> list[int]:
        if self.kind == "spm":
            # SentencePiece adds a space before the text, as llama.cpp does at the start of the
            # input and after every special token.
            if self.add_space_prefix and after_special:
                text = " " + text
            text = text.replace(" ", SPACE)
        return self._backend.encode(text, add_special_tokens=False).ids

    # ------------------------------------------------------------------ decode

    def _check_ids(self, ids) -> list[int]:
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self.n_vocab:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{self.n_vocab - 1})")
        return out

    def decode_bytes(self, ids: Iterable[int], special: bool = False,
                     *, strip_space_prefix: bool = True) -> bytes:
        """Raw bytes of `ids` (they may end inside a UTF-8 character). special=False drops control
        tokens. For SentencePiece vocabularies with a space prefix, the first piece loses its
        leading space unless strip_space_prefix=False (use that when decoding a stream piecewise)."""
        ids = self._check_ids(ids)
        pieces = self._pieces
        if special:
            parts = [pieces[i] for i in ids]
        else:
            hidden = self._hidden
            parts = [pieces[i] for i in ids if i not in hidden]
        if strip_space_prefix and self.add_space_prefix:
            first = next((k for k, p in enumerate(parts) if p), None)
            if first is not None and parts[first].startswith(b" "):
                parts[first] = parts[first][1:]
        return b"".join(parts)

    def decode(self, ids: Iterable[int], special: bool = False, *, strip_space_prefix: bool = True) -> str:
        """Text of `ids`; invalid or incomplete UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, special, strip_space_prefix=strip_space_prefix).decode(
            "utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token (control tokens give their text)."""
        return self._pieces[self._check_ids([token_id])[0]]

    def token_text(self, token_id: int) -> str:
        """Printable text of one token, for logs and logprobs (control tokens give their text,
        a partial UTF-8 character gives U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_type(self, token_id: int) -> int:
        return int(self._types[self._check_ids([token_id])[0]])

    def is_eog(self, token_id: int) -> bool:
        return int(token_id) in self.eog_ids

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id}, "
                f"eog={sorted(self.eog_ids)}, source={self.source!r})")
