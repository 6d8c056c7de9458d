"""Quantized matrix multiply out = x @ W.T with W given as raw GGML rows.

Two paths, chosen by the number of tokens:
  * n_tok <= MATVEC_MAX_TOK: fused kernels (matvec.py) read the quantized blocks directly, one pass
    over the weights per call (each row stays in L1 while the tokens are looped over).
  * otherwise: dequantize a tile of rows into a float32 scratch buffer (dequant.py, Numba-parallel)
    and multiply it with BLAS (numpy.matmul); the whole matrix is never materialized.
F16 / BF16 / F32 weights take half_matvec.py up to MATVEC_MAX_TOK tokens; longer calls: F32 straight to BLAS, BF16
half_gemm.py where the CPU has AVX512_BF16, F16 half_gemm.py where it has AVX-512, others the tile path above.
"""
import ctypes
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from gguf import GGMLQuantizationType as QType

from . import half_gemm, half_matvec, q8_0_gemm, q8_0_int8
from . import matvec as mv
from .act_quant import round_activations
from .dequant import (QK, QK_HALF, F16_TABLE, IQ3XXS_GRID, IQ4NL_VALUES, check_raw,
                      dequantize_into, dequantize_into_serial)
from .repack import INT8_LAYOUTS, ROWS4_LAYOUTS
from ..qtypes import block_geometry

# Largest n_tok that uses the fused kernels (measured crossover on 2 Zen 4 cores, see bench).
MATVEC_MAX_TOK = 8
# The int8 layouts (IQ3_XXS, Q4_K, Q5_K, Q6_K repacked; Q8_0, and Q4_0 / Q5_0 / IQ4_NL in their own blocks)
# take their int8 kernel for every token count (prompt chunks: the register-tiled GEMMs of q8_0_gemm.py and
# nibble_gemm.py, with the same bits): its result for a token does not depend on the other
# tokens of the call (integer block dots, then a fixed order of float sums per token and row), so a
# token's logits do not depend on what shares its forward (batch invariance: speculative verification,
# prefix caching and chunked prompts rely on it). Dequantize + BLAS was faster for prompt chunks of
# short rows (1.5B Q4_K_M prompt 51 against 44 tok/s on a 2-core AVX2 VM) but BLAS blocks by the token
# count; on the default model the int8-only prompt measured 114-120 tok/s against 120-127 (same VM,
# 512 tokens).
# The tile path dequantizes about this many float32 bytes at a time (fits L2).
TILE_BYTES = 1 << 20

_HALF = {QType.F16, QType.BF16}   # up to MATVEC_MAX_TOK tokens: half_matvec.py (rows of whole 16-weight steps)
_FUSED = {QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.IQ4_NL, QType.Q4_K, QType.Q5_K, QType.Q6_K,
          QType.IQ3_XXS}


def _check(qtype, raw, n_cols, x, out):
    qtype, raw = check_raw(qtype, raw, n_cols)
    _check_x(x, n_cols)
    _check_out(out, x.shape[0], raw.shape[0])
    return qtype, raw


def _check_x(x, n_cols):
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError("x must be a C-contiguous float32 array (n_tok, n_cols)")
    if x.shape[1] != n_cols:
        raise ValueError(f"x has {x.shape[1]} columns, the weights have {n_cols}")


def _check_out(out, n_tok, n_out):
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 2:
        raise ValueError("out must be a float32 array (n_tok, n_out)")
    if out.shape != (n_tok, n_out):
        raise ValueError(f"out has shape {out.shape}, expected {(n_tok, n_out)}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")


def qmatmul(qtype, raw: np.ndarray, n_cols: int, x: np.ndarray, out: np.ndarray) -> None:
    """out[...] = x @ W.T, W the (n_out, n_cols) matrix stored as GGML rows in raw (uint8 (n_out, row_nbytes))."""
    qtype, raw = _check(qtype, raw, n_cols, x, out)
    n_tok = x.shape[0]
    if n_tok == 0 or raw.shape[0] == 0:
        return
    if qtype == QType.F32 and n_tok <= MATVEC_MAX_TOK and half_matvec.fits(n_cols):
        half_matvec.matvec_f32(raw, x, out)
    elif qtype == QType.F32:
        np.matmul(x, raw.view(np.float32).T, out=out)
    elif qtype in _HALF and n_tok <= MATVEC_MAX_TOK and half_matvec.fits(n_cols):
        half_matvec.matvec(raw, qtype == QType.BF16, x, out)
    elif qtype in _HALF and half_gemm.takes(qtype == QType.BF16, n_cols):
        half_gemm.matmul(raw, qtype == QType.BF16, x, out)
    elif qtype in _FUSED and n_tok <= MATVEC_MAX_TOK:
        matvec_fused(qtype, raw, x, out)
    else:
        matmul_tiled(qtype, raw, x, out)


