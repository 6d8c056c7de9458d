"""Q5_K repacked for the AVX2 int8 kernel (nibble_int8.py): Q4_K's layout with the fifth bits' plane.

A Q5_K weight is d * sc[s] * q - dmin * m[s] with q a 5-bit code (4 low bits in ql, the fifth in qh) and
6-bit (sc, m) per 32-weight sub-block, packed 12 bytes per 256 weights; the file's block is d, dmin (f16),
scales[12], qh[32], ql[128] (176 bytes, 5.5 bits/weight). The float kernel (matvec.py) reassembles every
code and converts it to float32. At load each block is rewritten losslessly with the scales unpacked (192
instead of 176 bytes per 256 weights, 6 bits/weight):
  [0:128)   the file's low 4 bits (ql, the same nibble order as Q4_K's codes)
  [128:160) the file's qh: bit 2p of byte j is weight 64p + j's fifth bit, bit 2p + 1 weight 64p + 32 + j's
  [160:168) sc (uint8, 0..63)        [168:172) float32 d
  [172:176) int32 C = sum over sub-blocks of sc * (sum of the sub-block's 5-bit codes)
  [176:184) m (uint8, 0..63)         [184:188) float32 dmin        [188:192) zero
The kernel ORs each fifth bit into its code (0..31) and multiplies with pmaddubsw as for Q4_K. Activations
are rounded to Q8_K as llama.cpp does for Q5_K; the mins need each sub-block's activation sum.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import nibble_gemm, nibble_int8
from .dequant import f16_at, k_scale_min

BLOCK_BYTES = 192
SRC_BLOCK_BYTES = 176
QK = 256
_NO_TABLE = np.zeros(32, dtype=np.int8)


@njit(cache=True, parallel=True)
def _repack(src, dst, dst_f32, dst_i32, f16t):
    # src (n_blocks, 176) Q5_K: d, dmin f16 [0:4], scales [4:16], qh [16:48], ql [48:176]; dst (n_blocks, 192),
    # dst_f32 / dst_i32 the same bytes (n_blocks, 48)
    for b in prange(src.shape[0]):
        for i in range(128):
            dst[b, i] = src[b, 48 + i]
        for i in range(32):
            dst[b, 128 + i] = src[b, 16 + i]
        c_total = np.int32(0)
        for s in range(8):
            sc, m = k_scale_min(src, b, s)
            dst[b, 160 + s] = np.uint8(sc)
            dst[b, 176 + s] = np.uint8(m)
            shift = 4 * (s % 2)
            qsum = 0
            for j in range(32):
                low = (np.int32(src[b, 48 + 32 * (s // 2) + j]) >> shift) & 15
                qsum += low | (((np.int32(src[b, 16 + j]) >> s) & 1) << 4)
            c_total += np.int32(sc) * qsum
        dst_f32[b, 42] = f16_at(src, b, 0, f16t)
        dst_i32[b, 43] = c_total
        dst_f32[b, 46] = f16_at(src, b, 2, f16t)


def repack(raw: np.ndarray, n_cols: int, f16t) -> np.ndarray:
    """Q5_K rows (uint8 (n_rows, n_cols // 256 * 176)) -> this layout (uint8 (n_rows, n_cols // 256 * 192))."""
    return nibble_int8.repack_rows(raw, n_cols, SRC_BLOCK_BYTES, BLOCK_BYTES, _repack, f16t)


def matvec(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_rows) = x @ W.T; W repacked (n_rows, nb, 192), x float32 (n_tok, nb, 256)."""
    nibble_gemm.multiply(raw3, x3, out, _NO_TABLE, nibble_int8.Q5K)
