"""Numba dequantizers for GGML block formats: rows of raw GGUF blocks -> float32.

Results are bit-exact against ``gguf.quants.dequantize``: the float operations are done in float32 in
the same order as gguf does them, and no fastmath (so no FMA contraction) is used here.

Kernel layout: the raw rows (n_rows, row_nbytes) are viewed as (n_rows, n_blocks, block_nbytes) so
that every byte index is (row, block, offset) with small non-negative offsets. Inner loops take their
trip count (``bs`` = 32 or 16) as a runtime argument: a constant trip count makes LLVM fully unroll
the inner loop and then vectorize the *block* loop (gathers); a runtime count keeps the inner loop a
contiguous, vectorized loop (checked in the assembly: vpmovzxbd / vcvtdq2ps / vmulps).
"""
import numpy as np
from numba import njit, prange
from gguf import GGMLQuantizationType as QType
from gguf import quants as _gq

from ..qtypes import block_geometry, check_supported, row_nbytes
from . import half_matvec

# float16 bit pattern -> float32 value, exact for every pattern (NaN payloads included)
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
IQ4NL_VALUES = np.array(_gq.IQ4_NL.kvalues, dtype=np.float32)
_gq.IQ3_XXS.init_grid()
IQ3XXS_GRID = np.ascontiguousarray(_gq.IQ3_XXS.grid.reshape(256, 4).astype(np.float32))
IQ2_KSIGNS = np.frombuffer(_gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()   # 128 sign bytes
# IQ3XXS_SIGNED_GRID[(g << 4) | m] = grid row g with value k negated where bit k of the 4-bit sign mask m is
# set (flat, row i at 4*i): one table row per 4 weights, no sign branches. Negation is exact, so
# db * row == db * grid * sign bit for bit.
_NEG4 = np.where((np.arange(16)[:, None] >> np.arange(4)) & 1, -1.0, 1.0)
IQ3XXS_SIGNED_GRID = (IQ3XXS_GRID[:, None, :] * _NEG4).astype(np.float32).reshape(-1)
# IQ2_SIGN_MASKS[i, k] = float32 sign bit of weight k of a group of 8 with sign index i (matvec xors it in)
IQ2_SIGN_MASKS = np.where((IQ2_KSIGNS[:, None] >> np.arange(8)) & 1, 1 << 31, 0).astype(np.uint32)

U32 = np.uint32   # narrow index arithmetic (no int64 promotion, no negative-index wraparound)

# Inner trip counts are passed from Python at run time (not literals in the drivers): a constant would
# be propagated by LLVM, the inner loop fully unrolled and vectorization lost (see module docstring).
QK = 32
QK_HALF = 16


@njit(inline="always")
def f16_at(blk, b, o, f16t):
    """float16 stored little-endian at blk[b, o:o+2] -> float32."""
    return f16t[np.int64(blk[b, o]) | (np.int64(blk[b, o + 1]) << 8)]


@njit(inline="always")
def k_scale_min(blk, b, j):
    """6-bit (scale, min) of sub-block j (0..7) of a Q4_K/Q5_K block; 12 scale bytes at offset 4."""
    if j < 4:
        sc = np.int64(blk[b, 4 + j]) & 63
        m = np.int64(blk[b, 8 + j]) & 63
    else:
        sc = (np.int64(blk[b, 12 + j - 4]) & 15) | ((np.int64(blk[b, 4 + j - 4]) >> 6) << 4)
        m = (np.int64(blk[b, 12 + j - 4]) >> 4) | ((np.int64(blk[b, 8 + j - 4]) >> 6) << 4)
    return sc, m


# ---------------------------------------------------------------------------------------- per row
# blk: (n_blocks, block_nbytes) uint8 ; o: (n_blocks * block_size,) float32 output row

@njit(cache=True)
def dq_row_q8_0(blk, o, f16t, bs):
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 0, f16t)
        base = b * 32
        for j in range(bs):
            o[base + j] = np.float32(np.int8(blk[b, 2 + j])) * d


@njit(cache=True)
def dq_row_q4_0(blk, o, f16t, hb):
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 0, f16t)
        base = b * 32
        for j in range(hb):
            v = np.int64(blk[b, 2 + j])
            o[base + j] = d * np.float32((v & 15) - 8)
            o[base + 16 + j] = d * np.float32((v >> 4) - 8)


