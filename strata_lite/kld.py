"""KL divergence of a model against a base model over the positions llama-perplexity scores.

Both models evaluate the same token chunks (the base model's tokenization, no BOS, non-overlapping
chunks of ctx tokens from an empty cache, second half of each chunk scored). Per scored position:
KL(P_base || Q_model) = sum_v p(v) (log p(v) - log q(v)) with float64 log-softmax over the full
vocabulary; top-1 agreement = the two argmax ids are equal. Both perplexities come from the same pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .perplexity import chunk_logprobs, log_softmax


@dataclass(frozen=True)
class KLDResult:
    mean_kl: float
    median_kl: float
    p99_kl: float
    max_kl: float
    top1: float                # fraction of scored positions whose argmax agrees with the base's
    ppl_base: float
    ppl: float
    mean_nll_base: float
    mean_nll: float
    n_chunks: int
    n_scored: int

    def format(self) -> str:
        return (f"PPL base {self.ppl_base:.4f}, model {self.ppl:.4f}; KL mean {self.mean_kl:.6f}, median "
                f"{self.median_kl:.6f}, p99 {self.p99_kl:.6f}, max {self.max_kl:.6f}; top-1 {self.top1:.6f} "
                f"({self.n_scored} positions in {self.n_chunks} chunks)")


def kld(base_llm, llm, text: str, ctx: int = 512, progress: bool = True):
    """KLDResult of llm against base_llm; llm may be a list of models (-> list of results, base run once)."""
    models = list(llm) if isinstance(llm, (list, tuple)) else [llm]
    for m in [base_llm] + models:
        if ctx > m.n_ctx:
            raise ValueError(f"--ctx {ctx} is larger than the model context n_ctx = {m.n_ctx}")
        if m.config.n_vocab != base_llm.config.n_vocab:
            raise ValueError(f"{m.model_path} has {m.config.n_vocab} tokens, the base model "
                             f"{base_llm.model_path} has {base_llm.config.n_vocab}: KL needs the same vocabulary")
    ids = base_llm.tokenize(text, add_special=False, parse_special=False)
    streams = [chunk_logprobs(m, ids, ctx, progress=False) for m in models]
    kls = [[] for _ in models]
    agree = [0] * len(models)
    nll = [[] for _ in models]
    nll_base = []
    n_chunks = 0
    from tqdm import tqdm
    for base_logits, targets in tqdm(chunk_logprobs(base_llm, ids, ctx, progress=False), total=len(ids) // ctx,
                                     desc="kld", unit="chunk", disable=not progress):
        n_chunks += 1
        lp = log_softmax(base_logits)
        del base_logits
        r = np.arange(len(targets))
        nll_base.append(-lp[r, targets])
        top_base = lp.argmax(axis=-1)
        p = np.exp(lp)
        for i, stream in enumerate(streams):
            logits, _ = next(stream)
            lq = log_softmax(logits)
            kls[i].append(np.einsum("ij,ij->i", p, lp - lq))
            agree[i] += int((lq.argmax(axis=-1) == top_base).sum())
            nll[i].append(-lq[r, targets])
    base_mean = float(np.mean(np.concatenate(nll_base)))
    out = []
    for i in range(len(models)):
        kl = np.maximum(np.concatenate(kls[i]), 0.0)
        mean_nll = float(np.mean(np.concatenate(nll[i])))
        out.append(KLDResult(float(kl.mean()), float(np.median(kl)), float(np.percentile(kl, 99)), float(kl.max()),
                             agree[i] / len(kl), math.exp(base_mean), math.exp(mean_nll), base_mean, mean_nll,
                             n_chunks, len(kl)))
    return out if isinstance(llm, (list, tuple)) else out[0]
