"""Sampling over logit rows (numpy, float64), exactly the semantics of kernels/sample_rows.py.

The last step mirrors numpy's Generator.choice(keep, p=p) operation for operation (cdf = cumsum(p),
cdf /= cdf[-1], searchsorted(cdf, u, 'right')), so a request sampled with uniform = rng.random() picks
what rng.choice would have picked. Work per row: one sort of the candidates (the whole vocabulary
when top_k is off), as llama.cpp's CPU sampler does.
"""
from __future__ import annotations

import numpy as np

from ..sample_rows import SampleRows, Sampled, count_pairs

__all__ = ["sample", "argmax_prob", "add_counts", "top_ids", "log_softmax"]


def sample(logits: np.ndarray, rows: SampleRows, counts: np.ndarray | None) -> Sampled:
    """logits (m, n_vocab) float32, counts int32 (n_count_rows, n_vocab) or None -> Sampled."""
    if not isinstance(logits, np.ndarray) or logits.ndim != 2 or logits.dtype != np.float32:
        raise ValueError(f"logits must be a 2-D float32 numpy array, got {getattr(logits, 'shape', None)}")
    m, n_vocab = logits.shape
    if len(rows) != m:
        raise ValueError(f"{len(rows)} sample rows for {m} logit rows")
    if m and rows.count_rows.max() >= 0:
        if counts is None or counts.ndim != 2 or counts.shape[1] != n_vocab:
            raise ValueError(f"penalties need a (n_rows, {n_vocab}) count table, got "
                             f"{getattr(counts, 'shape', None)}")
        if rows.count_rows.max() >= counts.shape[0]:
            raise ValueError(f"count row {rows.count_rows.max()} beyond the table's {counts.shape[0]} rows")
    out = Sampled.empty(m, rows.n_top)
    for r in range(m):
        c = rows.count_rows[r]
        if c < 0 and rows.temperature[r] == 0:
            # greedy without penalties: the float32 row's argmax is its float64 copy's (the conversion is exact
            # and keeps the order), without the copy (~45 us a 151,936-token row)
            token = int(np.argmax(logits[r]))
        else:
            z = logits[r].astype(np.float64)
            if c >= 0:
                z -= float(rows.frequency[r]) * counts[c] + float(rows.presence[r]) * (counts[c] > 0)
            token = _choose(z, rows, r)
        out.ids[r] = token
        n = int(rows.n_logprobs[r])
        if n >= 0:
            lp = log_softmax(logits[r])
            out.logprob[r] = lp[token]
            if n:
                best = top_ids(lp, n)
                out.top_ids[r, :len(best)] = best
                out.top_logprobs[r, :len(best)] = lp[best]
    return out


def argmax_prob(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Greedy ids and their softmax probabilities of logit rows (m, n_vocab) float32: what sample() gives a greedy
    row with n_logprobs 0 (the lowest id of the largest logit; exp of its log_softmax value, rounded to float32 as
    Sampled keeps it), without building sample rows (an MTP draft's token and confidence every step: 44 against
    69 us for a 32,768-column row on a Zen 5 VM)."""
    ids = np.argmax(logits, axis=1).astype(np.int64)
    probs = np.array([np.float32(log_softmax(row)[i]) for row, i in zip(logits, ids)], np.float64)
    return ids, np.exp(probs)


def _choose(z: np.ndarray, rows: SampleRows, r: int) -> int:
    """One token from penalized float64 logits z (n_vocab,) with row r's parameters."""
    temperature = float(rows.temperature[r])
    if temperature == 0.0:
        return int(np.argmax(z))                      # first maximum = lowest id on ties
    z = z / temperature
    k = int(rows.top_k[r])
    idx = top_ids(z, k if 0 < k < len(z) else len(z))
    p = np.exp(z[idx] - z[idx[0]])
    p /= p.sum()
    keep = len(idx)
    top_p, min_p = float(rows.top_p[r]), float(rows.min_p[r])
    if top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1)
    if min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(p >= min_p * p[0]))))
    p = p[:keep] / p[:keep].sum()
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    i = int(np.searchsorted(cdf, float(rows.uniform[r]), side="right"))
    return int(idx[min(i, keep - 1)])


def top_ids(v: np.ndarray, k: int) -> np.ndarray:
    """int64 ids of the k largest of v (1-D), descending, ties lower id first."""
    n = len(v)
    if k >= n:
        return np.argsort(-v, kind="stable")
    thr = v[np.argpartition(-v, k - 1)[k - 1]]        # the k-th largest value
    above = np.flatnonzero(v > thr)
    ids = np.concatenate([above, np.flatnonzero(v == thr)[:k - len(above)]])   # ascending ids per group
    return ids[np.argsort(-v[ids], kind="stable")]


def log_softmax(row: np.ndarray) -> np.ndarray:
    """float64 log-softmax of one row."""
    z = row.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def add_counts(counts: np.ndarray, count_rows: np.ndarray, ids: np.ndarray) -> None:
    """counts[count_rows[i], ids[i]] += 1 where count_rows[i] >= 0 (repeats add up)."""
    pairs = count_pairs(counts.shape, count_rows, ids)
    if pairs is not None:
        np.add.at(counts, pairs, 1)
