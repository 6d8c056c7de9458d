"""Q4_K repacked for the AVX2 int8 kernel (nibble_int8.py): unpacked scales, multiplied with pmaddubsw.

A Q4_K weight is d * sc[s] * q - dmin * m[s] with q a 4-bit code and 6-bit (sc, m) per 32-weight
sub-block, packed 12 bytes per 256 weights. The float kernel (matvec.py) unpacks the scales and
converts every code to float32 (~3.5 GB/s per thread on the 0.5B model's ffn_down); the codes are
already unsigned bytes pmaddubsw can multiply against int8 activations, 32 at a time. At load each
block is rewritten losslessly with the scales unpacked (160 instead of 144 bytes per 256 weights,
5 bits/weight), in nibble_int8.py's layout:
  [0:128)   the file's codes (same nibble order)
  [128:136) sc (uint8, 0..63)        [136:140) float32 d
  [140:144) int32 C = sum over sub-blocks of sc * (sum of the sub-block's codes)
  [144:152) m (uint8, 0..63)         [152:156) float32 dmin        [156:160) zero
Activations are rounded to Q8_K as llama.cpp does for Q4_K; the mins need the activation sum of
each 32-weight sub-block (llama.cpp's Q8_K keeps sums of 16).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import nibble_gemm, nibble_int8
from .dequant import f16_at, k_scale_min

BLOCK_BYTES = 160
SRC_BLOCK_BYTES = 144
QK = 256
_NO_TABLE = np.zeros(32, dtype=np.int8)


@njit(cache=True, parallel=True)
def _repack(src, dst, dst_f32, dst_i32, f16t):
    # src (n_blocks, 144) Q4_K: d, dmin f16 [0:4], scales [4:16], codes [16:144]; dst (n_blocks, 160),
    # dst_f32 / dst_i32 the same bytes (n_blocks, 40)
    for b in prange(src.shape[0]):
        for i in range(128):
            dst[b, i] = src[b, 16 + i]
        c_total = np.int32(0)
        for s in range(8):
            sc, m = k_scale_min(src, b, s)
            dst[b, 128 + s] = np.uint8(sc)
            dst[b, 144 + s] = np.uint8(m)
            shift = 4 * (s % 2)
            qsum = 0
            for j in range(32):
                qsum += (np.int32(src[b, 16 + 32 * (s // 2) + j]) >> shift) & 15
            c_total += np.int32(sc) * qsum
        dst_f32[b, 34] = f16_at(src, b, 0, f16t)
        dst_i32[b, 35] = c_total
        dst_f32[b, 38] = f16_at(src, b, 2, f16t)


def repack(raw: np.ndarray, n_cols: int, f16t) -> np.ndarray:
    """Q4_K rows (uint8 (n_rows, n_cols // 256 * 144)) -> this layout (uint8 (n_rows, n_cols // 256 * 160))."""
    return nibble_int8.repack_rows(raw, n_cols, SRC_BLOCK_BYTES, BLOCK_BYTES, _repack, f16t)


def matvec(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_rows) = x @ W.T; W repacked (n_rows, nb, 160), x float32 (n_tok, nb, 256)."""
    nibble_gemm.multiply(raw3, x3, out, _NO_TABLE, nibble_int8.Q4K)
