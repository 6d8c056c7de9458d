"""Attention scores q.k in integer arithmetic with AVX2, for kernels/cpu/attention.py, and the float path's
scores by the same eight-key reduction tree (scores_float).

A key's group of KV_GROUP = 32 channels is int8 with its own float32 scale (kv_layout.py); the query is
rounded per (query row, group) to integers with a float32 scale, so one group's dot product is exact
integer arithmetic. Two query roundings:
  * int8 (quantize_row): as ggml rounds activations to Q8_0 (d = max|x| / 127, q = rint(x / d), d stored
    as f16; act_quant.py). A group is one 256-bit integer dot: pmaddubsw takes unsigned x signed bytes,
    so it gets |k| and sign(k) * q (psignb); its int16 pair sums (<= 2 * 127^2 < 2^15) are widened and
    paired by pmaddwd. On random data the rounding moves outputs by ~0.4% of their scale.
  * int16 (quantize_row16): d = max|x| / 32767 in float32, an error of 1/65534 of the group's max|x|
    per channel: ~1.5e-5 of the outputs' scale on random data, but it follows the group's largest |q|
    (attention.py: why neither path is the default). The keys are sign-extended to int16 when the block
    is gathered; a group is two pmaddwd (products <= 32767 * 127, a group's sum < 2^31).
Eight keys' int32 partial sums are reduced together by a transpose tree (one vector of eight dot
products, no per-key horizontal sum), converted to float and scaled by d_q * d_k:

    S[r, j] = sum over groups g (in order) of dot_g(q_r, k_j) * (qd[r, g] * ks[g, j])

The integer dots are exact and the float part is a fixed sequence per (row, key) (no contraction), so a
score does not depend on the other rows or keys in the block: batch invariance holds as on the float path.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from .act_quant import round_f16

GROUP = 32        # channels per integer dot: KV_GROUP (one 256-bit register of int8, two of int16)
KEYS = 8          # keys per reduction tree (one float vector of scores)


@njit(cache=True, inline="always")
def quantize_row(x, qi, qd, r, scale):
    """x (head_dim,) f32 -> qi[r] int8 and qd[r, g] = f16(max|x_g| / 127) * scale (ggml's Q8_0 rounding,
    with the softmax scale folded into the group's float scale)."""
    for g in range(qd.shape[1]):
        lo = g * GROUP
        amax = np.float32(0.0)
        for c in range(lo, lo + GROUP):
            amax = max(amax, abs(x[c]))
        d = np.float32(amax / np.float32(127.0))
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        qd[r, g] = np.float32(round_f16(d)) * scale
        for c in range(lo, lo + GROUP):
            qi[r, c] = np.int8(np.rint(x[c] * inv))


@njit(cache=True, inline="always")
def quantize_row16(x, qi, qd, r, scale):
    """x (head_dim,) f32 -> qi[r] int16 and qd[r, g] = (max|x_g| / 32767) * scale: the query to 16 bits
    per group (a relative error of 1/65534 of the group's max; the scale stays float32)."""
    for g in range(qd.shape[1]):
        lo = g * GROUP
        amax = np.float32(0.0)
        for c in range(lo, lo + GROUP):
            amax = max(amax, abs(x[c]))
        d = np.float32(amax / np.float32(32767.0))
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        qd[r, g] = d * scale
        for c in range(lo, lo + GROUP):
            qi[r, c] = np.int16(np.rint(x[c] * inv))


def _tree_sum(builder, vs):
    """8 vectors of 8 (int32 or float32) -> one vector whose lane i is the sum of vs[i]'s lanes: three rounds
    of pairwise interleave-and-add (lanes 0-7, then pairs of lanes, then 128-bit halves), a fixed order."""
    pats = ([[0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]],
            [[0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]],
            [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]])
    idx = ir.VectorType(L.I32, 8)
    add = builder.fadd if isinstance(vs[0].type.element, ir.FloatType) else builder.add
    for a, b in pats:
        vs = [add(builder.shuffle_vector(x, y, ir.Constant(idx, a)), builder.shuffle_vector(x, y, ir.Constant(idx, b)))
              for x, y in zip(vs[0::2], vs[1::2])]
    return vs[0]


