"""Fused quantized matrix x (few) vectors: out[t, r] = dot(W[r], x[t]), reading GGML blocks directly.

x stays float32 (no int8 re-quantization): for every 32 (or 16) weights the integer quants are
converted to float32 and multiply-added with x in a vectorized inner loop, the block scale is applied
once per block. Measured on this 2-core Zen 4 box this is faster than an int8 x / int32 pmaddwd
variant (LLVM turns the int path into vpmovsxbw + vpmaddwd + a horizontal add per block; the float
path is vpmovsxbd/vpmovzxbd + vcvtdq2ps + vfmadd231ps) and it keeps float32 accuracy.
Constant offsets (-8, -16, -32) and K-quant mins are folded in through per-block sums of x.

Vectorization notes (see dequant.py): blocks are addressed as raw3[row, block, byte]; inner loops take
their trip count as a runtime argument (32 / 16) so LLVM vectorizes them instead of unrolling them
and vectorizing over blocks. fastmath is limited to reassoc+contract (needed for vector reductions
and FMA); nothing here is meant to be bit-exact.
"""
import os

# How Numba's OpenMP workers wait between the ~170 short parallel calls of a decode step. libgomp's
# default spin (GOMP_SPINCOUNT 300k) turns into 10x slowdowns as soon as the 2 cores are shared
# (measured: decode 0.9 -> 12.6 tok/s at load 10 with PASSIVE). Never spinning costs a futex wake-up
# per call instead: a short spin (10k) made IQ3_XXS 1.5B decode 9.0 -> 10.65 tok/s on the idle
# machine and 2.12 -> 1.79 tok/s with 4 busy processes on the 2 cores. We take the short spin; set
# OMP_WAIT_POLICY=PASSIVE (and nothing else) on a machine shared with other busy work. Read by
# libgomp when Numba first starts its thread pool, so it must be in the environment before the first
# parallel kernel runs; any setting by the user wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["GOMP_SPINCOUNT"] = "10000"

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import llvm_ir as L  # noqa: E402
from .dequant import IQ2_SIGN_MASKS, f16_at, k_scale_min  # noqa: E402
from .prefetch import emit_prefetch, prefetch_row  # noqa: E402

FM = {"reassoc", "contract"}
F32 = np.float32
U8 = np.uint8     # narrowing casts: let LLVM unpack in 8/32-bit lanes instead of int64
U32 = np.uint32
BIT8 = np.array([1 << k for k in range(8)], dtype=np.uint8)


# ---------------------------------------------------------------------------------------- row dots
# blk: (n_blocks, block_nbytes) uint8 row;  x2: x of one token viewed (n_blocks, block_size);
# xs: per-32 (xs16: per-16) sums of that token's x, flat.

@njit(fastmath=FM, cache=True)
def dot_q8_0(blk, x2, f16t, bs):
    acc = F32(0)
    for b in range(blk.shape[0]):
        s = F32(0)
        for j in range(bs):
            s += F32(np.int8(blk[b, 2 + j])) * x2[b, j]
        acc += f16_at(blk, b, 0, f16t) * s
    return acc


@njit(fastmath=FM, cache=True)
def dot_q4_0(blk, x2, xs, f16t, hb):
    acc = F32(0)
    for b in range(blk.shape[0]):
        s = F32(0)
        for j in range(hb):
            v = blk[b, 2 + j]
            s += F32(U8(v & 15)) * x2[b, j] + F32(U8(v >> 4)) * x2[b, 16 + j]
        acc += f16_at(blk, b, 0, f16t) * (s - F32(8) * xs[b])
    return acc


@njit(fastmath=FM, cache=True)
def dot_iq4_nl(blk, x2, f16t, kv, hb):
    acc = F32(0)
    for b in range(blk.shape[0]):
        s = F32(0)
        for j in range(hb):
            v = blk[b, 2 + j]
            s += kv[U8(v & 15)] * x2[b, j] + kv[U8(v >> 4)] * x2[b, 16 + j]
        acc += f16_at(blk, b, 0, f16t) * s
    return acc


