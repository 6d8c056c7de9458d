"""F16 and BF16 weights in prompt chunks (more than MATVEC_MAX_TOK tokens): tiles with tokens in the vector lanes.

BF16, where the CPU has AVX512_BF16 (AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and later): a
chunk's activations are rounded to BF16 (to nearest, ties to even; NaN stays NaN), as ggml rounds them for its
BF16 mat-muls, and `vdpbf16ps` adds two BF16 products into each of 16 float32 lanes (twice the multiply-adds of a
float32 FMA instruction). F16, where the CPU has AVX-512: the activations stay float32; a tile's rows are widened
to float32 a block at a time (`vcvtph2ps`) into a scratch that stays in L1, and float32 FMAs multiply them.

Layout: the 16 lanes are 16 tokens. The activations are packed per group of 16 tokens, (groups, steps, 16) 32-bit
words: BF16 word [g, p, l] = token 16 g + l's values 2p and 2p + 1, F16 (float32) word [g, k, l] = its value k;
tokens past the call's last are 0. One 64-byte load gives a step's activations for 16 tokens, and a weight
row's step (a BF16 pair from the file's own row, or a float32 from the scratch: 4 bytes) is broadcast to every
lane. A tile of ROWS rows by GROUPS token groups keeps ROWS x GROUPS accumulators in registers, each activation
load serving ROWS of them and each broadcast GROUPS; the lanes are stored to their tokens' output rows once, so
no horizontal sums. The row length is walked in blocks (the tile's weights stay in L1 while the chunk's token
groups pass), each block summed from zero in its lanes and added to the blocks before it (kept in a scratch of
16-lane vectors between blocks); the tokens go in chunks of groups so that a block's packed activations stay in
L2 (BF16: 8 groups x 1 KB a token; F16: 16 groups x 1 KB).

Each output's float operations are then fixed by the row length alone (one lane: the steps of each block in
order from zero, the blocks added in order), not by the tile, the chunk or the call's token count: a token's
outputs are the same bits in any prompt chunk of more than MATVEC_MAX_TOK tokens. Decode-sized calls keep
half_matvec.py, whose sums run in another order (and, for BF16, on float32 activations), so a token's outputs
differ between a prompt chunk and a decode step by that order (BF16: and the activations' rounding, relative 2^-9
a value at most: docs/bounds.md).

Measured on a 2-core AMD EPYC (Zen 5) VM, 2 threads, 512 tokens, GFLOP/s, 2026-12-07 (docs/cpu.md, "F16 and BF16
prompt tiles"): BF16 (peak of vdpbf16ps there 1,089) 764-825 on rows of 1,536 and 8,960 weights, against 430-620
for tiles of 3 rows x 6 tokens with one accumulator per (row, token) along the row and a halving sum; F16 (float32
FMA peak ~545) 383-427 against the tile path's (rows widened to float32, then BLAS) 212-422: faster on rows of
3,072 weights and more (1536 x 8960: 394 against 212), level or slower on shorter ones, which keep the tile path
(F16_MIN_ROW). Tiles of 8 x 3, 6 x 4, 4 x 6, 10 x 2, 14 x 2, 16 x 1 and 24 x 1 and other block and chunk sizes were
level or slower somewhere.

Not compiled where the CPU lacks the instructions (BF16_BUILT / F16_BUILT False): LLVM cannot emit vdpbf16ps for
such a target, and Numba compiles a function on its first call, which qmatmul.py makes only where built.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from .half_matvec import widen
from .isa import BF16_DOT, F16_TILES, host_features

BF16_BUILT = host_features()["avx512bf16"]
F16_BUILT = host_features()["avx512f"]
STEP = 32              # n_in must be a multiple of this (BF16 pairs and F16 widening in whole 64-byte vectors)
LANES = 16             # tokens a token group (float32 lanes)
ROWS, GROUPS = 12, 2   # a tile: 12 weight rows x 2 token groups = 24 accumulators of the 32 vector registers
BF16_BLOCK, BF16_CHUNK = 512, 8    # weights of a row a block (the tile's rows: 12 KB), token groups a chunk
F16_BLOCK, F16_CHUNK = 256, 16     # (the tile's widened rows: 12 KB of float32)
# F16 rows shorter than this keep the tile path (rows widened to float32 in tiles, then BLAS), which is as fast or
# a little faster there: Zen 5 VM, 2 threads, 512 tokens, GFLOP/s these tiles / the tile path, 2026-12-07: n_in
# 896 411 / 421, 1536 396-427 / 405-422, 2048 405 / 414, 3072 407 / 384, 4096 402-416 / 365-367, 4864 383 / 346,
# 8960 394 / 212 (the tile path's row tiles shrink with the row length: TILE_BYTES of float32 a tile)
F16_MIN_ROW = 3072
assert BF16_CHUNK % GROUPS == 0 and F16_CHUNK % GROUPS == 0   # a chunk's tiles never reach into the next chunk
BF16_ENABLED = BF16_DOT            # built, and not switched off by STRATA_LITE_BF16_GEMM=0 (isa.py)
F16_ENABLED = F16_TILES            # built, and not switched off by STRATA_LITE_F16_GEMM=0 (isa.py)
_ADD_BEFORE, _TO_OUT = 1, 2        # a tile's mode bits: add the scratch's earlier blocks; store to out (last block)


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


def _make_tile(bf16: bool):
    """The tile intrinsic tile(src, r0, xp, g0, c0, i0, i1, acc, mode, out): one block (steps i0 .. i1 - 1) of
    the tile of ROWS rows from r0 and GROUPS token groups from g0, each clamped to the last row / group (a short
    last tile computes the last one again and stores the same values). src: BF16 the weights, uint16 (n_out, n_in);
    F16 the block's rows widened, float32 (ROWS, F16_BLOCK) (row i = row r0 + i, step i0 at column 0). xp: the
    packed activations, uint32 (groups, n_in / 2, LANES) for BF16, float32 (groups, n_in, LANES) for F16. acc
    float32 (chunk groups, n_out, LANES): the earlier blocks' sums of the chunk that starts at group c0. out
    float32 (n_tok, n_out). The block's sums start from zero; with mode & _ADD_BEFORE the scratch's are added to
    them (scratch + block); with mode & _TO_OUT each lane goes to its token's output (tokens < n_tok), else back to
    the scratch."""
    src_type, x_type = (types.uint16, types.uint32) if bf16 else (types.float32, types.float32)

    @intrinsic
    def tile(typingctx, src, r0, xp, g0, c0, i0, i1, acc, mode, out):
        if not (L.c_arrays((src, src_type, 2), (xp, x_type, 3), (acc, types.float32, 3), (out, types.float32, 2))
                and all(isinstance(v, types.Integer) for v in (r0, g0, c0, i0, i1, mode))):
            return None
        sig = types.void(src, types.intp, xp, types.intp, types.intp, types.intp, types.intp, acc, types.intp, out)

        def codegen(context, builder, signature, args):
            (ps, sstr, _), (px, xstr, xshape), (pa, astr, _), (po, ostr, oshape) = (
                L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 2, 7, 9))
            rows = L.clamped_rows(builder, args[1], ROWS, oshape[1])
            groups = L.clamped_rows(builder, args[3], GROUPS, xshape[0])
            c0, i0, i1, mode = args[4], args[5], args[6], args[8]
            src_rows = rows if bf16 else [L.const(i) for i in range(ROWS)]
            wrows = [builder.gep(ps, [builder.mul(r, sstr[0])]) for r in src_rows]
            xgroups = [builder.gep(px, [builder.mul(g, xstr[0])]) for g in groups]
            if bf16:
                op = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F, _V32BF, _V32BF]),
                                                    "llvm.x86.avx512bf16.dpbf16ps.512")
            else:
                op = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3),
                                                    "llvm.fma.v16f32")
            zero = ir.Constant(_V16F, [0.0] * LANES)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in groups] for _ in rows]
            for row in accs:
                for a in row:
                    builder.store(zero, a)
            with cgutils.for_range_slice(builder, i0, i1, L.const(1), inc=True) as (i, _):
                w_off = builder.mul(i if bf16 else builder.sub(i, i0), L.const(4))
                xv = [L.load(builder, q, builder.mul(i, xstr[1]), _V16I if bf16 else _V16F) for q in xgroups]
                for r in range(ROWS):
                    if bf16:
                        wv = builder.bitcast(L.splat(builder, L.load(builder, wrows[r], w_off, L.I32), _V16I), _V32BF)
                    else:
                        wv = L.splat(builder, L.load(builder, wrows[r], w_off, L.F32), _V16F)
                    for j in range(GROUPS):
                        a = builder.load(accs[r][j])
                        new = (builder.call(op, [a, builder.bitcast(xv[j], _V32BF), wv]) if bf16
                               else builder.call(op, [wv, xv[j], a]))
                        builder.store(new, accs[r][j])

            def scratch(r, j):   # the scratch vector of (row r, group j): acc[g - c0, row, :]
                off = builder.add(builder.mul(builder.sub(groups[j], c0), astr[0]), builder.mul(rows[r], astr[1]))
                return builder.bitcast(builder.gep(pa, [off]), _V16F.as_pointer())

            with builder.if_then(builder.icmp_signed("!=", builder.and_(mode, L.const(_ADD_BEFORE)), L.const(0))):
                for r in range(ROWS):
                    for j in range(GROUPS):
                        before = builder.load(scratch(r, j), align=4)
                        builder.store(builder.fadd(before, builder.load(accs[r][j])), accs[r][j])
            to_out = builder.icmp_signed("!=", builder.and_(mode, L.const(_TO_OUT)), L.const(0))
            with builder.if_else(to_out) as (last, not_last):
                with last:   # token by token, its ROWS outputs together (one or two lines; rows of 2^k floats
                    # put a group's 16 tokens in one L1 set, which row-by-row stores thrashed: 2048 rows 531
                    # against 790 GFLOP/s for 2064)
                    for j in range(GROUPS):
                        vs = [builder.load(accs[r][j]) for r in range(ROWS)]
                        for lane in range(LANES):
                            t = builder.add(builder.mul(groups[j], L.const(LANES)), L.const(lane))
                            with builder.if_then(builder.icmp_signed("<", t, oshape[0])):
                                row_out = builder.mul(t, ostr[0])
                                for r in range(ROWS):
                                    off = builder.add(row_out, builder.mul(rows[r], ostr[1]))
                                    L.store_f32(builder, po, off, builder.extract_element(vs[r], L.const(lane, L.I32)))
                with not_last:
                    for r in range(ROWS):
                        for j in range(GROUPS):
                            builder.store(builder.load(accs[r][j]), scratch(r, j), align=4)
            return context.get_dummy_value()

        return sig, codegen
    return tile


_tile_bf16, _tile_f16 = _make_tile(True), _make_tile(False)


@intrinsic
def _widen_rows(typingctx, w, r0, k0, k1, wf):
    """wf[i, :k1 - k0] = float32 of F16 row r0 + i (clamped to the last row), columns k0 .. k1 - 1, for i < ROWS:
    w uint16 (n_out, n_in), wf float32 (ROWS, F16_BLOCK), k1 - k0 a multiple of LANES."""
    if not (L.c_arrays((w, types.uint16, 2), (wf, types.float32, 2))
            and all(isinstance(v, types.Integer) for v in (r0, k0, k1))):
        return None
    sig = types.void(w, types.intp, types.intp, types.intp, wf)

    def codegen(context, builder, signature, args):
        (pw, wstr, wshape), (pf, fstr, _) = (L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 4))
        k0, k1 = args[2], args[3]
        vectors = builder.sdiv(builder.sub(k1, k0), L.const(LANES))
        for i, r in enumerate(L.clamped_rows(builder, args[1], ROWS, wshape[0])):
            src = builder.gep(pw, [builder.add(builder.mul(r, wstr[0]), builder.mul(k0, L.const(2)))])
            dst = builder.gep(pf, [builder.mul(L.const(i), fstr[0])])
            with cgutils.for_range(builder, vectors) as loop:
                f = widen(builder, L.load(builder, src, builder.mul(loop.index, L.const(2 * LANES)), L.V16W), False)
                ptr = builder.gep(dst, [builder.mul(loop.index, L.const(4 * LANES))])
                builder.store(f, builder.bitcast(ptr, _V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _mode(i0, i1, n_steps):
    """A block's mode bits: add the earlier blocks unless it is the first, store to out if it is the last."""
    return (_ADD_BEFORE if i0 > 0 else 0) | (_TO_OUT if i1 == n_steps else 0)


