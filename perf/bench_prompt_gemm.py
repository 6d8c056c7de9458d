"""Prompt-chunk GEMMs (kernels/cpu/q8_0_gemm.py, nibble_gemm.py) against the int8 vector kernels the engine
takes below their MIN_TOK (q8_0_int8.mv_avx2, on the calling thread for small matrices as the engine does;
nibble_int8.matvec), at the default model's shapes (Qwen2.5-Coder-0.5B Q4_K_M), per token count: the
table behind the MIN_TOK crossovers.

    python perf/bench_prompt_gemm.py [--rounds 7] [--tokens 16 32 64 128 256 512] [--shapes gate_up down_q4_k]
                                     [--cpu-clock]

The vector kernel and the GEMM run alternately in one process (the order swapped every round; on a machine
shared with other busy work, separate processes minutes apart differ by more than the kernels do), on the
engine's thread count, each result checked bit for bit against the other. Printed per shape and token
count: min and median ms of each, and vector / GEMM of the medians (> 1: the GEMM is faster). --cpu-clock
times CPU seconds of the process instead of wall clock (with NUMBA_NUM_THREADS=1: what the kernel itself
costs on a machine busy with other work, where a parallel region waits for a thread the OS has parked).
Weights are random valid blocks (tests/kernels/test_dequant.random_rows), activations standard normal.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from test_dequant import random_rows  # noqa: E402

from strata_lite.kernels.cpu import nibble_gemm, nibble_int8, q8_0_gemm, q8_0_int8  # noqa: E402
from strata_lite.kernels.cpu import repack as rp  # noqa: E402
from strata_lite.kernels.cpu.iq3_int8 import CODE_TABLE  # noqa: E402

# name -> (file type, n_in, n_out): the default model's mat-muls of a prompt chunk (q/k/v and gate/up fused)
SHAPES = {
    "gate_up": (QType.Q5_0, 896, 9728),
    "qkv": (QType.Q5_0, 896, 1152),
    "attn_out": (QType.Q5_0, 896, 896),
    "attn_k": (QType.Q5_0, 896, 128),      # layers whose attn_v is Q8_0 keep q, k, v apart
    "attn_v": (QType.Q8_0, 896, 128),
    "down_q4_k": (QType.Q4_K, 4864, 896),
    "down_q6_k": (QType.Q6_K, 4864, 896),
}
_KIND = {QType.Q8_0: q8_0_int8.Q8_0_KIND, QType.Q5_0: q8_0_int8.Q5_0_KIND, QType.Q4_0: q8_0_int8.Q4_0_KIND,
         QType.IQ4_NL: q8_0_int8.IQ4_NL_KIND}
_NIB_KIND = {rp.Q4K_I8: nibble_int8.Q4K, rp.Q5K_I8: nibble_int8.Q5K, rp.Q6K_I8: nibble_int8.Q6K,
             rp.IQ3_I8: nibble_int8.IQ3}
_TABLE = {rp.IQ3_I8: CODE_TABLE}
_NO_TABLE = np.zeros(32, dtype=np.int8)


def kernels(qtype, n_in, n_out):
    """(vector kernel, GEMM): callables f(x, out) for a random weight of this type and shape, as the CPU
    backend holds it."""
    raw = random_rows(qtype, n_out, n_in, seed=1)
    w = rp.pack_weight(SimpleNamespace(name="w", qtype=qtype, n_out=n_out, n_in=n_in, raw=raw), int8=True)
    if w.layout in _NIB_KIND:
        kind, table = _NIB_KIND[w.layout], _TABLE.get(w.layout, _NO_TABLE)
        shape = (-1, w.nb, 256)
        return (lambda x, out: nibble_int8.matvec(w.raw3, x.reshape(shape), out, table, kind),
                lambda x, out: nibble_gemm.matmul(w.raw3, x.reshape(shape), out, table, kind))
    kind = _KIND[qtype]
    mv = q8_0_int8.mv_avx2_serial if w.small else q8_0_int8.mv_avx2
    return (lambda x, out: mv(w.raw3, x.reshape(-1, w.nb, 32), out, kind),
            lambda x, out: q8_0_gemm.matmul(w.raw3, x.reshape(-1, w.nb, 32), out, kind))


def compare(shapes, tokens, rounds, clock=time.perf_counter):
    """Yields (shape name, n_tok, vector kernel seconds list, GEMM seconds list)."""
    for name in shapes:
        qtype, n_in, n_out = SHAPES[name]
        old, new = kernels(qtype, n_in, n_out)
        for n_tok in tokens:
            x = np.random.default_rng(n_tok).standard_normal((n_tok, n_in), dtype=np.float32)
            outs = [np.empty((n_tok, n_out), np.float32) for _ in range(2)]
            old(x, outs[0]), new(x, outs[1])               # compile, page in
            assert np.array_equal(outs[0], outs[1]), f"{name}, {n_tok} tokens: the GEMM's bits differ"
            reps = max(1, int(2e7 // (n_tok * n_in * n_out)))     # ~20 M multiply-adds per sample
            times = ([], [])
            for r in range(rounds):
                for v in ((0, 1) if r % 2 == 0 else (1, 0)):
                    f = (old, new)[v]
                    t = clock()
                    for _ in range(reps):
                        f(x, outs[v])
                    times[v].append((clock() - t) / reps)
            yield name, n_tok, times[0], times[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, nargs="+", default=[9, 16, 24, 32, 48, 64, 128, 256, 512])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--cpu-clock", action="store_true")
    a = ap.parse_args()
    import numba
    print(f"{numba.get_num_threads()} threads, {'CPU' if a.cpu_clock else 'wall'} clock, {a.rounds} alternating rounds")
    print(f"{'shape':10} {'type':5} {'n_in x n_out':>12} {'tokens':>6}  {'vector min / median ms':>23}  "
          f"{'GEMM min / median ms':>21}  {'vector / GEMM':>13}")
    for name, n_tok, t_old, t_new in compare(a.shapes, a.tokens, a.rounds,
                                             time.process_time if a.cpu_clock else time.perf_counter):
        qtype, n_in, n_out = SHAPES[name]
        mo, mn = statistics.median(t_old), statistics.median(t_new)
        print(f"{name:10} {qtype.name:5} {f'{n_in}x{n_out}':>12} {n_tok:6}  {min(t_old) * 1e3:12.2f} / "
              f"{mo * 1e3:8.2f}  {min(t_new) * 1e3:10.2f} / {mn * 1e3:8.2f}  {mo / mn:12.2f}x", flush=True)


if __name__ == "__main__":
    main()
