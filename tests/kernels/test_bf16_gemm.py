"""BF16 prompt chunks on the BF16 dot products (kernels/cpu/bf16_gemm.py): the activations' rounding, the products
against float64, the same bits for a token in any chunk, and qmatmul's entry points taking it. The kernel needs
AVX512_BF16; on a CPU without it these tests are skipped and BF16 chunks keep the float32 tile path."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite.kernels.cpu import bf16_gemm as bg
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.qmatmul import MATVEC_MAX_TOK, qmatmul

pytestmark = pytest.mark.skipif(not bg.BUILT, reason="the CPU has no AVX512_BF16 (vdpbf16ps)")

# BF16 products (exact in float32) summed in one float32 lane, pairs of a 512-weight block in order from zero, the
# blocks added in order, over 32-4864 weights, against float64: measured 0.4e-7 - 4.8e-7 of the largest output
REL_TOL = 1e-6


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _weights(rng, n_out, n_in):
    """(raw uint8 (n_out, 2 n_in) BF16 rows, their values as float64)"""
    bits = bg.round_bf16(rng.standard_normal((n_out, n_in)).astype(np.float32))
    return bits.view(np.uint8).reshape(n_out, 2 * n_in), _bf16_values(bits).astype(np.float64)


def test_rounding_to_bf16():
    """To nearest, ties to even, overflow to infinity, NaN kept (quiet), signs kept."""
    bits = np.array([[0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0x7F800000, 0x7F800001,
                      0xFFC00000, 0x80000001, 0xBF818000, 0x00000000, 0x80000000]], np.uint32)
    want = [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0x7F80, 0x7FC0, 0xFFC0, 0x8000, 0xBF82, 0x0000, 0x8000]
    assert bg.round_bf16(bits.view(np.float32)).tolist() == [want]
    x = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    got = _bf16_values(bg.round_bf16(x))
    assert np.abs(got - x).max() <= 2 ** -8 * np.abs(x).max()          # half a BF16 unit at most


@pytest.mark.parametrize("n_out,n_in,n_tok", [(37, 896, 13), (4864, 896, 70), (19, 4864, 9), (5, 32, 1),
                                             (29, 1056, 150)])   # 2 chunks of groups; a short last block
def test_against_float64_and_batch_invariant(n_out, n_in, n_tok):
    """The rounded activations' products against float64 (rows and tokens past whole tiles and 16-token groups
    included); a token's outputs are the same bits in a call of other tokens (its group, its lane, tiles and
    chunks fall elsewhere)."""
    rng = np.random.default_rng(n_out + n_tok)
    raw, w = _weights(rng, n_out, n_in)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    out = np.full((n_tok, n_out), np.nan, np.float32)
    bg.matmul(raw, x, out)
    ref = _bf16_values(bg.round_bf16(x)).astype(np.float64) @ w.T
    assert np.abs(out - ref).max() <= REL_TOL * np.abs(ref).max()
    for lo, hi in {(0, 1), (n_tok - 1, n_tok), (n_tok // 3, n_tok)}:
        part = np.full((hi - lo, n_out), np.nan, np.float32)
        bg.matmul(raw, x[lo:hi].copy(), part)
        np.testing.assert_array_equal(part, out[lo:hi])


def test_qmatmul_and_the_backend_take_it(monkeypatch):
    """BF16 calls of more than MATVEC_MAX_TOK tokens give the kernel's bits through both entry points; switched
    off (STRATA_LITE_BF16_GEMM=0 sets ENABLED), the float32 tile path, within BF16 rounding of the activations."""
    rng = np.random.default_rng(5)
    be = CpuBackend()
    n_tok, n_in = MATVEC_MAX_TOK + 12, 896
    raw, w = _weights(rng, 48, n_in)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    direct = np.empty((n_tok, 48), np.float32)
    bg.matmul(raw, x, direct)
    out = np.empty_like(direct)
    qmatmul(QT.BF16, raw, n_in, x, out)
    np.testing.assert_array_equal(out, direct)

    class W:
        name, n_out, qtype, n_in = "blk.0.ffn_up.weight", 48, QT.BF16, 896
    W.raw = raw
    np.testing.assert_array_equal(be.qmatmul(be.upload_weight(W()), x), direct)
    monkeypatch.setattr(bg, "ENABLED", False)
    assert not bg.takes(n_in)
    qmatmul(QT.BF16, raw, n_in, x, out)
    ref = x.astype(np.float64) @ w.T
    assert np.abs(out - ref).max() <= 1e-6 * np.abs(ref).max()       # float32 activations: closer
    assert np.abs(direct - ref).max() <= 2 ** -8 * np.abs(x).max() * np.abs(w).sum(axis=1).max()
