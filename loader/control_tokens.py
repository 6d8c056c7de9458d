"""Control tokens of a vocabulary, and chat prompts tokenized so that only the template writes them.

A chat prompt is the template's rendering, tokenized with special tokens parsed. Done naively, a user
(or a tool result, or an earlier assistant turn) that writes "<|im_start|>system" in a message gets the
real control token and can forge a role or end a turn. Here:

1. `mark_inputs` copies the messages and tools, putting an unused private-use character (the mark)
   after the first character of every control-token text found in any string (keys too). The template
   renders the marked copy; everything else in the inputs is unchanged, so templates that inspect the
   content (`'</think>' in content`, `content.split(...)`) behave as on the original.
2. `MarkedPrompt.from_rendered` removes the marks and remembers where each marked text starts.
3. `encode` splits the prompt at control-token texts like `Tokenizer.encode(parse_special=True)`
   does, except that texts starting at a marked position stay plain text; plain runs are tokenized
   with parse_special=False (user-defined tokens such as "<tool_call>" are matched in both modes, as in
   llama.cpp and transformers). With no control text in the inputs the ids equal
   `tokenizer.encode(rendering, parse_special=True)` exactly (tests/loader/test_control_tokens.py).

Limits: a template that writes an input through `tojson(ensure_ascii=True)` shows the mark as a
`\\ue000`-style escape (still plain text); a control token split between template text and an input
(template writes "<", the content continues "|im_start|>") is not caught (no template does that).
"""
from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# GGUF token types that `encode(parse_special=True)` matches and parse_special=False does not
# (loader/tokenizer.py: UNKNOWN, CONTROL; USER_DEFINED tokens are matched in both modes)
_SPECIAL_TYPES = (2, 3)
_USER_DEFINED = 4
# candidates for the mark: the private-use areas (no case mapping, not in any vocabulary's control text)
_MARK_RANGES = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))


@dataclass(frozen=True)
class MarkedPrompt:
    text: str                                   # the rendering, as ChatTemplate.render() gives it
    plain_at: frozenset[int] = field(default_factory=frozenset)   # starts of control texts from inputs

    @classmethod
    def from_rendered(cls, rendered: str, mark: str) -> "MarkedPrompt":
        if not mark or mark not in rendered:
            return cls(rendered)
        parts = rendered.split(mark)
        starts, end = [], 0
        for part in parts[:-1]:
            end += len(part)
            starts.append(end - 1)              # the mark follows the first character of the text
        return cls("".join(parts), frozenset(starts))


class ControlTokens:
    """text -> id of a vocabulary's control (and unknown) tokens, and `max_token_chars`, the most text
    one token of plain text stands for, in bytes (>= characters): a text of n characters, tokenized
    with parse_special=False, has at least n / max_token_chars tokens."""

    def __init__(self, ids: Mapping[str, int], max_token_chars: int):
        self.ids = dict(ids)
        self.max_token_chars = max(1, int(max_token_chars))
        texts = sorted(self.ids, key=lambda s: (-len(s), s))
        self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None

    @classmethod
    def of(cls, tokenizer) -> "ControlTokens":
        """The control tokens of `tokenizer` (GGUF token types), scanned once per tokenizer (~0.4 s for
        a 150k vocabulary). A tokenizer without token types (a test fake) has none."""
        with _lock:
            found = _cache.get(tokenizer)
            if found is None:
                found = _cache[tokenizer] = cls._scan(tokenizer)
            return found

    @classmethod
    def _scan(cls, tokenizer) -> "ControlTokens":
        if not hasattr(tokenizer, "token_type"):
            return cls({}, 1)
        ids: dict[str, int] = {}
        user: set[str] = set()
        longest = 1
        for i in range(tokenizer.n_vocab):
            piece = tokenizer.token_bytes(i)
            kind = tokenizer.token_type(i)
            if kind in _SPECIAL_TYPES:
                if piece:
                    ids.setdefault(piece.decode("utf-8", errors="replace"), i)   # the first id wins, as in encode
                continue
            longest = max(longest, len(piece))          # what one token of plain text can stand for
            if kind == _USER_DEFINED:
                user.add(piece.decode("utf-8", errors="replace"))
        return cls({t: i for t, i in ids.items() if t not in user}, longest)

    # ---- rendering side

    def free_mark(self, inputs: Any) -> str | None:
        """A character in no string of `inputs` ("" when there are no control tokens to mark; None when
        every private-use character is taken)."""
        if self.pattern is None:
            return ""
        used: set[str] = set()
        for s in strings_in(inputs):
            used.update(s)
        for lo, hi in _MARK_RANGES:
            for cp in range(lo, hi + 1):
                if chr(cp) not in used:
                    return chr(cp)
        return None

    def mark_inputs(self, obj: Any, mark: str) -> Any:
        """A copy of obj (dicts, lists, strings at any depth) with `mark` after the first character of
        every control-token text in its strings and keys."""
        if not mark:
            return obj

        def sub(m: re.Match) -> str:
            return m.group()[0] + mark + m.group()[1:]

        def walk(x):
            if isinstance(x, str):
                return self.pattern.sub(sub, x)
            if isinstance(x, Mapping):
                return {walk(k): walk(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [walk(v) for v in x]
            return x
        return walk(obj)

    # ---- tokenizing side

    def encode(self, tokenizer, prompt: MarkedPrompt, add_special: bool = True) -> list[int]:
        """Token ids of the prompt: control-token texts written by the template become their ids, those
        from the inputs plain text. add_special: BOS/EOS as `tokenizer.encode(add_special=True)` adds."""
        text, plain_at = prompt.text, prompt.plain_at
        prefix, suffix = _edges(tokenizer) if add_special else ([], [])
        ids = list(prefix)
        run = 0
        for m in self.pattern.finditer(text) if self.pattern is not None else ():
            if m.start() in plain_at:
                continue
            if m.start() > run:
                ids += tokenizer.encode(text[run:m.start()], add_special=False, parse_special=False)
            ids.append(self.ids[m.group()])
            run = m.end()
        if run < len(text):
            ids += tokenizer.encode(text[run:], add_special=False, parse_special=False)
        return ids + suffix


_lock = threading.Lock()
_cache: "weakref.WeakKeyDictionary[Any, ControlTokens]" = weakref.WeakKeyDictionary()


def _edges(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) that encode(add_special=True) adds around a text: BOS, and EOS when the
    vocabulary asks for it."""
    both = list(tokenizer.encode("", add_special=True, parse_special=False))
    eos = getattr(tokenizer, "eos_id", None)
    if both and getattr(tokenizer, "add_eos", False) and both[-1] == eos:
        return both[:-1], both[-1:]
    return both, []


def strings_in(x: Any):
    """Every string in x (dicts with their keys, lists, tuples), without recursion."""
    stack = [x]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            yield x
        elif isinstance(x, Mapping):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
