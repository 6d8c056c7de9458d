"""Random GGML blocks that dequantize to zero-mean weights of a chosen standard deviation.

    random_matrix(rng, qtype, n_out, n_in, std=None) -> uint8 (n_out, row_nbytes)
    random_vector(rng, n, around, spread) -> float32 (n,)

Every byte of a block starts random (any quant byte is valid data); then the scale fields are patched,
vectorized over all blocks, so that the weights have std `std` (default 1/sqrt(n_in): a matmul of a
unit-RMS input gives a unit-RMS output) and zero mean (random-sign d where the quant values are not
symmetric; Q4_K's and Q5_K's min is set to the middle of their range). The std of each type's weights at d = 1 is
measured once by dequantizing sample blocks with gguf.quants, so no per-type constant can drift.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType
from gguf import quants as gq

JITTER = 0.25          # per-block d is the target times uniform(1 - JITTER, 1 + JITTER)


def _q4_k_scales(rng, raw3: np.ndarray) -> None:
    """Q4_K / Q5_K sub-block scale = min = s_j in [8, 16) (6-bit fields with their top bits zero), so that with
    dmin = 7.5 d (Q5_K: 15.5 d) every sub-block is d * s_j * (q - 7.5), q in 0..15 (q - 15.5, q in 0..31):
    symmetric around 0."""
    s = rng.integers(8, 16, size=(raw3.shape[0], 8), dtype=np.uint8)
    raw3[:, 4:8] = s[:, :4]                       # scales[0..3]: scale of sub-blocks 0..3
    raw3[:, 8:12] = s[:, :4]                      # scales[4..7]: min of sub-blocks 0..3
    raw3[:, 12:16] = s[:, 4:] | (s[:, 4:] << 4)   # scales[8..11]: scale | min << 4 of sub-blocks 4..7


def _q6_k_scales(rng, raw3: np.ndarray) -> None:
    """Q6_K int8 scales of its 16 sub-blocks: +-[16, 64) (q - 32 has mean -0.5; random signs cancel it)."""
    mag = rng.integers(16, 64, size=(raw3.shape[0], 16), dtype=np.int8)
    sign = np.where(rng.integers(0, 2, size=mag.shape, dtype=np.uint8) == 1, -1, 1).astype(np.int8)
    raw3[:, 192:208] = (mag * sign).view(np.uint8)


def _iq3_xxs_scales(rng, raw3: np.ndarray) -> None:
    """IQ3_XXS 4-bit sub-block scales (top nibble of the 8 uint32 at byte 66) limited to 0..7, as
    llama.cpp's quantizer writes them (its largest sub-block gets 7); grid and sign bits stay random."""
    raw3[:, 69::4] &= 0x7F


@dataclass(frozen=True)
class BlockLayout:
    d_offset: int                 # byte offset of the f16 super-scale d in a block
    signed_d: bool                # d gets a random sign (types whose quant values have a non-zero mean)
    dmin_ratio: float = 0.0       # > 0: an f16 dmin = ratio * d follows d (Q4_K, Q5_K)
    patch: Callable | None = None  # (rng, raw3) -> None: sets sub-block scales in place


# One entry per generated type (F16 / BF16 / F32 are drawn as floats, see random_matrix).
LAYOUTS: dict[QType, BlockLayout] = {
    QType.Q8_0: BlockLayout(0, signed_d=True),
    QType.Q5_0: BlockLayout(0, signed_d=True),
    QType.Q4_0: BlockLayout(0, signed_d=True),
    QType.IQ4_NL: BlockLayout(0, signed_d=True),
    QType.IQ3_XXS: BlockLayout(0, signed_d=False, patch=_iq3_xxs_scales),   # sign bits are random already
    QType.Q4_K: BlockLayout(0, signed_d=False, dmin_ratio=7.5, patch=_q4_k_scales),
    QType.Q5_K: BlockLayout(0, signed_d=False, dmin_ratio=15.5, patch=_q4_k_scales),
    QType.Q6_K: BlockLayout(208, signed_d=False, patch=_q6_k_scales),
}

