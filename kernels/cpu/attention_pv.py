"""acc += P @ V for a block of keys, rows register-blocked (kernels/cpu/attention.py's p.V step).

For a block of `_BK` keys, every query row r of a work item adds sum_j P[r, j] * V[j, :] to its
accumulator row acc[r, :] (head_dim floats). Row by row, each row would reload all of V's rows and its own
accumulator every few keys: ~20 instructions per (row, key) and 8 channels. Here a group of up to
ROWS rows walks the block once per 16-channel chunk with the group's accumulators in registers (2 vectors
of 8 floats a row): per key one load of the chunk's two V vectors serves every row of the group, and a row
costs one broadcast of P[r, j] (folded into the multiply-add's memory operand where AVX-512 has embedded
broadcasts) and two fused multiply-adds.

Float order: acc[r, d] = fma(P[r, j], V[j, d], acc[r, d]) for j = 0, 1, ..., _BK - 1 in order, one chain per
(row, channel); it does not depend on which rows share a group or how many there are, so a row's result is
the same in any batch (batch invariance, tests/kernels/test_batch_invariance.py).

ROWS: 8 where AVX-512 VL gives 32 vector registers (16 accumulators + 2 V vectors), else 6 (12 + 2 of 16).
It depends only on the target Numba compiles for, which is part of its cache key.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from .isa import host_features

CHUNK = 16        # channels per pass: two 8-float vectors a row
ROWS = 8 if host_features()["avx512vl"] else 6


@intrinsic
def _pv(typingctx, acc, p, vb, r0, n):
    """acc[r0 + k, :] += P[r0 + k, :] @ vb for k < n (a literal 1..8): acc float32 (max rows, head_dim), p
    float32 (max rows, block keys), vb float32 (block keys, head_dim); head_dim a multiple of CHUNK."""
    if not (L.c_arrays((acc, types.float32, 2), (p, types.float32, 2), (vb, types.float32, 2))
            and isinstance(r0, types.Integer) and isinstance(n, types.IntegerLiteral) and 1 <= n.literal_value <= 8):
        return None
    sig = types.void(acc, p, vb, types.intp, n)
    rows = n.literal_value

    def codegen(context, builder, signature, args):
        (pa, astr, ashape), (pp, pstr, _), (pv, vstr, vshape) = (
            L.array_arg(context, builder, signature.args[i], args[i]) for i in range(3))
        r0 = context.cast(builder, args[3], signature.args[3], types.intp)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(L.V8F, [L.V8F] * 3), "llvm.fma.v8f32")
        arow = [builder.gep(pa, [builder.mul(builder.add(r0, L.const(k)), astr[0])]) for k in range(rows)]
        prow = [builder.gep(pp, [builder.mul(builder.add(r0, L.const(k)), pstr[0])]) for k in range(rows)]
        n_chunks = builder.udiv(ashape[1], L.const(CHUNK))
        halves = (0, 32)        # byte offsets of a chunk's two vectors
        with cgutils.for_range(builder, n_chunks) as cl:
            off = builder.mul(cl.index, L.const(4 * CHUNK))
            accs = [[cgutils.alloca_once_value(builder, L.load(builder, a, builder.add(off, L.const(h)), L.V8F, 4))
                     for h in halves] for a in arow]
            with cgutils.for_range(builder, vshape[0]) as jl:
                j = jl.index
                vrow = builder.gep(pv, [builder.add(builder.mul(j, vstr[0]), off)])
                v = [L.load(builder, vrow, h, L.V8F, 4) for h in halves]
                pj = builder.mul(j, L.const(4))
                for k in range(rows):
                    w = L.splat(builder, L.load(builder, prow[k], pj, L.F32, 4), L.V8F)
                    for h in range(2):
                        builder.store(builder.call(fma, [w, v[h], builder.load(accs[k][h])]), accs[k][h])
            for a, pair in zip(arow, accs):
                for h, ptr in zip(halves, pair):
                    builder.store(builder.load(ptr), builder.bitcast(builder.gep(a, [builder.add(off, L.const(h))]),
                                                                     L.V8F.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def pv_rows(acc, p, vb, rows):
    """acc[r, :] += p[r, :] @ vb for r < rows, ROWS rows a pass (the module docstring has the order)."""
    r = 0
    while r < rows:
        n = min(ROWS, rows - r)
        if n >= 8:
            _pv(acc, p, vb, r, 8)
        elif n == 7:
            _pv(acc, p, vb, r, 7)
        elif n == 6:
            _pv(acc, p, vb, r, 6)
        elif n == 5:
            _pv(acc, p, vb, r, 5)
        elif n == 4:
            _pv(acc, p, vb, r, 4)
        elif n == 3:
            _pv(acc, p, vb, r, 3)
        elif n == 2:
            _pv(acc, p, vb, r, 2)
        else:
            _pv(acc, p, vb, r, 1)
        r += n
