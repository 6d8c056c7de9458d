"""Batch: what one forward pass computes, passed explicitly from runner to model to backend.

All arrays are host numpy; the model moves them to the device. `validate` checks every index once on
the host, so device kernels can trust them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    token_ids: np.ndarray    # (n,) int32
    positions: np.ndarray    # (n,) int32: position of each token in its sequence
    token_seq: np.ndarray    # (n,) int32: row of page_tables each token belongs to
    page_tables: np.ndarray  # (n_seqs, max_pages) int32: KV pages of each sequence, in order
    logit_rows: np.ndarray   # (m,) int32: rows of the batch whose next-token logits are wanted

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

    @property
    def max_pos(self) -> int:
        """Largest position + 1 (0 for an empty batch): the most keys any token attends to."""
        return int(self.positions.max()) + 1 if len(self.positions) else 0

    def validate(self, n_pages: int, page_size: int, n_vocab: int | None = None) -> None:
        """ValueError unless every index is in range: token ids (when n_vocab is given) in the vocabulary,
        token_seq in page_tables' rows, positions within a page table row's capacity, the pages holding
        each sequence's positions 0..max within the cache, logit rows within the batch."""
        n = len(self.token_ids)
        for name in ("token_ids", "positions", "token_seq"):
            a = getattr(self, name)
            if a.dtype != np.int32 or a.shape != (n,):
                raise ValueError(f"Batch.{name} must be int32 of shape ({n},), got {a.dtype} {a.shape}")
        tables = self.page_tables
        if tables.dtype != np.int32 or tables.ndim != 2:
            raise ValueError(f"Batch.page_tables must be 2-D int32, got {tables.dtype} {tables.shape}")
        if len(self.logit_rows) and not (0 <= self.logit_rows.min() and self.logit_rows.max() < n):
            raise ValueError(f"Batch.logit_rows out of range of the {n} tokens")
        if n == 0:
            return
        if n_vocab is not None and not (0 <= self.token_ids.min() and self.token_ids.max() < n_vocab):
            raise ValueError(f"Batch.token_ids outside the vocabulary (0..{n_vocab - 1})")
        if self.token_seq.min() < 0 or self.token_seq.max() >= tables.shape[0]:
            raise ValueError(f"Batch.token_seq out of range of the {tables.shape[0]} page_tables rows")
        if self.positions.min() < 0 or self.max_pos > tables.shape[1] * page_size:
            raise ValueError(f"Batch.positions negative or beyond the page table's capacity "
                             f"({tables.shape[1]} pages of {page_size})")
        last = np.full(tables.shape[0], -1, np.int64)         # highest position per sequence
        np.maximum.at(last, self.token_seq, self.positions)
        used = np.arange(tables.shape[1])[None, :] <= (last // page_size)[:, None]   # (n_seqs, max_pages)
        pages = tables[used]
        if len(pages) and (pages.min() < 0 or pages.max() >= n_pages):
            raise ValueError(f"Batch.page_tables entry (for a used position) out of range of the {n_pages} pages")
