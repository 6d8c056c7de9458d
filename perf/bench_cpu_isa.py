"""The int8 kernels' AVX2 path against their VNNI path (kernels/cpu/isa.py), side by side: the Q8_0-family
mat-muls that have both (q8_0_int8.mv_avx2, on the calling thread for small matrices as the engine does, for
decode steps and short calls; q8_0_gemm.matmul for prompt chunks) at the default model's shapes
(Qwen2.5-Coder-0.5B Q4_K_M: its Q5_0 and Q8_0 matrices) and an 8B-layer one, at 2 threads and at all.

    python perf/bench_cpu_isa.py [--rounds 7] [--threads 2 16] [--shapes gate_up output]

The two paths run alternately in one process (the order swapped every round), each output checked bit for
bit against the other; printed per shape, token count and thread count: median ms of each (wall clock) and
AVX2 / VNNI (> 1: VNNI is faster). The header names the CPU, its flags and the path the engine would take.
Where the CPU has no VNNI (as Numba compiles for it) only the AVX2 path is timed, and the header says so.
Weights are random valid blocks (tests/kernels/test_dequant.random_rows), activations standard normal.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import llvmlite
import numba
import numpy as np
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from test_dequant import random_rows  # noqa: E402

from strata_lite.kernels.cpu import isa, q8_0_gemm, q8_0_int8  # noqa: E402
from strata_lite.kernels.cpu import repack as rp  # noqa: E402

# name -> (file type, n_in, n_out, token counts): decode steps (1), short calls (8), prompt chunks (GEMM)
SHAPES = {
    "gate_up": (QType.Q5_0, 896, 9728, (1, 8, 64, 512)),
    "qkv": (QType.Q5_0, 896, 1152, (1, 8, 64, 512)),
    "attn_out": (QType.Q5_0, 896, 896, (1, 8, 512)),
    "attn_v": (QType.Q8_0, 896, 128, (1, 8, 512)),
    "output": (QType.Q8_0, 896, 151936, (1, 8)),          # the logits row: decode only
    "8b_q8_0": (QType.Q8_0, 4096, 4096, (1, 8, 512)),
}
_KIND = {QType.Q8_0: q8_0_int8.Q8_0_KIND, QType.Q5_0: q8_0_int8.Q5_0_KIND}
CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")


def _cpuinfo():
    """(model name, the CPU_FLAGS /proc/cpuinfo lists) or placeholders off Linux."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "unknown CPU", []
    first = text.split("\n\n", 1)[0]                       # the first processor's block
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    flags = set(field.get("flags", "").split())
    return field.get("model name", "unknown CPU"), [f for f in CPU_FLAGS if f in flags]


def kernel(qtype, n_in, n_out):
    """f(x, out, isa_id): the engine's int8 kernel for this token count (the GEMM from its MIN_TOK)."""
    raw = random_rows(qtype, n_out, n_in, seed=1)
    w = rp.pack_weight(SimpleNamespace(name="w", qtype=qtype, n_out=n_out, n_in=n_in, raw=raw), int8=True)
    mv = q8_0_int8.mv_avx2_serial if w.small else q8_0_int8.mv_avx2
    kind = _KIND[qtype]

    def f(x, out, which):
        x3 = x.reshape(x.shape[0], w.nb, 32)
        if x.shape[0] >= q8_0_gemm.MIN_TOK:
            q8_0_gemm.matmul(w.raw3, x3, out, kind, which)
        else:
            mv(w.raw3, x3, out, kind, which)
    return f


def compare(shapes, threads, rounds, paths):
    """Yields (shape name, n_tok, n_threads, {path: seconds list})."""
    for name in shapes:
        qtype, n_in, n_out, tokens = SHAPES[name]
        f = kernel(qtype, n_in, n_out)
        for n_tok in tokens:
            x = np.random.default_rng(n_tok).standard_normal((n_tok, n_in), dtype=np.float32)
            outs = {p: np.empty((n_tok, n_out), np.float32) for p in paths}
            for n_threads in threads:
                numba.set_num_threads(n_threads)
                for p in paths:                                   # compile, page in
                    f(x, outs[p], p)
                assert all(np.array_equal(outs[p], outs[paths[0]]) for p in paths), f"{name}: the paths' bits differ"
                t = time.perf_counter()
                f(x, outs[paths[0]], paths[0])
                reps = max(1, int(0.005 / max(time.perf_counter() - t, 1e-6)))     # >= ~5 ms a sample
                times = {p: [] for p in paths}
                for r in range(rounds):
                    for p in (paths if r % 2 == 0 else paths[::-1]):
                        t = time.perf_counter()
                        for _ in range(reps):
                            f(x, outs[p], p)
                        times[p].append((time.perf_counter() - t) / reps)
                yield name, n_tok, n_threads, times


def main():
    n_cpu = numba.config.NUMBA_NUM_THREADS
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({min(2, n_cpu), n_cpu}))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    a = ap.parse_args()
    model, flags = _cpuinfo()
    feats = isa.host_features()
    print(f"CPU: {model}; /proc/cpuinfo flags: {' '.join(flags) or 'none of ' + ' '.join(CPU_FLAGS)}")
    print(f"Numba {numba.__version__} (llvmlite {llvmlite.__version__}) compiles for: "
          f"{' '.join(k for k, on in feats.items() if on)}; Numba threads up to {n_cpu}")
    print(f"engine's choice: {isa.kernel_family()}")
    paths = (isa.AVX2, isa.VNNI) if isa.VNNI_BUILT else (isa.AVX2,)
    if not isa.VNNI_BUILT:
        print("no AVX-512 VNNI with VL or AVX-VNNI here: the VNNI path cannot be compiled; AVX2 only")
    t = time.perf_counter()
    for n_out, n_tok in ((64, 1), (4096, 1), (64, q8_0_gemm.MIN_TOK)):    # mv_avx2_serial, mv_avx2, the GEMM
        kernel(QType.Q5_0, 256, n_out)(np.ones((n_tok, 256), np.float32), np.empty((n_tok, n_out), np.float32),
                                       isa.AVX2)
    print(f"first calls (compile or load the three kernels, both paths): {time.perf_counter() - t:.1f} s")
    print(f"{a.rounds} alternating rounds, wall clock, medians\n")
    print(f"{'shape':9} {'type':5} {'n_in x n_out':>12} {'tokens':>6} {'threads':>7}  {'AVX2 ms':>9}  {'VNNI ms':>9}"
          f"  {'AVX2 / VNNI':>11}")
    for name, n_tok, n_threads, times in compare(a.shapes, a.threads, a.rounds, paths):
        qtype, n_in, n_out, _ = SHAPES[name]
        med = {p: statistics.median(v) for p, v in times.items()}
        vnni = f"{med[isa.VNNI] * 1e3:9.3f}  {med[isa.AVX2] / med[isa.VNNI]:10.2f}x" if isa.VNNI in med else \
            f"{'-':>9}  {'-':>11}"
        print(f"{name:9} {qtype.name:5} {f'{n_in}x{n_out}':>12} {n_tok:6} {n_threads:7}  {med[isa.AVX2] * 1e3:9.3f}  "
              f"{vnni}", flush=True)


if __name__ == "__main__":
    main()