@njit(fastmath=FM, cache=True)
def dot_q5_0(blk, x2, xs, f16t, hb):
    # x2: this token's x viewed (n_blocks, 4, 8) so every x index is a plain (block, group, lane)
    # hb = 8: the 5th bits come from qh bytes g (values j = 8g+k) and g+2 (values 16+j). They are tested
    # with a mask table BIT8[k] = 1 << k (a contiguous vector load) instead of a variable shift, which
    # LLVM kept in 64-bit lanes (vpsrlvq); this keeps the unpacking in narrow lanes.
    acc = F32(0)
    for b in range(blk.shape[0]):
        s = F32(0)
        for g in range(2):
            hlo = blk[b, 2 + g]
            hhi = blk[b, 4 + g]
            for k in range(hb):
                v = blk[b, 6 + 8 * g + k]
                m = BIT8[k]
                lo = U8(v & 15) | U8(U8(U8(hlo & m) != 0) << 4)
                hi = U8(v >> 4) | U8(U8(U8(hhi & m) != 0) << 4)
                s += F32(lo) * x2[b, g, k] + F32(hi) * x2[b, 2 + g, k]
        acc += f16_at(blk, b, 0, f16t) * (s - F32(16) * xs[b])
    return acc


@njit(fastmath=FM, cache=True)
def dot_q4_k(blk, x2, xs, f16t, bs):
    acc = F32(0)
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 0, f16t)
        dmin = f16_at(blk, b, 2, f16t)
        for jj in range(4):
            sc0, m0 = k_scale_min(blk, b, 2 * jj)
            sc1, m1 = k_scale_min(blk, b, 2 * jj + 1)
            s0 = F32(0)
            s1 = F32(0)
            o = 64 * jj
            for j in range(bs):
                v = blk[b, 16 + 32 * jj + j]
                s0 += F32(U8(v & 15)) * x2[b, o + j]
                s1 += F32(U8(v >> 4)) * x2[b, o + 32 + j]
            acc += d * (F32(sc0) * s0 + F32(sc1) * s1) - dmin * (
                F32(m0) * xs[8 * b + 2 * jj] + F32(m1) * xs[8 * b + 2 * jj + 1])
    return acc


@njit(fastmath=FM, cache=True)
def dot_q5_k(blk, x2, xs, f16t, bs):
    acc = F32(0)
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 0, f16t)
        dmin = f16_at(blk, b, 2, f16t)
        for jj in range(4):
            sc0, m0 = k_scale_min(blk, b, 2 * jj)
            sc1, m1 = k_scale_min(blk, b, 2 * jj + 1)
            s0 = F32(0)
            s1 = F32(0)
            o = 64 * jj
            sh = np.uint8(2 * jj)
            for j in range(bs):
                v = blk[b, 48 + 32 * jj + j]
                h = U8(blk[b, 16 + j] >> sh)
                s0 += F32(U8((v & 15) | ((h & 1) << 4))) * x2[b, o + j]
                s1 += F32(U8((v >> 4) | ((h & 2) << 3))) * x2[b, o + 32 + j]
            acc += d * (F32(sc0) * s0 + F32(sc1) * s1) - dmin * (
                F32(m0) * xs[8 * b + 2 * jj] + F32(m1) * xs[8 * b + 2 * jj + 1])
    return acc


@njit(fastmath=FM, cache=True)
def dot_q6_k(blk, x2, xs16, f16t, hb):
    acc = F32(0)
    for b in range(blk.shape[0]):
        d = f16_at(blk, b, 208, f16t)
        for n in range(2):
            for half in range(2):
                s0 = F32(0)
                s1 = F32(0)
                s2 = F32(0)
                s3 = F32(0)
                ob = 128 * n + 16 * half
                for k in range(hb):
                    kk = 16 * half + k
                    ql0 = blk[b, 64 * n + kk]
                    ql1 = blk[b, 64 * n + 32 + kk]
                    qh = blk[b, 128 + 32 * n + kk]
                    s0 += F32(U8((ql0 & 15) | ((qh & 3) << 4))) * x2[b, ob + k]
                    s1 += F32(U8((ql1 & 15) | ((qh & 12) << 2))) * x2[b, ob + 32 + k]
                    s2 += F32(U8((ql0 >> 4) | (qh & 48))) * x2[b, ob + 64 + k]
                    s3 += F32(U8((ql1 >> 4) | ((qh >> 2) & 48))) * x2[b, ob + 96 + k]
                sb = 192 + 8 * n + half
                xb = 16 * b + 8 * n + half
                t = (F32(np.int8(blk[b, sb])) * (s0 - F32(32) * xs16[xb])
                     + F32(np.int8(blk[b, sb + 2])) * (s1 - F32(32) * xs16[xb + 2])
                     + F32(np.int8(blk[b, sb + 4])) * (s2 - F32(32) * xs16[xb + 4])
                     + F32(np.int8(blk[b, sb + 6])) * (s3 - F32(32) * xs16[xb + 6]))
                acc += d * t
    return acc


