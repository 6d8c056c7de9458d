"""Suffix drafts (after SuffixDecoding, arXiv 2411.04975): propose the continuation that most often
followed the longest suffix of the sequence that occurred before, in the request's own tokens (prompt
and output so far) or in recent requests' outputs (agent turns repeat earlier turns' tool calls).

Index, per request: for each context length L in LENGTHS, the positions where each L-gram ends.
  * the prompt is indexed at admission with numpy: polynomial hashes of every L-gram (uint64, wrapping
    arithmetic), sorted once; a lookup is a binary search (50K tokens: ~20 ms to build, ~10 us a lookup);
  * generated tokens go into a dict per L as they are appended (L dict updates per token).
Global: the outputs of the last GLOBAL_REQUESTS finished requests (at most GLOBAL_TOKENS tokens), with
a dict per L over them; the oldest output is dropped as a whole.

A draft: take the longest L whose L-gram suffix occurred before (candidates = the positions after
each occurrence, most recent first, at most MAX_CANDIDATES), then walk forward: at each depth the
candidates vote for the next token; the most frequent wins (ties: the most recent) and the others
drop out. `conf[i]` is the product of the winning shares so far (the path's empirical frequency);
the walk stops when it falls under MIN_CONF, the candidates run out of text, or max_len is reached.
Hand-written (no suffix-tree library installs without compilers on Windows and covers a growing
index plus a global one); numpy only.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import chain, islice
from dataclasses import dataclass

import numpy as np

LENGTHS = (32, 16, 8, 4, 2, 1)   # suffix lengths tried, longest first
MAX_CANDIDATES = 32              # occurrences voting on a continuation (the most recent)
MIN_CONF = 0.1                   # stop a draft when the path's frequency falls under this
GLOBAL_REQUESTS = 256            # finished outputs kept for drafting in other requests
GLOBAL_TOKENS = 1 << 18
GLOBAL_MIN_LEN = 4               # shorter suffixes are too common to draft from other requests

_B = np.uint64(0x100000001B3)    # hash base (odd: invertible mod 2^64)


@dataclass(frozen=True)
class Draft:
    tokens: list[int]      # proposed continuation
    conf: list[float]      # conf[i]: empirical frequency of the path up to tokens[i] among the candidates
    match_len: int         # length of the suffix that matched (0: no draft)

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT = Draft([], [], 0)


def _window_hashes(tokens: np.ndarray, L: int) -> np.ndarray:
    """uint64 hash of tokens[i - L + 1 .. i] for i = L-1 .. n-1, sum of t_j * B^(i - j), wrapping."""
    n = len(tokens)
    t = tokens.astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        h = np.zeros(n - L + 1, np.uint64)
        for j in range(L):                       # L passes over n elements: vectorized, no prefix inverse
            h = h * _B + t[j:n - L + 1 + j]
    return h


def _hash(seq) -> int:
    h = 0
    for t in seq:
        h = (h * 0x100000001B3 + int(t) + 1) & 0xFFFFFFFFFFFFFFFF
    return h


class _StaticIndex:
    """L-gram end positions of a fixed token array, by sorted hashes."""

    def __init__(self, tokens: np.ndarray, lengths=LENGTHS):
        self.tokens = tokens
        self.sorted: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for L in lengths:
            if len(tokens) < L:
                continue
            h = _window_hashes(tokens, L)
            order = np.argsort(h, kind="stable")          # equal hashes: ascending end position
            self.sorted[L] = (h[order], (order + L - 1).astype(np.int64))

    def ends(self, L: int, key: int) -> np.ndarray:
        """End positions of the L-grams hashing to key, ascending."""
        entry = self.sorted.get(L)
        if entry is None:
            return np.empty(0, np.int64)
        h, ends = entry
        k = np.uint64(key)
        lo, hi = np.searchsorted(h, k, "left"), np.searchsorted(h, k, "right")
        return ends[lo:hi]


class _GrowingIndex:
    """L-gram end positions of tokens appended one at a time (dict per L)."""

    def __init__(self, lengths=LENGTHS):
        self.lengths = lengths
        self.ends: dict[int, dict[int, list[int]]] = {L: {} for L in lengths}

    def add(self, tokens, i: int, lo: int = 0) -> None:
        """Index the L-grams of tokens ending at position i that start at or after lo."""
        for L in self.lengths:
            if i - L + 1 >= lo:
                self.ends[L].setdefault(_hash(tokens[i - L + 1:i + 1]), []).append(i)


class SequenceIndex:
    """The drafting index of one request: its prompt (static) and its generated tokens (growing)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens                      # the sequence's own list (prompt + generated), read only
        self.n_static = len(tokens)
        self.static = _StaticIndex(np.asarray(tokens, np.int64))
        self.growing = _GrowingIndex()
        self.n_indexed = self.n_static

    def update(self) -> None:
        """Index the tokens appended since the last call."""
        for i in range(self.n_indexed, len(self.tokens)):
            self.growing.add(self.tokens, i)
        self.n_indexed = len(self.tokens)

    def occurrences(self, L: int, key: int, before: int):
        """End positions (< before) of earlier L-grams with this hash, most recent first (lazily: a
        common token can have thousands)."""
        for e in reversed(self.growing.ends[L].get(key, ())):
            if e < before:
                yield e
        for e in self.static.ends(L, key)[::-1]:
            if e < before:
                yield int(e)


