"""pytest-benchmark suite for the CPU quantized kernels.

    python -m pytest perf/bench_cpu_kernels.py --benchmark-only -q

* matvec (n_tok=1) at Qwen2.5-0.5B shapes: 896->896, 896->4864, 4864->896 (types with 256-weight
  blocks - K-quants, IQ3_XXS - use 1024->1024, 1024->4864, 5120->1024 since 896 is not a multiple
  of 256; the real model's K-quant tensor is ffn_down 4864->896, i.e. 19 blocks per row), plus the
  Q8_0 896->151936 output projection.  extra_info["GB/s"] = weight bytes / time.
* 512-token matmul (tile dequant + BLAS) at 896->4864 (1024->4864): extra_info["GFLOP/s"].
Weights are random valid blocks (random bytes, f16 scales in 1e-3..1e-2).
"""
import os
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from test_dequant import random_rows  # noqa: E402

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


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_512(benchmark, qtype):
    n_cols = 1024 if block_geometry(qtype)[0] == 256 else 896
    n_out = 4864
    raw, x, out = _setup(qtype, n_cols, n_out, 512)
    benchmark.pedantic(qmatmul, args=(qtype, raw, n_cols, x, out), rounds=5, iterations=1)
    benchmark.extra_info["GFLOP/s"] = round(2 * 512 * n_cols * n_out / benchmark.stats.stats.min / 1e9, 1)
