"""The prompt-chunk GEMMs (q8_0_gemm.py for Q8_0 / Q5_0 / Q4_0 / IQ4_NL, nibble_gemm.py for the IQ3_XXS /
Q4_K / Q5_K / Q6_K repackings) against the int8 kernels they replace for prompt chunks, and against float64.

* Bit-identical to q8_0_int8.mv_avx2 / nibble_int8.matvec: the GEMMs form the same exact integer block
  sums (in another way) and then the same float operations in the same order, so every output must equal
  the vector kernels' bit for bit. Shapes with tails everywhere: row counts that are not multiples of the
  tile's rows or of a panel, token counts that are not multiples of the tile's tokens (the packing repeats
  the last token), one panel with many token ranges (gemm_work.token_chunks) and many panels with one,
  extreme weights (Q8_0's -128, all Q5_0 fifth bits set / clear, the largest codes), a zero and a large
  activation block.
* Float64 reference (gguf.quants.dequantize, activations rounded as llama.cpp does): the bounds of
  test_own_blocks_int8.py / test_nibble_int8.py, whose reasoning holds unchanged for equal bits; it
  guards against the vector kernels and the GEMMs sharing a mistake.
* The engine's routing: CpuBackend.qmatmul takes a GEMM from its MIN_TOK on and a token's row is the same
  whether it is computed alone, in a short call or in a prompt chunk (batch invariance).
"""
from types import SimpleNamespace

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from strata_lite.kernels.cpu import (iq3_int8, nibble_gemm, nibble_int8, q4_k_int8, q5_k_int8, q6_k_int8, q8_0_gemm,
                                     q8_0_int8)
from strata_lite.kernels.cpu.act_quant import round_activations
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.dequant import F16_TABLE
from strata_lite.kernels.cpu.isa import host_has_avx2
from test_dequant import random_rows
from test_own_blocks_int8 import _rows as own_block_rows

pytestmark = pytest.mark.skipif(not host_has_avx2(), reason="the int8 kernels need an AVX2 CPU")

Q8_KINDS = {QType.Q8_0: q8_0_int8.Q8_0_KIND, QType.Q5_0: q8_0_int8.Q5_0_KIND, QType.Q4_0: q8_0_int8.Q4_0_KIND,
            QType.IQ4_NL: q8_0_int8.IQ4_NL_KIND}
NIBBLE = {QType.IQ3_XXS: (iq3_int8, nibble_int8.IQ3, iq3_int8.CODE_TABLE),
          QType.Q4_K: (q4_k_int8, nibble_int8.Q4K, q4_k_int8._NO_TABLE),
          QType.Q5_K: (q5_k_int8, nibble_int8.Q5K, q5_k_int8._NO_TABLE),
          QType.Q6_K: (q6_k_int8, nibble_int8.Q6K, q6_k_int8._NO_TABLE)}
TOKENS = (1, 7, 9, 16, 23, 41, 70)


def _x(n_tok, n_cols, seed):
    x = np.random.default_rng(seed).standard_normal((n_tok, n_cols), dtype=np.float32)
    x[0, 32:64] = 0                                 # an all-zero Q8_0 block (and part of a Q8_K block)
    x[-1, :256] = 0                                 # an all-zero Q8_K block
    if n_tok > 2:
        x[1, :32] *= 1000                           # and a large one
    return x


