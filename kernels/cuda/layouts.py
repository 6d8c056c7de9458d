"""Device layouts of the weight types: how a GGUF row is laid out on the GPU, and the lossless conversions.

A GGUF block puts its fields at 2-byte offsets (Q8_0 34 bytes: d, 32 quants; Q4_0 and IQ4_NL 18: d, 16 nibble
bytes; Q5_0 22: d, 4 bytes of fifth bits, 16 nibble bytes; Q6_K 210), so in a row of them the kernels read each
field as 4-byte words stitched by funnel shifts. On the device these types' rows are planes instead, one per
field, each naturally aligned (nb = blocks per row), then zeros up to a multiple of 16 bytes
(`device_row_bytes`), so every row and plane starts 16-byte aligned:

    Q8_0     qs nb * 32 | d nb * 2                          (block u's field at u * its size in its plane)
    Q4_0     qs nb * 16 | d nb * 2
    IQ4_NL   qs nb * 16 | d nb * 2
    Q5_0     qs nb * 16 | qh nb * 4 | d nb * 2

IQ3_XXS (98 bytes: d, 64 grid indices, 32 bytes of signs and scales) takes the same planes per group of 8
blocks instead of per row, so a row's blocks stay together (784 bytes a group, 16-byte aligned; a last
group of r < 8 blocks has r-block planes):

    IQ3_XXS  per group: qs 8 * 64 | signs and scales 8 * 32 | d 8 * 2

Q6_K (ql 128 bytes, qh 64, scales 16, d 2) also puts a 32-weight unit's low nibbles in two 32-byte runs and its
top bits in 2-bit fields shared with three other units, so a unit's weights match activations from four
places. Its planes are reordered so that unit u covers the row's weights 32u .. 32u + 31:

    lo  nb * 128 bytes: unit u's 16 bytes at 16u; byte i = low nibble of weight 32u + i (bits 0-3) and of
        weight 32u + 16 + i (bits 4-7)
    hi  nb * 64 bytes: unit u's 8 bytes at 8u; byte 4h + b holds the top 2 bits of weight 32u + 16h + 4w + b
        at bits 2w, 2w + 1 (w = 0..3), so (word h >> 2w) & 0x03030303 are the top bits of 4 consecutive weights
    sc  nb * 16 int8: the scale of weights 16s .. 16s + 15 at s (the file's order)
    d   nb * 2 bytes: each block's f16 d (the file's order)

Every other type keeps the file's blocks (Q4_K and Q5_K blocks are 16-byte multiples). The same bytes as the
file's, plus at most 14 a row; qmatmul_types.cuh decodes them. Q8_0 in planes per group of 32 blocks (each
block's two 16-quant halves in planes of their own) measured slower than per row (perf/kernel_notes.md).
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from ..qtypes import row_nbytes

Q6_K_BLOCK = 210            # bytes per 256 weights in the file
_ROW_ALIGN = 16
# the 32-weight block types' fields as (offset, bytes) in a file block, in their plane order on the device
PLANES = {QType.Q8_0: ((2, 32), (0, 2)), QType.Q4_0: ((2, 16), (0, 2)), QType.IQ4_NL: ((2, 16), (0, 2)),
          QType.Q5_0: ((6, 16), (2, 4), (0, 2)), QType.IQ3_XXS: ((2, 64), (66, 32), (0, 2))}
GROUP_BLOCKS = {QType.IQ3_XXS: 8}   # types whose planes are per group of that many blocks (else per row)


def repacked(qtype) -> bool:
    """Whether the device holds this type in a layout of its own (not the file's blocks)."""
    qtype = QType(int(qtype))
    return qtype == QType.Q6_K or qtype in PLANES


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ROW_ALIGN) * _ROW_ALIGN


def device_row_bytes(qtype, n_in: int) -> int:
    """Bytes of one row on the device (the row pitch every kernel is given)."""
    nbytes = row_nbytes(qtype, n_in)
    return _padded(nbytes) if repacked(qtype) else nbytes


def _groups(qtype, nb: int) -> list[tuple[int, int]]:
    """(first block, blocks) of each group of a row of nb blocks: the whole row, or GROUP_BLOCKS[qtype] at a time."""
    g = GROUP_BLOCKS.get(qtype, nb) or 1
    return [(b0, min(g, nb - b0)) for b0 in range(0, nb, g)]


def _planes_to_device(qtype, raw, xp):
    n_out = raw.shape[0]
    fields = PLANES[qtype]
    block = sum(size for _, size in fields)
    b = raw.reshape(n_out, -1, block)
    return xp.concatenate([b[:, b0:b0 + n, off:off + size].reshape(n_out, -1)
                           for b0, n in _groups(qtype, b.shape[1]) for off, size in fields], axis=1)


def _planes_from_device(qtype, dev, n_in: int, xp):
    n_out, nb = dev.shape[0], n_in // GGML_QUANT_SIZES[qtype][0]
    fields = PLANES[qtype]
    block = sum(size for _, size in fields)
    out = xp.empty((n_out, nb, block), dtype=xp.uint8)
    start = 0
    for b0, n in _groups(qtype, nb):
        for off, size in fields:
            out[:, b0:b0 + n, off:off + size] = dev[:, start:start + n * size].reshape(n_out, n, size)
            start += n * size
    return out.reshape(n_out, nb * block)


