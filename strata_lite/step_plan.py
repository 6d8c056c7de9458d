"""StepPlan: what one engine step computes (a Batch mixing decode tokens and prompt chunks) and how
its logit rows map back to sequences; StepEvent: one sampled token handed back to the engine loop."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch
from .sequence import Sequence


@dataclass(frozen=True)
class StepPlan:
    batch: Batch
    seqs: list[Sequence]         # page-table row i of the batch -> its sequence
    n_tokens: list[int]          # tokens of seqs[i] computed in this step (from seqs[i].n_computed)
    logit_seqs: list[Sequence]   # logit row j -> the sequence whose next token it gives
    n_decode: int                # sequences decoding one token
    n_read: int                  # prompt tokens read (within the step budget)


@dataclass(frozen=True)
class StepEvent:
    seq: Sequence
    token: int
    finish_reason: str | None    # set when this token ended the sequence ("stop" | "length" | ...)


def build_plan(work: dict[Sequence, int], n_decode: int) -> StepPlan:
    """work: sequence -> tokens to compute from its n_computed, in row order."""
    seqs = list(work)
    n_tokens = [work[s] for s in seqs]
    total = sum(n_tokens)
    ids = np.empty(total, np.int32)
    pos = np.empty(total, np.int32)
    row_of = np.empty(total, np.int32)
    tables = np.zeros((len(seqs), max(len(s.pages) for s in seqs)), np.int32)
    logit_rows, logit_seqs, at = [], [], 0
    for row, (seq, n) in enumerate(zip(seqs, n_tokens)):
        start = seq.n_computed
        ids[at:at + n] = seq.tokens[start:start + n]
        pos[at:at + n] = np.arange(start, start + n, dtype=np.int32)
        row_of[at:at + n] = row
        tables[row, :len(seq.pages)] = seq.pages
        if start + n == len(seq.tokens):
            logit_rows.append(at + n - 1)
            logit_seqs.append(seq)
        at += n
    batch = Batch(ids, pos, row_of, tables, np.asarray(logit_rows, np.int64))
    return StepPlan(batch, seqs, n_tokens, logit_seqs, n_decode, total - n_decode)
