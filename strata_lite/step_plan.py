"""StepPlan: what one engine step computes (a Batch mixing decode tokens, drafted tokens to verify and
prompt chunks) and how its logit rows map back to sequences; StepEvent: one token handed back to the
engine loop."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .batch import Batch
from .sequence import Sequence


@dataclass(frozen=True)
class StepPlan:
    batch: Batch
    seqs: list[Sequence]         # page-table row i of the batch -> its sequence
    n_tokens: list[int]          # tokens of seqs[i] computed in this step (from seqs[i].n_computed)
    logit_seqs: list[Sequence]   # logit row j -> the sequence whose next token it gives
    n_decode: int                # sequences decoding (one token each, plus their drafted tokens)
    n_read: int                  # prompt tokens read (within the step budget)
    drafts: dict = field(default_factory=dict)   # decoding sequence -> drafted tokens it verifies
    n_drafted: int = 0

    @property
    def n_tokens_total(self) -> int:
        return self.n_decode + self.n_drafted + self.n_read


@dataclass(frozen=True)
class StepEvent:
    seq: Sequence
    token: int
    finish_reason: str | None    # set when this token ended the sequence ("stop" | "length" | ...)
    row: int = 0                 # the logit row it was sampled from (its logprobs)


def build_plan(work: dict[Sequence, int], n_decode: int, drafts: dict | None = None) -> StepPlan:
    """work: sequence -> tokens to compute from its n_computed, in row order, the n_decode decoding sequences
    first (the batch's decode_rows are theirs; the rest are prompt reads). drafts: decoding sequence
    -> drafted tokens; its work is 1 + len(draft): the pending token, then the draft, every one a logit
    row (row i verifies draft[i]; the last gives the token after the whole draft)."""
    drafts = drafts or {}
    seqs = list(work)
    n_tokens = [work[s] for s in seqs]
    tables = np.zeros((len(seqs), max(len(s.pages) for s in seqs)), np.int32)
    ids, pos, row_of, logit_rows, logit_seqs = [], [], [], [], []     # Python lists: a decode step's rows
    at = 0                                                            # are a few, numpy calls cost more
    for row, (seq, n) in enumerate(zip(seqs, n_tokens)):
        start = seq.n_computed
        draft = drafts.get(seq)
        if draft is None:
            ids += seq.tokens[start:start + n]
        else:
            ids += seq.tokens[start:]
            ids += draft
        pos += range(start, start + n)
        row_of += [row] * n
        tables[row, :len(seq.pages)] = seq.page_row()
        if draft is not None:
            logit_rows += range(at, at + n)
            logit_seqs += [seq] * n
        elif start + n == len(seq.tokens):
            logit_rows.append(at + n - 1)
            logit_seqs.append(seq)
        at += n
    batch = Batch(np.array(ids, np.int32), np.array(pos, np.int32), np.array(row_of, np.int32), tables,
                  np.array(logit_rows, np.int32), decode_rows=sum(n_tokens[:n_decode]))
    n_drafted = sum(len(d) for d in drafts.values())
    return StepPlan(batch, seqs, n_tokens, logit_seqs, n_decode, at - n_decode - n_drafted, dict(drafts),
                    n_drafted)