# ------------------------------------------------------------------------------------------ IQ3_XXS
# Every 4 weights are a look-up in a 256-row grid and every 8 share a 7-bit sign pattern. Numba runs LLVM
# without the SLP vectorizer and its loop vectorizer scalarizes table look-ups (no fast gathers here), so
# the best plain-Numba version (decode a row into an int8 scratch, then a vectorized dot) reached 3.3 G
# weights/s on one core (old branchy kernel: 1.65). The row dots are therefore emitted as LLVM vector IR:
# per 8 weights two 16-byte grid rows form one <8 x float>, the signs are xor-ed in as float sign bits
# from a (128, 8) table, then FMA with x. One Zen 4 core, 1024 -> 4864, min over rounds: 9.6 G weights/s
# (first IR version: 8.2). What limits it is loads (3 table loads per 8 weights; without the sign load
# it runs 30% faster) and µops, not FMAs. Each choice below was timed side by side with a copy of this
# kernel that differs in that one point (time of the alternative):
#   * 4 rows per call share each x load (2 rows: +8%; 8 rows spill: +13%);
#   * the 32-weight sub-block loop is not unrolled (unrolled x8, LLVM hoists all index loads and
#     spills: +8%);
#   * index fields are cut with a rotate and a mask LLVM cannot see through (from the table shape and
#     strides), so it cannot turn the rotate into a shift: x86-64 gets rorx + and per index instead of
#     mov + shr + and (+11%). Loading each index byte instead (movzbl + shl: fewer µops, one more
#     load per index) is slower (+12%);
#   * the sign table is a 64-byte aligned copy (numpy's 16-byte alignment puts half of the 32-byte
#     rows across two cache lines: +8%);
#   * each sub-block sum starts with a multiply, not an FMA onto zero (+5%).
# With 2..4 tokens each 8-weight group is decoded once, scaled, and multiply-added into every token's
# accumulator (2 rows x n_tok); more tokens go in chunks of 2..4 (1 row x 8 tokens: +18%; 2 x 8 spills).
# Same shape, per call (before: decoded again for every token): 2 tokens 1.21 -> 0.64 ms, 3 tokens
# 1.77 -> 0.73 ms, 4 tokens 2.36 -> 0.89 ms, 8 tokens 4.83 -> 1.85..2.03 ms.
# Multi-byte fields are read little-endian.

_F32 = ir.FloatType()
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V8F, _V8I, _V4I = ir.VectorType(_F32, 8), ir.VectorType(_I32, 8), ir.VectorType(_I32, 4)
_CONTRACT = ("contract",)
_IQ3_SCALES = ((np.arange(16) + 0.5) * 0.5).astype(np.float32)   # 4-bit sub-block scale ls -> (ls + 0.5) / 2
IQ3_MAX_TOK = 4     # tokens per _iq3_xxs_dot call


def _aligned(a, align=64):
    """A copy of a whose data starts on an align-byte boundary."""
    buf = np.empty(a.nbytes + align, dtype=np.uint8)
    off = -buf.ctypes.data % align
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


IQ3_SIGNS = _aligned(IQ2_SIGN_MASKS)   # pass as mv_iq3_xxs's signs


