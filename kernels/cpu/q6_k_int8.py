"""Q6_K repacked for the AVX2 int8 kernel (nibble_int8.py, `wide` layout): int8 weights, scales per 16.

A Q6_K weight is d * sc[i // 16] * (q - 32) with q a 6-bit code split over two bit planes (4 low bits,
2 high bits) and 16 int8 scales per 256 weights. The float kernel (matvec.py) reassembles every code
and converts it to float32. At load each block is rewritten losslessly with the codes as int8 values
q - 32 (-32..31) in natural order (280 instead of 210 bytes per 256 weights, 8.75 bits/weight):
  [0:256)   int8 q - 32, weight i at byte i
  [256:272) the 16 int8 scales (scale k covers weights 16k .. 16k + 15)
  [272:276) float32 d
  [276:280) int32 C = sum over the 16 groups of scale * (sum of the group's values)
Activations are rounded to Q8_K as llama.cpp does for Q6_K.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import nibble_gemm, nibble_int8
from .dequant import f16_at

BLOCK_BYTES = 280
SRC_BLOCK_BYTES = 210
QK = 256
_NO_TABLE = np.zeros(32, dtype=np.int8)


@njit(cache=True, parallel=True)
def _repack(src, dst, dst_f32, dst_i32, f16t):
    # src (n_blocks, 210) Q6_K: ql [0:128), qh [128:192), int8 scales [192:208), d f16 [208:210);
    # dst (n_blocks, 280), dst_f32 / dst_i32 the same bytes (n_blocks, 70)
    for b in prange(src.shape[0]):
        c_total = np.int32(0)
        for n in range(2):                       # two halves of 128 weights, ggml's order
            for l in range(32):
                ql0 = np.int32(src[b, 64 * n + l])
                ql1 = np.int32(src[b, 64 * n + l + 32])
                qh = np.int32(src[b, 128 + 32 * n + l])
                base = 128 * n + l
                dst[b, base] = np.uint8(((ql0 & 15) | ((qh & 3) << 4)) - 32 & 0xFF)
                dst[b, base + 32] = np.uint8(((ql1 & 15) | (((qh >> 2) & 3) << 4)) - 32 & 0xFF)
                dst[b, base + 64] = np.uint8(((ql0 >> 4) | (((qh >> 4) & 3) << 4)) - 32 & 0xFF)
                dst[b, base + 96] = np.uint8(((ql1 >> 4) | (((qh >> 6) & 3) << 4)) - 32 & 0xFF)
        for k in range(16):
            sc = np.int32(np.int8(src[b, 192 + k]))
            dst[b, 256 + k] = src[b, 192 + k]
            s = np.int32(0)
            for i in range(16 * k, 16 * k + 16):
                s += np.int32(np.int8(dst[b, i]))
            c_total += sc * s
        dst_f32[b, 68] = f16_at(src, b, 208, f16t)
        dst_i32[b, 69] = c_total


def repack(raw: np.ndarray, n_cols: int, f16t) -> np.ndarray:
    """Q6_K rows (uint8 (n_rows, n_cols // 256 * 210)) -> this layout (uint8 (n_rows, n_cols // 256 * 280))."""
    return nibble_int8.repack_rows(raw, n_cols, SRC_BLOCK_BYTES, BLOCK_BYTES, _repack, f16t)


def matvec(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_rows) = x @ W.T; W repacked (n_rows, nb, 280), x float32 (n_tok, nb, 256)."""
    nibble_gemm.multiply(raw3, x3, out, _NO_TABLE, nibble_int8.Q6K)
