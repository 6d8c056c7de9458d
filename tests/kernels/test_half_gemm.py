"""F16 and BF16 prompt chunks on tiles with tokens in the vector lanes (kernels/cpu/half_gemm.py): BF16's activation
rounding, the products against float64, the same bits for a token in any chunk, and qmatmul's entry points taking
them. BF16's tiles need AVX512_BF16, F16's AVX-512; on a CPU without them those tests are skipped and such chunks
keep the float32 tile path."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite.kernels.cpu import half_gemm as hg
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.qmatmul import MATVEC_MAX_TOK, qmatmul

KINDS = [pytest.param(True, id="BF16", marks=pytest.mark.skipif(not hg.BF16_BUILT, reason="no AVX512_BF16 here")),
         pytest.param(False, id="F16", marks=pytest.mark.skipif(not hg.F16_BUILT, reason="no AVX-512 here"))]
# products exact in float32 (BF16 x BF16; F16 weights widened exactly, times float32 activations: one rounding
# each), summed in one float32 lane, the steps of a block (512 / 256 weights) in order from zero, the blocks added
# in order, over 32-4864 weights, against float64: measured 0.4e-7 - 4.8e-7 of the largest output (BF16) and
# 0.8e-7 - 4.9e-7 (F16)
REL_TOL = 1e-6


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _weights(rng, bf16, n_out, n_in):
    """(raw uint8 (n_out, 2 n_in) F16 / BF16 rows, their values as float64)"""
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if bf16:
        bits = hg.round_bf16(w)
        return bits.view(np.uint8).reshape(n_out, 2 * n_in), _bf16_values(bits).astype(np.float64)
    half = w.astype(np.float16)
    return half.view(np.uint8).reshape(n_out, 2 * n_in), half.astype(np.float64)


def _activations(bf16, x):
    """x as the tiles multiply it: BF16's rounded to BF16, F16's as it is (float64)."""
    return (_bf16_values(hg.round_bf16(x)) if bf16 else x).astype(np.float64)


@pytest.mark.skipif(not hg.BF16_BUILT, reason="no AVX512_BF16 here")
def test_rounding_to_bf16():
    """To nearest, ties to even, overflow to infinity, NaN kept (quiet), signs kept."""
    bits = np.array([[0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0x7F800000, 0x7F800001,
                      0xFFC00000, 0x80000001, 0xBF818000, 0x00000000, 0x80000000]], np.uint32)
    want = [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0x7F80, 0x7FC0, 0xFFC0, 0x8000, 0xBF82, 0x0000, 0x8000]
    assert hg.round_bf16(bits.view(np.float32)).tolist() == [want]
    x = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    got = _bf16_values(hg.round_bf16(x))
    assert np.abs(got - x).max() <= 2 ** -8 * np.abs(x).max()          # half a BF16 unit at most


@pytest.mark.parametrize("bf16", KINDS)
@pytest.mark.parametrize("n_out,n_in,n_tok", [(37, 896, 13), (4864, 896, 70), (19, 4864, 9), (5, 32, 1),
                                             (29, 1056, 300)])   # 2-3 chunks of groups; a short last block
def test_against_float64_and_batch_invariant(bf16, n_out, n_in, n_tok):
    """The products against float64 (rows and tokens past whole tiles and 16-token groups included); a token's
    outputs are the same bits in a call of other tokens (its group, its lane, tiles and chunks fall elsewhere)."""
    rng = np.random.default_rng(n_out + n_tok)
    raw, w = _weights(rng, bf16, n_out, n_in)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    out = np.full((n_tok, n_out), np.nan, np.float32)
    hg.matmul(raw, bf16, x, out)
    ref = _activations(bf16, x) @ w.T
    assert np.abs(out - ref).max() <= REL_TOL * np.abs(ref).max()
    for lo, hi in {(0, 1), (n_tok - 1, n_tok), (n_tok // 3, n_tok)}:
        part = np.full((hi - lo, n_out), np.nan, np.float32)
        hg.matmul(raw, bf16, x[lo:hi].copy(), part)
        np.testing.assert_array_equal(part, out[lo:hi])


@pytest.mark.parametrize("bf16", KINDS)
def test_qmatmul_and_the_backend_take_it(monkeypatch, bf16):
    """F16 / BF16 calls of more than MATVEC_MAX_TOK tokens give the tiles' bits through both entry points;
    switched off (STRATA_LITE_BF16_GEMM=0 / STRATA_LITE_F16_GEMM=0 clear the ENABLED flags), the float32 tile
    path (BF16: within BF16 rounding of the activations)."""
    rng = np.random.default_rng(5)
    be = CpuBackend()
    qtype = QT.BF16 if bf16 else QT.F16
    n_tok, n_in = MATVEC_MAX_TOK + 12, 896 if bf16 else hg.F16_MIN_ROW
    raw, w = _weights(rng, bf16, 48, n_in)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    direct = np.empty((n_tok, 48), np.float32)
    hg.matmul(raw, bf16, x, direct)
    out = np.empty_like(direct)
    qmatmul(qtype, raw, n_in, x, out)
    np.testing.assert_array_equal(out, direct)

    class W:
        name, n_out = "blk.0.ffn_up.weight", 48
    W.raw, W.qtype, W.n_in = raw, qtype, n_in
    np.testing.assert_array_equal(be.qmatmul(be.upload_weight(W()), x), direct)
    assert hg.takes(bf16, n_in) and hg.takes(bf16, n_in - hg.STEP) == bf16   # F16: shorter rows keep the tile path
    monkeypatch.setattr(hg, "BF16_ENABLED" if bf16 else "F16_ENABLED", False)
    assert not hg.takes(bf16, n_in)
    qmatmul(qtype, raw, n_in, x, out)
    ref = x.astype(np.float64) @ w.T
    assert np.abs(out - ref).max() <= 1e-6 * np.abs(ref).max()       # float32 activations and BLAS
    if bf16:
        assert np.abs(direct - ref).max() <= 2 ** -8 * np.abs(x).max() * np.abs(w).sum(axis=1).max()
    else:
        assert np.abs(direct - ref).max() <= REL_TOL * np.abs(ref).max()
        assert not np.array_equal(out, direct)     # the switch took the other path (another order of sums)