@intrinsic
def _iq3_xxs_dot(typingctx, raw3, r0, x3, t0, n_tok, out, f16t, grid, signs, scales):
    """out[t0 + j, r] = dot(W[r], x3[t0 + j]) for j < n_tok (a literal 1..IQ3_MAX_TOK) and R rows
    r = r0.. (R = 4 for one token, else 2; rows past the last are clamped to it, i.e. computed again).
    raw3: IQ3_XXS rows, uint8 (rows, blocks, 98); x3: float32 (tokens, blocks, 256); out: float32
    (tokens, rows); f16t: F16_TABLE; grid: IQ3XXS_GRID (256, 4); signs: IQ3_SIGNS (128, 8) uint32;
    scales: _IQ3_SCALES; all C-contiguous."""
    if not (L.c_arrays((raw3, types.uint8, 3), (x3, types.float32, 3), (out, types.float32, 2),
                       (f16t, types.float32, 1), (grid, types.float32, 2), (signs, types.uint32, 2),
                       (scales, types.float32, 1))
            and L.tile_args(r0, t0, n_tok, IQ3_MAX_TOK)):
        return None
    sig = types.void(raw3, types.intp, x3, types.intp, n_tok, out, f16t, grid, signs, scales)
    T = n_tok.literal_value
    R = 4 if T == 1 else 2

    def codegen(context, builder, signature, args):
        const = L.const

        def array(i):
            return L.array_arg(context, builder, signature.args[i], args[i])

        def load(ptr, off, ty, align=1):
            return L.load(builder, ptr, off, ty, align)

        def field(word, shift, mask):              # byte offset rotr(word, shift) & mask, as i64
            ty = word.type
            rotr = builder.module.declare_intrinsic("llvm.fshr", [ty], ir.FunctionType(ty, [ty] * 3))
            v = builder.and_(builder.call(rotr, [word, word, const(shift % ty.width, ty)]), mask)
            return v if word.type == _I64 else builder.zext(v, _I64)

        def fma(a, b, c):
            return builder.fadd(builder.fmul(a, b, flags=_CONTRACT), c, flags=_CONTRACT)

        def splat(s):
            return L.splat(builder, s, _V8F)

        (praw, rstr, rshape), (px0, xstr, xshape), (pout, ostr, _) = array(0), array(2), array(5)
        pf16, pscale = array(6)[0], array(9)[0]
        (pgrid, gstr, gshape), (psign, sstr, sshape) = array(7), array(8)
        # index masks: byte offset of a table's last row, (rows - 1) * row stride (powers of 2). Runtime
        # values, so LLVM knows none of their bits (see the comment block).
        gmask = builder.mul(builder.sub(gshape[0], const(1)), gstr[0])
        smask = builder.trunc(builder.mul(builder.sub(sshape[0], const(1)), sstr[0]), _I32)
        r_idx = L.clamped_rows(builder, args[1], R, rshape[0])
        t_idx = [builder.add(args[3], const(j)) for j in range(T)]
        row0 = [builder.gep(praw, [builder.mul(r, rstr[0])]) for r in r_idx]
        x0 = [builder.gep(px0, [builder.mul(t, xstr[0])]) for t in t_idx]
        zero = ir.Constant(_V8F, None)
        acc_ptr = [[cgutils.alloca_once_value(builder, zero) for _ in range(T)] for _ in range(R)]  # -> registers

        def decode(l, qs, aux):           # weights 8l..8l+7 of a sub-block: grid rows qs[2l], qs[2l + 1]
            g0 = load(pgrid, field(qs, 16 * l - 4, gmask), _V4I, 4)
            g1 = load(pgrid, field(qs, 16 * l + 4, gmask), _V4I, 4)
            sign = load(psign, field(aux, 7 * l - 5, smask), _V8I, 4)
            w = builder.xor(builder.shuffle_vector(g0, g1, ir.Constant(_V8I, list(range(8)))), sign)
            return builder.bitcast(w, _V8F)

        # software prefetch of the next row group (the rows this thread's next call reads: prange hands each
        # thread a contiguous range): a row of 1536 weights is only 588 bytes, too short a stream for the
        # hardware prefetcher, and a model's weights come from DRAM. Streaming 28 distinct 1536x17920
        # matrices: 11.0 -> 17.7 G weights/s on 2 threads (hot, in cache: 18.4 either way).
        next_group = builder.mul(const(R), rstr[0])
        with cgutils.for_range(builder, rshape[1]) as blk:                   # blocks of 256 weights
            rows = [builder.gep(p, [builder.mul(blk.index, rstr[1])]) for p in row0]
            for p in rows:                    # a 98-byte block spans at most 2 cache lines
                for o in (0, 64):
                    emit_prefetch(builder, builder.gep(p, [builder.add(next_group, const(o))]))
            xb = [builder.gep(p, [builder.mul(blk.index, xstr[1])]) for p in x0]
            d = [load(pf16, builder.shl(builder.zext(load(p, 0, _I16), _I64), const(2)), _F32, 4) for p in rows]
            # sub-blocks of 32 weights; a runtime trip count (256 / 32) keeps LLVM from unrolling the loop
            with cgutils.for_range(builder, builder.lshr(xshape[2], const(5))) as sub:
                s = sub.index
                acc = [[builder.load(a) for a in ar] for ar in acc_ptr]
                xv = [[load(p, builder.add(builder.mul(s, const(128)), const(32 * l)), _V8F, 4) for l in range(4)]
                      for p in xb]
                for k, p in enumerate(rows):
                    aux = load(p, builder.add(builder.mul(s, const(4)), const(66)), _I32)  # 4 sign indices, scale
                    qs = load(p, builder.add(builder.mul(s, const(8)), const(2)), _I64)    # 8 grid indices
                    ls = builder.zext(builder.lshr(aux, const(28, _I32)), _I64)
                    sc = splat(builder.fmul(d[k], load(pscale, builder.shl(ls, const(2)), _F32, 4)))
                    if T == 1:                # sum the sub-block, then scale it once
                        w = [decode(l, qs, aux) for l in range(4)]
                        t = builder.fmul(w[0], xv[0][0], flags=_CONTRACT)
                        for l in range(1, 4):
                            t = fma(w[l], xv[0][l], t)
                        acc[k][0] = fma(sc, t, acc[k][0])
                    else:                     # scale each group once, then one FMA per token
                        for l in range(4):
                            w = builder.fmul(decode(l, qs, aux), sc, flags=_CONTRACT)
                            for j in range(T):
                                acc[k][j] = fma(w, xv[j][l], acc[k][j])
                for ar, vr in zip(acc_ptr, acc):
                    for a, v in zip(ar, vr):
                        builder.store(v, a)
        L.store_tile(builder, pout, ostr, t_idx, r_idx, lambda k, j: L.hsum(builder, builder.load(acc_ptr[k][j])))
        return context.get_dummy_value()

    return sig, codegen


