"""A few launches of the kernels of one decode step of many sequences (8B-layer shapes), for a profiler.

Run under Nsight Compute on the GPU machine, one kernel family at a time, e.g.

    ncu --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis -k regex:'^(mm|attn)' -c 3 \
        python perf/step_kernels.py glu

Each name launches its kernel `--reps` times on random weights (timing is the profiler's business):
  glu       Q4_K gate+up 4096 -> 2 x 14336 (the small-token kernel at 9-63 tokens)
  q4k_down  Q4_K 14336 -> 4096
  q6k_down  Q6_K 14336 -> 4096 (dp4a)
  iq3_glu   IQ3_XXS gate+up 4096 -> 2 x 14336 (dp4a)
  attn      attention of --tokens sequences over 4,096 int8 keys each (32 / 8 heads of 128)
  attn32k   attention of one sequence over 32,768 keys
perf/kernel_notes.md ("Decode of many sequences, continued") has what it showed on an H200.
"""
from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import numpy as np

KINDS = ("glu", "q4k_down", "q6k_down", "iq3_glu", "attn", "attn32k")


def random_weight(qm, rng, qtype: str, n_out: int, n_in: int):
    """Random block bytes (timing only: the values are whatever the bytes decode to)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
    qt = QT[qtype]
    elems, bsize = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n_out, n_in // elems * bsize), dtype=np.uint8)
    return qm.upload(SimpleNamespace(name="profile", qtype=qt, n_out=n_out, n_in=n_in, raw=raw))


def matmul(cp, rng, qtype, n_out, n_in, n_tok, glu, reps):
    from strata_lite.kernels.cuda import qmatmul as qm
    w = random_weight(qm, rng, qtype, n_out, n_in)
    x = cp.asarray(rng.standard_normal((n_tok, n_in), dtype=np.float32))
    out = cp.empty((n_tok, n_out // 2 if glu else n_out), cp.float32)
    act = qm.ActBuffers(max(n_tok, 16), n_in)
    for _ in range(reps):
        qm.matmul(w, x, out, act, glu=glu)
    cp.cuda.runtime.deviceSynchronize()


def attention(cp, rng, n_keys, n_seq, reps, n_heads=32, n_kv=8, hd=128, page_size=64):
    from strata_lite.kernels.cuda import attention as ak
    from strata_lite.kernels.kv_layout import kv_shapes
    per = n_keys // page_size
    pages, scales = kv_shapes(1, per * n_seq, page_size, n_kv, hd)
    kp = cp.asarray(rng.integers(-127, 128, size=pages[1:], dtype=np.int8))
    vp = cp.asarray(rng.integers(-127, 128, size=pages[1:], dtype=np.int8))
    ks = cp.asarray(rng.random(scales[1:], dtype=np.float32) * 0.01)
    vs = cp.asarray(rng.random(scales[1:], dtype=np.float32) * 0.01)
    q = cp.asarray(rng.standard_normal((n_seq, n_heads, hd), dtype=np.float32))
    out = cp.empty_like(q)
    seq = cp.arange(n_seq, dtype=cp.int32)
    pos = cp.full(n_seq, n_keys - 1, cp.int32)
    tables = cp.arange(per * n_seq, dtype=cp.int32).reshape(n_seq, per)
    ws = ak.attention_workspace(n_seq, n_heads, hd, n_keys)
    for _ in range(reps):
        ak.attention(q, seq, pos, tables, kp, ks, vp, vs, 1 / math.sqrt(hd), out, ws, n_keys)
    cp.cuda.runtime.deviceSynchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kinds", nargs="+", choices=KINDS)
    ap.add_argument("--tokens", type=int, default=16, help="tokens (sequences) of the step")
    ap.add_argument("--reps", type=int, default=2, help="launches of each kernel")
    args = ap.parse_args(argv)
    from strata_lite.kernels.cuda.runtime import BackendUnavailable, cupy
    try:
        cp = cupy()
    except BackendUnavailable as e:
        print(f"step_kernels: {e}")
        return 2
    rng = np.random.default_rng(0)
    n = args.tokens
    for kind in args.kinds:
        if kind == "glu":
            matmul(cp, rng, "Q4_K", 2 * 14336, 4096, n, True, args.reps)
        elif kind == "q4k_down":
            matmul(cp, rng, "Q4_K", 4096, 14336, n, False, args.reps)
        elif kind == "q6k_down":
            matmul(cp, rng, "Q6_K", 4096, 14336, n, False, args.reps)
        elif kind == "iq3_glu":
            matmul(cp, rng, "IQ3_XXS", 2 * 14336, 4096, n, True, args.reps)
        elif kind == "attn":
            attention(cp, rng, 4096, n, args.reps)
        else:
            attention(cp, rng, 32768, 1, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
