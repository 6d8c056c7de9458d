"""Q6_K repacked for the AVX2 int8 kernel (nibble_int8.py, `wide` layout): 4-bit codes, a plane of high bits.

A Q6_K weight is d * sc[i // 16] * (q - 32) with q a 6-bit code split over two bit planes (4 low bits,
2 high bits) and 16 int8 scales per 256 weights; the file's block is ql[128], qh[64], scales[16], d (f16):
210 bytes, 6.56 bits/weight, in ggml's own order. The float kernel (matvec.py) reassembles every code and
converts it to float32. At load each block is rewritten losslessly in the order of the other 4-bit layouts
(216 instead of 210 bytes per 256 weights, 6.75 bits/weight; a decode reads each weight's bytes once):
  [0:128)   low 4 bits: byte 32p + j holds weight 64p + j in its low nibble, 64p + 32 + j in its high one
  [128:192) high 2 bits: byte 128 + 32h + j, for p = 2h + e (e = 0, 1), bits 4e .. 4e + 1 of weight 64p + j
            and bits 4e + 2 .. 4e + 3 of weight 64p + 32 + j
  [192:208) the 16 int8 scales (scale k covers weights 16k .. 16k + 15)
  [208:212) float32 d
  [212:216) int32 C = sum over the 16 groups of scale * (sum of the group's values q - 32)
The kernel ORs the high bits in above the low 4 and subtracts 32 (int8 values -32..31). Activations are
rounded to Q8_K as llama.cpp does for Q6_K.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import nibble_gemm, nibble_int8
from .dequant import f16_at

BLOCK_BYTES = 216
SRC_BLOCK_BYTES = 210
QK = 256
_NO_TABLE = np.zeros(32, dtype=np.int8)


@njit(cache=True, parallel=True)
def _repack(src, dst, dst_f32, dst_i32, f16t):
    # src (n_blocks, 210) Q6_K: ql [0:128), qh [128:192), int8 scales [192:208), d f16 [208:210);
    # dst (n_blocks, 216), dst_f32 / dst_i32 the same bytes (n_blocks, 54)
    for b in prange(src.shape[0]):
        q = np.empty(QK, np.int32)               # the 6-bit codes in weight order
        for n in range(2):                       # two halves of 128 weights, ggml's order
            for l in range(32):
                ql0 = np.int32(src[b, 64 * n + l])
                ql1 = np.int32(src[b, 64 * n + l + 32])
                qh = np.int32(src[b, 128 + 32 * n + l])
                base = 128 * n + l
                q[base] = (ql0 & 15) | ((qh & 3) << 4)
                q[base + 32] = (ql1 & 15) | (((qh >> 2) & 3) << 4)
                q[base + 64] = (ql0 >> 4) | (((qh >> 4) & 3) << 4)
                q[base + 96] = (ql1 >> 4) | (((qh >> 6) & 3) << 4)
        for i in range(128, 192):
            dst[b, i] = 0
        for p in range(4):
            sh = 4 * (p % 2)
            for j in range(32):
                lo, hi = q[64 * p + j], q[64 * p + 32 + j]
                dst[b, 32 * p + j] = np.uint8((lo & 15) | ((hi & 15) << 4))
                dst[b, 128 + 32 * (p // 2) + j] |= np.uint8(((lo >> 4) << sh) | ((hi >> 4) << (sh + 2)))
        c_total = np.int32(0)
        for k in range(16):
            sc = np.int32(np.int8(src[b, 192 + k]))
            dst[b, 192 + k] = src[b, 192 + k]
            s = np.int32(0)
            for i in range(16 * k, 16 * k + 16):
                s += q[i] - 32
            c_total += sc * s
        dst_f32[b, 52] = f16_at(src, b, 208, f16t)
        dst_i32[b, 53] = c_total


def repack(raw: np.ndarray, n_cols: int, f16t) -> np.ndarray:
    """Q6_K rows (uint8 (n_rows, n_cols // 256 * 210)) -> this layout (uint8 (n_rows, n_cols // 256 * 216))."""
    return nibble_int8.repack_rows(raw, n_cols, SRC_BLOCK_BYTES, BLOCK_BYTES, _repack, f16t)


@njit(cache=True)
def _rows(src, src_f32, ids, out):
    # src (n_rows, nb, 216) this layout, src_f32 the same bytes as float32 (n_rows, nb, 54): d at word 52;
    # out (len(ids), nb * 256) float32: (d * float(scale)) * float(q - 32), the file's dequantization
    # (dequant.dq_row_q6_k) operation for operation
    for i in range(ids.shape[0]):
        r = ids[i]
        for b in range(src.shape[1]):
            d = src_f32[r, b, 52]
            for w in range(QK):
                p, j, upper = w // 64, w % 32, (w % 64) // 32
                low = (np.int32(src[r, b, 32 * p + j]) >> (4 * upper)) & 15
                high = (np.int32(src[r, b, 128 + 32 * (p // 2) + j]) >> (4 * (p % 2) + 2 * upper)) & 3
                ds = d * np.float32(np.int8(src[r, b, 192 + w // 16]))
                out[i, b * QK + w] = ds * np.float32((low | (high << 4)) - 32)


def dequantize_rows(raw: np.ndarray, n_cols: int, ids) -> np.ndarray:
    """Rows ids of a matrix in this layout (uint8 (n_rows, n_cols // 256 * 216)) as float32 (len(ids), n_cols):
    the values the file's Q6_K blocks dequantize to, bit for bit (a tied output's token embedding looked up
    from its repacked copy)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= raw.shape[0]):
        raise IndexError(f"row ids outside 0 .. {raw.shape[0] - 1}")
    nb = n_cols // QK
    out = np.empty((ids.size, n_cols), dtype=np.float32)
    n_rows = raw.shape[0]
    _rows(raw.reshape(n_rows, nb, BLOCK_BYTES), raw.view(np.float32).reshape(n_rows, nb, BLOCK_BYTES // 4), ids, out)
    return out


def matvec(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_rows) = x @ W.T; W repacked (n_rows, nb, 216), x float32 (n_tok, nb, 256)."""
    nibble_gemm.multiply(raw3, x3, out, _NO_TABLE, nibble_int8.Q6K)