# ------------------------------------------------------------------------ parallel drivers
# raw3 (n_out, n_blocks, block_nbytes); x3 (n_tok, n_blocks, block_size); out (n_tok, n_out)

@njit(cache=True, parallel=True)
def mv_q8_0(raw3, x3, out, f16t, bs):
    n = raw3.shape[0]
    for r in prange(n):
        if r + 1 < n:
            prefetch_row(raw3, r + 1)      # rows of a few hundred bytes: see prefetch.py
        for t in range(x3.shape[0]):
            out[t, r] = dot_q8_0(raw3[r], x3[t], f16t, bs)


@njit(cache=True)
def mv_q8_0_serial(raw3, x3, out, f16t, bs):
    """mv_q8_0 on the calling thread only: for small matrices a parallel launch costs more than it saves."""
    for r in range(raw3.shape[0]):
        for t in range(x3.shape[0]):
            out[t, r] = dot_q8_0(raw3[r], x3[t], f16t, bs)


@njit(cache=True, parallel=True)
def mv_q4_0(raw3, x3, xs, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        for t in range(x3.shape[0]):
            out[t, r] = dot_q4_0(raw3[r], x3[t], xs[t], f16t, bs)


@njit(cache=True, parallel=True)
def mv_iq4_nl(raw3, x3, out, f16t, kv, bs):
    for r in prange(raw3.shape[0]):
        for t in range(x3.shape[0]):
            out[t, r] = dot_iq4_nl(raw3[r], x3[t], f16t, kv, bs)


@njit(cache=True, parallel=True)
def mv_q5_0(raw3, x3, xs, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        for t in range(x3.shape[0]):
            out[t, r] = dot_q5_0(raw3[r], x3[t], xs[t], f16t, bs)


@njit(cache=True, parallel=True)
def mv_q4_k(raw3, x3, xs, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        for t in range(x3.shape[0]):
            out[t, r] = dot_q4_k(raw3[r], x3[t], xs[t], f16t, bs)


@njit(cache=True, parallel=True)
def mv_q5_k(raw3, x3, xs, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        for t in range(x3.shape[0]):
            out[t, r] = dot_q5_k(raw3[r], x3[t], xs[t], f16t, bs)


@njit(cache=True, parallel=True)
def mv_q6_k(raw3, x3, xs16, out, f16t, bs):
    for r in prange(raw3.shape[0]):
        for t in range(x3.shape[0]):
            out[t, r] = dot_q6_k(raw3[r], x3[t], xs16[t], f16t, bs)


@njit(cache=True, parallel=True)
def mv_iq3_xxs(raw3, x3, out, f16t, grid, signs):
    """signs: IQ3_SIGNS (any (128, 8) copy works, the aligned one is faster)."""
    n, n_tok = raw3.shape[0], x3.shape[0]
    if n_tok == 1:
        for q in prange((n + 3) // 4):
            _iq3_xxs_dot(raw3, 4 * q, x3, 0, 1, out, f16t, grid, signs, _IQ3_SCALES)
    else:
        n_chunks = (n_tok + IQ3_MAX_TOK - 1) // IQ3_MAX_TOK      # chunks of 2..4 tokens, as even as possible
        for p in prange((n + 1) // 2):
            for c in range(n_chunks):
                t0 = n_tok * c // n_chunks
                nt = n_tok * (c + 1) // n_chunks - t0
                if nt == 4:
                    _iq3_xxs_dot(raw3, 2 * p, x3, t0, 4, out, f16t, grid, signs, _IQ3_SCALES)
                elif nt == 3:
                    _iq3_xxs_dot(raw3, 2 * p, x3, t0, 3, out, f16t, grid, signs, _IQ3_SCALES)
                else:
                    _iq3_xxs_dot(raw3, 2 * p, x3, t0, 2, out, f16t, grid, signs, _IQ3_SCALES)
