"""Score GGUF files with llama.cpp itself (llama-cpp-python), by the golden sets' method.

    python perf/score_llamacpp.py --base BASE.gguf [--text heapq.py] [--threads 2] FILE.gguf ...

Perplexity of each file on the text (no BOS, 512-token chunks each from an empty cache, tokens
256..511 of every chunk scored) and KL(base || file) over those positions from float64
log-softmax of the float32 logits, top-1 agreement: the computation of the golden `gen_ppl.py`
(n_ctx = n_batch = n_ubatch = 512, f16 KV cache, flash attention off, CPU). Our files are
ordinary GGUF, so llama.cpp reads them; scoring ours and llama.cpp's own files with the same
evaluator separates quantization quality from the evaluating engine (our `strata-lite kld`
keeps K/V in int8, llama.cpp in f16). Needs `pip install llama-cpp-python` (not a dependency
of strata_lite); prints one table, `--json` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from strata_lite.perplexity import log_softmax

CHUNK, FIRST = 512, 256
GOLDEN_TEXT = Path(os.environ.get("STRATA_GOLDEN", "/work/shared/golden")) / \
    "qwen2.5-coder-0.5b-instruct-q4_k_m" / "heapq.py"


def scored_logprobs(llama_cpp, path: str, ids: list[int], threads: int):
    """Yields, per chunk, (float64 log-probs of the scored positions, their target ids)."""
    llm = llama_cpp.Llama(model_path=path, n_ctx=CHUNK, n_batch=CHUNK, n_ubatch=CHUNK, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, n_gpu_layers=0, flash_attn=False,
                          seed=0, verbose=False)
    try:
        for c in range(len(ids) // CHUNK):
            toks = ids[c * CHUNK:(c + 1) * CHUNK]
            llm._ctx.kv_cache_clear()
            llm.reset()
            llm.eval(toks)
            logits = np.array(llm.scores[FIRST - 1:CHUNK - 1, :], dtype=np.float32)
            yield log_softmax(logits), np.asarray(toks[FIRST:CHUNK])
    finally:
        llm.close()


def score(llama_cpp, path: str, ids: list[int], threads: int, base: list[np.ndarray] | None) -> dict:
    nll, kl, top1, kept = [], [], [], []
    t0 = time.time()
    for c, (lp, tgt) in enumerate(scored_logprobs(llama_cpp, path, ids, threads)):
        nll.append(-lp[np.arange(len(tgt)), tgt])
        if base is None:
            kept.append(lp.astype(np.float32))
        else:
            p_lp = base[c].astype(np.float64)
            kl.append((np.exp(p_lp) * (p_lp - lp)).sum(axis=1))
            top1.append(p_lp.argmax(axis=1) == lp.argmax(axis=1))
    nll = np.concatenate(nll)
    row = dict(file=os.path.basename(path), bytes=os.path.getsize(path), ppl=float(np.exp(nll.mean())),
               secs=round(time.time() - t0, 1))
    if base is not None:
        kl = np.concatenate(kl)
        row.update(mean_kl=float(kl.mean()), median_kl=float(np.median(kl)), p99_kl=float(np.quantile(kl, 0.99)),
                   max_kl=float(kl.max()), top1=float(np.concatenate(top1).mean()))
    return row, kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the reference model (KL is measured from it)")
    ap.add_argument("--text", default=str(GOLDEN_TEXT), help="UTF-8 text to score (default: golden heapq.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        sys.exit("score_llamacpp: needs llama-cpp-python (pip install llama-cpp-python)")
    for p in [a.base, a.text, *a.files]:
        if not os.path.isfile(p):
            sys.exit(f"score_llamacpp: no such file: {p}")
    vocab = llama_cpp.Llama(model_path=a.base, vocab_only=True, verbose=False)
    ids = vocab.tokenize(Path(a.text).read_bytes(), add_bos=False, special=False)
    if len(ids) < CHUNK:
        sys.exit(f"score_llamacpp: {a.text} has {len(ids)} tokens; needs at least {CHUNK}")
    base_row, base_lp = score(llama_cpp, a.base, ids, a.threads, None)
    rows = [base_row]
    for f in a.files:
        rows.append(score(llama_cpp, f, ids, a.threads, base_lp)[0])
        print(json.dumps(rows[-1]), flush=True)
    print(f"llama.cpp {llama_cpp.__version__}, {len(ids) // CHUNK} chunks x {CHUNK - FIRST} scored tokens")
    print("| file | bytes | PPL | mean KL | median KL | p99 KL | max KL | top-1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        kl = (f"{r['mean_kl']:.4f} | {r['median_kl']:.4f} | {r['p99_kl']:.3f} | {r['max_kl']:.3f} | {r['top1']:.4f}"
              if "mean_kl" in r else "— | — | — | — | —")
        print(f"| {r['file']} | {r['bytes']:,} | {r['ppl']:.4f} | {kl} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
