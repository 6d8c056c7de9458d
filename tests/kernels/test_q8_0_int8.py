"""The AVX2 int8 Q8_0 kernel (q8_0_int8.py) against float64, and the backend routing to it.

Tolerance: integer block sums are exact; the only error is float32 rounding of the per-block products
d_w * d_a * sum and their accumulation (measured ~2e-8 of sum |W| |x|): 1e-5 of that sum catches any
wrong sign, scale or offset (each moves results by O(1) of it).
"""
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from types import SimpleNamespace

from strata_lite.kernels.cpu import q8_0_int8
from strata_lite.kernels.cpu.act_quant import round_activations
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.isa import host_has_avx2
from strata_lite.kernels.cpu.qmatmul import MATVEC_MAX_TOK
from test_dequant import random_rows

needs_avx2 = pytest.mark.skipif(not host_has_avx2(), reason="the int8 kernels need an AVX2 CPU")
RTOL = 1e-5


def _reference(raw, x, qtype=QType.Q8_0):
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    xr = round_activations(QType.Q8_0, x).astype(np.float64)          # llama.cpp's Q8_0 rounding
    return xr @ w.T, np.abs(xr) @ np.abs(w).T


def test_activation_quantization_is_llama_cpp_q8_0_rounding():
    x = np.random.default_rng(0).standard_normal((3, 96), dtype=np.float32) * 7
    x[2, 32:64] = 0                                               # an all-zero block
    q, d = q8_0_int8.quantize_activations(x)
    ours = (q.astype(np.float32) * d[:, :, None]).reshape(x.shape)
    np.testing.assert_array_equal(ours, round_activations(QType.Q8_0, x))


@needs_avx2
@pytest.mark.parametrize("n_out", [1, 2, 3, 4, 5, 9])
def test_every_row_tail_and_token_count(n_out):
    raw = random_rows(QType.Q8_0, n_out, 160, seed=n_out)
    raw.reshape(n_out, 5, 34)[0, 1, 2:] = 0x80                    # weights of -128: |w| = 128 unsigned
    for n_tok in range(1, 10):
        x = np.random.default_rng(n_tok).standard_normal((n_tok, 160), dtype=np.float32)
        x[0, 64:96] = 0
        ref, scale = _reference(raw, x)
        out = np.full((n_tok, n_out), np.nan, np.float32)
        q8_0_int8.mv_avx2(raw.reshape(n_out, 5, 34), x.reshape(n_tok, 5, 32), out)
        err = np.abs(out - ref)
        assert np.all(err <= RTOL * scale + 1e-30), f"n_tok {n_tok}: max rel err {np.max(err / scale):.3g}"


@needs_avx2
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q5_0, QType.Q4_0, QType.IQ4_NL], ids=lambda t: t.name)
def test_backend_serves_q8_0_and_its_repacked_types_in_int8(qtype, monkeypatch):
    raw = random_rows(qtype, 1200, 256, seed=7)                   # > SMALL_BYTES once repacked
    w = SimpleNamespace(name="w", qtype=qtype, n_out=1200, n_in=256, raw=raw)
    be = CpuBackend()
    pw = be.upload_weight(w)
    assert pw.qtype == qtype and pw.int8                          # its own blocks: the kernel unpacks them
    for n_tok in (1, 3, MATVEC_MAX_TOK, MATVEC_MAX_TOK + 1, 21):  # chunks of up to 8 tokens per kernel call
        x = np.random.default_rng(n_tok).standard_normal((n_tok, 256), dtype=np.float32)
        ref, scale = _reference(raw, x, qtype)
        assert np.all(np.abs(be.qmatmul(pw, x) - ref) <= RTOL * scale + 1e-30)
    monkeypatch.setenv("STRATA_LITE_INT8", "0")
    assert not CpuBackend().upload_weight(w).int8


@needs_avx2
@pytest.mark.parametrize("qtype,kind", [(QType.Q5_0, q8_0_int8.Q5_0_KIND), (QType.Q4_0, q8_0_int8.Q4_0_KIND),
                                        (QType.IQ4_NL, q8_0_int8.IQ4_NL_KIND)], ids=lambda v: getattr(v, "name", ""))
def test_own_blocks_give_the_bits_of_their_q8_0_repacking(qtype, kind):
    """The kernel unpacks these blocks to the integers the lossless Q8_0 repacking stores and sums as
    the Q8_0 kernel does: bit-identical results for every token count."""
    from strata_lite.kernels.cpu.repack import repack_to_q8_0
    raw = random_rows(qtype, 70, 512, seed=3)
    q8 = repack_to_q8_0(qtype, raw, 512).reshape(70, 16, 34)
    for n_tok in (1, 2, 5, 8, 9, 30):
        x = np.random.default_rng(n_tok).standard_normal((n_tok, 512), dtype=np.float32).reshape(n_tok, 16, 32)
        a, b = np.empty((n_tok, 70), np.float32), np.empty((n_tok, 70), np.float32)
        q8_0_int8.mv_avx2(q8, x, a, q8_0_int8.Q8_0_KIND)
        q8_0_int8.mv_avx2(raw.reshape(70, 16, -1), x, b, kind)
        np.testing.assert_array_equal(a, b)