@njit(parallel=True, cache=True)
def _gemm_bf16(w, xp, acc, out):
    n_row_tiles = (w.shape[0] + ROWS - 1) // ROWS
    n_groups, n_pairs = xp.shape[0], xp.shape[1]
    block = BF16_BLOCK // 2
    for c0 in range(0, n_groups, BF16_CHUNK):
        c1 = min(n_groups, c0 + BF16_CHUNK)
        for rt in prange(n_row_tiles):
            for p0 in range(0, n_pairs, block):
                p1 = min(n_pairs, p0 + block)
                for g0 in range(c0, c1, GROUPS):
                    _tile_bf16(w, rt * ROWS, xp, g0, c0, p0, p1, acc, _mode(p0, p1, n_pairs), out)


@njit(parallel=True, cache=True)
def _gemm_f16(w, xp, acc, out):
    n_row_tiles = (w.shape[0] + ROWS - 1) // ROWS
    n_groups, n_in = xp.shape[0], xp.shape[1]
    for c0 in range(0, n_groups, F16_CHUNK):
        c1 = min(n_groups, c0 + F16_CHUNK)
        for rt in prange(n_row_tiles):
            wf = np.empty((ROWS, F16_BLOCK), np.float32)
            for k0 in range(0, n_in, F16_BLOCK):
                k1 = min(n_in, k0 + F16_BLOCK)
                _widen_rows(w, rt * ROWS, k0, k1, wf)
                for g0 in range(c0, c1, GROUPS):
                    _tile_f16(wf, rt * ROWS, xp, g0, c0, k0, k1, acc, _mode(k0, k1, n_in), out)


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
def _pack_bf16(x, xp):
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


