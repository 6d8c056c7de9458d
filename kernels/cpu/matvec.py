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

# Numba's OpenMP workers must not busy-wait between the ~170 short parallel calls of a decode step:
# libgomp's default spin (GOMP_SPINCOUNT 300k) turns into 10x slowdowns as soon as the 2 cores are
# shared (measured: decode 0.9 -> 12.6 tok/s at load 10). Read by libgomp when Numba first starts
# its thread pool, so it has to be in the environment before the first parallel kernel runs; an
# explicit setting by the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from .dequant import f16_at, k_scale_min  # noqa: E402

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
# weights/s on one core (old branchy kernel: 1.65). The row dot is therefore emitted as LLVM vector IR
# (~8 G weights/s): per 8 weights two 16-byte grid rows form one <8 x float>, the signs are xor-ed in as
# float sign bits from a (128, 8) table, one FMA with x; each 32-weight sub-block is scaled once and the
# whole row is one IR loop (one horizontal sum per row). Two rows share every x load (~20% faster than
# one row; four are no faster). Multi-byte fields are read little-endian.

_F32 = ir.FloatType()
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V8F, _V8I, _V4I = ir.VectorType(_F32, 8), ir.VectorType(_I32, 8), ir.VectorType(_I32, 4)
_CONTRACT = ("contract",)
_IQ3_SCALES = ((np.arange(16) + 0.5) * 0.5).astype(np.float32)   # 4-bit sub-block scale ls -> (ls + 0.5) / 2


@intrinsic
def _iq3_xxs_dot2(typingctx, raw3, r0, r1, x2, f16t, grid, signs, scales):
    """(dot(W[r0], x), dot(W[r1], x)) for IQ3_XXS rows r0, r1 of raw3 (uint8 (rows, blocks, 98)).

    x2: float32 (blocks, 256); f16t: F16_TABLE; grid: IQ3XXS_GRID (256, 4); signs: IQ2_SIGN_MASKS
    (128, 8) uint32; scales: _IQ3_SCALES; all C-contiguous."""
    arrays = ((raw3, types.uint8, 3), (x2, types.float32, 2), (f16t, types.float32, 1),
              (grid, types.float32, 2), (signs, types.uint32, 2), (scales, types.float32, 1))
    if not (all(isinstance(a, types.Array) and a.dtype == dt and a.ndim == nd and a.layout == "C"
                for a, dt, nd in arrays) and isinstance(r0, types.Integer) and isinstance(r1, types.Integer)):
        return None
    sig = types.UniTuple(types.float32, 2)(raw3, r0, r1, x2, f16t, grid, signs, scales)

    def codegen(context, builder, signature, args):
        def array(i):     # (i8* data, strides, shape) of array argument i
            a = cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i])
            return (builder.bitcast(a.data, _I8.as_pointer()), cgutils.unpack_tuple(builder, a.strides),
                    cgutils.unpack_tuple(builder, a.shape))

        def load(ptr, off, ty, align=1):
            off = off if isinstance(off, ir.Value) else ir.Constant(_I64, off)
            return builder.load(builder.bitcast(builder.gep(ptr, [off]), ty.as_pointer()), align=align)

        def field(word, shift, mask, scale):      # byte offset ((word >> shift) & mask) << scale
            v = builder.and_(builder.lshr(word, ir.Constant(word.type, shift)), ir.Constant(word.type, mask))
            return builder.shl(v if word.type == _I64 else builder.zext(v, _I64), ir.Constant(_I64, scale))

        def fma(a, b, c):
            return builder.fadd(builder.fmul(a, b, flags=_CONTRACT), c, flags=_CONTRACT)

        (praw, rstr, rshape), (px0, xstr, _) = array(0), array(3)
        pf16, pgrid, psign, pscale = (array(i)[0] for i in (4, 5, 6, 7))
        row0 = [builder.gep(praw, [builder.mul(context.cast(builder, args[i], signature.args[i], types.intp),
                                                rstr[0])]) for i in (1, 2)]
        undef = ir.Constant(_V8F, ir.Undefined)
        zero = ir.Constant(_V8F, None)
        acc_ptr = [cgutils.alloca_once_value(builder, zero) for _ in row0]   # promoted to registers
        with cgutils.for_range(builder, rshape[1]) as loop:                  # blocks of 256 weights
            rows = [builder.gep(p, [builder.mul(loop.index, rstr[1])]) for p in row0]
            px = builder.gep(px0, [builder.mul(loop.index, xstr[0])])
            acc = [builder.load(a) for a in acc_ptr]
            d = [load(pf16, builder.shl(builder.zext(load(p, 0, _I16), _I64), ir.Constant(_I64, 2)), _F32, 4)
                 for p in rows]
            for ib in range(8):                       # sub-blocks of 32 weights
                xv = [load(px, 4 * (32 * ib + 8 * l), _V8F, 4) for l in range(4)]
                for k, p in enumerate(rows):
                    aux = load(p, 66 + 4 * ib, _I32)  # four 7-bit sign indices, 4-bit scale on top
                    qs = load(p, 2 + 8 * ib, _I64)    # eight grid indices
                    t = zero
                    for l in range(4):                # 8 weights: grid rows qs[2l], qs[2l + 1]
                        g0 = load(pgrid, field(qs, 16 * l, 255, 4), _V4I, 4)
                        g1 = load(pgrid, field(qs, 16 * l + 8, 255, 4), _V4I, 4)
                        sign = load(psign, field(aux, 7 * l, 127, 5), _V8I, 4)
                        w = builder.xor(builder.shuffle_vector(g0, g1, ir.Constant(_V8I, list(range(8)))), sign)
                        t = fma(builder.bitcast(w, _V8F), xv[l], t)
                    sc = builder.fmul(d[k], load(pscale, field(aux, 28, 15, 2), _F32, 4))
                    scv = builder.shuffle_vector(builder.insert_element(undef, sc, ir.Constant(_I32, 0)), undef,
                                                 ir.Constant(_V8I, [0] * 8))
                    acc[k] = fma(scv, t, acc[k])
            for a, v in zip(acc_ptr, acc):
                builder.store(v, a)
        sums = []
        for a in acc_ptr:                             # horizontal sum 8 -> 4 -> 2 -> 1
            v = builder.load(a)
            for n in (4, 2, 1):
                half = ir.VectorType(_I32, n)
                v = builder.fadd(builder.shuffle_vector(v, v, ir.Constant(half, list(range(n)))),
                                 builder.shuffle_vector(v, v, ir.Constant(half, list(range(n, 2 * n)))))
            sums.append(builder.extract_element(v, ir.Constant(_I32, 0)))
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


# ------------------------------------------------------------------------ parallel drivers
# raw3 (n_out, n_blocks, block_nbytes); x3 (n_tok, n_blocks, block_size); out (n_tok, n_out)

@njit(cache=True, parallel=True)
def mv_q8_0(raw3, x3, out, f16t, bs):
    for r in prange(raw3.shape[0]):
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
    n = raw3.shape[0]
    for p in prange((n + 1) // 2):                    # row pairs; an odd last row pairs with itself
        r0 = 2 * p
        r1 = min(r0 + 1, n - 1)
        for t in range(x3.shape[0]):
            out[t, r0], out[t, r1] = _iq3_xxs_dot2(raw3, r0, r1, x3[t], f16t, grid, signs, _IQ3_SCALES)