@njit(cache=True)
def dq_row_iq4_nl(blk, o, f16t, kv, hb):
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 0, f16t)
        base = b * 32
        for j in range(hb):
            v = np.int64(blk[b, 2 + j])
            o[base + j] = d * kv[v & 15]
            o[base + 16 + j] = d * kv[v >> 4]


@njit(cache=True)
def dq_row_q5_0(blk, o, f16t, hb):
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 0, f16t)
        qh = (np.int64(blk[b, 2]) | (np.int64(blk[b, 3]) << 8) | (np.int64(blk[b, 4]) << 16)
              | (np.int64(blk[b, 5]) << 24))
        base = b * 32
        for j in range(hb):
            v = np.int64(blk[b, 6 + j])
            lo = (v & 15) | (((qh >> j) & 1) << 4)
            hi = (v >> 4) | (((qh >> (j + 16)) & 1) << 4)
            o[base + j] = d * np.float32(lo - 16)
            o[base + 16 + j] = d * np.float32(hi - 16)


@njit(cache=True)
def dq_row_q4_k(blk, o, f16t, bs):
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 0, f16t)
        dmin = f16_at(blk, b, 2, f16t)
        for jj in range(4):
            sc0, m0 = k_scale_min(blk, b, 2 * jj)
            sc1, m1 = k_scale_min(blk, b, 2 * jj + 1)
            d0 = d * np.float32(sc0)
            dm0 = dmin * np.float32(m0)
            d1 = d * np.float32(sc1)
            dm1 = dmin * np.float32(m1)
            base = b * 256 + jj * 64
            for j in range(bs):
                v = np.int64(blk[b, 16 + 32 * jj + j])
                o[base + j] = d0 * np.float32(v & 15) - dm0
                o[base + 32 + j] = d1 * np.float32(v >> 4) - dm1


@njit(cache=True)
def dq_row_q5_k(blk, o, f16t, bs):
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 0, f16t)
        dmin = f16_at(blk, b, 2, f16t)
        for jj in range(4):
            sc0, m0 = k_scale_min(blk, b, 2 * jj)
            sc1, m1 = k_scale_min(blk, b, 2 * jj + 1)
            d0 = d * np.float32(sc0)
            dm0 = dmin * np.float32(m0)
            d1 = d * np.float32(sc1)
            dm1 = dmin * np.float32(m1)
            base = b * 256 + jj * 64
            for j in range(bs):
                v = np.int64(blk[b, 48 + 32 * jj + j])
                h = np.int64(blk[b, 16 + j]) >> (2 * jj)
                o[base + j] = d0 * np.float32((v & 15) | ((h & 1) << 4)) - dm0
                o[base + 32 + j] = d1 * np.float32((v >> 4) | ((h & 2) << 3)) - dm1


@njit(cache=True)
def dq_row_q6_k(blk, o, f16t, hb):
    # bytes: ql[0:128] qh[128:192] scales(int8)[192:208] d[208:210]
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 208, f16t)
        for n in range(2):
            for c in range(4):                      # chunk 4n+c of 32 values
                sh_l = 4 * (c >> 1)
                off_l = 64 * n + 32 * (c & 1)
                for half in range(2):
                    ds = d * np.float32(np.int8(blk[b, 192 + 8 * n + 2 * c + half]))
                    base = b * 256 + 32 * (4 * n + c) + 16 * half
                    for k in range(hb):
                        kk = 16 * half + k
                        ql = (np.int64(blk[b, off_l + kk]) >> sh_l) & 15
                        qh = (np.int64(blk[b, 128 + 32 * n + kk]) >> (2 * c)) & 3
                        o[base + k] = ds * np.float32((ql | (qh << 4)) - 32)


