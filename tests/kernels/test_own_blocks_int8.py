"""Q5_0, Q4_0 and IQ4_NL in their own blocks through the AVX2 int8 kernel (q8_0_int8.py), against the
lossless Q8_0 repacking they replaced (repack.py) and against float64. (Q5_0 / Q4_0 matrices of 4k rows take
the interleaved layout instead: test_rows4_int8.py; the shapes here have other row counts.)

* Bit-identical to the Q8_0-repacked path for every token count (1, 2, 3, 4, 8, 17: one-token 4-row
  tiles, chunks of 2..8 tokens, several chunks) and shape (row tails, the 0.5B model's 896 / 4864
  columns), through the kernel, its serial twin and the backend (upload_weight / qmatmul). The engine's
  batch invariance and llama.cpp goldens were measured with the Q8_0 repacking: equal bits keep them.
* Lossless unpacking: the kernel fed 127 e_j (activation scale exactly 1) returns 127 x the weight that
  gguf.quants.dequantize gives, bit for bit, for every column j: every nibble, fifth bit and table value
  is unpacked to the integer the file holds.
* Prompt chunks (q8_0_gemm.MIN_TOK+ tokens) take the register-tiled GEMM: tests/kernels/test_prompt_gemm.py.
* Float64 reference (gguf.quants.dequantize, activations rounded to Q8_0 as llama.cpp does): weights and
  rounded activations are exact float32 products (<= 18 significant bits each), so the reference is exact
  and the only error is float32 rounding in the kernel: the product d_w d_a, then one FMA per block into
  8 lanes (nb / 8 roundings per lane) and a 3-level lane sum. Bound: (nb / 8 + 4) 2^-24 sum |w| |x|
  (rigorous; measured: at most 0.22 of it over this file's cases, 1.8e-7 of the sum at 4864 columns). A
  single wrong weight, sign or scale moves a result by ~1 / n_cols of that sum (>= 2e-4 here), 150x the bound.
"""
from types import SimpleNamespace

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from strata_lite.kernels.cpu import q8_0_int8, repack as rp
from strata_lite.kernels.cpu.act_quant import round_activations
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.isa import host_has_avx2
from test_dequant import random_rows

pytestmark = pytest.mark.skipif(not host_has_avx2(), reason="the int8 kernels need an AVX2 CPU")

OWN = {QType.Q5_0: q8_0_int8.Q5_0_KIND, QType.Q4_0: q8_0_int8.Q4_0_KIND, QType.IQ4_NL: q8_0_int8.IQ4_NL_KIND}
TYPES = sorted(OWN, key=lambda t: t.name)
TOKENS = (1, 2, 3, 4, 8, 17)
SHAPES = [(5, 160), (13, 896), (37, 4864)]          # (rows, columns): row tails of the 4-row / 16-row groups


