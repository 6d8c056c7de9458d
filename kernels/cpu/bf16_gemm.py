"""BF16 weights in prompt chunks (more than MATVEC_MAX_TOK tokens) on the CPU's BF16 dot products.

Where the CPU has AVX512_BF16 (AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and later), a chunk's
activations are rounded to BF16 (to nearest, ties to even; NaN stays NaN), as ggml rounds them for its BF16
mat-muls, and multiplied with the weights by `vdpbf16ps`, which adds two BF16 products into each of 16 float32
lanes (twice the multiply-adds of a float32 FMA instruction).

Layout: the 16 lanes are 16 tokens. The activations are packed per group of 16 tokens as (groups, n_in / 2, 16)
32-bit words, word [g, p, l] = token 16 g + l's values 2p and 2p + 1 (tokens past the call's last are 0), so one
64-byte load gives a weight pair's partner for 16 tokens, and a weight row's pair (4 bytes) is broadcast to every
lane from the file's own rows (no repacked copy). A tile of ROWS rows by GROUPS token groups keeps ROWS x GROUPS
accumulators in registers, each activation load serving ROWS of them and each broadcast GROUPS; the lanes are
stored to their tokens' output rows once, so no horizontal sums. The row length is walked in blocks of K_BLOCK
values (the tile's weights, 12 rows x 1 KB, stay in L1 while the chunk's token groups pass), each block summed
from zero in its lanes and added to the blocks before it (kept in a scratch of 16-lane vectors between blocks);
the tokens go in chunks of CHUNK_GROUPS groups so that a block's packed activations (8 x 16 tokens x 1 KB) stay
in L2.

Each output's float operations are then fixed by the row length alone (one lane: the pairs of each block in
order from zero, the blocks added in order), not by the tile, the chunk or the call's token count: a token's
outputs are the same bits in any prompt chunk of more than MATVEC_MAX_TOK tokens. Decode-sized calls keep
half_matvec.py (float32 activations), so a token's outputs differ between a prompt chunk and a decode step by the
activations' BF16 rounding (relative 2^-9 a value at most: docs/bounds.md).

Measured on a 2-core AMD EPYC (Zen 5) VM, 2 threads, 512 tokens, GFLOP/s (peak of vdpbf16ps there: 1,089),
2026-12-07, this layout against the one before (tiles of 3 rows x 6 tokens, one accumulator per (row, token) of
16 lanes along the row, then a halving sum): 1536 x 1536 707 / 570, 17920 x 1536 687 / 483, 1536 x 8960 780 /
430; tiles of 8 x 3, 6 x 4, 10 x 2, 14 x 2, 16 x 1 and 24 x 1, blocks of 256 and 1,024 and chunks of 16 groups
were each level or slower somewhere (docs/cpu.md).

Without AVX512_BF16 (BUILT False) nothing here is compiled: LLVM cannot emit vdpbf16ps for such a target, and
Numba compiles a function on its first call, which qmatmul.py makes only where BUILT.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from .isa import BF16_DOT, host_features

BUILT = host_features()["avx512bf16"]
STEP = 32              # n_in must be a multiple of this (the activations' pairs, the blocks' 64-byte loads)
LANES = 16             # tokens a token group (float32 lanes of a vdpbf16ps)
ROWS, GROUPS = 12, 2   # a tile: 12 weight rows x 2 token groups = 24 accumulators of the 32 vector registers
K_BLOCK = 512          # weights of a row a block (the tile's 12 rows: 12 KB)
CHUNK_GROUPS = 8       # token groups of a chunk (a block's packed activations: 128 KB)
ENABLED = BF16_DOT     # built, and not switched off by STRATA_LITE_BF16_GEMM=0 (isa.py)
_ADD_BEFORE, _TO_OUT = 1, 2   # a tile's mode bits: add the scratch's earlier blocks; store to out (last block)


class _BFloat(ir.types.Type):
    """LLVM's bfloat (llvmlite.ir has no such type; only its vectors are used, as bitcasts of 32-bit lanes)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_V32BF = ir.VectorType(_BFloat(), 2 * LANES)
