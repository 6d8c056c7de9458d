"""IQ3_XXS as 4-bit codes, multiplied in int8 with AVX2 (pshufb + pmaddubsw + pmaddwd).

Every IQ3_XXS weight is d * (2 ls + 1) / 4 * (+-g) with g one of 8 grid levels {4, 12, .., 52, 62}: a
sign and a 3-bit level index, i.e. exactly a 4-bit code. The file's 3.06 bits/weight come from the
256-entry grid (4 weights per byte) and 7-bit sign groups, which x86 can only decode with table
look-ups per 4 weights: the float kernel in matvec.py spends ~2 µops per weight on it and is µop-bound
(IQ3_XXS 1.5B decode 10.5 tok/s on 2 Zen 4 cores, llama.cpp's AVX2 kernel 10.0). Repacked once at
load to 4-bit codes, 32 weights decode with one pshufb from a 16-entry int8 table and multiply-add
against int8 activations with pmaddubsw/pmaddwd: ~0.25 µops per weight. The price is memory:
4.5 bits/weight instead of 3.06 (the 1.5B model's matrices: 591 -> 868 MB), which the decode streams
once per token.

Block layout (144 bytes per 256 weights, little-endian):
  [0:128)   codes: byte 32p + j holds weight 64p + j in its low nibble and 64p + 32 + j in its high
            nibble (p = 0..3); code = level index | sign << 3, value IQ3_CODE_VALUES[code]
  [128:136) the 8 sub-block scales 2 ls + 1 (uint8, 1..31)
  [136:140) float32 d / 4
  [140:144) int32 C = sum over sub-blocks of scale * (sum of the sub-block's signed values)
Weight i of block b dequantizes to (d / 4) * scale[i // 32] * value[code_i], the same value the file
holds (rounding of the float32 scale product aside).

The kernel (nibble_int8.py, shared with Q4_K) looks the codes up with one pshufb per 32 weights and
multiplies them with pmaddubsw/pmaddwd against Q8_K-rounded activations.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import nibble_gemm, nibble_int8
from .dequant import IQ2_KSIGNS, IQ3XXS_GRID, f16_at

BLOCK_BYTES = 144
SRC_BLOCK_BYTES = 98
QK = 256
IQ3_LEVELS = np.array([4, 12, 20, 28, 36, 44, 52, 62], dtype=np.int8)
IQ3_CODE_VALUES = np.concatenate([IQ3_LEVELS, -IQ3_LEVELS]).astype(np.int8)   # code -> signed value
# grid byte -> level index (the grid only uses the 8 levels)
_LEVEL_OF = np.full(256, 255, dtype=np.uint8)
_LEVEL_OF[IQ3_LEVELS.astype(np.uint8)] = np.arange(8, dtype=np.uint8)
_GRID_U8 = np.ascontiguousarray(IQ3XXS_GRID.astype(np.uint8))                  # (256, 4)
assert np.all(_LEVEL_OF[_GRID_U8] != 255)


# ------------------------------------------------------------------------------------------ layout

@njit(cache=True, parallel=True)
def _repack(src, dst, dst_f32, dst_i32, f16t, grid, ksigns, level_of):
    # src (n_blocks, 98) IQ3_XXS: d f16 [0:2], grid indices [2:66], 8 x u32 [66:98] = 4 sign indices
    # of 7 bits + a 4-bit scale; dst (n_blocks, 144), dst_f32 / dst_i32 the same bytes (n_blocks, 36)
    for b in prange(src.shape[0]):
        c_total = np.int32(0)
        for ib in range(8):
            p = 66 + 4 * ib
            aux = (np.uint32(src[b, p]) | (np.uint32(src[b, p + 1]) << 8) | (np.uint32(src[b, p + 2]) << 16)
                   | (np.uint32(src[b, p + 3]) << 24))
            scale = np.int32(2 * (aux >> 28) + 1)
            dst[b, 128 + ib] = np.uint8(scale)
            wsum = np.int32(0)
            pair, half = ib // 2, ib % 2
            for l in range(4):
                signs = ksigns[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                for k in range(8):
                    g = grid[src[b, 2 + 8 * ib + 2 * l + k // 4], k % 4]
                    neg = (signs >> k) & 1
                    code = level_of[g] | (neg << 3)
                    wsum += -np.int32(g) if neg else np.int32(g)
                    o = 32 * pair + 8 * l + k
                    if half == 0:
                        dst[b, o] = (dst[b, o] & np.uint8(0xF0)) | np.uint8(code)
                    else:
                        dst[b, o] = (dst[b, o] & np.uint8(0x0F)) | np.uint8(code << 4)
            c_total += scale * wsum
        dst_f32[b, 34] = f16_at(src, b, 0, f16t) * np.float32(0.25)
        dst_i32[b, 35] = c_total


def repack(raw: np.ndarray, n_cols: int, f16t) -> np.ndarray:
    """IQ3_XXS rows (uint8 (n_rows, n_cols // 256 * 98)) -> this layout (uint8 (n_rows, n_cols // 256 * 144))."""
    return nibble_int8.repack_rows(raw, n_cols, SRC_BLOCK_BYTES, BLOCK_BYTES, _repack, f16t, _GRID_U8, IQ2_KSIGNS,
                                   _LEVEL_OF)


CODE_TABLE = np.concatenate([IQ3_CODE_VALUES, IQ3_CODE_VALUES])      # one copy per 128-bit lane


def matvec(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_rows) = x @ W.T; W repacked (n_rows, nb, 144), x float32 (n_tok, nb, 256)."""
    nibble_gemm.multiply(raw3, x3, out, CODE_TABLE, nibble_int8.IQ3)