def _dot8(builder, qrow, kp, goff):
    """int8 group dot: 32 q bytes at qrow + goff against 32 k bytes at kp + goff -> 8 int32 partial sums."""
    psign, maddubs, maddwd = (L.avx2(builder, n) for n in ("psign.b", "pmadd.ub.sw", "pmadd.wd"))
    qv = L.load(builder, qrow, goff, L.V32B)
    kv = L.load(builder, kp, goff, L.V32B)
    pair = builder.call(maddubs, [builder.call(psign, [kv, kv]), builder.call(psign, [qv, kv])])
    return builder.call(maddwd, [pair, ir.Constant(L.V16W, [1] * 16)])


def _dot16(builder, qrow, kp, goff):
    """int16 group dot: 32 q int16 at qrow + 2 goff against 32 k int16 -> 8 int32 partial sums (pmaddwd)."""
    maddwd = L.avx2(builder, "pmadd.wd")
    off = builder.mul(goff, L.const(2))
    halves = [builder.call(maddwd, [L.load(builder, qrow, builder.add(off, L.const(h)), L.V16W),
                                    L.load(builder, kp, builder.add(off, L.const(h)), L.V16W)]) for h in (0, 32)]
    return builder.add(*halves)


V32F = ir.VectorType(L.F32, GROUP)