@njit(cache=True)
def dq_row_iq3_xxs(blk, o, f16t, sgrid, ksigns, bs):
    # bytes: d[0:2] qs(grid idx)[2:66] scales_and_signs(u32 x8)[66:98]. Two passes per block: copy the
    # signed grid rows (loads grouped before stores so LLVM merges each 4-float copy into one 16-byte
    # move), then scale every 32-weight sub-block in a vectorized loop over the freshly written values.
    for b in range(blk.shape[0]):
        for ib in range(8):
            p = 66 + 4 * ib
            aux = (U32(blk[b, p]) | (U32(blk[b, p + 1]) << 8) | (U32(blk[b, p + 2]) << 16)
                   | (U32(blk[b, p + 3]) << 24))
            for l in range(4):
                m = U32(ksigns[(aux >> U32(7 * l)) & U32(127)])
                i0 = (U32(blk[b, 2 + 8 * ib + 2 * l]) << 6) | ((m & U32(15)) << 2)
                i1 = (U32(blk[b, 3 + 8 * ib + 2 * l]) << 6) | ((m >> 4) << 2)
                v0, v1, v2, v3 = sgrid[i0], sgrid[i0 + 1], sgrid[i0 + 2], sgrid[i0 + 3]
                v4, v5, v6, v7 = sgrid[i1], sgrid[i1 + 1], sgrid[i1 + 2], sgrid[i1 + 3]
                j = b * 256 + 32 * ib + 8 * l
                o[j], o[j + 1], o[j + 2], o[j + 3] = v0, v1, v2, v3
                o[j + 4], o[j + 5], o[j + 6], o[j + 7] = v4, v5, v6, v7
        d = f16_at(blk, b, 0, f16t)
        for ib in range(8):
            db = d * (np.float32(0.5) + np.float32(blk[b, 69 + 4 * ib] >> 4)) * np.float32(0.5)
            base = b * 256 + 32 * ib
            for j in range(bs):
                o[base + j] = db * o[base + j]


# ------------------------------------------------------------------------------ parallel drivers

