"""Batch: what one forward pass computes, passed explicitly from runner to model to backend.

All arrays are host numpy; the model moves them to the device. `validate` checks every index once on
the host, so device kernels can trust them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numba import njit


@dataclass(frozen=True)
class Batch:
    token_ids: np.ndarray    # (n,) int32
    positions: np.ndarray    # (n,) int32: position of each token in its sequence
    token_seq: np.ndarray    # (n,) int32: row of page_tables each token belongs to
    page_tables: np.ndarray  # (n_seqs, max_pages) int32: KV pages of each sequence, in order
    logit_rows: np.ndarray   # (m,) int32: rows of the batch whose next-token logits are wanted
    # rows before the first prompt row (the engine's decode and verify tokens; StepPlan sets it), -1: not known,
    # taken as short_run_rows
    decode_rows: int = -1

    def __post_init__(self):
        object.__setattr__(self, "logit_rows", np.asarray(self.logit_rows, dtype=np.int32))

    @staticmethod
    def single(token_ids, start_pos: int, pages, logit_rows=None) -> "Batch":
        """A run of consecutive tokens of one sequence, from position start_pos."""
        ids = np.asarray(token_ids, dtype=np.int32)
        n = len(ids)
        rows = np.arange(n, dtype=np.int32) if logit_rows is None else np.asarray(logit_rows, dtype=np.int32)
        return Batch(ids, np.arange(start_pos, start_pos + n, dtype=np.int32), np.zeros(n, np.int32),
                     np.asarray([pages], dtype=np.int32), rows)

    def select(self, rows) -> "Batch":
        """The batch of the given rows only (host indices, in that order) with the same page tables and no logit
        rows (transformer.block_at_rows: rows whose block output is read after it, or that store K and V only)."""
        rows = np.asarray(rows, dtype=np.int64)
        return Batch(self.token_ids[rows], self.positions[rows], self.token_seq[rows], self.page_tables,
                     np.zeros(0, np.int32))

    # runs (consecutive tokens of one sequence) of at most this many tokens count as short: a decode token with
    # its drafted tokens (spec/: at most 8 drafts)
    SHORT_RUN = 16

    @cached_property
    def short_run_rows(self) -> int:
        """Tokens before the first run of more than SHORT_RUN tokens (the engine's plans put the decoding
        sequences, one token or a few to verify each, before the prompt chunks): a backend may compute their
        attention apart from the chunks' (Backend.attention split_rows)."""
        seq = self.token_seq
        if len(seq) <= self.SHORT_RUN:     # no run can be long (a decode step: ~20 us of numpy saved)
            return len(seq)
        starts = np.flatnonzero(np.diff(seq)) + 1
        bounds = np.concatenate(([0], starts, [len(seq)]))
        long_runs = np.flatnonzero(np.diff(bounds) > self.SHORT_RUN)
        return int(bounds[long_runs[0]]) if len(long_runs) else len(seq)

    @cached_property
    def prompt_runs(self) -> tuple:
        """The runs of prompt tokens: from decode_rows on where the plan gave it (every prompt chunk, however
        short), else from short_run_rows on (the runs after the leading short ones); each as (first row, end row,
        sequence, keys = its last position + 1), host ints (Backend.attention runs)."""
        n = len(self.token_seq)
        first = self.decode_rows if self.decode_rows >= 0 else self.short_run_rows
        if first >= n:
            return ()
        seq = self.token_seq[first:]
        bounds = np.concatenate(([0], np.flatnonzero(np.diff(seq)) + 1, [n - first])) + first
        return tuple((int(a), int(b), int(self.token_seq[a]), int(self.positions[a:b].max()) + 1)
                     for a, b in zip(bounds[:-1], bounds[1:]))

    @cached_property
    def max_pos(self) -> int:
        """Largest position + 1 (0 for an empty batch): the most keys any token attends to (computed once:
        a Batch's arrays are not changed after it is made)."""
        return int(self.positions.max()) + 1 if len(self.positions) else 0

    def validate(self, n_pages: int, page_size: int, n_vocab: int | None = None) -> None:
        """ValueError unless every index is in range: token ids (when n_vocab is given) in the vocabulary,
        token_seq in page_tables' rows, positions within a page table row's capacity, the pages holding
        each sequence's positions 0..max within the cache, logit rows within the batch. The range checks
        run as one compiled pass (_first_bad_index: every step validates its batch, and a dozen numpy
        reductions cost ~20 µs of host time a step)."""
        n = len(self.token_ids)
        for name in ("token_ids", "positions", "token_seq"):
            a = getattr(self, name)
            if a.dtype != np.int32 or a.shape != (n,):
                raise ValueError(f"Batch.{name} must be int32 of shape ({n},), got {a.dtype} {a.shape}")
        tables = self.page_tables
        if tables.dtype != np.int32 or tables.ndim != 2:
            raise ValueError(f"Batch.page_tables must be 2-D int32, got {tables.dtype} {tables.shape}")
        bad = _first_bad_index(self.token_ids, self.positions, self.token_seq, np.ascontiguousarray(tables),
                               self.logit_rows, n_pages, page_size, -1 if n_vocab is None else n_vocab)
        if bad == _LOGIT_ROWS:
            raise ValueError(f"Batch.logit_rows out of range of the {n} tokens")
        if bad == _TOKEN_IDS:
            raise ValueError(f"Batch.token_ids outside the vocabulary (0..{n_vocab - 1})")
        if bad == _TOKEN_SEQ:
            raise ValueError(f"Batch.token_seq out of range of the {tables.shape[0]} page_tables rows")
        if bad == _POSITIONS:
            raise ValueError(f"Batch.positions negative or beyond the page table's capacity "
                             f"({tables.shape[1]} pages of {page_size})")
        if bad == _PAGES:
            raise ValueError(f"Batch.page_tables entry (for a used position) out of range of the {n_pages} pages")


_OK, _LOGIT_ROWS, _TOKEN_IDS, _TOKEN_SEQ, _POSITIONS, _PAGES = range(6)


@njit(cache=True)
def _first_bad_index(ids, pos, seq, tables, logit_rows, n_pages, page_size, n_vocab):
    """Which of Batch.validate's range checks fails first (_LOGIT_ROWS .. _PAGES), or _OK. n_vocab < 0: token
    ids unchecked. The pages checked are each sequence's table entries 0 .. (its highest position) // page_size."""
    n = ids.shape[0]
    for r in logit_rows:
        if r < 0 or r >= n:
            return _LOGIT_ROWS
    if n_vocab >= 0:
        for t in ids:
            if t < 0 or t >= n_vocab:
                return _TOKEN_IDS
    n_seqs, width = tables.shape
    for s in seq:
        if s < 0 or s >= n_seqs:
            return _TOKEN_SEQ
    last = np.full(n_seqs, -1, np.int64)        # highest position per sequence
    for i in range(n):
        p = pos[i]
        if p < 0 or p >= width * page_size:
            return _POSITIONS
        if p > last[seq[i]]:
            last[seq[i]] = p
    for s in range(n_seqs):
        if last[s] >= 0:
            for j in range(last[s] // page_size + 1):
                if tables[s, j] < 0 or tables[s, j] >= n_pages:
                    return _PAGES
    return _OK
