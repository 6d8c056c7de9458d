"""Load-time weight preparation for the CPU backend: lossless repacking + precomputed kernel views.

Q4_0, Q5_0 and IQ4_NL blocks are exactly representable as Q8_0 blocks: every weight is
``f16 d * small integer`` and the integers (-8..7, -16..15, the IQ4_NL table -127..113) fit int8, so a
block becomes ``d`` (same 2 bytes) + 32 int8 = a genuine Q8_0 block (34 bytes per 32 weights, 8.5
bits/weight). gguf dequantizes both as one float32 product ``d * float32(q)``, so the repacked matrix
dequantizes bit-identically, and every such matrix runs the Q8_0 kernels (5-8x faster per weight than
the Q5_0 one, whose 5th-bit unpacking does not vectorize).

When the CPU has AVX2, Q5_0, Q4_0 and IQ4_NL keep their own blocks instead (q8_0_int8.py unpacks them
in registers, with the results of their Q8_0 repacking, bit for bit), and IQ3_XXS, Q4_K, Q5_K and Q6_K are
repacked losslessly for the int8 kernel of
nibble_int8.py: IQ3_XXS as 4-bit codes (iq3_int8.py: 4.5 instead of 3.06 bits/weight, 3x less work per
weight; layout IQ3_I8), Q4_K with its scales unpacked (q4_k_int8.py: 5 instead of 4.5; Q4K_I8), Q5_K the
same with its fifth bits' plane (q5_k_int8.py: 6 instead of 5.5; Q5K_I8), Q6_K as 4-bit codes with a plane
of two high bits each (q6_k_int8.py: 6.75 instead of 6.56; Q6K_I8). Those layouts run the int8 kernel for every
token count (batch invariance: qmatmul.py).

`PackedWeight` is a drop-in for the loader's QuantTensor (name, qtype, n_out, n_in, raw, nbytes), so
embed() / dequantize() keep working on it; it also keeps the reshaped views the matvec kernels take,
so the per-call path does no validation of the weight and no reshaping.
"""
from __future__ import annotations

import mmap

import numpy as np
from gguf import GGMLQuantizationType as QType
from numba import njit, prange

from . import iq3_int8, q4_k_int8, q5_k_int8, q6_k_int8, rows4, rows4_int8
from .dequant import F16_TABLE, IQ4NL_VALUES, check_raw
from ..qtypes import block_geometry

REPACK_TO_Q8_0 = frozenset({QType.Q4_0, QType.Q5_0, QType.IQ4_NL})
IQ4NL_I8 = IQ4NL_VALUES.astype(np.int8)            # the table is integral, -127..113


@njit(cache=True, parallel=True)
def _q4_0_to_q8_0(src, dst, hb):
    # src (n_blocks, 18): d, 16 bytes (lo nibbles = values 0..15, hi = 16..31); dst (n_blocks, 34)
    for b in prange(src.shape[0]):
        dst[b, 0] = src[b, 0]
        dst[b, 1] = src[b, 1]
        for j in range(hb):
            v = src[b, 2 + j]
            dst[b, 2 + j] = np.uint8((v & 15) - 8)      # uint8 wraparound = the int8 two's complement
            dst[b, 18 + j] = np.uint8((v >> 4) - 8)


