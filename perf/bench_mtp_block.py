"""What one fill of the MTP block's KV rows costs by its row count: n rows of one sequence as the drafter writes
them (MtpDrafter._fill_rows: eh_proj and the K / V rows of every row, the whole decoder block on the last one,
whose output a first draft reads; no head), beside the whole block on every row, on the backend and model given
(default: the default model with its shipped block, on the CPU). Prints ms per forward and per row of each, the
median of --runs after two warm-up runs (the two alternating); the rows' hidden states are random, so only the
time means anything.

usage: python perf/bench_mtp_block.py [--model M] [--mtp SIDECAR] [--backend cpu|cuda] [--rows 1,4,16,64,256]
           [--runs 10] [--threads N]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from strata_lite.api import LLM


def main(argv=None) -> list[tuple[int, float, float]]:
    """-> (rows, ms a fill, ms of the whole block on every row) per row count, as printed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--mtp", default=None, help="sidecar GGUF with an MTP block (default: the model's own or shipped)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    llm = LLM(args.model, backend=args.backend, spec="mtp", mtp=args.mtp, n_ctx=max(rows) + 256,
              n_threads=args.threads)
    drafter, be, cfg = llm.mtp, llm.backend, llm.config
    rng = np.random.default_rng(0)
    print(f"MTP block fill, {args.backend} backend ({platform.processor() or platform.machine()}), "
          f"n_embd {cfg.n_embd}, median of {args.runs}")
    out = []
    for n in rows:
        hidden = be.from_host(rng.standard_normal((n, cfg.n_embd)).astype(np.float32))
        ids = [int(t) for t in rng.integers(0, cfg.n_vocab, n)]
        idx = list(range(n))
        times = {"fill": [], "whole": []}
        for r in range(args.runs + 2):
            for mode, keep in (("fill", [n - 1]), ("whole", idx)):
                t0 = time.perf_counter()
                drafter._fill_rows(hidden, idx, ids, list(range(100, 100 + n)), [0] * n, [llm._pages], keep)
                be.synchronize()
                times[mode].append(time.perf_counter() - t0)
        fill, whole = (statistics.median(times[m][2:]) * 1e3 for m in ("fill", "whole"))
        print(f"rows {n:4d}: fill {fill:8.2f} ms ({fill / n:6.3f} a row); whole block on every row "
              f"{whole:8.2f} ms ({whole / n:6.3f} a row)")
        out.append((n, fill, whole))
    return out


if __name__ == "__main__":
    main()
