"""F16 / BF16 / F32 weights in decode-sized calls (kernels/cpu/half_matvec.py): against float64, the same bits for a
token whatever else shares the call (1-8 tokens), through qmatmul's entry points, and rows that are not whole
16-weight steps left to the tile path."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite.kernels.cpu import half_gemm
from strata_lite.kernels.cpu import half_matvec as hm
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.qmatmul import MATVEC_MAX_TOK, qmatmul

# float32 sums of 896-4864 products against float64: measured 1.6e-7 of the largest output
REL_TOL = 2e-6


def _weights(rng, qtype, n_out, n_in):
    """(raw uint8 (n_out, 2 n_in) (F32: 4 n_in), the same values as float64)"""
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if qtype == QT.F32:
        return w.view(np.uint8).reshape(n_out, 4 * n_in), w.astype(np.float64)
    if qtype == QT.BF16:
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        values = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        bits = w.astype(np.float16).view(np.uint16)
        values = bits.view(np.float16).astype(np.float32)
    return bits.view(np.uint8).reshape(n_out, 2 * n_in), values.astype(np.float64)


def _matvec(qtype, raw, x, out):
    if qtype == QT.F32:
        hm.matvec_f32(raw, x, out)
    else:
        hm.matvec(raw, qtype == QT.BF16, x, out)


def _rows(qtype, raw):
    """The kernel's view of raw rows: uint16 bits, or float32 values."""
    return raw.view(np.float32 if qtype == QT.F32 else np.uint16)


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.F32])
@pytest.mark.parametrize("n_out,n_in", [(37, 896), (300, 4864), (37, 2048), (5, 16)])
def test_against_float64_and_batch_invariant(qtype, n_out, n_in):
    rng = np.random.default_rng(n_out)
    raw, ref_w = _weights(rng, qtype, n_out, n_in)
    x = rng.standard_normal((MATVEC_MAX_TOK, n_in)).astype(np.float32)
    out = np.empty((MATVEC_MAX_TOK, n_out), np.float32)
    _matvec(qtype, raw, x, out)
    ref = x.astype(np.float64) @ ref_w.T
    assert np.abs(out - ref).max() <= REL_TOL * np.abs(ref).max()
    for lo, hi in [(0, 1), (3, 4), (1, 3), (2, 8)]:
        part = np.empty((hi - lo, n_out), np.float32)
        _matvec(qtype, raw, x[lo:hi].copy(), part)
        np.testing.assert_array_equal(part, out[lo:hi])


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.F32])
def test_row_groups_change_no_bits(qtype):
    """Long rows ROW_GROUP at a time through one loop give each row the bits it has alone (a one-row matrix: the
    last-rows path), at 1-8 tokens; short rows' chains give the same bits in any call."""
    rng = np.random.default_rng(11)
    for n_out, n_in in [(hm.ROW_GROUP * 3 + 1, hm.LONG_ROW), (hm.ROW_GROUP * 2 + 3, 896 + 16)]:
        raw, _ = _weights(rng, qtype, n_out, n_in)
        w = _rows(qtype, raw)
        for n_tok in (1, 3, MATVEC_MAX_TOK):
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            whole = np.full((n_tok, n_out), np.nan, np.float32)
            hm._mv(w, x, whole, qtype == QT.BF16)
            for r in range(n_out):
                alone = np.full((n_tok, 1), np.nan, np.float32)
                hm._mv(w[r:r + 1], x, alone, qtype == QT.BF16)
                np.testing.assert_array_equal(alone[:, 0], whole[:, r])


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.F32])
def test_qmatmul_and_the_backend_take_it(qtype):
    """Up to MATVEC_MAX_TOK tokens both entry points give the kernel's bits; a row of 904 weights (not whole
    steps) and a 20-token chunk take the tile path or half_gemm.py's tiles where the CPU has them (BF16's with the
    activations rounded to BF16), within float32 rounding of float64."""
    rng = np.random.default_rng(7)
    be = CpuBackend()
    for n_in, n_tok in [(896, 1), (896, 8), (904, 2), (896, 20)]:
        raw, ref_w = _weights(rng, qtype, 48, n_in)
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        out = np.empty((n_tok, 48), np.float32)
        qmatmul(qtype, raw, n_in, x, out)

        class W:
            name, n_out = "blk.0.ffn_up.weight", 48
        W.qtype, W.n_in, W.raw = qtype, n_in, raw
        np.testing.assert_array_equal(be.qmatmul(be.upload_weight(W()), x), out)
        if hm.fits(n_in) and n_tok <= MATVEC_MAX_TOK:
            direct = np.empty_like(out)
            _matvec(qtype, raw, x, direct)
            np.testing.assert_array_equal(out, direct)
        xr = x
        if qtype == QT.BF16 and n_tok > MATVEC_MAX_TOK and half_gemm.takes(True, n_in):   # activations rounded to BF16
            xr = (half_gemm.round_bf16(x).astype(np.uint32) << 16).view(np.float32)
        ref = xr.astype(np.float64) @ ref_w.T
        assert np.abs(out - ref).max() <= REL_TOL * np.abs(ref).max()


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16])
def test_tile_dequantization_is_exact(qtype):
    """The tile path's conversion (half_matvec.to_f32 through dequantize_into) gives every value's float32
    bits, infinities, signed zeros and subnormals included, and NaN for NaN (the 1,022 signaling NaN patterns
    of F16 come back with the quiet bit numpy's cast leaves clear); rows not of whole steps use numpy."""
    from strata_lite.kernels.cpu.dequant import dequantize_into
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    if qtype == QT.BF16:
        expect = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        expect = bits.view(np.float16).astype(np.float32)
    for cols in (256, 200):
        out = np.empty((256, cols), np.float32)
        dequantize_into(qtype, np.ascontiguousarray(bits[:, :cols]).view(np.uint8), out)
        want = expect[:, :cols]
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(out), nan)
        np.testing.assert_array_equal(out.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
