"""Prompt chunks of Q5_0, Q4_0 and IQ4_NL weights kept in their own blocks (q8_0_int8.py).

On AVX2 CPUs these matrices stay in the file's 22 / 18-byte blocks (5.5 / 4.5 bits per weight read per
decode step instead of the 8.5 of a Q8_0 repacking) and the int8 kernel unpacks each block in registers
to the integers the lossless Q8_0 repacking stores. With 1-8 tokens per call (decode, batched decode,
draft verification) the tokens share that unpacking and fewer bytes to read is faster. A prompt chunk
of n tokens makes n / 8 kernel passes over each row, each unpacking it again (~12 more µops per block
and pass). Here the matrix is unpacked once per call instead, by the same in-register code, into Q8_0
blocks in a reused per-thread buffer (slabs of rows of at most SCRATCH_BYTES), which the Q8_0 kernel
multiplies: the same integers through the same kernel, so the same bits as the in-register path and as
the Q8_0 repacking (tests/kernels/test_own_blocks_int8.py). Unpacking costs ~0.2 ms per 4.4 M weights
on one thread. 896 -> 4864, one thread, CPU time, best of 15 alternating runs (2-core AVX2 VM under
load, 2026-12-02), Q8_0 blocks / in-register / unpacked once: Q5_0 64 tokens 9.45 / 11.04 / 10.05 ms,
256 tokens 38.4 / 44.5 / 39.2; IQ4_NL 64 tokens 9.42 / 10.41 / 10.12, 256 tokens 38.4 / 42.6 / 41.9.
Unpacking per group of 16 rows into a small buffer instead was slower than both (12.0 ms at 64 tokens).
"""
from __future__ import annotations

import threading

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from . import q8_0_int8 as q8

MIN_TOK = 2 * q8.MAX_TOK + 1      # from 3 token chunks per row on (2: unpacking twice costs about as much)
SCRATCH_BYTES = 4 << 20           # Q8_0 bytes unpacked at a time (a buffer per calling thread, kept): one
                                  # slab for every 0.5B and 1.5B attention matrix, 3 for the 0.5B fused
                                  # gate/up (8 MiB gave 2 and held 4 MiB more for the process's life)


def _make_unpack(block_weights):
    @intrinsic
    def unpack(typingctx, raw3, r, dst3, i):
        if not (L.c_arrays((raw3, types.uint8, 3), (dst3, types.uint8, 3))
                and isinstance(r, types.Integer) and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            (praw, rstr, rshape), (pdst, dstr, _) = (
                L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 2))
            src0 = builder.gep(praw, [builder.mul(args[1], rstr[0])])
            dst0 = builder.gep(pdst, [builder.mul(args[3], dstr[0])])
            with cgutils.for_range(builder, rshape[1]) as loop:
                p = builder.gep(src0, [builder.mul(loop.index, rstr[1])])
                d = builder.gep(dst0, [builder.mul(loop.index, dstr[1])])
                builder.store(L.load(builder, p, 0, L.I16), builder.bitcast(d, L.I16.as_pointer()), align=1)
                builder.store(block_weights(builder, p)[0],
                              builder.bitcast(builder.gep(d, [L.const(2)]), L.V32B.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(raw3, types.intp, dst3, types.intp), codegen

    unpack.__doc__ = "dst3[i] (blocks, 34) = row r of raw3 as the Q8_0 blocks of its lossless repacking."
    return unpack


_unpack_q5_0 = _make_unpack(q8._q5_0_weights)
_unpack_q4_0 = _make_unpack(q8._q4_0_weights)
_unpack_iq4_nl = _make_unpack(q8._iq4_nl_weights)


@njit(cache=True, inline="always")
def _unpack(kind, raw3, r, dst3, i):
    if kind == q8.Q5_0_KIND:
        _unpack_q5_0(raw3, r, dst3, i)
    elif kind == q8.Q4_0_KIND:
        _unpack_q4_0(raw3, r, dst3, i)
    else:
        _unpack_iq4_nl(raw3, r, dst3, i)


@njit(cache=True, parallel=True)
def unpack_rows(kind, raw3, r0, dst3):
    """dst3 (n, blocks, 34) = rows r0 .. r0 + n - 1 of raw3 (block format `kind`) as Q8_0 blocks."""
    for i in prange(dst3.shape[0]):
        _unpack(kind, raw3, r0 + i, dst3, i)


_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's reused uint8 buffer of at least nbytes (its pages stay mapped between calls)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.buf = np.empty(nbytes, dtype=np.uint8)
    return buf


def matmul(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray, kind: int) -> None:
    """out (n_tok, n_rows) = x @ W.T, W (n_rows, blocks, block bytes) of format `kind` (q8_0_int8.py's
    Q5_0 / Q4_0 / IQ4_NL kinds), x float32 (n_tok, blocks, 32): q8_0_int8.mv_avx2's results, bit for bit."""
    n_rows, nb = raw3.shape[0], raw3.shape[1]
    row_bytes = nb * q8.BLOCK_BYTES
    slab = min(n_rows, max(q8.ROW_GROUP, SCRATCH_BYTES // row_bytes // q8.ROW_GROUP * q8.ROW_GROUP))
    buf = _scratch(slab * row_bytes)
    for a in range(0, n_rows, slab):
        b = min(n_rows, a + slab)
        dst = buf[:(b - a) * row_bytes].reshape(b - a, nb, q8.BLOCK_BYTES)
        unpack_rows(kind, raw3, a, dst)
        # a slab's columns go straight into out (a strided view): no float tile of n_tok x slab rows to copy
        # (17 MiB for 512 tokens of the 0.5B gate/up with 8 MiB slabs: a prompt's largest temporary)
        q8.mv_avx2(dst, x3, out if b - a == n_rows else out[:, a:b], q8.Q8_0_KIND)
