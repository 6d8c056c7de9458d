"""Perplexity with llama-perplexity's scoring: non-overlapping chunks of n_ctx tokens, each from an
empty cache, scoring the second half of every chunk (no BOS substitution). The remainder is dropped."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    mean_nll: float
    n_chunks: int
    n_scored: int
    chunk_nll: list[float]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def chunk_logprobs(llm, ids: list[int], ctx: int, progress: bool = True):
    """Yields, per chunk, float64 log-probs (ctx - ctx//2 - 1 ... ) of the scored positions and their targets."""
    n_chunks = len(ids) // ctx
    if n_chunks == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    first = ctx // 2
    for c in tqdm(range(n_chunks), desc="perplexity", unit="chunk", disable=not progress):
        chunk = ids[c * ctx:(c + 1) * ctx]
        rows = np.arange(first - 1, ctx - 1)              # logits at j-1 predict token j
        yield llm.eval(chunk, 0, rows), np.asarray(chunk[first:], dtype=np.int64)


def perplexity(llm, text: str, ctx: int = 512, progress: bool = True) -> PerplexityResult:
    ids = llm.tokenize(text, add_special=False, parse_special=False)
    if ctx > llm.n_ctx:
        raise ValueError(f"--ctx {ctx} is larger than the model context n_ctx = {llm.n_ctx}")
    chunk_nll = []
    for logits, targets in chunk_logprobs(llm, ids, ctx, progress):
        lp = log_softmax(logits)
        chunk_nll.append(float(-lp[np.arange(len(targets)), targets].mean()))
    mean = float(np.mean(chunk_nll))
    return PerplexityResult(math.exp(mean), mean, len(chunk_nll), len(chunk_nll) * (ctx - ctx // 2), chunk_nll)