class GlobalIndex:
    """Outputs of recently finished requests (bounded), for drafts across requests."""

    def __init__(self, max_requests: int = GLOBAL_REQUESTS, max_tokens: int = GLOBAL_TOKENS):
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.texts: OrderedDict[int, list[int]] = OrderedDict()
        self.index: dict[int, dict[int, deque]] = {L: {} for L in LENGTHS if L >= GLOBAL_MIN_LEN}
        self.n_tokens = 0
        self._next_id = 0

    def add(self, tokens: list[int]) -> None:
        if not tokens or len(tokens) > self.max_tokens:
            return
        tid, self._next_id = self._next_id, self._next_id + 1
        self.texts[tid] = list(tokens)
        self.n_tokens += len(tokens)
        for L, table in self.index.items():
            for i in range(L - 1, len(tokens)):
                entries = table.setdefault(_hash(tokens[i - L + 1:i + 1]), deque(maxlen=MAX_CANDIDATES))
                entries.append((tid, i))
        while len(self.texts) > self.max_requests or self.n_tokens > self.max_tokens:
            _, old = self.texts.popitem(last=False)
            self.n_tokens -= len(old)
        # entries of dropped texts are skipped on lookup and age out of their bounded deques

    def occurrences(self, L: int, key: int):
        """(text, end position) of the L-grams with this hash, most recent first."""
        for tid, end in reversed(self.index.get(L, {}).get(key, ())):
            text = self.texts.get(tid)
            if text is not None:
                yield text, end


class SuffixDrafter:
    """Drafts for many sequences from their own SequenceIndex and one GlobalIndex."""

    def __init__(self, global_index: GlobalIndex | None = None):
        self.global_index = global_index if global_index is not None else GlobalIndex()

    def propose(self, index: SequenceIndex, max_len: int) -> Draft:
        """A draft of at most max_len tokens continuing index.tokens (NO_DRAFT when nothing matches)."""
        if max_len < 1:
            return NO_DRAFT
        index.update()
        tokens, n = index.tokens, len(index.tokens)
        for L in LENGTHS:
            if L > n:
                continue
            tail = tokens[n - L:]
            key = _hash(tail)
            own = ((tokens, e) for e in index.occurrences(L, key, n - 1))
            others = self.global_index.occurrences(L, key) if L >= GLOBAL_MIN_LEN else ()
            cands = list(islice(((t, e) for t, e in chain(own, others) if t[e - L + 1:e + 1] == tail),
                                MAX_CANDIDATES))
            if cands:
                return _walk(cands, L, max_len)
        return NO_DRAFT

    def finished(self, output: list[int]) -> None:
        """A request's generated tokens, for later requests' drafts."""
        self.global_index.add(output)


def _walk(cands: list[tuple[list[int], int]], match_len: int, max_len: int) -> Draft:
    """Follow the most frequent continuation of the candidate occurrences (text, end position)."""
    out, conf, c = [], [], 1.0
    live = [(text, end + 1) for text, end in cands]      # the position each candidate continues at
    while live and len(out) < max_len:
        votes: dict[int, int] = {}
        for text, at in live:
            if at < len(text):
                tok = text[at]
                votes[tok] = votes.get(tok, 0) + 1
        if not votes:
            break
        best = max(votes, key=lambda t: votes[t])     # dict order = most recent first: ties go to it
        c *= votes[best] / len(live)
        if c < MIN_CONF:
            break
        out.append(best)
        conf.append(c)
        live = [(text, at + 1) for text, at in live if at < len(text) and text[at] == best]
    return Draft(out, conf, match_len) if out else NO_DRAFT