def _rows(qtype, n_out, n_cols, seed):
    """Random blocks plus the extremes: all fifth bits set / clear, codes 0 and 15 (Q4_0 -8, IQ4_NL -127)."""
    raw = random_rows(qtype, n_out, n_cols, seed=seed)
    b = raw.reshape(n_out, n_cols // 32, -1)
    lo = 2 if qtype != QType.Q5_0 else 6
    b[0, 0, lo:] = 0x00
    b[-1, -1, lo:] = 0xFF
    if qtype == QType.Q5_0:
        b[0, -1, 2:6] = 0xFF
        b[-1, 0, 2:6] = 0x00
    return raw


def _x(n_tok, n_cols, seed):
    x = np.random.default_rng(seed).standard_normal((n_tok, n_cols), dtype=np.float32)
    x[0, 32:64] = 0                                 # an all-zero activation block
    if n_tok > 1:
        x[1, :32] *= 1000                           # and a large one
    return x


def _old_and_new(qtype, raw, n_out, n_cols):
    """(the Q8_0-repacked weight the engine used before, the weight in its own blocks), both int8."""
    old = rp.PackedWeight("w", QType.Q8_0, n_out, n_cols, rp.repack_to_q8_0(qtype, raw, n_cols),
                          src_qtype=qtype, int8=True)
    new = rp.pack_weight(SimpleNamespace(name="w", qtype=qtype, n_out=n_out, n_in=n_cols, raw=raw), int8=True)
    return old, new


@pytest.mark.parametrize("n_out,n_cols", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bits_equal_the_q8_0_repacked_path(qtype, n_out, n_cols):
    raw = _rows(qtype, n_out, n_cols, seed=n_cols + n_out)
    old, new = _old_and_new(qtype, raw, n_out, n_cols)
    assert new.qtype == qtype and new.layout == rp.GGML and new.int8 and np.shares_memory(new.raw, raw)
    assert new.nbytes * 34 == old.nbytes * (22 if qtype == QType.Q5_0 else 18)
    be = CpuBackend()
    for n_tok in TOKENS:
        x = _x(n_tok, n_cols, seed=n_tok)
        x3 = x.reshape(n_tok, n_cols // 32, 32)
        ref = np.full((n_tok, n_out), np.nan, np.float32)
        q8_0_int8.mv_avx2(old.raw3, x3, ref, q8_0_int8.Q8_0_KIND)
        for mv in (q8_0_int8.mv_avx2, q8_0_int8.mv_avx2_serial):
            out = np.full((n_tok, n_out), np.nan, np.float32)
            mv(new.raw3, x3, out, OWN[qtype])
            np.testing.assert_array_equal(out, ref, err_msg=f"{mv.__name__}, {n_tok} tokens")
        np.testing.assert_array_equal(be.qmatmul(new, x), ref)
        np.testing.assert_array_equal(be.qmatmul(old, x), ref)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_unpacking_is_lossless(qtype):
    n_out, n_cols = 9, 256
    raw = _rows(qtype, n_out, n_cols, seed=11)
    w = gguf.quants.dequantize(raw, qtype)                       # float32 (n_out, n_cols)
    x = np.zeros((n_cols, n_cols), np.float32)
    np.fill_diagonal(x, 127.0)                                   # token j: 127 at column j (scale 1, q 127)
    out = np.full((n_cols, n_out), np.nan, np.float32)
    q8_0_int8.mv_avx2(raw.reshape(n_out, n_cols // 32, -1), x.reshape(n_cols, -1, 32), out, OWN[qtype])
    np.testing.assert_array_equal(out, np.float32(127) * w.T)


@pytest.mark.parametrize("n_out,n_cols", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_against_float64(qtype, n_out, n_cols):
    raw = _rows(qtype, n_out, n_cols, seed=n_out)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    new = rp.pack_weight(SimpleNamespace(name="w", qtype=qtype, n_out=n_out, n_in=n_cols, raw=raw), int8=True)
    bound = (n_cols // 32 / 8 + 4) * 2.0 ** -24
    for n_tok in TOKENS:
        x = _x(n_tok, n_cols, seed=100 + n_tok)
        xr = round_activations(QType.Q8_0, x).astype(np.float64)     # llama.cpp's Q8_0 rounding
        ref, scale = xr @ w.T, np.abs(xr) @ np.abs(w).T
        err = np.abs(CpuBackend().qmatmul(new, x).astype(np.float64) - ref)
        assert np.all(err <= bound * scale), f"{n_tok} tokens: {np.max(err / scale) / bound:.3g} of the bound"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_off_keeps_the_q8_0_repacking(qtype, monkeypatch):
    monkeypatch.setenv("STRATA_LITE_INT8", "0")
    raw = _rows(qtype, 7, 896, seed=5)
    be = CpuBackend()
    pw = be.upload_weight(SimpleNamespace(name="w", qtype=qtype, n_out=7, n_in=896, raw=raw))
    assert (pw.qtype, pw.src_qtype, pw.int8) == (QType.Q8_0, qtype, False)
    np.testing.assert_array_equal(gguf.quants.dequantize(pw.raw, QType.Q8_0), gguf.quants.dequantize(raw, qtype))
