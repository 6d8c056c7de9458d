"""Batch: what one forward pass computes, passed explicitly from runner to model to backend."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    token_ids: np.ndarray    # (n,) int32
    positions: np.ndarray    # (n,) int32: position of each token in its sequence
    token_seq: np.ndarray    # (n,) int32: row of page_tables each token belongs to
    page_tables: np.ndarray  # (n_seqs, max_pages) int32: KV pages of each sequence, in order
    logit_rows: np.ndarray   # (m,) int64: rows of the batch whose next-token logits are wanted

    @staticmethod
    def single(token_ids, start_pos: int, pages, logit_rows=None) -> "Batch":
        """A run of consecutive tokens of one sequence, from position start_pos."""
        ids = np.asarray(token_ids, dtype=np.int32)
        n = len(ids)
        rows = np.arange(n, dtype=np.int64) if logit_rows is None else np.asarray(logit_rows, dtype=np.int64)
        return Batch(ids, np.arange(start_pos, start_pos + n, dtype=np.int32), np.zeros(n, np.int32),
                     np.asarray([pages], dtype=np.int32), rows)