_V16I = ir.VectorType(L.I32, LANES)
_V16F = ir.VectorType(L.F32, LANES)


@intrinsic
def _tile(typingctx, w, r0, xp, g0, c0, p0, p1, acc, mode, out):
    """One K_BLOCK block (pairs p0 .. p1 - 1) of the tile of ROWS rows from r0 and GROUPS token groups from g0, each
    clamped to the last row / group (a short last tile computes the last one again and stores the same values):
    w uint16 (n_out, n_in) BF16 rows; xp uint32 (groups, n_in / 2, LANES) packed activations; acc float32
    (CHUNK_GROUPS, n_out, LANES) the earlier blocks' sums of the chunk that starts at group c0; out float32 (n_tok,
    n_out). The block's sums start from zero; with mode & _ADD_BEFORE the scratch's are added to them (scratch +
    block); with mode & _TO_OUT each lane goes to its token's output (tokens < n_tok), else back to the scratch."""
    if not (L.c_arrays((w, types.uint16, 2), (xp, types.uint32, 3), (acc, types.float32, 3), (out, types.float32, 2))
            and all(isinstance(v, types.Integer) for v in (r0, g0, c0, p0, p1, mode))):
        return None
    sig = types.void(w, types.intp, xp, types.intp, types.intp, types.intp, types.intp, acc, types.intp, out)

    def codegen(context, builder, signature, args):
        (pw, wstr, wshape), (px, xstr, xshape), (pa, astr, _), (po, ostr, oshape) = (
            L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 2, 7, 9))
        rows = L.clamped_rows(builder, args[1], ROWS, wshape[0])
        groups = L.clamped_rows(builder, args[3], GROUPS, xshape[0])
        c0, p0, p1, mode = args[4], args[5], args[6], args[8]
        wrows = [builder.gep(pw, [builder.mul(r, wstr[0])]) for r in rows]
        xgroups = [builder.gep(px, [builder.mul(g, xstr[0])]) for g in groups]
        dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F, _V32BF, _V32BF]),
                                            "llvm.x86.avx512bf16.dpbf16ps.512")
        zero = ir.Constant(_V16F, [0.0] * LANES)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in groups] for _ in rows]
        for row in accs:
            for a in row:
                builder.store(zero, a)
        with cgutils.for_range_slice(builder, p0, p1, L.const(1), inc=True) as (p, _):
            xv = [builder.bitcast(L.load(builder, q, builder.mul(p, xstr[1]), _V16I), _V32BF) for q in xgroups]
            for i in range(ROWS):
                pair = L.load(builder, wrows[i], builder.mul(p, L.const(4)), L.I32)
                wv = builder.bitcast(L.splat(builder, pair, _V16I), _V32BF)
                for j in range(GROUPS):
                    builder.store(builder.call(dp, [builder.load(accs[i][j]), xv[j], wv]), accs[i][j])

        def scratch(i, j):   # the scratch vector of (row i, group j): acc[g - c0, r, :]
            off = builder.add(builder.mul(builder.sub(groups[j], c0), astr[0]), builder.mul(rows[i], astr[1]))
            return builder.bitcast(builder.gep(pa, [off]), _V16F.as_pointer())

        with builder.if_then(builder.icmp_signed("!=", builder.and_(mode, L.const(_ADD_BEFORE)), L.const(0))):
            for i in range(ROWS):
                for j in range(GROUPS):
                    before = builder.load(scratch(i, j), align=4)
                    builder.store(builder.fadd(before, builder.load(accs[i][j])), accs[i][j])
        to_out = builder.icmp_signed("!=", builder.and_(mode, L.const(_TO_OUT)), L.const(0))
        with builder.if_else(to_out) as (last, not_last):
            with last:
                for i in range(ROWS):
                    for j in range(GROUPS):
                        v = builder.load(accs[i][j])
                        for lane in range(LANES):
                            t = builder.add(builder.mul(groups[j], L.const(LANES)), L.const(lane))
                            with builder.if_then(builder.icmp_signed("<", t, oshape[0])):
                                off = builder.add(builder.mul(t, ostr[0]), builder.mul(rows[i], ostr[1]))
                                L.store_f32(builder, po, off, builder.extract_element(v, L.const(lane, L.I32)))
            with not_last:
                for i in range(ROWS):
                    for j in range(GROUPS):
                        builder.store(builder.load(accs[i][j]), scratch(i, j), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, cache=True)
