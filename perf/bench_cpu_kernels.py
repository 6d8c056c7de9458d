"""pytest-benchmark suite for the CPU quantized kernels.

    python -m pytest perf/bench_cpu_kernels.py --benchmark-only -q

* matvec (n_tok=1) at Qwen2.5-0.5B shapes: 896->896, 896->4864, 4864->896 (types with 256-weight
  blocks - K-quants, IQ3_XXS - use 1024->1024, 1024->4864, 5120->1024 since 896 is not a multiple
  of 256; the real model's K-quant tensor is ffn_down 4864->896, i.e. 19 blocks per row), plus the
  Q8_0 896->151936 output projection.  extra_info["GB/s"] = weight bytes / time.
* IQ3_XXS matvec with 2, 4, 8 tokens (batched decode, speculative verification) at 1024->4864:
  extra_info["us/token"].
* 512-token matmul (tile dequant + BLAS) at 896->4864 (1024->4864): extra_info["GFLOP/s"].
* the engine's path, CpuBackend.upload_weight + CpuBackend.qmatmul (repack.py: on AVX2 Q4_0/Q5_0/IQ4_NL
  in their own blocks, else repacked to Q8_0 at load): test_packed_matvec reports "GB/s" over the bytes
  actually read (the layout the kernel reads) and "file GB/s" over the file's bytes (the speed-up seen by
  the model); test_packed_call_overhead the fixed cost of one call on a 16x64 matrix (serial and parallel
  kernel); test_packed_matmul_512 the prompt path with "GFLOP/s" and numpy's sgemm on the same
  shape ("sgemm GFLOP/s", a float32 weight already in memory) for comparison.
* test_stream: the 1.5B model's fused gate/up shape (1536 -> 17920) for 28 distinct matrices in a
  row, so the weights come from DRAM as in a decode step; IQ3_XXS, Q4_K, Q5_K and Q6_K in the int8 layouts
  (nibble_int8.py) against the file layout's float kernels ("G w/s", "GB/s" of the layout's bytes).
* test_attention_decode: one decode token's attention over 4K / 32K cached keys of one layer at the
  1.5B model's head shape ("us/key", "GB/s" of the int8 K/V cache read).
* `python perf/bench_cpu_kernels.py [--cpu-clock]` (not pytest): Q5_0 / Q4_0 / IQ4_NL in their own
  blocks against their Q8_0 repacking at the 0.5B shapes, 1 / 4 / 64 / 256 tokens, alternating runs
  (own_blocks_vs_q8_0; under load, NUMBA_NUM_THREADS=1 with --cpu-clock times the kernel itself).
Weights are random valid blocks (random bytes, f16 scales in 1e-3..1e-2).
Under load compare single-threaded runs: NUMBA_NUM_THREADS=1 python -m pytest ... (timings are wall
clock; pytest-benchmark's min over rounds is the least disturbed one).
"""
import os
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from test_dequant import random_rows  # noqa: E402

from types import SimpleNamespace  # noqa: E402

from strata_lite.kernels.cpu import repack as rp  # noqa: E402
from strata_lite.kernels.cpu.backend import CpuBackend  # noqa: E402
from strata_lite.kernels.cpu.qmatmul import qmatmul  # noqa: E402
from strata_lite.kernels.qtypes import block_geometry  # noqa: E402

TYPES = [QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.Q4_0, QType.Q5_K, QType.IQ4_NL,
         QType.IQ3_XXS, QType.F16, QType.BF16, QType.F32]


def _shapes(qtype):
    if block_geometry(qtype)[0] == 256:
        return [(1024, 1024), (1024, 4864), (5120, 1024)]
    return [(896, 896), (896, 4864), (4864, 896)]


MATVEC_CASES = [(t, k, n) for t in TYPES for (k, n) in _shapes(t)] + [(QType.Q8_0, 896, 151936)]


def _setup(qtype, n_cols, n_out, n_tok):
    raw = random_rows(qtype, n_out, n_cols, seed=1)
    x = np.random.default_rng(2).standard_normal((n_tok, n_cols), dtype=np.float32)
    out = np.empty((n_tok, n_out), dtype=np.float32)
    qmatmul(qtype, raw, n_cols, x, out)          # compile / warm up
    return raw, x, out


