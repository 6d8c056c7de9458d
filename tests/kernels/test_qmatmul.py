"""qmatmul vs a float64 reference, for every supported type and both paths (fused matvec, tile+BLAS).

Tolerance: both paths compute in float32 (x is NOT re-quantized to int8; BF16 chunks on the CPU's BF16 dot
products round x to BF16, as the reference then does), so the only error is float32
rounding of the products/sums: |err| <= n_cols * 2**-24 * sum_k |W_rk x_tk| in the worst case, about
sqrt(n_cols) * 2**-24 of it in practice. We allow 1e-4 * (|W| @ |x|) elementwise (~50x the
typical rounding error at these sizes, far below the O(1) relative error of any indexing/scale bug).
"""
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from act_reference import round_like_ggml
from strata_lite.kernels.cpu import half_gemm
from strata_lite.kernels.cpu import qmatmul as qm
from strata_lite.kernels.cpu.qmatmul import qmatmul
from strata_lite.kernels.qtypes import SUPPORTED_QTYPES, block_geometry, row_nbytes
from test_dequant import random_rows

ALL_TYPES = sorted(SUPPORTED_QTYPES, key=lambda t: t.name)
RTOL = 1e-4


def _n_cols(qtype):
    return 512 if block_geometry(qtype)[0] == 256 else 160


def _check_against_reference(qtype, n_out, n_cols, n_tok, seed=0):
    raw = random_rows(qtype, n_out, n_cols, seed=seed)
    x = np.random.default_rng(seed + 1).standard_normal((n_tok, n_cols), dtype=np.float32)
    w64 = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    bf16_chunk = qtype == QType.BF16 and n_tok > qm.MATVEC_MAX_TOK and half_gemm.takes(True, n_cols)
    x64 = round_like_ggml(qtype, x, bf16_chunk=True).astype(np.float64) if bf16_chunk else x.astype(np.float64)
    ref = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    out = np.full((n_tok, n_out), np.nan, dtype=np.float32)
    qmatmul(qtype, raw, n_cols, x, out)
    err = np.abs(out - ref)
    assert np.all(err <= RTOL * scale + 1e-30), f"max rel err {np.max(err / scale):.3g}"


@pytest.mark.parametrize("n_tok", [1, 3, 40])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_qmatmul_matches_float64(qtype, n_tok):
    _check_against_reference(qtype, 37, _n_cols(qtype), n_tok)


@pytest.mark.parametrize("n_out", [1, 2, 3, 5, 9])
def test_iq3_xxs_matvec_row_groups_and_token_chunks(n_out):
    """The IQ3_XXS kernel works on groups of 4 rows (2 with several tokens; a short last group repeats
    its last row) and on chunks of 2-4 tokens: every row count tail and token count 1..8."""
    for n_tok in range(1, qm.MATVEC_MAX_TOK + 1):
        _check_against_reference(QType.IQ3_XXS, n_out, 768, n_tok, seed=n_out * 10 + n_tok)


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q6_K], ids=lambda t: t.name)
def test_qmatmul_several_tiles(qtype, monkeypatch):
    monkeypatch.setattr(qm, "TILE_BYTES", 16 * 4 * 512)      # 16-row tiles, last tile partial
    _check_against_reference(qtype, 70, 512, 12, seed=5)


def test_qmatmul_readonly_raw_and_detects_wrong_result():
    qtype, n_cols = QType.Q8_0, 64
    raw = random_rows(qtype, 5, n_cols)
    raw.flags.writeable = False
    x = np.ones((1, n_cols), dtype=np.float32)
    out = np.empty((1, 5), dtype=np.float32)
    qmatmul(qtype, raw, n_cols, x, out)
    want = gguf.quants.dequantize(raw, qtype).sum(axis=1)
    np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(out[0], want[::-1])


@pytest.mark.parametrize("bad", ["x_cols", "x_dtype", "out_shape", "out_dtype", "raw_bytes", "x_noncontig"])
def test_qmatmul_shape_mismatch_raises(bad):
    qtype, n_cols, n_out, n_tok = QType.Q4_K, 256, 4, 2
    raw = random_rows(qtype, n_out, n_cols)
    x = np.zeros((n_tok, n_cols), dtype=np.float32)
    out = np.zeros((n_tok, n_out), dtype=np.float32)
    if bad == "x_cols":
        x = np.zeros((n_tok, n_cols + 256), dtype=np.float32)
    elif bad == "x_dtype":
        x = x.astype(np.float64)
    elif bad == "out_shape":
        out = np.zeros((n_tok, n_out + 1), dtype=np.float32)
    elif bad == "out_dtype":
        out = out.astype(np.float64)
    elif bad == "raw_bytes":
        raw = raw[:, :row_nbytes(qtype, n_cols) - 2]
    elif bad == "x_noncontig":
        x = np.zeros((n_cols, n_tok), dtype=np.float32).T
    with pytest.raises(ValueError):
        qmatmul(qtype, raw, n_cols, x, out)