def _gemm(w, xp, acc, out):
    n_row_tiles = (w.shape[0] + ROWS - 1) // ROWS
    n_groups, n_pairs = xp.shape[0], xp.shape[1]
    block = K_BLOCK // 2
    for c0 in range(0, n_groups, CHUNK_GROUPS):
        c1 = min(n_groups, c0 + CHUNK_GROUPS)
        for rt in prange(n_row_tiles):
            for p0 in range(0, n_pairs, block):
                p1 = min(n_pairs, p0 + block)
                mode = (_ADD_BEFORE if p0 > 0 else 0) | (_TO_OUT if p1 == n_pairs else 0)
                for g0 in range(c0, c1, GROUPS):
                    _tile(w, rt * ROWS, xp, g0, c0, p0, p1, acc, mode, out)


@njit(cache=True, inline="always")
def _bf16_bits(b):
    """float32 bits b -> its BF16 bits (to nearest, ties to even; a NaN keeps its sign and becomes a quiet NaN)."""
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return (b >> 16) | 0x40
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


@njit(parallel=True, cache=True)
def _round_bf16(x, xb):
    bits = x.view(np.uint32)
    for t in prange(x.shape[0]):
        for k in range(x.shape[1]):
            xb[t, k] = np.uint16(_bf16_bits(bits[t, k]))


@njit(parallel=True, cache=True)
def _pack(x, xp):
    """xp[g, p, l] = x[16 g + l, 2 p] | x[16 g + l, 2 p + 1] << 16 as BF16 bits; 0 for tokens past the last."""
    bits = x.view(np.uint32)
    n_tok = x.shape[0]
    for g in prange(xp.shape[0]):
        for lane in range(LANES):
            t = g * LANES + lane
            for p in range(xp.shape[1]):
                if t < n_tok:
                    xp[g, p, lane] = _bf16_bits(bits[t, 2 * p]) | (_bf16_bits(bits[t, 2 * p + 1]) << 16)
                else:
                    xp[g, p, lane] = 0


def takes(n_in: int) -> bool:
    """Whether a BF16 matrix of rows of n_in weights takes this kernel on this CPU (and it is not switched off)."""
    return ENABLED and n_in % STEP == 0


def round_bf16(x: np.ndarray) -> np.ndarray:
    """x float32 (n, k) C-contiguous -> its BF16 bits, uint16 (n, k)."""
    xb = np.empty(x.shape, np.uint16)
    _round_bf16(x, xb)
    return xb


def pack_activations(x: np.ndarray) -> np.ndarray:
    """x float32 (n_tok, n_in) C-contiguous -> uint32 (ceil(n_tok / 16), n_in / 2, 16), the tiles' layout."""
    n_tok, n_in = x.shape
    xp = np.empty(((n_tok + LANES - 1) // LANES, n_in // 2, LANES), np.uint32)
    _pack(x, xp)
    return xp


def matmul(raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_out) = x (n_tok, n_in) rounded to BF16 @ W.T for raw (n_out, 2 * n_in) uint8 rows of BF16
    values; x float32 C-contiguous, takes(n_in)."""
    w = np.asarray(raw).view(np.uint16)
    xp = pack_activations(x)
    scratch = (min(CHUNK_GROUPS, xp.shape[0]), w.shape[0]) if x.shape[1] > K_BLOCK else (1, 1)
    _gemm(w, xp, np.empty((*scratch, LANES), np.float32), out)
