"""What `Backend.sample` takes per logit row (SampleRows) and gives back (Sampled); host numpy only.

Sampling semantics, implemented exactly by every backend (row r of logits (m, n_vocab) float32):
  z = logits[r]
  if count_rows[r] >= 0: c = counts[count_rows[r]]; z -= frequency[r] * c + presence[r] * (c > 0)
  logprobs are the log-softmax of the RAW logits (no penalties, no temperature)
  greedy (temperature[r] == 0): token = argmax(z), lowest id on ties; uniform[r] is ignored
  else:
    z /= temperature[r]
    candidates = the top_k[r] largest of z (all when top_k is 0 or >= n_vocab), sorted descending,
                 ties lower id first
    p = softmax over the candidates
    keep = len(candidates)
    if top_p[r] < 1: keep = min(keep, searchsorted(cumsum(p), top_p[r], 'left') + 1)
    if min_p[r] > 0: keep = min(keep, max(1, count(p >= min_p[r] * p[0])))
    p = p[:keep] renormalized; cum = cumsum(p)
    token = candidates[first i < keep with cum[i] > uniform[r] * cum[keep - 1]] (clamped to keep - 1)
  This equals numpy's Generator.choice(keep, p=p) when uniform is the generator's next random().
Logprobs (n_logprobs[r]): -1 none; 0 the chosen token's only; n > 0 also the n best tokens of the raw
log-softmax, best first, ties lower id first. Sampled pads rows asking for fewer with -1 / NaN.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache, cached_property

import numpy as np

_DTYPES = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "min_p": np.float32,
           "presence": np.float32, "frequency": np.float32, "uniform": np.float64,
           "count_rows": np.int32, "n_logprobs": np.int32}


@dataclass(frozen=True)
class SampleRows:
    """Per-row sampling parameters, host numpy arrays of shape (m,) (dtypes in _DTYPES)."""
    temperature: np.ndarray     # float32, 0 = greedy
    top_k: np.ndarray           # int32, 0 = off
    top_p: np.ndarray           # float32, 1 = off
    min_p: np.ndarray           # float32, 0 = off
    presence: np.ndarray        # float32 presence penalty
    frequency: np.ndarray       # float32 frequency penalty
    uniform: np.ndarray         # float64 U[0,1) draw from the request's own seeded generator
    count_rows: np.ndarray      # int32 row of the backend's token-count table, -1 = no penalties
    n_logprobs: np.ndarray      # int32, -1 none, 0 chosen token only, n > 0 also the n best

    def __post_init__(self):
        m = None
        for f in fields(self):
            a = np.ascontiguousarray(getattr(self, f.name), dtype=_DTYPES[f.name])
            if a.ndim != 1 or (m is not None and len(a) != m):
                raise ValueError(f"SampleRows.{f.name}: expected shape ({m},), got {a.shape}")
            m = len(a)
            object.__setattr__(self, f.name, a)

    def __len__(self) -> int:
        return len(self.temperature)

    @property
    def n_top(self) -> int:
        """Width of Sampled.top_ids: the most alternatives any row asks for."""
        return max(0, int(self.n_logprobs.max())) if len(self) else 0

    @cached_property
    def _plain_greedy(self) -> bool:
        penalized = (self.count_rows >= 0) & ((self.presence != 0) | (self.frequency != 0))
        return bool(np.all(self.temperature == 0) and not penalized.any() and self.n_logprobs.max(initial=-1) < 0)

    def plain_greedy(self) -> bool:
        """Every row takes its top logit as it is: temperature 0, no penalty changes a logit, no logprobs."""
        return self._plain_greedy

    @classmethod
    def greedy(cls, m: int) -> "SampleRows":
        """m rows of plain argmax, no penalties, no logprobs (one shared read-only object per m)."""
        return _greedy_rows(cls, m)

    @classmethod
    def from_rows(cls, rows) -> "SampleRows":
        """From a list of dicts of per-row values; missing keys take the 'off' defaults. Rows that are all
        plain greedy (_is_plain_greedy: what they sample is the argmax whatever their other fields say) give
        greedy(len(rows)): a decode step builds no arrays."""
        if all(_is_plain_greedy(r) for r in rows):
            return cls.greedy(len(rows))
        unknown = {k for r in rows for k in r} - _DEFAULTS.keys()
        if unknown:
            raise ValueError(f"unknown SampleRows fields {sorted(unknown)}")
        return cls(**{k: np.array([r.get(k, d) for r in rows], dtype=_DTYPES[k]) for k, d in _DEFAULTS.items()})


_DEFAULTS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "presence": 0.0, "frequency": 0.0,
             "uniform": 0.0, "count_rows": -1, "n_logprobs": -1}


def _is_plain_greedy(row: dict) -> bool:
    """A from_rows row that samples its argmax as it is: temperature 0 (top_k, top_p, min_p and the uniform
    draw are then unused), no logprobs and no count row (a count row is kept, penalties or not: a backend
    checks that it has the count table); only known fields."""
    return (row.get("temperature", 0.0) == 0 and row.get("n_logprobs", -1) < 0 and row.get("count_rows", -1) < 0
            and row.keys() <= _DEFAULTS.keys())


@cache
def _greedy_rows(cls, m: int) -> SampleRows:
    rows = cls(**{k: np.full(m, d, dtype=_DTYPES[k]) for k, d in _DEFAULTS.items()})
    for f in fields(rows):
        getattr(rows, f.name).flags.writeable = False
    return rows


@dataclass
class Sampled:
    """Host results of Backend.sample for m rows."""
    ids: np.ndarray             # (m,) int32 chosen tokens
    logprob: np.ndarray         # (m,) float32 raw log-softmax of the chosen token, NaN where not asked
    top_ids: np.ndarray         # (m, n_top) int32 best tokens, best first, ties lower id; -1 padding
    top_logprobs: np.ndarray    # (m, n_top) float32 their logprobs; NaN padding

    @classmethod
    def empty(cls, m: int, n_top: int) -> "Sampled":
        """Poisoned result arrays to fill: ids 0, logprobs NaN, top_ids -1."""
        return cls(ids=np.zeros(m, np.int32), logprob=np.full(m, np.nan, np.float32),
                   top_ids=np.full((m, n_top), -1, np.int32),
                   top_logprobs=np.full((m, n_top), np.nan, np.float32))

    def __len__(self) -> int:
        return len(self.ids)


def count_pairs(table_shape, count_rows, ids):
    """The (row, id) pairs that add_counts increments: host int64 arrays (rows, ids) for the entries with
    count_rows >= 0, or None when there are none; ValueError for mismatched shapes or out-of-range values."""
    count_rows, ids = np.asarray(count_rows, np.int64), np.asarray(ids, np.int64)
    if count_rows.shape != ids.shape or count_rows.ndim != 1:
        raise ValueError(f"count_rows {count_rows.shape} and ids {ids.shape} must be equal 1-D shapes")
    sel = count_rows >= 0
    if not sel.any():
        return None
    rows, ids = count_rows[sel], ids[sel]
    if rows.max() >= table_shape[0] or ids.min() < 0 or ids.max() >= table_shape[1]:
        raise ValueError(f"count rows / ids out of range of the {tuple(table_shape)} table")
    return rows, ids