def qmatmul_packed(w, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out = x @ W.T for a PackedWeight (repack.py): the per-call hot path of the engine.

    The weight was validated and its kernel views built once at load, so only x / out are checked
    here (cheap attribute tests), and n_tok <= MATVEC_MAX_TOK goes straight to the fused kernel.
    x: float32 activations. llama.cpp rounds them to Q8_0 / Q8_K before quantized mat-muls and so do
    we (act_quant.py): the int8 kernels quantize x to those int8 values themselves, the float kernels
    get the rounded values. The repacked int8 layouts take the int8 kernel for any number of tokens."""
    if (type(x) is not np.ndarray or x.dtype != _F32 or x.ndim != 2 or x.shape[1] != w.n_in
            or not x.flags.c_contiguous):
        _check_x(x, w.n_in)
    n_tok = x.shape[0]
    if out is None:
        out = np.empty((n_tok, w.n_out), dtype=_F32)
    elif (type(out) is not np.ndarray or out.dtype != _F32 or out.shape != (n_tok, w.n_out)
          or not out.flags.c_contiguous):
        _check_out(out, n_tok, w.n_out)
    if n_tok == 0 or w.n_out == 0:
        return out
    qtype = w.qtype
    if w.layout in ROWS4_LAYOUTS:
        full = out if not w.pad else np.empty((n_tok, w.n_out + w.pad), dtype=_F32)   # padded groups' rows
        INT8_LAYOUTS[w.layout][1].matvec(w.raw3, x.reshape(n_tok, w.nb, w.elems), full, serial=w.small)
        if w.pad:
            out[:] = full[:, :w.n_out]
        return out
    if w.layout in INT8_LAYOUTS:
        INT8_LAYOUTS[w.layout][1].matvec(w.raw3, x.reshape(n_tok, w.nb, w.elems), out)
        return out
    if w.int8:
        kind = _INT8_KIND.get(w.qtype, q8_0_int8.Q8_0_KIND)
        x3 = x.reshape(n_tok, w.nb, q8_0_int8.QK)
        if n_tok >= q8_0_gemm.MIN_TOK:
            q8_0_gemm.matmul(w.raw3, x3, out, kind)           # prompt chunks: register-tiled, same bits
        else:
            (q8_0_int8.mv_avx2_serial if w.small else q8_0_int8.mv_avx2)(w.raw3, x3, out, kind)
        return out
    x = round_activations(w.src_qtype, x)
    if qtype == _Q8_0 and n_tok <= MATVEC_MAX_TOK:
        x3 = x.reshape(n_tok, w.nb, 32)
        if w.small:
            mv.mv_q8_0_serial(w.raw3, x3, out, F16_TABLE, QK)
        else:
            mv.mv_q8_0(w.raw3, x3, out, F16_TABLE, QK)
    elif qtype == QType.F32 and n_tok <= MATVEC_MAX_TOK and half_matvec.fits(w.n_in):
        half_matvec.matvec_f32(w.raw, x, out)
    elif qtype == QType.F32:
        np.matmul(x, w.raw.view(np.float32).T, out=out)
    elif qtype in _HALF and n_tok <= MATVEC_MAX_TOK and half_matvec.fits(w.n_in):
        half_matvec.matvec(w.raw, qtype == QType.BF16, x, out)
    elif qtype in _HALF and half_gemm.takes(qtype == QType.BF16, w.n_in):
        half_gemm.matmul(w.raw, qtype == QType.BF16, x, out)
    elif qtype in _FUSED and n_tok <= MATVEC_MAX_TOK:
        matvec_fused(qtype, w.raw, x, out)
    else:
        matmul_tiled(qtype, w.raw, x, out)
    return out


_F32 = np.dtype(np.float32)
_Q8_0 = QType.Q8_0
_INT8_KIND = {QType.Q5_0: q8_0_int8.Q5_0_KIND, QType.Q4_0: q8_0_int8.Q4_0_KIND, QType.IQ4_NL: q8_0_int8.IQ4_NL_KIND}


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
        mv.mv_iq3_xxs(raw3, x3, out, F16_TABLE, IQ3XXS_GRID, mv.IQ3_SIGNS)
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


def matmul_tiled(qtype, raw, x, out, dq_serial=None):
    """Dequantize row tiles to float32 and multiply them with BLAS. dq_serial(qtype, rows, out): the
    dequantizer for each thread's tiles (default: GGML rows of qtype).

    With n > 1 Numba threads the output rows are split into n contiguous parts, one per thread (the
    caller + a persistent pool): each dequantizes its own tiles (GIL-free serial Numba) into its own
    scratch and multiplies them with a single-threaded BLAS call. One level of threads only: OpenBLAS's
    own pool is set to 1 thread (its busy-waiting workers and Numba's spinning OpenMP workers
    alternating on 2 cores cost 2-10x under load, see perf notes)."""
    n_out = raw.shape[0]
    n_cols = x.shape[1]
    tile = max(16, min(n_out, TILE_BYTES // (4 * n_cols)) // 16 * 16)
    n_par = min(numba.get_num_threads(), max(1, n_out // tile))
    if n_par <= 1:
        _tiles(qtype, raw, x, out, 0, n_out, tile, dq_serial or dequantize_into)
        return
    dq_serial = dq_serial or dequantize_into_serial
    _blas_single_thread()
    bounds = [n_out * i // n_par // 16 * 16 for i in range(n_par)] + [n_out]
    pool = _pool(n_par - 1)
    futs = [pool.submit(_tiles, qtype, raw, x, out, bounds[i], bounds[i + 1], tile, dq_serial)
            for i in range(1, n_par)]
    _tiles(qtype, raw, x, out, bounds[0], bounds[1], tile, dq_serial)
    for f in futs:
        f.result()


def _tiles(qtype, raw, x, out, lo, hi, tile, dq):
    scratch = np.empty((min(tile, hi - lo), x.shape[1]), dtype=np.float32)
    for r0 in range(lo, hi, tile):
        r1 = min(hi, r0 + tile)
        w = scratch[:r1 - r0]
        dq(qtype, raw[r0:r1], w)
        np.matmul(x, w.T, out=out[:, r0:r1])


_POOL = None
_POOL_LOCK = threading.Lock()


def _pool(n_workers):
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < n_workers:
            _POOL = ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="strata-qmatmul")
        return _POOL


_BLAS_DONE = False


def _blas_single_thread():
    """Set numpy's OpenBLAS to 1 thread (once); no-op when it cannot be found."""
    global _BLAS_DONE
    if _BLAS_DONE:
        return
    _BLAS_DONE = True
    libdir = os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "*openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(1))
                return
