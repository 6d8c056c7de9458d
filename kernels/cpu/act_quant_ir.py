"""llama.cpp's Q8_0 and Q8_K rounding of one activation block in vector instructions, and the 4-row layout's
copy of a Q8_0 block (rows4_int8.py), for the int8 kernels' per-call preparation of their activations.

As scalar loops these took ~1.4 us for the 896 activations of a 0.5B-model mat-vec (Q8_0), the 4-row
layout's byte copies another ~1.2, and the Q8_K rounding of 4,864 activations ~3.8, on the calling thread
while the other threads waited, ~100 times a decode token. Here every 8 values are one vector: an |x| max
tree, the same scalar scale arithmetic, one multiply, round and narrowing; the same operations on the same
values, so the same bits (tests/kernels/test_act_quant_ir.py compares them with numpy's float32 forms):

    Q8_0 (32 values): amax = max |x_j|;  s = amax / 127;  inv = 1 / s (0 when s = 0);  d = s rounded to f16
        (fptrunc: ties to even, as act_quant.round_f16);  q_j = int8(rint(x_j * inv))
    Q8_K (256 values): mx = the first x_j of the largest magnitude;  iscale = -127 / mx;  d = 1 / iscale;
        q_j = min(127, rint(iscale * x_j)), stored + 128;  8 sums of 32 q_j;  an all-zero block: d = 0, q = 0

(max is exact in any order; NaN inputs give unspecified codes in both forms.)
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import llvm_ir as L

V8B = ir.VectorType(L.I8, 8)
_ABS = ir.Constant(L.V8I, [0x7FFFFFFF] * 8)


def _f16_round(builder, v):
    """float -> the nearest float16 value as a float (IEEE round to nearest even; >= 65520 -> inf)."""
    return builder.fpext(builder.fptrunc(v, ir.HalfType()), L.F32)


def _rint(builder, v):
    fn = builder.module.declare_intrinsic("llvm.rint.v8f32", (), ir.FunctionType(L.V8F, [L.V8F]))
    return builder.call(fn, [v])


def _tree(builder, vs, pick):
    """pick(a, b) (a select between two vectors) over the vectors lane-wise, then over the lanes -> a scalar."""
    while len(vs) > 1:
        vs = [pick(vs[i], vs[i + 1]) for i in range(0, len(vs), 2)]
    v, n = vs[0], vs[0].type.count // 2
    while n >= 1:
        idx = ir.VectorType(L.I32, n)
        v = pick(builder.shuffle_vector(v, v, ir.Constant(idx, list(range(n)))),
                 builder.shuffle_vector(v, v, ir.Constant(idx, list(range(n, 2 * n)))))
        n //= 2
    return builder.extract_element(v, L.const(0, L.I32))


def _fmax_tree(builder, vs):
    """The largest lane of the float vectors (fcmp ogt + select: maxps)."""
    return _tree(builder, vs, lambda a, b: builder.select(builder.fcmp_ordered(">", a, b), a, b))


def _imin_tree(builder, vs):
    """The least lane of the int32 vectors (signed)."""
    return _tree(builder, vs, lambda a, b: builder.select(builder.icmp_signed("<", a, b), a, b))


def _at(builder, i, j, strides):
    """Byte offset of element [i, j] (of its first two dimensions) of an array with these strides."""
    return builder.add(builder.mul(i, strides[0]), builder.mul(j, strides[1]))


def _load_block(builder, px, off, n):
    """(the n <8 x float> vectors of a block at byte offset off of i8* px, their absolute values)."""
    xv = [L.load(builder, px, builder.add(off, L.const(32 * k)), L.V8F) for k in range(n)]
    return xv, [builder.bitcast(builder.and_(builder.bitcast(v, L.V8I), _ABS), L.V8F) for v in xv]


@intrinsic
def q8_0_block(typingctx, x3, tx, b, q, d, tq):
    """x3[tx, b] (32 float32) -> q[tq, b] (32 int8) and d[tq, b] (the f16-rounded scale, float32): llama.cpp's
    Q8_0 rounding. x3 float32 (tokens, blocks, 32), q int8 (tokens, blocks, 32), d float32 (tokens, blocks),
    all C-contiguous."""
    if not (L.c_arrays((x3, types.float32, 3), (q, types.int8, 3), (d, types.float32, 2))
            and all(isinstance(i, types.Integer) for i in (tx, b, tq))):
        return None
    sig = types.void(x3, tx, b, q, d, tq)

    def codegen(context, builder, signature, args):
        (px, xs, _), (pq, qs, _), (pd, ds, _) = (L.array_arg(context, builder, signature.args[i], args[i])
                                                 for i in (0, 3, 4))
        tx_, b_, tq_ = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2, 5))
        xv, absv = _load_block(builder, px, _at(builder, tx_, b_, xs), 4)
        amax = _fmax_tree(builder, absv)
        s = builder.fdiv(amax, ir.Constant(L.F32, 127.0))
        zero = ir.Constant(L.F32, 0.0)
        inv = builder.select(builder.fcmp_unordered("!=", s, zero),
                             builder.fdiv(ir.Constant(L.F32, 1.0), s), zero)
        L.store_f32(builder, pd, _at(builder, tq_, b_, ds), _f16_round(builder, s))
        qoff = _at(builder, tq_, b_, qs)
        invv = L.splat(builder, inv, L.V8F)
        for k, v in enumerate(xv):
            codes = builder.trunc(builder.fptosi(_rint(builder, builder.fmul(v, invv)), L.V8I), V8B)
            builder.store(codes, builder.bitcast(builder.gep(pq, [builder.add(qoff, L.const(8 * k))]),
                                                 V8B.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def rows4_copy(typingctx, xq, xp, xc, t, b, offset):
    """xq[t, b] (32 int8, dwords a0 .. a7) -> xp[t, b] (128 int8: vector v = a_2v four times, then a_2v+1 four
    times: the 4-row layout's code vectors' order) and xc[t, b] = offset x the block's sum. xq int8 (tokens,
    blocks, 32), xp int8 (tokens, blocks, 128), xc int32 (tokens, blocks), C-contiguous."""
    if not (L.c_arrays((xq, types.int8, 3), (xp, types.int8, 3), (xc, types.int32, 2))
            and all(isinstance(i, types.Integer) for i in (t, b, offset))):
        return None
    sig = types.void(xq, xp, xc, t, b, offset)

    def codegen(context, builder, signature, args):
        (pq, qs, _), (pp, ps, _), (pc, cs, _) = (L.array_arg(context, builder, signature.args[i], args[i])
                                                 for i in (0, 1, 2))
        t_, b_ = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (3, 4))
        off = context.cast(builder, args[5], signature.args[5], types.int32)
        qv = L.load(builder, pq, _at(builder, t_, b_, qs), L.V32B)
        words = builder.bitcast(qv, L.V8I)
        poff = _at(builder, t_, b_, ps)
        for v in range(4):
            pat = ir.Constant(ir.VectorType(L.I32, 8), [2 * v] * 4 + [2 * v + 1] * 4)
            vec = builder.shuffle_vector(words, words, pat)
            builder.store(vec, builder.bitcast(builder.gep(pp, [builder.add(poff, L.const(32 * v))]),
                                               L.V8I.as_pointer()), align=1)
        total = L.hsum(builder, builder.sext(qv, ir.VectorType(L.I32, 32)))
        builder.store(builder.mul(off, total),
                      builder.bitcast(builder.gep(pc, [_at(builder, t_, b_, cs)]), L.I32.as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def q8_k_block(typingctx, x3, tx, b, q, d, bs, tq):
    """x3[tx, b] (256 float32) -> q[tq, b] (256 uint8: the int8 value + 128), d[tq, b] and bs[tq, b] (8 sums of
    32 int8 values): llama.cpp's Q8_K rounding (ggml's quantize_row_q8_K): mx = the first value of
    the largest magnitude, iscale = -127 / mx, d = 1 / iscale, q_j = min(127, rint(iscale x_j)); an all-zero
    block gives d = 0, codes 128, sums 0. x3 float32 (tokens, blocks, 256), q uint8 (tokens, blocks, 256), d
    float32 (tokens, blocks), bs int32 (tokens, blocks, 8), C-contiguous."""
    if not (L.c_arrays((x3, types.float32, 3), (q, types.uint8, 3), (d, types.float32, 2), (bs, types.int32, 3))
            and all(isinstance(i, types.Integer) for i in (tx, b, tq))):
        return None
    sig = types.void(x3, tx, b, q, d, bs, tq)
    n = 256 // 8

    def codegen(context, builder, signature, args):
        (px, xs, _), (pq, qs, _), (pd, ds, _), (pb, bss, _) = (
            L.array_arg(context, builder, signature.args[i], args[i]) for i in (0, 3, 4, 5))
        tx_, b_, tq_ = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2, 6))
        xoff = _at(builder, tx_, b_, xs)
        xv, absv = _load_block(builder, px, xoff, n)
        amax = _fmax_tree(builder, absv)
        qoff, doff, boff = (_at(builder, tq_, b_, st) for st in (qs, ds, bss))
        zero = ir.Constant(L.F32, 0.0)

        def store_codes(vecs):          # <8 x i32> int8 values, one per 8 weights -> q (+ 128) and the 8 sums
            for k, v in enumerate(vecs):
                codes = builder.trunc(builder.add(v, ir.Constant(L.V8I, [128] * 8)), V8B)
                builder.store(codes, builder.bitcast(builder.gep(pq, [builder.add(qoff, L.const(8 * k))]),
                                                     V8B.as_pointer()), align=1)
            for s in range(8):
                tot = L.hsum(builder, builder.add(builder.add(vecs[4 * s], vecs[4 * s + 1]),
                                                  builder.add(vecs[4 * s + 2], vecs[4 * s + 3])))
                builder.store(tot, builder.bitcast(builder.gep(pb, [builder.add(boff, L.const(4 * s))]),
                                                   L.I32.as_pointer()))

        with builder.if_else(builder.fcmp_ordered("==", amax, zero)) as (is_zero, nonzero):
            with is_zero:
                L.store_f32(builder, pd, doff, zero)
                store_codes([ir.Constant(L.V8I, [0] * 8)] * n)
            with nonzero:
                # the first value of magnitude amax: the least index among the lanes equal to it
                amaxv = L.splat(builder, amax, L.V8F)
                none = ir.Constant(L.V8I, [256] * 8)
                idx = [builder.select(builder.fcmp_ordered("==", a, amaxv),
                                      ir.Constant(L.V8I, list(range(8 * k, 8 * k + 8))), none)
                       for k, a in enumerate(absv)]
                first = builder.sext(_imin_tree(builder, idx), L.I64)
                mx = L.load(builder, px, builder.add(xoff, builder.mul(first, L.const(4))), L.F32)
                iscale = builder.fdiv(ir.Constant(L.F32, -127.0), mx)
                L.store_f32(builder, pd, doff, builder.fdiv(ir.Constant(L.F32, 1.0), iscale))
                top = ir.Constant(L.V8F, [127.0] * 8)
                isv = L.splat(builder, iscale, L.V8F)
                vals = []
                for v in xv:
                    r = _rint(builder, builder.fmul(isv, v))
                    vals.append(builder.fptosi(builder.select(builder.fcmp_ordered("<", top, r), top, r), L.V8I))
                store_codes(vals)
        return context.get_dummy_value()

    return sig, codegen