@pytest.mark.parametrize("qtype,n_cols,n_out", MATVEC_CASES,
                         ids=[f"{t.name}-{k}x{n}" for t, k, n in MATVEC_CASES])
def test_matvec(benchmark, qtype, n_cols, n_out):
    raw, x, out = _setup(qtype, n_cols, n_out, 1)
    benchmark(qmatmul, qtype, raw, n_cols, x, out)
    benchmark.extra_info["GB/s"] = round(raw.nbytes / benchmark.stats.stats.min / 1e9, 2)


@pytest.mark.parametrize("n_tok", [2, 4, 8])
def test_matvec_multi_token_iq3_xxs(benchmark, n_tok):
    raw, x, out = _setup(QType.IQ3_XXS, 1024, 4864, n_tok)
    benchmark(qmatmul, QType.IQ3_XXS, raw, 1024, x, out)
    benchmark.extra_info["us/token"] = round(benchmark.stats.stats.min * 1e6 / n_tok, 1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_512(benchmark, qtype):
    n_cols = 1024 if block_geometry(qtype)[0] == 256 else 896
    n_out = 4864
    raw, x, out = _setup(qtype, n_cols, n_out, 512)
    benchmark.pedantic(qmatmul, args=(qtype, raw, n_cols, x, out), rounds=5, iterations=1)
    benchmark.extra_info["GFLOP/s"] = round(2 * 512 * n_cols * n_out / benchmark.stats.stats.min / 1e9, 1)


@pytest.mark.parametrize("qtype", [QType.F16, QType.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("n_cols,n_out", [(1536, 8960), (8960, 1536)], ids=["1536x8960", "8960x1536"])
def test_half_matmul_512(benchmark, qtype, n_cols, n_out):
    """512 tokens of F16 / BF16 rows: half_gemm.py's tiles where the CPU has them (F16 over rows of 3,072+
    weights), else the tile path."""
    raw, x, out = _setup(qtype, n_cols, n_out, 512)
    benchmark.pedantic(qmatmul, args=(qtype, raw, n_cols, x, out), rounds=5, iterations=1)
    benchmark.extra_info["GFLOP/s"] = round(2 * 512 * n_cols * n_out / benchmark.stats.stats.min / 1e9, 1)


# ------------------------------------------------------------- the engine's path (PackedWeight)
PACKED_TYPES = [QType.Q5_0, QType.Q8_0, QType.Q4_0, QType.IQ4_NL, QType.Q4_K, QType.Q6_K, QType.IQ3_XXS]
PACKED_CASES = [(t, k, n) for t in PACKED_TYPES for (k, n) in _shapes(t)] + [
    (QType.Q5_0, 896, 128), (QType.Q8_0, 896, 151936)]
_BE = CpuBackend()


def _packed(qtype, n_cols, n_out, n_tok):
    raw = random_rows(qtype, n_out, n_cols, seed=1)
    w = _BE.upload_weight(SimpleNamespace(name="bench", qtype=qtype, n_out=n_out, n_in=n_cols, raw=raw))
    x = np.random.default_rng(2).standard_normal((n_tok, n_cols), dtype=np.float32)
    out = np.empty((n_tok, n_out), dtype=np.float32)
    _BE.qmatmul(w, x, out)
    return raw, w, x, out


@pytest.mark.parametrize("qtype,n_cols,n_out", PACKED_CASES,
                         ids=[f"{t.name}-{k}x{n}" for t, k, n in PACKED_CASES])
def test_packed_matvec(benchmark, qtype, n_cols, n_out):
    raw, w, x, out = _packed(qtype, n_cols, n_out, 1)
    benchmark(_BE.qmatmul, w, x, out)
    t = benchmark.stats.stats.min
    benchmark.extra_info["layout"] = w.qtype.name if w.layout == rp.GGML else w.layout
    benchmark.extra_info["GB/s"] = round(w.nbytes / t / 1e9, 2)
    benchmark.extra_info["file GB/s"] = round(raw.nbytes / t / 1e9, 2)


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_packed_call_overhead(benchmark, parallel, monkeypatch):
    monkeypatch.setattr(rp, "SMALL_BYTES", 0 if parallel else 1 << 30)
    _, w, x, out = _packed(QType.Q5_0, 64, 16, 1)
    benchmark(_BE.qmatmul, w, x, out)
    benchmark.extra_info["us/call"] = round(benchmark.stats.stats.min * 1e6, 2)


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.IQ3_XXS],
                         ids=lambda t: t.name)
def test_packed_matmul_512(benchmark, qtype):
    n_cols = 1024 if block_geometry(qtype)[0] == 256 else 896
    n_out = 4864
    _, w, x, out = _packed(qtype, n_cols, n_out, 512)
    benchmark.pedantic(_BE.qmatmul, args=(w, x, out), rounds=5, iterations=1)
    flop = 2 * 512 * n_cols * n_out
    benchmark.extra_info["GFLOP/s"] = round(flop / benchmark.stats.stats.min / 1e9, 1)
    wf = np.random.default_rng(3).standard_normal((n_out, n_cols), dtype=np.float32)
    best = min(_timed(lambda: np.matmul(x, wf.T, out=out)) for _ in range(3))
    benchmark.extra_info["sgemm GFLOP/s"] = round(flop / best / 1e9, 1)


def _timed(f):
    import time
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


@pytest.mark.parametrize("int8_layout", [True, False], ids=["int8", "file-layout"])
@pytest.mark.parametrize("qtype", [QType.IQ3_XXS, QType.Q4_K, QType.Q5_K, QType.Q6_K], ids=lambda t: t.name)
def test_stream(benchmark, qtype, int8_layout, monkeypatch):
    if int8_layout and not _BE.int8:
        pytest.skip("no AVX2: the int8 layout is not used on this CPU")
    monkeypatch.setenv("STRATA_LITE_INT8", "1" if int8_layout else "0")
    be = CpuBackend()
    n_cols, n_out, n_mats = 1536, 17920, 28
    base = random_rows(qtype, 256, n_cols, seed=1)
    ws = [be.upload_weight(SimpleNamespace(name=f"w{i}", qtype=qtype, n_out=n_out, n_in=n_cols,
                                           raw=np.tile(np.roll(base, i, axis=0), (n_out // 256, 1))))
          for i in range(n_mats)]
    x = np.random.default_rng(2).standard_normal((1, n_cols), dtype=np.float32)
    out = np.empty((1, n_out), dtype=np.float32)

    def run():
        for w in ws:
            be.qmatmul(w, x, out)
    run()
    benchmark.pedantic(run, rounds=10, iterations=1)
    t = benchmark.stats.stats.min
    benchmark.extra_info["G w/s"] = round(n_mats * n_out * n_cols / t / 1e9, 1)
    benchmark.extra_info["GB/s"] = round(sum(w.nbytes for w in ws) / t / 1e9, 1)


@pytest.mark.parametrize("n_keys", [4096, 32768])
def test_attention_decode(benchmark, n_keys):
    """One decode token of Qwen2.5-Coder-1.5B's attention (12 query heads over 2 KV heads of 128) over
    n_keys cached positions of one layer: "us/key" per cached key, "GB/s" of int8 K/V + scales read."""
    from strata_lite.kernels.cpu.attention import attention
    from strata_lite.kernels.kv_layout import kv_shapes
    n_heads, n_kv, hd, page = 12, 2, 128, 256
    n_pages = n_keys // page
    pages, scales = kv_shapes(1, n_pages, page, n_kv, hd)
    rng = np.random.default_rng(0)
    k_pages, v_pages = (rng.integers(-127, 128, pages[1:], dtype=np.int8) for _ in range(2))
    k_scales, v_scales = (rng.uniform(0.001, 0.01, scales[1:]).astype(np.float32) for _ in range(2))
    page_tables = np.arange(n_pages, dtype=np.int32)[None, :]
    q = rng.standard_normal((1, n_heads, hd), dtype=np.float32)
    out = np.empty_like(q)
    args = (q, np.zeros(1, np.int32), np.array([n_keys - 1], np.int32), page_tables, k_pages, k_scales,
            v_pages, v_scales, hd ** -0.5, out)
    attention(*args)
    benchmark(attention, *args)
    t = benchmark.stats.stats.min
    benchmark.extra_info["us/key"] = round(t / n_keys * 1e6, 4)
    benchmark.extra_info["GB/s"] = round((k_pages.nbytes + v_pages.nbytes + k_scales.nbytes + v_scales.nbytes) / t / 1e9, 1)


# ---------------------------------- Q5_0 / Q4_0 / IQ4_NL: own blocks against their Q8_0 repacking
OWN_BLOCK_TYPES = [QType.IQ4_NL, QType.Q5_0, QType.Q4_0]
OWN_BLOCK_SHAPES = [(896, 896), (896, 4864), (4864, 896)]      # (n_in, n_out), the 0.5B model's
STREAM_BYTES = 128 << 20     # decode: distinct matrices of this many Q8_0 bytes per pass (4x this VM's L3)


def own_blocks_vs_q8_0(qtypes=OWN_BLOCK_TYPES, shapes=OWN_BLOCK_SHAPES, tokens=(1, 4, 64, 256), rounds=9,
                       clock=None):
    """Alternating runs, old (the weight repacked to Q8_0 blocks, q8_0_int8.py's Q8_0 kind) against new
    (the file's blocks, unpacked in registers), both through CpuBackend.qmatmul. 1-8 tokens (decode,
    batched decode) stream distinct matrices from DRAM as a decode step does; more tokens (prompt
    chunks) repeat one matrix. Yields (type, n_in, n_out, n_tok, old s/matrix, new s/matrix): medians
    over `rounds` rounds, the order of old and new swapped every round. clock: time.perf_counter (wall,
    the default) or time.process_time (CPU seconds of the process: on a machine shared with other busy
    work, with NUMBA_NUM_THREADS=1, what the kernel itself costs)."""
    import statistics
    import time
    clock = clock or time.perf_counter
    for qtype in qtypes:
        for n_in, n_out in shapes:
            base = random_rows(qtype, n_out, n_in, seed=1)
            n_mats = max(1, STREAM_BYTES // (n_out * n_in // 32 * 34))
            pairs = []
            for i in range(n_mats):
                raw = np.roll(base, i, axis=0)
                old = rp.PackedWeight("old", QType.Q8_0, n_out, n_in, rp.repack_to_q8_0(qtype, raw, n_in),
                                      src_qtype=qtype, int8=True)
                new = rp.pack_weight(SimpleNamespace(name="new", qtype=qtype, n_out=n_out, n_in=n_in, raw=raw),
                                     int8=True)
                assert new.qtype == qtype and new.int8
                pairs.append((old, new))
            for n_tok in tokens:
                x = np.random.default_rng(2).standard_normal((n_tok, n_in), dtype=np.float32)
                out = np.empty((n_tok, n_out), dtype=np.float32)
                mats = pairs if n_tok <= 8 else pairs[:1]
                reps = 3 if n_tok <= 8 else max(1, 4096 // (n_tok * max(1, n_in * n_out >> 20)))
                times = ([], [])

                def run(v):
                    t = clock()
                    for _ in range(reps):
                        for p in mats:
                            _BE.qmatmul(p[v], x, out)
                    return (clock() - t) / (reps * len(mats))
                run(0), run(1)                          # compile, page in
                for r in range(rounds):
                    for v in ((0, 1) if r % 2 == 0 else (1, 0)):
                        times[v].append(run(v))
                yield qtype.name, n_in, n_out, n_tok, statistics.median(times[0]), statistics.median(times[1])


if __name__ == "__main__":
    # python perf/bench_cpu_kernels.py [--cpu-clock] [--rounds N] [--tokens 1 4 64 256] [--types Q5_0 ...]:
    # the own-blocks table (the rest of this file runs under pytest)
    import argparse
    import time
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-clock", action="store_true", help="time.process_time instead of wall clock")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 64, 256])
    ap.add_argument("--types", nargs="+", default=[t.name for t in OWN_BLOCK_TYPES])
    a = ap.parse_args()
    print("type     shape        tokens   Q8_0 repack us   own blocks us   speed-up   own G w/s")
    for name, n_in, n_out, n_tok, t_old, t_new in own_blocks_vs_q8_0(
            [QType[t] for t in a.types], tokens=a.tokens, rounds=a.rounds,
            clock=time.process_time if a.cpu_clock else None):
        print(f"{name:8} {n_in:4}x{n_out:<6} {n_tok:6} {t_old * 1e6:16.1f} {t_new * 1e6:15.1f} "
              f"{t_old / t_new:9.2f}x {n_in * n_out * n_tok / t_new / 1e9:10.1f}", flush=True)
