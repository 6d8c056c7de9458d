"""Quantized matrix multiply out = x @ W.T with W given as raw GGML rows.

Two paths, chosen by the number of tokens:
  * n_tok <= MATVEC_MAX_TOK: fused kernels (matvec.py) read the quantized blocks directly, one pass
    over the weights per call (each row stays in L1 while the tokens are looped over).
  * otherwise: dequantize a tile of rows into a float32 scratch buffer (dequant.py, Numba-parallel)
    and multiply it with BLAS (numpy.matmul); the whole matrix is never materialized.
F32 weights go straight to BLAS; F16 / BF16 always take the tile path.
"""
import numpy as np
from gguf import GGMLQuantizationType as QType

from . import matvec as mv
from .dequant import QK, QK_HALF, F16_TABLE, IQ2_KSIGNS, IQ3XXS_GRID, IQ4NL_VALUES, check_raw, dequantize_into
from ..qtypes import block_geometry

# Largest n_tok that uses the fused kernels (measured crossover on 2 Zen 4 cores, see bench).
MATVEC_MAX_TOK = 8
# The tile path dequantizes about this many float32 bytes at a time (fits L2).
TILE_BYTES = 1 << 20

_FUSED = {QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.IQ4_NL, QType.Q4_K, QType.Q5_K, QType.Q6_K,
          QType.IQ3_XXS}


def _check(qtype, raw, n_cols, x, out):
    qtype, raw = check_raw(qtype, raw, n_cols)
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError("x must be a C-contiguous float32 array (n_tok, n_cols)")
    if x.shape[1] != n_cols:
        raise ValueError(f"x has {x.shape[1]} columns, the weights have {n_cols}")
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 2:
        raise ValueError("out must be a float32 array (n_tok, n_out)")
    if out.shape != (x.shape[0], raw.shape[0]):
        raise ValueError(f"out has shape {out.shape}, expected {(x.shape[0], raw.shape[0])}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    return qtype, raw


def qmatmul(qtype, raw: np.ndarray, n_cols: int, x: np.ndarray, out: np.ndarray) -> None:
    """out[...] = x @ W.T, W the (n_out, n_cols) matrix stored as GGML rows in raw (uint8 (n_out, row_nbytes))."""
    qtype, raw = _check(qtype, raw, n_cols, x, out)
    n_tok = x.shape[0]
    if n_tok == 0 or raw.shape[0] == 0:
        return
    if qtype == QType.F32:
        np.matmul(x, raw.view(np.float32).T, out=out)
    elif qtype in _FUSED and n_tok <= MATVEC_MAX_TOK:
        matvec_fused(qtype, raw, x, out)
    else:
        matmul_tiled(qtype, raw, x, out)


def matvec_fused(qtype, raw, x, out):
    """Fused kernels, no checks (raw C-contiguous, shapes already validated)."""
    elems, bsize = block_geometry(qtype)
    n_tok, n_cols = x.shape
    raw3 = raw.reshape(raw.shape[0], n_cols // elems, bsize)
    x3 = x.reshape(n_tok, n_cols // elems, elems)
    if qtype == QType.Q8_0:
        mv.mv_q8_0(raw3, x3, out, F16_TABLE, QK)
    elif qtype == QType.IQ4_NL:
        mv.mv_iq4_nl(raw3, x3, out, F16_TABLE, IQ4NL_VALUES, QK_HALF)
    elif qtype == QType.IQ3_XXS:
        mv.mv_iq3_xxs(raw3, x3, out, F16_TABLE, IQ3XXS_GRID, IQ2_KSIGNS)
    elif qtype == QType.Q6_K:
        xs16 = x.reshape(n_tok, n_cols // 16, 16).sum(axis=2, dtype=np.float32)
        mv.mv_q6_k(raw3, x3, xs16, out, F16_TABLE, QK_HALF)
    else:
        xs = x.reshape(n_tok, n_cols // 32, 32).sum(axis=2, dtype=np.float32)
        if qtype == QType.Q4_0:
            mv.mv_q4_0(raw3, x3, xs, out, F16_TABLE, QK_HALF)
        elif qtype == QType.Q5_0:
            mv.mv_q5_0(raw3, x.reshape(n_tok, n_cols // 32, 4, 8), xs, out, F16_TABLE, 8)
        elif qtype == QType.Q4_K:
            mv.mv_q4_k(raw3, x3, xs, out, F16_TABLE, QK)
        elif qtype == QType.Q5_K:
            mv.mv_q5_k(raw3, x3, xs, out, F16_TABLE, QK)
        else:  # pragma: no cover
            raise AssertionError(qtype)


def matmul_tiled(qtype, raw, x, out):
    """Dequantize TILE_BYTES-sized row tiles to float32 and multiply them with BLAS."""
    n_out = raw.shape[0]
    n_cols = x.shape[1]
    tile = max(16, min(n_out, TILE_BYTES // (4 * n_cols)) // 16 * 16)
    scratch = np.empty((tile, n_cols), dtype=np.float32)
    for r0 in range(0, n_out, tile):
        r1 = min(n_out, r0 + tile)
        w = scratch[:r1 - r0]
        dequantize_into(qtype, raw[r0:r1], w)
        np.matmul(x, w.T, out=out[:, r0:r1])
