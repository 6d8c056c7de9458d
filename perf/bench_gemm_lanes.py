"""The CPU prompt GEMMs (rows4_gemm.py: Q5_0 / Q4_0 / IQ4_NL / Q8_0 in 4-row groups; nibble_gemm.py: IQ3_XXS / Q4_K /
Q5_K / Q6_K) with 8 tokens a vector (256-bit) against 16 (512-bit, AVX-512 VNNI), side by side, at the default
model's shapes (Qwen2.5-Coder-0.5B Q4_K_M) and at the 1.5B IQ3_XXS policy's: which width kernels/cpu/isa.py
should pick on this CPU.

    python perf/bench_gemm_lanes.py [--rounds 7] [--threads 2 16] [--tokens 64 512]

Weights are random valid blocks in the engine's layout (kernels/cpu/repack.pack_weight), activations standard
normal; both widths run alternately in one process (order swapped every round), each output checked bit for bit
against the other; printed: median ms of each, GOP/s of the wider, and 8-lane / 16-lane (> 1: 512-bit faster).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numba
import numpy as np
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from test_dequant import random_rows  # noqa: E402

from strata_lite.kernels.cpu import isa, nibble_gemm, rows4_gemm  # noqa: E402
from strata_lite.kernels.cpu import repack as rp  # noqa: E402
from strata_lite.kernels.cpu.decode_block import NIBBLE, ROWS4, matrix_route  # noqa: E402

# name -> (file type, n_in, n_out)
SHAPES = {
    "0.5B gate+up Q5_0": (QType.Q5_0, 896, 9728),
    "0.5B q+k+v Q5_0": (QType.Q5_0, 896, 1152),
    "0.5B attn_out Q5_0": (QType.Q5_0, 896, 896),
    "0.5B down Q6_K": (QType.Q6_K, 4864, 896),
    "0.5B down Q4_K": (QType.Q4_K, 4864, 896),
    "1.5B gate+up IQ3_XXS": (QType.IQ3_XXS, 1536, 17920),
    "1.5B down IQ3_XXS": (QType.IQ3_XXS, 8960, 1536),
    "1.5B q IQ3_XXS": (QType.IQ3_XXS, 1536, 1536),
}


def gemm(qtype, n_in, n_out):
    """f(x, out, lanes): the engine's prompt GEMM for this matrix, VNNI path, lanes tokens a vector."""
    raw = random_rows(qtype, n_out, n_in, seed=1)
    w = rp.pack_weight(SimpleNamespace(name="w", qtype=qtype, n_out=n_out, n_in=n_in, raw=raw), int8=True)
    how, kind, table = matrix_route(w)

    def f(x, out, lanes):
        x3 = x.reshape(x.shape[0], w.raw3.shape[1], -1)
        if how == ROWS4:
            rows4_gemm.matmul(w.raw3, x3, out, kind, isa.VNNI, lanes)
        elif how == NIBBLE:
            nibble_gemm.matmul(w.raw3, x3, out, table, kind, isa.VNNI, lanes)
        else:
            raise SystemExit(f"{qtype.name} {n_in}x{n_out}: layout {w.layout} has no lanes choice")
    return f


def main(argv=None):
    """Prints the table; returns its rows as (shape, tokens, threads, 8-lane ms, 16-lane ms)."""
    n_cpu = numba.config.NUMBA_NUM_THREADS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({min(2, n_cpu), n_cpu}))
    ap.add_argument("--tokens", type=int, nargs="+", default=[512])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    a = ap.parse_args(argv)
    if not isa.WIDE_BUILT:
        raise SystemExit("this CPU has no AVX-512 VNNI (as Numba compiles for it): no 512-bit tiles to compare")
    print(f"CPU (LLVM's name): {isa.host_cpu_name()}; engine's choice: {isa.kernel_family()}")
    print(f"{a.rounds} alternating rounds, wall clock, medians")
    print("| shape | tokens | threads | 8 lanes ms | 16 lanes ms | 16 lanes GOP/s | 8 / 16 |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in a.shapes:
        qtype, n_in, n_out = SHAPES[name]
        f = gemm(qtype, n_in, n_out)
        for n_tok in a.tokens:
            x = np.random.default_rng(n_tok).standard_normal((n_tok, n_in), dtype=np.float32)
            outs = {lanes: np.empty((n_tok, n_out), np.float32) for lanes in (8, 16)}
            for n_threads in a.threads:
                numba.set_num_threads(n_threads)
                for lanes in outs:                                    # compile, page in
                    f(x, outs[lanes], lanes)
                if not np.array_equal(outs[8], outs[16]):
                    raise SystemExit(f"{name}, {n_tok} tokens: the two widths' bits differ")
                times = {8: [], 16: []}
                for r in range(a.rounds):
                    for lanes in ((8, 16) if r % 2 == 0 else (16, 8)):
                        t = time.perf_counter()
                        f(x, outs[lanes], lanes)
                        times[lanes].append(time.perf_counter() - t)
                m8, m16 = statistics.median(times[8]), statistics.median(times[16])
                gop = 2 * n_tok * n_in * n_out / m16 / 1e9
                print(f"| {name} | {n_tok} | {n_threads} | {m8 * 1e3:.2f} | {m16 * 1e3:.2f} | {gop:.0f} | "
                      f"{m8 / m16:.2f}x |", flush=True)
                rows.append((name, n_tok, n_threads, m8, m16))
    return rows


if __name__ == "__main__":
    main()