@njit(cache=True, parallel=True)
def _q5_0_to_q8_0(src, dst, hb):
    # src (n_blocks, 22): d, qh (u32 LE: bit j = 5th bit of value j), 16 nibble bytes
    for b in prange(src.shape[0]):
        dst[b, 0] = src[b, 0]
        dst[b, 1] = src[b, 1]
        qh = (np.uint32(src[b, 2]) | (np.uint32(src[b, 3]) << 8) | (np.uint32(src[b, 4]) << 16)
              | (np.uint32(src[b, 5]) << 24))
        for j in range(hb):
            v = np.uint32(src[b, 6 + j])
            lo = (v & 15) | (((qh >> j) & 1) << 4)
            hi = (v >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[b, 2 + j] = np.uint8((lo - 16) & 255)
            dst[b, 18 + j] = np.uint8((hi - 16) & 255)


@njit(cache=True, parallel=True)
def _iq4_nl_to_q8_0(src, dst, kv, hb):
    for b in prange(src.shape[0]):
        dst[b, 0] = src[b, 0]
        dst[b, 1] = src[b, 1]
        for j in range(hb):
            v = src[b, 2 + j]
            dst[b, 2 + j] = np.uint8(kv[v & 15])
            dst[b, 18 + j] = np.uint8(kv[v >> 4])


def repack_to_q8_0(qtype, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """Q4_0 / Q5_0 / IQ4_NL rows -> Q8_0 rows (uint8 (n_rows, n_cols // 32 * 34)), lossless."""
    qtype, raw = check_raw(qtype, raw, n_cols)
    if qtype not in REPACK_TO_Q8_0:
        raise ValueError(f"{qtype.name} has no lossless Q8_0 repacking")
    n_rows = raw.shape[0]
    nb = n_cols // 32
    src = raw.reshape(n_rows * nb, block_geometry(qtype)[1])
    dst = np.empty((n_rows * nb, 34), dtype=np.uint8)
    if n_rows * nb:
        if qtype == QType.Q4_0:
            _q4_0_to_q8_0(src, dst, 16)
        elif qtype == QType.Q5_0:
            _q5_0_to_q8_0(src, dst, 16)
        else:
            _iq4_nl_to_q8_0(src, dst, IQ4NL_I8, 16)
    return dst.reshape(n_rows, nb * 34)


class PackedWeight:
    """A weight matrix prepared for the CPU kernels; same attributes as loader.weights.QuantTensor.

    qtype / raw are what the kernels read (Q8_0 for repacked types); src_qtype is the file's type.
    layout: GGML (raw holds GGML blocks of qtype), IQ3_I8, Q4K_I8, Q5K_I8 or Q6K_I8 (IQ3_XXS / Q4_K / Q5_K /
    Q6_K repacked for nibble_int8.py by iq3_int8.py / q4_k_int8.py / q5_k_int8.py / q6_k_int8.py), Q5_0_R4,
    Q4_0_R4, IQ4_NL_R4 or Q8_0_R4 (rows interleaved by 4, rows4_int8.py).
    raw3 is raw viewed (rows, n_blocks, block_nbytes) for the fused kernels (None for float types).
    pad: rows of an interleaved layout past n_out (0-3: a vocabulary's rows in groups of 4, pack_weight); the
    kernels compute them, qmatmul_packed hands out the first n_out columns.
    """
    __slots__ = ("name", "qtype", "n_out", "n_in", "raw", "src_qtype", "layout", "raw3", "nb", "elems", "small",
                 "final", "int8", "pad")

    def __init__(self, name, qtype, n_out, n_in, raw, src_qtype=None, final=True, layout=None, int8=False):
        self.layout = layout or GGML
        if self.layout == GGML:
            qtype, raw = check_raw(qtype, raw, n_in)
            elems, bsize = block_geometry(qtype)
        elif self.layout in INT8_LAYOUTS:
            qtype, module = INT8_LAYOUTS[self.layout]
            elems, bsize = module.QK, module.BLOCK_BYTES
            if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != n_in // elems * bsize \
                    or not raw.flags.c_contiguous:
                raise ValueError(f"{name}: not repacked {qtype.name} rows of {n_in} weights")
        else:
            raise ValueError(f"unknown weight layout {layout!r}")
        self.pad = raw.shape[0] - int(n_out) if self.layout in ROWS4_LAYOUTS else 0
        if raw.shape[0] != int(n_out) + self.pad or not 0 <= self.pad < rows4_int8.ROWS:
            raise ValueError(f"{name}: raw has {raw.shape[0]} rows, expected {n_out}")
        self.name, self.qtype, self.n_out, self.n_in, self.raw = name, qtype, int(n_out), int(n_in), raw
        self.src_qtype = qtype if src_qtype is None else QType(int(src_qtype))
        self.elems = elems
        self.nb = self.n_in // elems
        self.raw3 = raw.reshape(raw.shape[0], self.nb, bsize) if elems > 1 else None
        # matrices this small run single-threaded in the matvec path: a parallel launch (thread
        # wake-up + barrier) costs more than it saves (see perf/bench_cpu_kernels.py)
        self.small = raw.nbytes < SMALL_BYTES
        # False: kept in a repackable layout on purpose (row lookups only); qmatmul repacks a copy
        self.final = bool(final)
        # the AVX2 int8 kernels serve it, for any number of tokens (nibble_int8.py: the repacked layouts;
        # q8_0_int8.py: Q8_0, small matrices on the calling thread)
        self.int8 = self.layout in INT8_LAYOUTS or (bool(int8) and (qtype == QType.Q8_0 or qtype in REPACK_TO_Q8_0))

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def __repr__(self):
        src = "" if self.src_qtype == self.qtype else f" (from {self.src_qtype.name})"
        src += "" if self.layout == GGML else f" [{self.layout}]"
        return f"PackedWeight({self.name!r}, {self.qtype.name}{src}, {self.n_out}x{self.n_in})"


GGML = "ggml"
IQ3_I8 = "iq3_xxs_i8"
Q4K_I8 = "q4_k_i8"
Q6K_I8 = "q6_k_i8"
Q5K_I8 = "q5_k_i8"
Q5_0_R4 = "q5_0_r4"
Q4_0_R4 = "q4_0_r4"
IQ4_NL_R4 = "iq4_nl_r4"
Q8_0_R4 = "q8_0_r4"
# layout -> (the file's type, the module with QK, BLOCK_BYTES, repack(raw, n_cols, f16 table), matvec)
INT8_LAYOUTS = {IQ3_I8: (QType.IQ3_XXS, iq3_int8), Q4K_I8: (QType.Q4_K, q4_k_int8),
                Q6K_I8: (QType.Q6_K, q6_k_int8), Q5K_I8: (QType.Q5_K, q5_k_int8),
                Q5_0_R4: (QType.Q5_0, rows4.Q5_0_R4), Q4_0_R4: (QType.Q4_0, rows4.Q4_0_R4),
                IQ4_NL_R4: (QType.IQ4_NL, rows4.IQ4_NL_R4), Q8_0_R4: (QType.Q8_0, rows4.Q8_0_R4)}
ROWS4_LAYOUTS = frozenset({Q5_0_R4, Q4_0_R4, IQ4_NL_R4, Q8_0_R4})   # rows interleaved in 4s: matrices of 4k rows only
_INT8_LAYOUT_OF = {qtype: layout for layout, (qtype, _) in INT8_LAYOUTS.items()}

# below this many weight bytes the matvec runs on the calling thread only
SMALL_BYTES = 160 * 1024


def pack_weight(w, repack: bool = True, release_source: bool = True, int8: bool = False,
                vocab_rows: bool = False) -> PackedWeight:
    """QuantTensor-like w -> PackedWeight. With `int8` (an AVX2 CPU) and `repack`, Q5_0, Q4_0, IQ4_NL and Q8_0
    matrices of 4k rows are interleaved by 4 rows for rows4_int8.py and IQ3_XXS, Q4_K, Q5_K and Q6_K repacked
    for nibble_int8.py; the other Q8_0 / Q5_0 / Q4_0 / IQ4_NL keep their blocks for q8_0_int8.py
    (q8_0_gemm.py for prompt chunks). Without `int8` Q5_0, Q4_0 and IQ4_NL are repacked to Q8_0 (with
    `repack`). With vocab_rows (rows scoring the vocabulary: the output matrix, MTP heads, whose rows must
    give the same bits in any matrix holding them, such as a head cut to a draft vocabulary of any size, so
    all of them take one layout) a Q8_0 matrix is interleaved whatever its row count, the last group padded
    with zero rows (PackedWeight.pad). The interleaved kernel reads faster than the blocks' on AVX2 and with
    VNNI alike (docs/cpu.md, "The output matrix interleaved").

    With release_source, the pages of the original (memory-mapped) bytes of a repacked matrix are
    dropped from the process (madvise MADV_DONTNEED): they were read once and are not needed again
    (anything touching them later just faults them back in from the page cache)."""
    if isinstance(w, PackedWeight):
        return w
    qtype = QType(int(w.qtype))
    layout = _INT8_LAYOUT_OF.get(qtype)
    # all of a vocabulary's Q8_0 matrices take one layout, so that a row gives the same bits in every matrix
    # holding it; interleaved, any row count is padded to whole groups of 4
    pad = (-w.n_out) % rows4_int8.ROWS if layout == Q8_0_R4 and vocab_rows else 0
    if layout in ROWS4_LAYOUTS and not (repack and int8 and (w.n_out + pad) % rows4_int8.ROWS == 0):
        layout = None                         # in their own blocks, or repacked to Q8_0
    if int8 and qtype in REPACK_TO_Q8_0 and layout is None:   # the int8 kernel unpacks these blocks itself
        return PackedWeight(w.name, qtype, w.n_out, w.n_in, w.raw, int8=int8)
    if repack and int8 and layout is not None:
        _, raw = check_raw(qtype, w.raw, w.n_in)
        if layout in ROWS4_LAYOUTS:
            packed = _repack_rows4(INT8_LAYOUTS[layout][1], raw, w.n_in, pad, release_source)
        else:
            packed = INT8_LAYOUTS[layout][1].repack(raw, w.n_in, F16_TABLE)
        if release_source:
            release_pages(w.raw)
        return PackedWeight(w.name, qtype, w.n_out, w.n_in, packed, layout=layout)
    if repack and qtype in REPACK_TO_Q8_0:
        packed = repack_to_q8_0(qtype, w.raw, w.n_in)
        if release_source:
            release_pages(w.raw)
        return PackedWeight(w.name, QType.Q8_0, w.n_out, w.n_in, packed, src_qtype=qtype, int8=int8)
    return PackedWeight(w.name, qtype, w.n_out, w.n_in, w.raw, int8=int8)


def _mmap_root(arr):
    """(mmap.mmap, numpy array spanning it from its start) behind arr, or (None, None)."""
    base, prev = arr, None
    while base is not None and not isinstance(base, mmap.mmap):
        prev, base = base, getattr(base, "base", None)
    if base is None or not isinstance(prev, np.ndarray):
        return None, None
    return base, prev


REPACK_CHUNK_ROWS = 4096   # rows repacked at a time (a multiple of 4): the source pages of each chunk are
                           # released before the next, so a large matrix (the 145 MB output) never has its
                           # mapped and repacked copies resident at once


def _repack_rows4(module, raw: np.ndarray, n_in: int, pad: int, release: bool) -> np.ndarray:
    """rows4_int8 layout of raw's rows and pad zero rows (scale 0, completing the last group), repacked
    REPACK_CHUNK_ROWS at a time, each chunk's source pages released after it where release is set."""
    n = raw.shape[0]
    whole = n - n % rows4_int8.ROWS
    out = np.empty((n + pad, raw.shape[1]), dtype=np.uint8)
    for a in range(0, whole, REPACK_CHUNK_ROWS):
        b = min(a + REPACK_CHUNK_ROWS, whole)
        out[a:b] = module.repack(raw[a:b], n_in, F16_TABLE)
        if release:
            release_pages(raw[a:b])
    if whole < n + pad:
        tail = np.concatenate([raw[whole:], np.zeros((pad, raw.shape[1]), np.uint8)])
        out[whole:] = module.repack(tail, n_in, F16_TABLE)
    return out


def release_pages(arr) -> bool:
    """madvise(MADV_DONTNEED) the whole pages under a view of a read-only memory map. False if arr
    is not such a view (nothing done)."""
    mm, root = _mmap_root(arr)
    if mm is None or not hasattr(mm, "madvise") or arr.nbytes == 0:
        return False
    start = arr.ctypes.data - root.ctypes.data        # np.memmap(offset=0) starts at the map's start
    if start < 0 or start + arr.nbytes > len(mm) or getattr(root, "offset", 0):
        return False
    page = mmap.PAGESIZE
    lo = (start + page - 1) // page * page            # only pages entirely inside the tensor
    hi = (start + arr.nbytes) // page * page
    if hi <= lo:
        return False
    try:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):
        return False
    return True
