"""Prompt-chunk GEMM for the layouts of nibble_int8.py (IQ3_XXS, Q4_K, Q5_K, Q6_K repacked), tokens in the lanes, with
the bits of nibble_int8.matvec.

nibble_int8's kernel gives, per (token, row), acc = fma(float(v_b), fl(d_w d_a), acc) over the blocks b, v_b the
block's exact integer dot sum_s scale_s (sum_{i in s} (q_i + 128) w_i) - 128 C, and for Q4_K / Q5_K beside it
mins = fma(float(m_b), fl(dmin d_a), mins), m_b = sum_s min_s bsum_s exact; the result is acc - mins. Here a tile
is 4 rows x 2 groups of 8 tokens, the tokens in the lanes of the accumulators: per 4 weights of a block, one
load of 8 tokens' packed activations serves the 4 rows and each row's 4 weights, unpacked to int8 in the
thread's panel, are one broadcast for both token groups; vpdpbusd (pmaddubsw + pmaddwd + add on AVX2) sums them
into the sub-block's int32 vector, which one vpmulld by the sub-block's scale adds to the block's. That is one
multiply per 32 (token, row) multiply-adds where the mat-vec form needs two (pmaddubsw, then pmaddwd by the
scale lanes): the 1.5B IQ3_XXS shapes' mat-muls at 512 tokens ran 2.2x faster (docs/cpu.md). On AVX2, Q4_K, Q5_K
and Q6_K tiles go row by row and sum pmaddubsw results in int16 before a pmaddwd by the scale (_make_tile_rows,
the same integers). Then per row and
block one subtract, one convert, one multiply (8 scale products) and one FMA (Q4_K / Q5_K: their mins term by 4
pmaddwd on int16 pairs of mins and sub-block sums, and one FMA more); every integer is exact and every
float operation is the mat-vec kernel's per (token, row), so are the bits (tests). With AVX-512 VNNI the tiles may
hold 16 tokens a vector instead (512-bit vpdpbusd; isa.GEMM_LANES says where): the same operations per token.

Saturation on AVX2: pmaddubsw's pair sums (q + 128) w stay within int16: |w| <= 62 (IQ3_XXS; Q6_K 32, Q5_K 31),
2 x 255 x 62 < 2^15. The block sums stay below 2^27.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from . import nibble_int8 as nib
from .act_quant_ir import q8_k_block
from .gemm_work import token_chunks
from .isa import AVX2, INT8_ISA, VNNI, VNNI_BUILT, WIDE_BUILT, tile_lanes

MIN_TOK = 32         # from here on the GEMM; below, nibble_int8.matvec (crossover 24-32 tokens, docs/cpu.md)
ROWS = 4             # a tile: 4 rows x 2 groups of `lanes` tokens (the lanes of a vector: 8, or 16 with WIDE)
PANEL = 4            # row groups a thread unpacks at a time (16 rows; 35 blocks x 1.4 KB x 4 = 200 KB at 8960
                     # columns, in L2)
QK = nib.QK
# Panel record of one row group and block (byte offsets): row q's 256 weights (int8, in order) at W + 256 q; the scale of sub-block s of row q at SC + 16 s + 4 q (int32; 8 sub-blocks of 32
# weights, Q6_K 16 of 16); row q's float32 d at D + 4 q, 128 C (int32) at C128 + 4 q, float32 dmin at DMIN + 4 q,
# the mins (Q4_K / Q5_K) of sub-blocks 2p and 2p + 1 as an int16 pair at MINS + 16 p + 4 q.
W, SC, D, C128, DMIN, MINS = 0, 1024, 1280, 1296, 1312, 1328
W_REC = 1456
# AVX2: pmaddubsw results ((q + 128) w pair sums, q + 128 <= 255) that add up within int16 before a pmaddwd, by
# layout: IQ3_XXS |w| <= 62 (31,620 a lane: 1), Q4_K 0..15 (7,650: 4), Q5_K 0..31 (15,810: 2), Q6_K -32..31
# (-16,320: 2)
INT16_SUMS = {nib.IQ3: 1, nib.Q4K: 4, nib.Q5K: 2, nib.Q6K: 2}


@njit(cache=True, inline="always")
def a_record(lanes):
    """Activation record of one token group of `lanes` tokens and block, byte offsets (A_X, A_D, A_B, A_REC): quad
    j of lane (token) l at A_X + 4 lanes j + 4 l (uint8: the Q8_K values + 128), the tokens' float32 scales at
    A_D + 4 l, the sums of sub-blocks 2p and 2p + 1 (|sum| <= 32 x 128: int16) as a pair at A_B + 4 lanes p + 4 l;
    A_REC bytes a record."""
    a_d = 256 * lanes
    return 0, a_d, a_d + 4 * lanes, a_d + 20 * lanes


# ------------------------------------------------------------------------------------------- panels

@njit(cache=True, inline="always")
def _iq3_value(c):
    """IQ3 code (level l | sign << 3) -> its signed value as arithmetic (vectorizes; a table gather does not):
    8 l + 4, 62 for l = 7 (iq3_int8.IQ3_LEVELS), negated for the sign."""
    lv = c & 7
    v = 8 * lv + 4 + 2 * (lv == 7)
    return (v ^ -(c >> 3)) + (c >> 3)


@njit(cache=True, inline="always")
def _weights(kind, src, dst):
    """One block of one row (src: its bytes in layout `kind`) -> dst (256 int8 weights in order, as uint8)."""
    for p in range(4):              # codes: byte 32p + j holds weight 64p + j (low nibble), 64p + 32 + j (high)
        for j in range(32):
            byte = np.int32(src[32 * p + j])
            lo, hi = byte & 15, byte >> 4
            if kind == nib.IQ3:
                lo, hi = _iq3_value(lo), _iq3_value(hi)
            elif kind == nib.Q5K:   # the fifth bits: bit 2p of plane byte j (weight 64p + j), 2p + 1 (64p + 32 + j)
                plane = np.int32(src[128 + j])
                lo |= ((plane >> (2 * p)) & 1) << 4
                hi |= ((plane >> (2 * p + 1)) & 1) << 4
            elif kind == nib.Q6K:   # two high bits each: bits 4e, 4e + 2 of plane byte 32 (p // 2) + j, e = p % 2
                plane = np.int32(src[128 + 32 * (p // 2) + j]) >> (4 * (p % 2))
                lo = (lo | ((plane & 3) << 4)) - 32
                hi = (hi | (((plane >> 2) & 3) << 4)) - 32
            dst[64 * p + j] = np.uint8(lo & 255)
            dst[64 * p + 32 + j] = np.uint8(hi & 255)


@njit(cache=True)
def _unpack_group(kind, raw3, raw_f, raw_i, r0, pw, pw_i, pw_i16, pw_f, gi):
    """Rows r0 .. r0 + 3 of raw3 (layout `kind`; raw_f / raw_i the same bytes as float32 / int32; rows past the
    last repeat it) into group gi of the panel (pw uint8 (groups, blocks, W_REC), pw_i / pw_i16 / pw_f its int32 /
    int16 / float32 views)."""
    n_rows = raw3.shape[0]
    sc_o, d_o, c_o, mins_o, dmin_o = nib.FIELDS[kind]
    n_sub = 16 if kind == nib.Q6K else 8
    for q in range(ROWS):
        r = min(r0 + q, n_rows - 1)
        for b in range(raw3.shape[1]):
            src = raw3[r, b]
            _weights(kind, src, pw[gi, b, W + QK * q:W + QK * (q + 1)])
            for s in range(n_sub):
                v = src[sc_o + s]
                pw_i[gi, b, (SC + 16 * s) // 4 + q] = np.int32(np.int8(v)) if kind == nib.Q6K else np.int32(v)
            pw_f[gi, b, D // 4 + q] = raw_f[r, b, d_o // 4]
            pw_i[gi, b, C128 // 4 + q] = np.int32(128) * raw_i[r, b, c_o // 4]
            if kind == nib.Q4K or kind == nib.Q5K:
                pw_f[gi, b, DMIN // 4 + q] = raw_f[r, b, dmin_o // 4]
                for s in range(8):
                    pw_i16[gi, b, (MINS + 16 * (s // 2)) // 2 + 2 * q + s % 2] = np.int16(src[mins_o + s])


# ------------------------------------------------------------------------------------- activations

@njit(cache=True, parallel=True)
def _pack_activations(x3, a, a_f32, a_i16, lanes):
    # a uint8 (token groups, blocks, record of a_record(lanes)), a_f32 / a_i16 the same bytes; a short last group
    # repeats its last token. llama.cpp's Q8_K rounding (act_quant_ir.q8_k_block).
    n_tok, nb = x3.shape[0], x3.shape[1]
    _, a_d, a_b, _ = a_record(lanes)
    for t in prange(a.shape[0] * lanes):
        g, lane = t // lanes, t % lanes
        tx = min(np.intp(t), n_tok - 1)
        q = np.empty((1, nb, QK), dtype=np.uint8)
        d = np.empty((1, nb), dtype=np.float32)
        bs = np.empty((1, nb, 8), dtype=np.int32)
        for b in range(nb):
            q8_k_block(x3, tx, b, q, d, bs, 0)
            for i in range(QK):
                a[g, b, 4 * lanes * (i // 4) + 4 * lane + i % 4] = q[0, b, i]
            a_f32[g, b, a_d // 4 + lane] = d[0, b]
            for s in range(8):
                a_i16[g, b, (a_b + 4 * lanes * (s // 2)) // 2 + 2 * lane + s % 2] = np.int16(bs[0, b, s])


# --------------------------------------------------------------------------------------------- tile

def _make_tile(isa, n_sub: int, mins: bool, lanes: int = 8, sums16: int = 0):
    """The intrinsic tile(pw, i, a, g0, g1, out, r0): out[lanes g + l, r0 + q] for the `lanes` tokens l of token
    groups g = g0 and g1 (g1 may equal g0: its values are then stored twice; stores past the last token or row go
    to the last one, which the packing repeated) and the 4 rows q of panel group i. n_sub: sub-blocks a block (8;
    Q6_K 16), mins: Q4_K / Q5_K's mins term; lanes: 8 (256-bit vectors) or 16 (512-bit, VNNI only).
    sums16 (AVX2): the layout's INT16_SUMS; above 1, _make_tile_rows' form."""
    if isa == AVX2 and sums16 > 1:
        return _make_tile_rows(n_sub, mins, sums16)
    quads = 64 // n_sub         # 4-weight quads a sub-block
    chains = 2 if isa == VNNI else 1
    A_X, A_D, A_B, _ = a_record.py_func(lanes)
    VI, VF, VB = (ir.VectorType(t, n) for t, n in ((L.I32, lanes), (L.F32, lanes), (L.I8, 4 * lanes)))

    @intrinsic
    def tile(typingctx, pw, i, a, g0, g1, out, r0):
        sig = L.gemm_tile_signature(pw, i, a, g0, g1, out, r0)
        if sig is None:
            return None

        def codegen(context, builder, signature, args):
            w0, (wstr, wshape), a0, astr, (pout, ostr, oshape) = L.gemm_tile_operands(context, builder, signature,
                                                                                   args)
            groups = (args[3], args[4])

            def vec(ty):
                return [[cgutils.alloca_once_value(builder, ir.Constant(ty, None)) for _ in range(ROWS)]
                        for _ in groups]
            acc, macc, blk = vec(VF), vec(VF), vec(VI)

            def bcast(p, off, ty=L.I32):     # a 4-byte field at p + off in each lane
                return L.splat(builder, L.load(builder, p, off, ty), VI if ty == L.I32 else VF)

            with cgutils.for_range(builder, wshape[1]) as loop:
                pwb = builder.gep(w0, [builder.mul(loop.index, wstr[1])])
                pab = [builder.gep(p, [builder.mul(loop.index, astr[1])]) for p in a0]
                for row in blk:
                    for ptr in row:
                        builder.store(ir.Constant(VI, None), ptr)
                # one iteration per sub-block, its quads unrolled
                with cgutils.for_range(builder, L.const(n_sub)) as sub:
                    s = sub.index
                    dsub = [[[None, None] for _ in range(ROWS)] for _ in groups]     # even / odd quads: 2 chains
                    for jj in range(quads):
                        j = builder.add(builder.mul(s, L.const(quads)), L.const(jj))
                        xa = [L.load(builder, p, builder.add(L.const(A_X), builder.mul(j, L.const(4 * lanes))), VB)
                              for p in pab]
                        for q in range(ROWS):
                            w = builder.bitcast(bcast(pwb, builder.add(L.const(W + QK * q), builder.mul(j, L.const(4)))),
                                                VB)
                            for k, x in enumerate(xa):
                                dsub[k][q][jj % chains] = L.dot_u8s8(builder, isa, x, w, dsub[k][q][jj % chains])
                    for q in range(ROWS):
                        sc = bcast(pwb, builder.add(L.const(SC + 4 * q), builder.mul(s, L.const(16))))
                        for k in range(len(groups)):
                            d = dsub[k][q][0] if chains == 1 else builder.add(*dsub[k][q])
                            builder.store(builder.add(builder.load(blk[k][q]), builder.mul(d, sc)), blk[k][q])
                for k, p in enumerate(pab):
                    da = L.load(builder, p, A_D, VF)
                    for q in range(ROWS):
                        v = builder.sub(builder.load(blk[k][q]), bcast(pwb, C128 + 4 * q))
                        sd = builder.fmul(bcast(pwb, D + 4 * q, L.F32), da)
                        builder.store(builder.fadd(builder.fmul(builder.sitofp(v, VF), sd, flags=L.CONTRACT),
                                                   builder.load(acc[k][q]), flags=L.CONTRACT), acc[k][q])
                        if mins:
                            m = None          # sum_s min_s bsum_s: one pmaddwd a pair of sub-blocks
                            vw = ir.VectorType(L.I16, 2 * lanes)
                            for pr in range(4):
                                t = L.madd_i16(builder, builder.bitcast(bcast(pwb, MINS + 16 * pr + 4 * q), vw),
                                               builder.bitcast(L.load(builder, p, A_B + 4 * lanes * pr, VI), vw))
                                m = t if m is None else builder.add(m, t)
                            sm = builder.fmul(bcast(pwb, DMIN + 4 * q, L.F32), da)
                            builder.store(builder.fadd(builder.fmul(builder.sitofp(m, VF), sm, flags=L.CONTRACT),
                                                       builder.load(macc[k][q]), flags=L.CONTRACT), macc[k][q])
            rows = L.clamped_rows(builder, args[6], ROWS, oshape[1])
            for k, g in enumerate(groups):
                vals = [builder.load(ptr) for ptr in acc[k]]
                if mins:
                    vals = [builder.fsub(v, builder.load(ptr)) for v, ptr in zip(vals, macc[k])]
                toks = L.clamped_rows(builder, builder.mul(g, L.const(lanes)), lanes, oshape[0])
                L.store_tile(builder, pout, ostr, toks, rows,
                             lambda q, l: builder.extract_element(vals[q], L.const(l, L.I32)))
            return context.get_dummy_value()

        return sig, codegen
    return tile


def _make_tile_rows(n_sub: int, mins: bool, sums16: int):
    """AVX2's tile for Q4_K, Q5_K and Q6_K (the intrinsic of _make_tile, 8 tokens a vector), row by row: each of the
    4 rows runs its own sub-block loop, loading the activations again (L1), so a row needs ~10 of AVX2's 16
    vector registers; the float accumulators are cells in memory, touched once a row and block. Per sub-block,
    `sums16` pmaddubsw results add up in int16 (INT16_SUMS), then one pmaddwd by the sub-block's scale in both
    int16 halves of each lane adds scale x (their pair sums) to the block's int32 sums: the same integers as a
    pmaddwd by ones a quad and a vpmulld a sub-block. One thread, 512 tokens, CPU time, three alternating
    processes (2-core AVX2 EPYC VM): Q4_K 4864 x 896 34.4-34.8 -> 31.8-32.5 ms, Q6_K 4864 x 896 31.5-31.7 ->
    29.0-29.4, Q4_K 1536 x 8960 104.2-104.7 -> 96.7-98.7, Q5_K 4864 x 896 31.6-31.8 -> 30.7-31.1. IQ3_XXS (no
    room for int16 sums) keeps the 4-row form, whose shared activation loads it needs (this form: 88-89 ->
    95-96 ms on 1536 x 8960)."""
    quads = 64 // n_sub
    A_X, A_D, A_B, _ = a_record.py_func(8)
    VI, VF, VB, VW = L.V8I, L.V8F, L.V32B, L.V16W
    n_groups = 2

    @intrinsic
    def tile(typingctx, pw, i, a, g0, g1, out, r0):
        sig = L.gemm_tile_signature(pw, i, a, g0, g1, out, r0)
        if sig is None:
            return None

        def codegen(context, builder, signature, args):
            w0, (wstr, wshape), a0, astr, (pout, ostr, oshape) = L.gemm_tile_operands(context, builder, signature,
                                                                                   args)
            groups = (args[3], args[4])
            # acc / macc [k * ROWS + q]: token group k, row q
            acc, macc = (cgutils.alloca_once(builder, VF, size=n_groups * ROWS) for _ in range(2))
            for cells in (acc, macc):
                for c in range(n_groups * ROWS):
                    builder.store(ir.Constant(VF, None), builder.gep(cells, [L.const(c)]))

            def bcast(p, off, ty=L.I32):     # a 4-byte field at p + off in each lane
                return L.splat(builder, L.load(builder, p, off, ty), VI if ty == L.I32 else VF)

            def add_cell(cells, at, value, scale):
                cell = builder.gep(cells, [at])
                builder.store(builder.fadd(builder.fmul(builder.sitofp(value, VF), scale, flags=L.CONTRACT),
                                           builder.load(cell), flags=L.CONTRACT), cell)

            with cgutils.for_range(builder, wshape[1]) as loop:
                pwb = builder.gep(w0, [builder.mul(loop.index, wstr[1])])
                pab = [builder.gep(p, [builder.mul(loop.index, astr[1])]) for p in a0]
                for qq in range(ROWS):                 # each row its own sub-block loop
                    q = L.const(qq)
                    pq = builder.gep(pwb, [builder.mul(q, L.const(4))])          # row q's 4-byte fields
                    pqw = builder.gep(pwb, [builder.add(L.const(W), builder.mul(q, L.const(QK)))])
                    blk = [cgutils.alloca_once_value(builder, ir.Constant(VI, None)) for _ in groups]
                    with cgutils.for_range(builder, L.const(n_sub)) as sub:
                        s = sub.index
                        sc = L.load(builder, pq, builder.add(L.const(SC), builder.mul(s, L.const(16))), L.I32)
                        sc = builder.mul(builder.and_(sc, ir.Constant(L.I32, 0xFFFF)), ir.Constant(L.I32, 0x10001))
                        sc2 = builder.bitcast(L.splat(builder, sc, VI), VW)     # the scale in both int16 halves
                        h16 = [None] * n_groups
                        for jj in range(quads):
                            j = builder.add(builder.mul(s, L.const(quads)), L.const(jj))
                            w = builder.bitcast(bcast(pqw, builder.mul(j, L.const(4))), VB)
                            for k, p in enumerate(pab):
                                x = L.load(builder, p, builder.add(L.const(A_X), builder.mul(j, L.const(32))), VB)
                                m = L.maddubs(builder, x, w)
                                h16[k] = m if jj % sums16 == 0 else builder.add(h16[k], m)
                                if jj % sums16 == sums16 - 1:
                                    builder.store(builder.add(L.madd_i16(builder, h16[k], sc2), builder.load(blk[k])),
                                                  blk[k])
                    for k, p in enumerate(pab):
                        da = L.load(builder, p, A_D, VF)
                        at = builder.add(L.const(k * ROWS), q)
                        v = builder.sub(builder.load(blk[k]), bcast(pq, C128))
                        add_cell(acc, at, v, builder.fmul(bcast(pq, D, L.F32), da))
                        if mins:
                            m = None          # sum_s min_s bsum_s: one pmaddwd a pair of sub-blocks
                            for pr in range(4):
                                t = L.madd_i16(builder, builder.bitcast(bcast(pq, MINS + 16 * pr), VW),
                                               builder.bitcast(L.load(builder, p, A_B + 32 * pr, VI), VW))
                                m = t if m is None else builder.add(m, t)
                            add_cell(macc, at, m, builder.fmul(bcast(pq, DMIN, L.F32), da))
            rows = L.clamped_rows(builder, args[6], ROWS, oshape[1])
            for k, g in enumerate(groups):
                vals = [builder.load(builder.gep(acc, [L.const(k * ROWS + q)])) for q in range(ROWS)]
                if mins:
                    vals = [builder.fsub(v, builder.load(builder.gep(macc, [L.const(k * ROWS + q)])))
                            for q, v in enumerate(vals)]
                toks = L.clamped_rows(builder, builder.mul(g, L.const(8)), 8, oshape[0])
                L.store_tile(builder, pout, ostr, toks, rows,
                             lambda q, l: builder.extract_element(vals[q], L.const(l, L.I32)))
            return context.get_dummy_value()

        return sig, codegen
    return tile


# (isa, n_sub, mins) -> tile: IQ3_XXS (8, no mins), Q4_K / Q5_K (8, mins; on AVX2 one each: their int16 sums
# differ), Q6_K (16, no mins); 512-bit ones where built
_t8, _t16 = (_make_tile(AVX2, n_sub, False, sums16=INT16_SUMS[kind]) for n_sub, kind in ((8, nib.IQ3), (16, nib.Q6K)))
_t8m4, _t8m5 = (_make_tile(AVX2, 8, True, sums16=INT16_SUMS[kind]) for kind in (nib.Q4K, nib.Q5K))
_t8v, _t8mv, _t16v = (_make_tile(VNNI, 8, False), _make_tile(VNNI, 8, True), _make_tile(VNNI, 16, False))
_t8w, _t8mw, _t16w = (_make_tile(VNNI, 8, False, 16), _make_tile(VNNI, 8, True, 16), _make_tile(VNNI, 16, False, 16))


@njit(cache=True, inline="always")
def _tile(kind, isa, lanes, pw, i, a, g0, g1, out, r0):
    if WIDE_BUILT and lanes == 16:
        if kind == nib.Q6K:
            _t16w(pw, i, a, g0, g1, out, r0)
        elif kind == nib.Q4K or kind == nib.Q5K:
            _t8mw(pw, i, a, g0, g1, out, r0)
        else:
            _t8w(pw, i, a, g0, g1, out, r0)
    elif VNNI_BUILT and isa == VNNI:
        if kind == nib.Q6K:
            _t16v(pw, i, a, g0, g1, out, r0)
        elif kind == nib.Q4K or kind == nib.Q5K:
            _t8mv(pw, i, a, g0, g1, out, r0)
        else:
            _t8v(pw, i, a, g0, g1, out, r0)
    elif kind == nib.Q6K:
        _t16(pw, i, a, g0, g1, out, r0)
    elif kind == nib.Q4K:
        _t8m4(pw, i, a, g0, g1, out, r0)
    elif kind == nib.Q5K:
        _t8m5(pw, i, a, g0, g1, out, r0)
    else:
        _t8(pw, i, a, g0, g1, out, r0)


# -------------------------------------------------------------------------------------------- GEMM

@njit(cache=True, parallel=True)
def _gemm(raw3, raw_f, raw_i, x3, out, kind, n_threads, isa, lanes):
    # lanes: tokens a vector, 8 (256-bit) or 16 (512-bit: WIDE_BUILT and isa VNNI)
    n_rows, nb = raw3.shape[0], raw3.shape[1]
    n_groups = (n_rows + ROWS - 1) // ROWS
    n_tg = (x3.shape[0] + lanes - 1) // lanes
    a = np.empty((n_tg, nb, a_record(lanes)[3]), dtype=np.uint8)
    _pack_activations(x3, a, a.view(np.float32), a.view(np.int16), lanes)
    n_pan = (n_groups + PANEL - 1) // PANEL
    n_ch = token_chunks(n_pan, n_tg, n_threads)
    for item in prange(n_pan * n_ch):
        p, c = item // n_ch, item % n_ch
        g0 = p * PANEL
        n_in_pan = min(PANEL, n_groups - g0)
        pw = np.empty((n_in_pan, nb, W_REC), dtype=np.uint8)    # the fields a kind does not use are never read
        pw_i, pw_i16, pw_f = pw.view(np.int32), pw.view(np.int16), pw.view(np.float32)
        for i in range(n_in_pan):
            _unpack_group(kind, raw3, raw_f, raw_i, ROWS * (g0 + i), pw, pw_i, pw_i16, pw_f, i)
        tg0, tg1 = n_tg * c // n_ch, n_tg * (c + 1) // n_ch
        for tg in range(tg0, tg1, 2):             # two token groups a tile (the last may repeat: same values)
            for i in range(n_in_pan):
                _tile(kind, isa, lanes, pw, i, a, tg, min(tg + 1, tg1 - 1), out, ROWS * (g0 + i))


def matmul(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray, table: np.ndarray, kind: int,
           isa: int = INT8_ISA, lanes: int | None = None) -> None:
    """out (n_tok, n_rows) = x @ W.T; W in layout `kind` (nibble_int8's IQ3, Q4K, Q6K, Q5K) as (n_rows, nb, block
    bytes), x float32 (n_tok, nb, 256): nibble_int8.matvec's results, bit for bit. table: IQ3's code values, which
    only the mat-vec kernel reads (the GEMM computes them, _iq3_value), taken so both have one signature. lanes:
    tokens a vector, 16 (512-bit) only with AVX-512 VNNI and isa VNNI; by default isa.GEMM_LANES on VNNI, else 8."""
    n_rows, nb, nbytes = raw3.shape
    as_f32, as_i32 = (raw3.view(dt).reshape(n_rows, nb, nbytes // 4) for dt in (np.float32, np.int32))
    _gemm(raw3, as_f32, as_i32, x3, out, kind, numba.get_num_threads(), isa, tile_lanes(isa, lanes))


def multiply(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray, table: np.ndarray, kind: int) -> None:
    """out = x @ W.T for any token count: this GEMM from MIN_TOK tokens, nibble_int8.matvec below (same bits)."""
    if x3.shape[0] >= MIN_TOK:
        matmul(raw3, x3, out, table, kind)
    else:
        nib.matvec(raw3, x3, out, table, kind)