@intrinsic
def dequant_key(typingctx, pages, scales, page, slot, g, buf, j):
    """buf[j] = float32(pages[page, slot, g]) * its group scales (scales[page, slot, g], one per 32 channels):
    one key's int8 row of a (n_pages, page_size, n_kv_heads, head_dim) cache into row j of a float32 (keys,
    head_dim) buffer, each group one vector sign-extension, convert and multiply, addressed from the arrays'
    strides (no row views). head_dim a multiple of 32; the scalar loop's products."""
    if not (L.c_arrays((pages, types.int8, 4), (scales, types.float32, 4), (buf, types.float32, 2))
            and all(isinstance(v, types.Integer) for v in (page, slot, g, j))):
        return None
    sig = types.void(pages, scales, types.intp, types.intp, types.intp, buf, types.intp)

    def codegen(context, builder, signature, args):
        (pp, pstr, pshape), (ps, sstr, _), (pb, bstr, _) = (
            L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 1, 5))
        page, slot, g, j = args[2], args[3], args[4], args[6]
        src = builder.gep(pp, [builder.add(builder.add(builder.mul(page, pstr[0]), builder.mul(slot, pstr[1])),
                                           builder.mul(g, pstr[2]))])
        sc = builder.gep(ps, [builder.add(builder.add(builder.mul(page, sstr[0]), builder.mul(slot, sstr[1])),
                                          builder.mul(g, sstr[2]))])
        dst = builder.gep(pb, [builder.mul(j, bstr[0])])
        n_groups = builder.sdiv(pshape[3], L.const(GROUP))
        with cgutils.for_range(builder, n_groups) as loop:
            gi = loop.index
            f = builder.sitofp(L.load(builder, src, builder.mul(gi, L.const(GROUP)), L.V32B), V32F)
            f = builder.fmul(f, L.splat(builder, L.load(builder, sc, builder.mul(gi, L.const(4)), L.F32), V32F))
            builder.store(f, builder.bitcast(builder.gep(dst, [builder.mul(gi, L.const(4 * GROUP))]),
                                             V32F.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def scores_float(typingctx, qs, kb, s, rows):
    """s[r, j] = sum over channels of qs[r, c] * kb[j, c] for r < rows and every key j of the block: qs
    float32 (max rows, head_dim) the scaled query rows, kb float32 (block keys, head_dim) the dequantized
    keys, s float32 (max rows, block keys). Per eight keys: each key's products accumulated in one 8-lane
    vector over the channels' 8-wide chunks in order (fused multiply-adds), then the eight vectors reduced
    together by _tree_sum: a fixed order per (row, key), no horizontal sum per key. Block keys a multiple of
    KEYS, head_dim of 8."""
    if not (L.c_arrays((qs, types.float32, 2), (kb, types.float32, 2), (s, types.float32, 2))
            and isinstance(rows, types.Integer)):
        return None
    sig = types.void(qs, kb, s, types.intp)

    def codegen(context, builder, signature, args):
        (pq, qstr, qshape), (pk, kstr, kshape), (ps, ostr, _) = (
            L.array_arg(context, builder, signature.args[i], args[i]) for i in range(3))
        rows = context.cast(builder, args[3], signature.args[3], types.intp)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(L.V8F, [L.V8F] * 3), "llvm.fma.v8f32")
        n_oct = builder.udiv(kshape[0], L.const(KEYS))
        n_chunks = builder.udiv(qshape[1], L.const(8))
        zero = ir.Constant(L.V8F, [0.0] * 8)
        with cgutils.for_range(builder, rows) as rl:
            qrow = builder.gep(pq, [builder.mul(rl.index, qstr[0])])
            srow = builder.gep(ps, [builder.mul(rl.index, ostr[0])])
            with cgutils.for_range(builder, n_oct) as jl:
                j0 = builder.mul(jl.index, L.const(KEYS))
                krows = [builder.gep(pk, [builder.mul(builder.add(j0, L.const(k)), kstr[0])]) for k in range(KEYS)]
                accs = [cgutils.alloca_once_value(builder, zero) for _ in range(KEYS)]
                with cgutils.for_range(builder, n_chunks) as cl:
                    off = builder.mul(cl.index, L.const(32))
                    qv = L.load(builder, qrow, off, L.V8F)
                    for kp, acc in zip(krows, accs):
                        builder.store(builder.call(fma, [qv, L.load(builder, kp, off, L.V8F), builder.load(acc)]), acc)
                out = builder.bitcast(builder.gep(srow, [builder.mul(j0, L.const(4))]), L.V8F.as_pointer())
                builder.store(_tree_sum(builder, [builder.load(a) for a in accs]), out, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _make_scores(qtype, dot):
    """The scores intrinsic for queries and keys of integer type qtype, one group's dot product by dot."""
    @intrinsic
    def scores(typingctx, qi, qd, kq, ks, s, rows):
        """s[r, j] for r < rows and every key j of the block: qi (max rows, head_dim) and qd float32 (max
        rows, groups) from the query rounding; kq (block keys, head_dim) the block's keys and ks float32
        (groups, block keys) their scales (transposed: eight keys' scales are one load); s float32 (max
        rows, block keys). Block keys a multiple of KEYS, head_dim = groups * GROUP."""
        if not (L.c_arrays((qi, qtype, 2), (qd, types.float32, 2), (kq, qtype, 2),
                           (ks, types.float32, 2), (s, types.float32, 2)) and isinstance(rows, types.Integer)):
            return None
        sig = types.void(qi, qd, kq, ks, s, types.intp)

        def codegen(context, builder, signature, args):
            (pqi, qstr, _), (pqd, dstr, dshape), (pkq, kstr, kshape), (pks, sstr, _), (ps, ostr, _) = (
                L.array_arg(context, builder, signature.args[i], args[i]) for i in range(5))
            rows = context.cast(builder, args[5], signature.args[5], types.intp)
            n_oct = builder.udiv(kshape[0], L.const(KEYS))
            with cgutils.for_range(builder, rows) as rl:
                r = rl.index
                qrow = builder.gep(pqi, [builder.mul(r, qstr[0])])
                drow = builder.gep(pqd, [builder.mul(r, dstr[0])])
                srow = builder.gep(ps, [builder.mul(r, ostr[0])])
                with cgutils.for_range(builder, n_oct) as jl:
                    j0 = builder.mul(jl.index, L.const(KEYS))
                    acc = cgutils.alloca_once_value(builder, ir.Constant(L.V8F, None))
                    with cgutils.for_range(builder, dshape[1]) as gl:
                        g = gl.index
                        goff = builder.mul(g, L.const(GROUP))
                        krows = [builder.gep(pkq, [builder.mul(builder.add(j0, L.const(k)), kstr[0])])
                                 for k in range(KEYS)]
                        dots = [dot(builder, qrow, kp, goff) for kp in krows]
                        dsum = builder.sitofp(_tree_sum(builder, dots), L.V8F)
                        dq = L.splat(builder, L.load(builder, drow, builder.mul(g, L.const(4)), L.F32, 4), L.V8F)
                        dk = L.load(builder, pks, builder.add(builder.mul(g, sstr[0]), builder.mul(j0, L.const(4))),
                                    L.V8F, 4)
                        builder.store(builder.fadd(builder.load(acc), builder.fmul(dsum, builder.fmul(dq, dk))), acc)
                    out = builder.bitcast(builder.gep(srow, [builder.mul(j0, L.const(4))]), L.V8F.as_pointer())
                    builder.store(builder.load(acc), out, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return scores


scores_int8 = _make_scores(types.int8, _dot8)
scores_int16 = _make_scores(types.int16, _dot16)