def _q8_rows(qtype, n_out, n_cols, seed):
    """Random blocks plus the extremes: Q8_0 weights of -128; for the own-block types test_own_blocks_int8's
    (Q5_0 fifth bits all set / all clear, codes 0 and 15: Q4_0 -8, IQ4_NL -127)."""
    if qtype != QType.Q8_0:
        return own_block_rows(qtype, n_out, n_cols, seed)
    raw = random_rows(qtype, n_out, n_cols, seed=seed)
    raw.reshape(n_out, n_cols // 32, -1)[0, 1, 2:] = 0x80
    return raw


# ------------------------------------------------------------------------------- Q8_0 family: q8_0_gemm

@pytest.mark.parametrize("n_out,n_cols", [(1, 160), (5, 896), (49, 96), (130, 896)], ids=str)
@pytest.mark.parametrize("qtype", list(Q8_KINDS), ids=lambda t: t.name)
def test_q8_0_gemm_bits_equal_the_vector_kernel(qtype, n_out, n_cols):
    """One row; 5 rows, 1 panel, many token ranges; 49 rows = a panel + 1; 130 rows = 3 panels (2 ranges)."""
    raw = _q8_rows(qtype, n_out, n_cols, seed=n_out + n_cols)
    raw3 = raw.reshape(n_out, n_cols // 32, -1)
    for n_tok in TOKENS:
        x3 = _x(n_tok, n_cols, seed=n_tok).reshape(n_tok, -1, 32)
        ref = np.full((n_tok, n_out), np.nan, np.float32)
        q8_0_int8.mv_avx2(raw3, x3, ref, Q8_KINDS[qtype])
        out = np.full_like(ref, np.nan)
        q8_0_gemm.matmul(raw3, x3, out, Q8_KINDS[qtype])
        np.testing.assert_array_equal(out, ref, err_msg=f"{n_tok} tokens")


@pytest.mark.parametrize("qtype", list(Q8_KINDS), ids=lambda t: t.name)
def test_q8_0_gemm_against_float64(qtype):
    n_out, n_cols, n_tok = 37, 4864, 41
    raw = _q8_rows(qtype, n_out, n_cols, seed=3)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    x = _x(n_tok, n_cols, seed=4)
    xr = round_activations(QType.Q8_0, x).astype(np.float64)          # llama.cpp's Q8_0 rounding
    ref, scale = xr @ w.T, np.abs(xr) @ np.abs(w).T
    out = np.empty((n_tok, n_out), np.float32)
    q8_0_gemm.matmul(raw.reshape(n_out, n_cols // 32, -1), x.reshape(n_tok, -1, 32), out, Q8_KINDS[qtype])
    bound = (n_cols // 32 / 8 + 4) * 2.0 ** -24                       # test_own_blocks_int8.py's reasoning
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= bound * scale), f"{np.max(err / scale) / bound:.3g} of the bound"


# ----------------------------------------------------------- IQ3_XXS / Q4_K / Q5_K / Q6_K: nibble_gemm

@pytest.mark.parametrize("n_out", [1, 3, 17, 33])
@pytest.mark.parametrize("qtype", list(NIBBLE), ids=lambda t: t.name)
def test_nibble_gemm_bits_equal_the_vector_kernel(qtype, n_out):
    """Row counts: one, an odd tile tail, a panel + 1, two panels + 1."""
    mod, kind, table = NIBBLE[qtype]
    n_cols = 768
    raw = random_rows(qtype, n_out, n_cols, seed=n_out)
    raw3 = mod.repack(raw, n_cols, F16_TABLE).reshape(n_out, n_cols // 256, mod.BLOCK_BYTES)
    for n_tok in TOKENS:
        x3 = _x(n_tok, n_cols, seed=n_tok).reshape(n_tok, -1, 256)
        ref = np.full((n_tok, n_out), np.nan, np.float32)
        nibble_int8.matvec(raw3, x3, ref, table, kind)
        out = np.full_like(ref, np.nan)
        nibble_gemm.matmul(raw3, x3, out, table, kind)
        np.testing.assert_array_equal(out, ref, err_msg=f"{n_tok} tokens")


@pytest.mark.parametrize("qtype", list(NIBBLE), ids=lambda t: t.name)
def test_nibble_gemm_against_float64(qtype):
    """test_nibble_int8.py's shape (3 blocks a row) and tolerance: the integer sums are exact, the float32
    roundings of the per-block products and their sums stay near 1e-7 of sum |W| |x|; 1e-5 of it catches
    any wrong code, scale, min or offset term. (The error grows with the blocks a row: the +128 offset and
    Q4_K's mins are summed before they cancel; at 19 blocks a Q4_K row measured 1.6e-5, the same bits as
    nibble_int8.matvec, which the test above checks.)"""
    mod, kind, table = NIBBLE[qtype]
    n_out, n_cols, n_tok = 21, 768, 70
    raw = random_rows(qtype, n_out, n_cols, seed=5)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    x = _x(n_tok, n_cols, seed=6)
    xr = round_activations(qtype, x).astype(np.float64)               # llama.cpp's Q8_K rounding
    ref, scale = xr @ w.T, np.abs(xr) @ np.abs(w).T
    out = np.empty((n_tok, n_out), np.float32)
    nibble_gemm.matmul(mod.repack(raw, n_cols, F16_TABLE).reshape(n_out, n_cols // 256, mod.BLOCK_BYTES),
                       x.reshape(n_tok, -1, 256), out, table, kind)
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= 1e-5 * scale), f"max rel err {np.max(err / scale):.3g}"


# ------------------------------------------------------------------------------------ engine routing

@pytest.mark.parametrize("qtype,n_in", [(QType.Q5_0, 896), (QType.Q8_0, 256), (QType.IQ4_NL, 256),
                                        (QType.Q4_K, 512), (QType.Q5_K, 512), (QType.Q6_K, 768),
                                        (QType.IQ3_XXS, 512)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_backend_rows_do_not_depend_on_the_call(qtype, n_in):
    """A prompt chunk past both GEMMs' MIN_TOK against its tokens alone and in short calls (the vector
    kernels): the same bits."""
    n_tok = max(q8_0_gemm.MIN_TOK, nibble_gemm.MIN_TOK) + 11
    be = CpuBackend()
    raw = random_rows(qtype, 45, n_in, seed=7)
    w = be.upload_weight(SimpleNamespace(name="blk.0.ffn_up.weight", qtype=qtype, n_out=45, n_in=n_in, raw=raw))
    assert w.int8
    x = _x(n_tok, n_in, seed=8)
    full = be.qmatmul(w, x)
    for lo, hi in [(0, 1), (n_tok - 1, n_tok), (3, 11), (5, 5 + q8_0_gemm.MIN_TOK), (2, n_tok - 1)]:
        np.testing.assert_array_equal(be.qmatmul(w, x[lo:hi].copy()), full[lo:hi], err_msg=f"tokens {lo}:{hi}")