@njit(cache=True, parallel=True)
def _dq_q8_0(raw3, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        dq_row_q8_0(raw3[r], out[r], f16t, bs)


@njit(cache=True, parallel=True)
def _dq_q4_0(raw3, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        dq_row_q4_0(raw3[r], out[r], f16t, bs)


@njit(cache=True, parallel=True)
def _dq_iq4_nl(raw3, out, f16t, kv, bs):
    for r in prange(raw3.shape[0]):
        dq_row_iq4_nl(raw3[r], out[r], f16t, kv, bs)


@njit(cache=True, parallel=True)
def _dq_q5_0(raw3, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        dq_row_q5_0(raw3[r], out[r], f16t, bs)


@njit(cache=True, parallel=True)
def _dq_q4_k(raw3, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        dq_row_q4_k(raw3[r], out[r], f16t, bs)


@njit(cache=True, parallel=True)
def _dq_q5_k(raw3, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        dq_row_q5_k(raw3[r], out[r], f16t, bs)


@njit(cache=True, parallel=True)
def _dq_q6_k(raw3, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        dq_row_q6_k(raw3[r], out[r], f16t, bs)


@njit(cache=True, parallel=True)
def _dq_iq3_xxs(raw3, out, f16t, sgrid, ksigns, bs):
    for r in prange(raw3.shape[0]):
        dq_row_iq3_xxs(raw3[r], out[r], f16t, sgrid, ksigns, bs)


# Serial, GIL-free driver: the prompt path (qmatmul.matmul_tiled) runs one per worker thread, each
# dequantizing its own row tiles next to a single-threaded BLAS call (no nested thread pools).
_SERIAL_CODE = {QType.Q8_0: 0, QType.Q4_0: 1, QType.Q5_0: 2, QType.IQ4_NL: 3, QType.Q4_K: 4,
                QType.Q5_K: 5, QType.Q6_K: 6, QType.IQ3_XXS: 7}


@njit(cache=True, nogil=True)
def _dq_serial(code, raw3, out, f16t, kv, sgrid, ksigns, bs, hb):
    for r in range(raw3.shape[0]):
        if code == 0:
            dq_row_q8_0(raw3[r], out[r], f16t, bs)
        elif code == 1:
            dq_row_q4_0(raw3[r], out[r], f16t, hb)
        elif code == 2:
            dq_row_q5_0(raw3[r], out[r], f16t, hb)
        elif code == 3:
            dq_row_iq4_nl(raw3[r], out[r], f16t, kv, hb)
        elif code == 4:
            dq_row_q4_k(raw3[r], out[r], f16t, bs)
        elif code == 5:
            dq_row_q5_k(raw3[r], out[r], f16t, bs)
        elif code == 6:
            dq_row_q6_k(raw3[r], out[r], f16t, hb)
        else:
            dq_row_iq3_xxs(raw3[r], out[r], f16t, sgrid, ksigns, bs)


def dequantize_into_serial(qtype: QType, raw: np.ndarray, out: np.ndarray) -> None:
    """dequantize_into on the calling thread only, releasing the GIL (same results, bit-exact)."""
    code = _SERIAL_CODE.get(qtype)
    if code is None:
        dequantize_into(qtype, raw, out)      # float types: numpy copies
        return
    _, bsize = block_geometry(qtype)
    _dq_serial(code, raw.reshape(raw.shape[0], -1, bsize), out, F16_TABLE, IQ4NL_VALUES, IQ3XXS_SIGNED_GRID,
               IQ2_KSIGNS, QK, QK_HALF)


def check_raw(qtype, raw: np.ndarray, n_cols: int):
    """Validate raw rows; returns (QType, C-contiguous uint8 2-D array)."""
    qtype = check_supported(qtype)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"raw must be a 2-D uint8 array, got {getattr(raw, 'dtype', type(raw))} "
                         f"with shape {getattr(raw, 'shape', None)}")
    nbytes = row_nbytes(qtype, n_cols)
    if raw.shape[1] != nbytes:
        raise ValueError(f"{qtype.name} rows of {n_cols} weights take {nbytes} bytes, raw has {raw.shape[1]}")
    if not raw.flags.c_contiguous:
        raw = np.ascontiguousarray(raw)
    return qtype, raw


def dequantize_into(qtype: QType, raw: np.ndarray, out: np.ndarray) -> None:
    """Kernel dispatch without checks: raw C-contiguous uint8 (n, row_nbytes), out float32 (n, n_cols) C."""
    if qtype == QType.F32:
        out[...] = raw.view(np.float32)
        return
    if qtype in (QType.F16, QType.BF16):
        if half_matvec.fits(out.shape[1]) and out.flags.c_contiguous:
            half_matvec.to_f32(raw, qtype == QType.BF16, out)
        elif qtype == QType.F16:
            out[...] = raw.view(np.float16)
        else:
            out.view(np.uint32)[...] = raw.view(np.uint16).astype(np.uint32) << 16
        return
    _, bsize = block_geometry(qtype)
    raw3 = raw.reshape(raw.shape[0], -1, bsize)
    if qtype == QType.Q8_0:
        _dq_q8_0(raw3, out, F16_TABLE, QK)
    elif qtype == QType.Q4_0:
        _dq_q4_0(raw3, out, F16_TABLE, QK_HALF)
    elif qtype == QType.Q5_0:
        _dq_q5_0(raw3, out, F16_TABLE, QK_HALF)
    elif qtype == QType.IQ4_NL:
        _dq_iq4_nl(raw3, out, F16_TABLE, IQ4NL_VALUES, QK_HALF)
    elif qtype == QType.Q4_K:
        _dq_q4_k(raw3, out, F16_TABLE, QK)
    elif qtype == QType.Q5_K:
        _dq_q5_k(raw3, out, F16_TABLE, QK)
    elif qtype == QType.Q6_K:
        _dq_q6_k(raw3, out, F16_TABLE, QK_HALF)
    elif qtype == QType.IQ3_XXS:
        _dq_iq3_xxs(raw3, out, F16_TABLE, IQ3XXS_SIGNED_GRID, IQ2_KSIGNS, QK)
    else:  # pragma: no cover - check_supported guards this
        raise AssertionError(qtype)


def dequantize(qtype, raw: np.ndarray, n_cols: int, serial: bool = False) -> np.ndarray:
    """Rows of GGML blocks (uint8 (n_rows, row_nbytes)) -> float32 (n_rows, n_cols), bit-exact vs gguf;
    serial: on the calling thread (dequantize_into_serial: the same values)."""
    qtype, raw = check_raw(qtype, raw, n_cols)
    out = np.empty((raw.shape[0], n_cols), dtype=np.float32)
    (dequantize_into_serial if serial else dequantize_into)(qtype, raw, out)
    return out