GENERATED_QTYPES = frozenset(LAYOUTS) | {QType.F16, QType.BF16, QType.F32}


def _random_blocks(rng, qtype: QType, n_blocks: int, d: np.ndarray) -> np.ndarray:
    """uint8 (n_blocks, block_nbytes): random bytes, sub-scales patched, d (float32 (n_blocks,)) written."""
    lay = LAYOUTS[qtype]
    raw3 = rng.integers(0, 256, size=(n_blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    if lay.patch is not None:
        lay.patch(rng, raw3)
    raw3[:, lay.d_offset:lay.d_offset + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if lay.dmin_ratio:
        dmin = (d * lay.dmin_ratio).astype(np.float16)
        raw3[:, lay.d_offset + 2:lay.d_offset + 4] = dmin.view(np.uint8).reshape(-1, 2)
    return raw3


@lru_cache(maxsize=None)
def unit_std(qtype: QType) -> float:
    """Std of the weights of random blocks of `qtype` with d = 1 (measured on 256 blocks, fixed seed)."""
    elems = GGML_QUANT_SIZES[qtype][0]
    n_blocks = max(256, 65536 // elems)
    raw = _random_blocks(np.random.default_rng(1234), qtype, n_blocks, np.ones(n_blocks, np.float32))
    return float(gq.dequantize(raw.reshape(-1), qtype).astype(np.float64).std())


def random_matrix(rng, qtype: QType, n_out: int, n_in: int, std: float | None = None) -> np.ndarray:
    """uint8 (n_out, row_nbytes) blocks of a W (n_out, n_in) with zero-mean weights of std `std`
    (default 1/sqrt(n_in)). n_in must be a multiple of the type's block size."""
    qtype = QType(qtype)
    std = 1.0 / np.sqrt(n_in) if std is None else float(std)
    if qtype in (QType.F16, QType.BF16, QType.F32):
        # uniform in [-a, a) with a = sqrt(3) * std (twice as fast to draw as normal values)
        w = rng.random((n_out, n_in), dtype=np.float32)
        w -= np.float32(0.5)
        w *= np.float32(2 * np.sqrt(3) * std)
        if qtype == QType.BF16:     # the top 16 bits, rounded to nearest even (finite values only)
            bits = w.view(np.uint32)
            bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
            return (bits >> np.uint32(16)).astype(np.uint16).view(np.uint8)
        return w.astype(np.float16 if qtype == QType.F16 else np.float32).view(np.uint8)
    if qtype not in LAYOUTS:
        names = ", ".join(sorted(t.name for t in GENERATED_QTYPES))
        raise ValueError(f"cannot generate {qtype.name} blocks (generated types: {names})")
    elems = GGML_QUANT_SIZES[qtype][0]
    if n_in % elems:
        raise ValueError(f"{qtype.name} rows must be a multiple of {elems} weights, got {n_in}")
    n_blocks = n_out * (n_in // elems)
    d = rng.uniform(1 - JITTER, 1 + JITTER, size=n_blocks).astype(np.float32)
    # E[jitter^2] = 1 + JITTER^2 / 3: divide it out so the std is the target on average
    d *= np.float32(std / unit_std(qtype) / np.sqrt(1 + JITTER ** 2 / 3))
    if LAYOUTS[qtype].signed_d:
        d[rng.integers(0, 2, size=n_blocks, dtype=np.uint8) == 1] *= -1
    return _random_blocks(rng, qtype, n_blocks, d).reshape(n_out, -1)


def random_vector(rng, n: int, around: float, spread: float) -> np.ndarray:
    """float32 (n,): around + spread * N(0, 1) (norm weights ~1, biases ~0)."""
    return (around + spread * rng.standard_normal(n)).astype(np.float32)