def _q6_k_codes(raw, xp):
    """(n_out, nb * 210) file bytes -> (n_out, nb, 256) uint8 codes 0..63 (weight = d * scale * (code - 32)),
    in row order: weight 128n + 32c + l has low nibble ql[64n + 32(c & 1) + l] >> 4(c >> 1), top bits
    qh[32n + l] >> 2c (ggml's dequantize_row_q6_K)."""
    n_out = raw.shape[0]
    b = raw.reshape(n_out, -1, Q6_K_BLOCK)
    ql = b[..., :128].reshape(n_out, -1, 2, 2, 32)              # [n][c & 1][l]
    qh = b[..., 128:192].reshape(n_out, -1, 2, 1, 32)           # [n][.][l]
    lo = xp.concatenate([ql & 15, ql >> 4], axis=3)             # [n][c][l], c = 2 (c >> 1) + (c & 1)
    hi = (qh >> (2 * xp.arange(4, dtype=xp.uint8)).reshape(1, 1, 1, 4, 1)) & 3
    return (lo | (hi << 4)).reshape(n_out, -1, 256)


def _q6_k_to_device(raw, xp):
    n_out, nbytes = raw.shape
    nb = nbytes // Q6_K_BLOCK
    q = _q6_k_codes(raw, xp).reshape(n_out, nb * 8, 32)        # [unit][weight]
    lo = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)         # (n_out, units, 16)
    top = (q >> 4).reshape(n_out, nb * 8, 2, 4, 4)              # [unit][h][w][b]
    hi = xp.zeros((n_out, nb * 8, 2, 4), dtype=xp.uint8)
    for w in range(4):
        hi |= top[:, :, :, w, :] << (2 * w)
    b = raw.reshape(n_out, nb, Q6_K_BLOCK)
    return xp.concatenate([lo.reshape(n_out, -1), hi.reshape(n_out, -1), b[..., 192:208].reshape(n_out, -1),
                           b[..., 208:210].reshape(n_out, -1)], axis=1)


def _q6_k_from_device(dev, n_in: int, xp):
    n_out = dev.shape[0]
    nb = n_in // 256
    lo = dev[:, :128 * nb].reshape(n_out, nb * 8, 16)
    hi = dev[:, 128 * nb:192 * nb].reshape(n_out, nb * 8, 2, 1, 4)
    top = (hi >> (2 * xp.arange(4, dtype=xp.uint8)).reshape(1, 1, 1, 4, 1)) & 3   # [unit][h][w][b]
    q = xp.concatenate([lo & 15, lo >> 4], axis=2) | (top.reshape(n_out, nb * 8, 32) << 4)
    q = q.reshape(n_out, nb, 2, 4, 32)                          # [n][c][l]
    ql = (q[:, :, :, :2, :] & 15) | ((q[:, :, :, 2:, :] & 15) << 4)            # [n][c & 1][l]
    qh = xp.zeros((n_out, nb, 2, 32), dtype=xp.uint8)
    for c in range(4):
        qh |= (q[:, :, :, c, :] >> 4) << (2 * c)
    return xp.ascontiguousarray(xp.concatenate(
        [ql.reshape(n_out, nb, 128), qh.reshape(n_out, nb, 64),
         dev[:, 192 * nb:208 * nb].reshape(n_out, nb, 16), dev[:, 208 * nb:210 * nb].reshape(n_out, nb, 2)],
        axis=2).reshape(n_out, nb * Q6_K_BLOCK))


CHUNK_BYTES = 8 << 20       # file bytes converted at a time (bounds the conversion's temporaries: ~10x that)


def to_device(qtype, raw, xp=np):
    """The file's rows (n_out, row_nbytes) uint8, a numpy array (a memmap is fine) -> the device layout
    (n_out, device_row_bytes) as an xp array (numpy, or cupy: rows are copied and converted a chunk of
    CHUNK_BYTES at a time, so the device holds little more than the result)."""
    qtype = QType(int(qtype))
    if not repacked(qtype):
        return xp.asarray(np.ascontiguousarray(raw))
    n_out, nbytes = raw.shape
    out = xp.zeros((n_out, _padded(nbytes)), dtype=xp.uint8)       # the padding stays zeros
    step = max(1, CHUNK_BYTES // max(nbytes, 1))
    convert = _q6_k_to_device if qtype == QType.Q6_K else lambda rows, xp: _planes_to_device(qtype, rows, xp)
    for r0 in range(0, n_out, step):
        out[r0:r0 + step, :nbytes] = convert(xp.asarray(np.ascontiguousarray(raw[r0:r0 + step])), xp)
    return out


def from_device(qtype, dev, n_in: int, xp=np):
    """The inverse of to_device: the file's rows."""
    qtype = QType(int(qtype))
    if not repacked(qtype):
        return dev
    return _q6_k_from_device(dev, n_in, xp) if qtype == QType.Q6_K else _planes_from_device(qtype, dev, n_in, xp)