@njit(parallel=True, cache=True)
def _pack_f32(x, xp):
    """xp[g, k, l] = x[16 g + l, k]; 0 for tokens past the last."""
    n_tok = x.shape[0]
    for g in prange(xp.shape[0]):
        for lane in range(LANES):
            t = g * LANES + lane
            for k in range(xp.shape[1]):
                xp[g, k, lane] = x[t, k] if t < n_tok else np.float32(0)


def takes(bf16: bool, n_in: int) -> bool:
    """Whether an F16 (bf16 False) or BF16 matrix of rows of n_in weights takes these tiles on this CPU (built
    and not switched off; F16 rows of at least F16_MIN_ROW weights)."""
    if bf16:
        return BF16_ENABLED and n_in % STEP == 0
    return F16_ENABLED and n_in % STEP == 0 and n_in >= F16_MIN_ROW


def round_bf16(x: np.ndarray) -> np.ndarray:
    """x float32 (n, k) C-contiguous -> its BF16 bits, uint16 (n, k)."""
    xb = np.empty(x.shape, np.uint16)
    _round_bf16(x, xb)
    return xb


def pack_activations(x: np.ndarray, bf16: bool) -> np.ndarray:
    """x float32 (n_tok, n_in) C-contiguous -> the tiles' layout: BF16 uint32 (ceil(n_tok / 16), n_in / 2, 16),
    F16 float32 (ceil(n_tok / 16), n_in, 16)."""
    n_tok, n_in = x.shape
    groups = (n_tok + LANES - 1) // LANES
    if bf16:
        xp = np.empty((groups, n_in // 2, LANES), np.uint32)
        _pack_bf16(x, xp)
    else:
        xp = np.empty((groups, n_in, LANES), np.float32)
        _pack_f32(x, xp)
    return xp


def matmul(raw: np.ndarray, bf16: bool, x: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_out) = x (n_tok, n_in) @ W.T for raw (n_out, 2 * n_in) uint8 rows of F16 (bf16 False) or BF16
    values (BF16: x rounded to BF16 first); x float32 and out C-contiguous, takes(bf16, n_in)."""
    w = np.asarray(raw).view(np.uint16)
    xp = pack_activations(x, bf16)
    block, chunk = (BF16_BLOCK, BF16_CHUNK) if bf16 else (F16_BLOCK, F16_CHUNK)
    scratch = (min(chunk, xp.shape[0]), w.shape[0]) if x.shape[1] > block else (1, 1)
    (_gemm_bf16 if bf16 else _gemm_f16)(w, xp, np.empty((*scratch, LANES), np.float32), out)
