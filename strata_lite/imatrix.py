"""Importance matrix (llama-imatrix's definition): for every weight matrix, the mean over tokens of x_j²
of the activation entering it, per input column j.

The text is tokenized without BOS and evaluated as non-overlapping chunks of `ctx` tokens, each from
an empty KV cache (as llama-imatrix and the golden sets do); every token's activations count, and the
output matrix sees every position (all logits are computed, as llama-imatrix does for its PPL).
File formats: `strata_lite.loader.imatrix_file` (GGUF as llama.cpp, or the golden npz layout).
"""
from __future__ import annotations

import math
import numpy as np
from tqdm import tqdm

from .batch import Batch
from .loader.imatrix_file import ImatrixData, load_imatrix, save_imatrix
from .perplexity import log_softmax


def collect_imatrix(llm, text: str, ctx: int = 512, chunks: int | None = None, progress: bool = True,
                    dataset: str | None = None) -> tuple[ImatrixData, float]:
    """-> (ImatrixData, perplexity of the text's scored second halves, llama-perplexity style)."""
    if ctx > llm.n_ctx:
        raise ValueError(f"--ctx {ctx} is larger than the model context n_ctx = {llm.n_ctx}")
    ids = llm.tokenize(text, add_special=False, parse_special=False)
    n_chunks = len(ids) // ctx
    if n_chunks == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    if chunks is not None:
        if chunks < 1:
            raise ValueError("--chunks must be >= 1")
        n_chunks = min(n_chunks, int(chunks))
    data = ImatrixData(datasets=[dataset] if dataset else [], chunk_size=ctx)
    pages = list(range(llm.kv.n_pages))
    first, nll = ctx // 2, []
    for c in tqdm(range(n_chunks), desc="imatrix", unit="chunk", disable=not progress):
        chunk = np.asarray(ids[c * ctx:(c + 1) * ctx], dtype=np.int32)
        for lo in range(0, ctx, llm.n_batch):
            hi = min(lo + llm.n_batch, ctx)
            batch = Batch.single(chunk[lo:hi], lo, pages)          # logits for every row
            logits = llm.backend.to_host(llm.forward(batch, observer=data.add))
            rows = np.arange(max(lo, first - 1), min(hi, ctx - 1))   # logits at row r predict token r+1 >= first
            if len(rows):
                lp = log_softmax(logits[rows - lo])
                nll.extend(-lp[np.arange(len(rows)), chunk[rows + 1]])
        data.chunk_count = c + 1
    return data, math.exp(float(np.mean(nll))) if nll else float("nan")


__all__ = ["collect_imatrix", "ImatrixData", "load_imatrix", "save_imatrix"]
