"""Prompt-chunk GEMM for the layouts of nibble_int8.py (IQ3_XXS, Q4_K, Q5_K, Q6_K repacked): register tiles of R
weight rows x T tokens, with the bits of nibble_int8.matvec.

nibble_int8.py's kernel takes one row and up to 4 tokens per call and reloads every token's activations
for each row. Here a thread copies PANEL rows at a time into a panel (codes as stored, scales widened to
int16, float terms), and each tile keeps R x T int32 block sums in registers while the weights and scale
lanes of R rows, unpacked in registers once per sub-block, meet the activations of T tokens.

Bits: per (token, row) and 256-weight block the same exact integer sum (pmaddubsw of the +128 activations
with the weights, pmaddwd with the scale lanes, summed over the 8 sub-blocks: integer, so in any order),
then the same float steps in the same order: acc = fma(float(isum), fl(d_w d_a), acc) per lane,
corr = fma(fl(d_w d_a), C, corr), for Q4_K / Q5_K mins = fma(float(m * bsum), fl(dmin d_a), mins) per lane, and
(hsum(acc) - 128 corr) - hsum(mins) at the end. The products d_w d_a of one row are formed for T tokens in
one vector multiply (each lane the scalar product the kernel forms); m * bsum is formed in float, exact
(m <= 63, |bsum| <= 32 x 127: below 2^24), as the kernel's int32 product converted.
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
from .gemm_work import token_chunks

MIN_TOK = 64         # from here on the GEMM; below, nibble_int8.matvec (perf/bench_prompt_gemm.py)
R, T = 2, 4          # tile: R T int32 sums + R weight and R scale-lane registers + 1 activation: 14 ymm
                     # (1 x 8, 2 x 6, 3 x 4, 4 x 2: no faster, one thread, within this VM's noise)
PANEL = 16           # rows a thread copies at a time (16 x 19 blocks x 208 bytes: 63 KB at 4864 columns)
QK = nib.QK
# A panel record holds block b of the R rows of a row group (k = a row's slot 0..R-1), byte offsets
# (panel_layout):
#   CODES + cb k: the row's codes as stored (cb = 128: two 4-bit codes a byte, nibble_int8's order; Q5_K:
#                 cb = 160, those and the fifth bits' plane; Q6_K: cb = 256 int8 weights)
#   sc + 32 k:    16 int16 scales (the 8 sub-block scales, or Q6_K's 16), so a sub-block's pmaddwd lanes
#                  are one broadcast
#   fl + 48 k:    float32 d, float(C), dmin, 0, then the 8 mins (Q4_K, Q5_K) as float32
# 80 + cb bytes a row and block. A panel of int8 weights and ready pmaddwd lanes (640 bytes) was no faster
# (2.1-2.3 cycles per row, token and 32 weights either way, one thread): the lanes' shift, mask and
# broadcast run beside the multiplies, which bound the tile.
CODES = 0
# byte offsets in a source block (nibble_int8.py's layouts): scales, d, C, mins, dmin (the mins: Q4_K, Q5_K)
SRC_NIB = (128, 136, 140, 144, 152)
SRC_Q5K = (160, 168, 172, 176, 184)
SRC_Q6K = (256, 272, 276, 0, 0)
MINS = (nib.Q4K, nib.Q5K)


def panel_layout(kind):
    """(cb, sc, fl, rec) of layout `kind`'s panel records: code bytes a row, the byte offsets of the int16
    scales and of the float fields, the record's bytes."""
    cb = 256 if kind == nib.Q6K else 160 if kind == nib.Q5K else 128
    return cb, R * cb, R * (cb + 32), R * (cb + 80)


# ------------------------------------------------------------------------------------------- panels

@njit(cache=True, inline="always")
def _unpack_row(kind, raw3, raw_f, raw_i, r, pw, p16, pf, g, k, cb, sc_at, fl_at):
    """Row r of raw3 (layout `kind`; raw_f / raw_i: the same bytes as float32 / int32) into slot k of row
    group g of the panel (pw: uint8 records; p16, pf: the same bytes as int16, float32; cb, sc_at, fl_at:
    panel_layout)."""
    n_sc = 16 if kind == nib.Q6K else 8
    sc_src, d_src, c_src, mins_src, dmin_src = SRC_Q6K if kind == nib.Q6K else SRC_Q5K if kind == nib.Q5K else SRC_NIB
    sc, fl = sc_at // 2 + 16 * k, fl_at // 4 + 12 * k
    for b in range(raw3.shape[1]):
        for i in range(cb):
            pw[g, b, CODES + cb * k + i] = raw3[r, b, i]
        for i in range(n_sc):       # Q6_K's scales are int8, the others' uint8
            v = raw3[r, b, sc_src + i]
            p16[g, b, sc + i] = np.int16(np.int8(v)) if kind == nib.Q6K else np.int16(v)
        pf[g, b, fl] = raw_f[r, b, d_src // 4]
        pf[g, b, fl + 1] = np.float32(raw_i[r, b, c_src // 4])
        if kind == nib.Q4K or kind == nib.Q5K:
            pf[g, b, fl + 2] = raw_f[r, b, dmin_src // 4]
            for i in range(8):
                pf[g, b, fl + 4 + i] = np.float32(raw3[r, b, mins_src + i])


# ------------------------------------------------------------------------------------- activations
# Packed activations: (tokens / T, blocks, A_REC) bytes; record [g, b]: T x 256 uint8 (Q8_K values + 128),
# T float32 scales, T x 8 float32 sub-block sums (Q4_K's mins). A short last group repeats its last token.
A_X, A_D, A_B = 0, 256 * T, 260 * T
A_REC = 292 * T


@njit(cache=True, parallel=True)
def _pack_activations(x3, a, a_f32):
    n_tok, nb = x3.shape[0], x3.shape[1]
    for t in prange(a.shape[0] * T):
        q = np.empty((1, nb, QK), dtype=np.uint8)
        d = np.empty((1, nb), dtype=np.float32)
        bs = np.empty((1, nb, 8), dtype=np.int32)
        xt = x3[min(t, n_tok - 1):]
        g, j = t // T, t % T
        for b in range(nb):
            nib._quantize_block(xt, q, d, bs, 0, b)
            for i in range(QK):
                a[g, b, A_X + QK * j + i] = q[0, b, i]
            a_f32[g, b, A_D // 4 + j] = d[0, b]
            for s in range(8):
                a_f32[g, b, A_B // 4 + 8 * j + s] = np.float32(bs[0, b, s])


# --------------------------------------------------------------------------------------------- tile

def _make_tile(kind):
    """The intrinsic tile(pw, gr, a, gt, out, r0, t0, table): out[t0 + j, r0 + k] (j < T, k < R; stores past
    the last token / row go to the last one, which the packing repeated) from row group gr of panel pw
    (layout `kind`) and token group gt of the packed activations a. table: IQ3's 16 code values twice."""
    lookup, mins, wide, high = kind == nib.IQ3, kind in MINS, kind == nib.Q6K, kind == nib.Q5K
    cb, SC, FL, _ = panel_layout(kind)

    @intrinsic
    def tile(typingctx, pw, gr, a, gt, out, r0, t0, table):
        if not (L.c_arrays((pw, types.uint8, 3), (a, types.uint8, 3), (table, types.int8, 1))
                and L.strided_array(out, types.float32, 2)
                and all(isinstance(v, types.Integer) for v in (gr, gt, r0, t0))):
            return None
        sig = types.void(pw, types.intp, a, types.intp, out, types.intp, types.intp, table)

        def codegen(context, builder, signature, args):
            maddubs, maddwd, pshufb = (L.avx2(builder, n) for n in ("pmadd.ub.sw", "pmadd.wd", "pshuf.b"))
            (ppw, wstr, wshape), (pa, astr, _), (pout, ostr, oshape), (ptab, _, _) = (
                L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 2, 4, 7))
            tab = L.load(builder, ptab, 0, L.V32B)
            VT = ir.VectorType(L.F32, T)
            low4 = ir.Constant(L.V32B, [15] * 32)
            w0 = builder.gep(ppw, [builder.mul(args[1], wstr[0])])
            a0 = builder.gep(pa, [builder.mul(args[3], astr[0])])

            def zeros(ty, n_k, n_j):
                return [[cgutils.alloca_once_value(builder, ir.Constant(ty, None)) for _ in range(n_j)]
                        for _ in range(n_k)]

            acc, mins_acc, isum = zeros(L.V8F, R, T), zeros(L.V8F, R, T), zeros(L.V8I, R, T)
            corr = zeros(VT, R, 1)

            def fl(p, k, i, ty=L.F32):
                return L.load(builder, p, FL + 48 * k + 4 * i, ty)

            def fma(x, y, ptr):         # the kernel's contracted multiply-add into an accumulator
                builder.store(builder.fadd(builder.fmul(x, y, flags=L.CONTRACT), builder.load(ptr),
                                           flags=L.CONTRACT), ptr)

            def weights(pwb, k, sub):
                """<32 x i8> weights of sub-block `sub` of row slot k, and its <16 x i16> pmaddwd lanes."""
                if wide:
                    w = L.load(builder, pwb, builder.add(builder.mul(sub, L.const(32)), L.const(cb * k)), L.V32B)
                    two = L.load(builder, pwb, builder.add(builder.mul(sub, L.const(4)), L.const(SC + 32 * k)),
                                 ir.VectorType(L.I16, 2))
                    return w, builder.shuffle_vector(two, two, ir.Constant(ir.VectorType(L.I32, 16), [0] * 8 + [1] * 8))
                pair, half = builder.ashr(sub, L.const(1)), builder.and_(sub, L.const(1))
                codes = L.load(builder, pwb, builder.add(builder.mul(pair, L.const(32)), L.const(cb * k)), L.V32B)
                shift = L.splat(builder, builder.trunc(builder.mul(half, L.const(4)), L.I16), L.V16W)
                w = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(codes, L.V16W), shift), L.V32B), low4)
                if lookup:
                    w = builder.call(pshufb, [tab, w])
                if high:                # Q5_K: bit `sub` of the plane byte is the fifth bit, as 16
                    plane = L.load(builder, pwb, L.const(cb * k + 128), L.V32B)
                    bit = L.splat(builder, builder.trunc(sub, L.I16), L.V16W)
                    fifth = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(plane, L.V16W), bit), L.V32B),
                                         ir.Constant(L.V32B, [1] * 32))
                    w = builder.or_(w, builder.bitcast(builder.shl(builder.bitcast(fifth, L.V16W),
                                                                   ir.Constant(L.V16W, [4] * 16)), L.V32B))
                sc = L.load(builder, pwb, builder.add(builder.mul(sub, L.const(2)), L.const(SC + 32 * k)), L.I16)
                return w, L.splat(builder, sc, L.V16W)

            # one iteration per 32-weight sub-block (a loop of nb x 8: with the 8 sub-blocks unrolled LLVM hoists
            # all their loads and spills), the float steps after a block's 8th
            with cgutils.for_range(builder, builder.mul(wshape[1], L.const(8))) as loop:
                blk, sub = builder.ashr(loop.index, L.const(3)), builder.and_(loop.index, L.const(7))
                pwb = builder.gep(w0, [builder.mul(blk, wstr[1])])
                pab = builder.gep(a0, [builder.mul(blk, astr[1])])
                ws = [weights(pwb, k, sub) for k in range(R)]
                for j in range(T):
                    xa = L.load(builder, pab, builder.add(builder.mul(sub, L.const(32)), L.const(A_X + QK * j)), L.V32B)
                    for k in range(R):
                        m = builder.call(maddwd, [builder.call(maddubs, [xa, ws[k][0]]), ws[k][1]])
                        builder.store(builder.add(builder.load(isum[k][j]), m), isum[k][j])
                with builder.if_then(builder.icmp_unsigned("==", sub, L.const(7))):
                    da = L.load(builder, pab, A_D, VT)
                    for k in range(R):
                        s_t = builder.fmul(L.splat(builder, fl(pwb, k, 0), VT), da)     # lane j: d_w * d_a of token j
                        fma(s_t, L.splat(builder, fl(pwb, k, 1), VT), corr[k][0])
                        if mins:
                            dm_t = builder.fmul(L.splat(builder, fl(pwb, k, 2), VT), da)
                            m8 = fl(pwb, k, 4, L.V8F)
                        for j in range(T):
                            lane = L.const(j, L.I32)
                            fma(builder.sitofp(builder.load(isum[k][j]), L.V8F),
                                L.splat(builder, builder.extract_element(s_t, lane), L.V8F), acc[k][j])
                            builder.store(ir.Constant(L.V8I, None), isum[k][j])
                            if mins:
                                bsum = L.load(builder, pab, A_B + 32 * j, L.V8F)
                                dm = L.splat(builder, builder.extract_element(dm_t, lane), L.V8F)
                                fma(builder.fmul(m8, bsum), dm, mins_acc[k][j])

            def result(k, j):
                c = builder.extract_element(builder.load(corr[k][0]), L.const(j, L.I32))
                v = builder.fsub(L.hsum(builder, builder.load(acc[k][j])),
                                 builder.fmul(ir.Constant(L.F32, 128.0), c))
                return builder.fsub(v, L.hsum(builder, builder.load(mins_acc[k][j]))) if mins else v

            rows = L.clamped_rows(builder, args[5], R, oshape[1])
            toks = L.clamped_rows(builder, args[6], T, oshape[0])
            L.store_tile(builder, pout, ostr, toks, rows, result)
            return context.get_dummy_value()

        return sig, codegen
    return tile


_tile_iq3, _tile_q4k, _tile_q6k, _tile_q5k = (_make_tile(k) for k in (nib.IQ3, nib.Q4K, nib.Q6K, nib.Q5K))


# -------------------------------------------------------------------------------------------- GEMM

@njit(cache=True, parallel=True)
def _gemm(raw3, raw_f, raw_i, x3, out, table, kind, cb, sc_at, fl_at, rec, n_threads):
    n_rows, nb = raw3.shape[0], raw3.shape[1]
    n_tg = (x3.shape[0] + T - 1) // T
    a = np.empty((n_tg, nb, A_REC), dtype=np.uint8)
    _pack_activations(x3, a, a.view(np.float32))
    n_pan = (n_rows + PANEL - 1) // PANEL
    n_ch = token_chunks(n_pan, n_tg, n_threads)
    for item in prange(n_pan * n_ch):
        p, c = item // n_ch, item % n_ch
        r0 = p * PANEL
        n_in_pan = min(PANEL, n_rows - r0)
        n_rg = (n_in_pan + R - 1) // R
        pw = np.empty((n_rg, nb, rec), dtype=np.uint8)
        p16, pf = pw.view(np.int16), pw.view(np.float32)
        for i in range(n_rg * R):
            _unpack_row(kind, raw3, raw_f, raw_i, r0 + min(i, n_in_pan - 1), pw, p16, pf, i // R, i % R,
                        cb, sc_at, fl_at)
        for gt in range(n_tg * c // n_ch, n_tg * (c + 1) // n_ch):
            for gr in range(n_rg):
                if kind == nib.Q4K:
                    _tile_q4k(pw, gr, a, gt, out, r0 + gr * R, gt * T, table)
                elif kind == nib.Q6K:
                    _tile_q6k(pw, gr, a, gt, out, r0 + gr * R, gt * T, table)
                elif kind == nib.Q5K:
                    _tile_q5k(pw, gr, a, gt, out, r0 + gr * R, gt * T, table)
                else:
                    _tile_iq3(pw, gr, a, gt, out, r0 + gr * R, gt * T, table)


def matmul(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray, table: np.ndarray, kind: int) -> None:
    """out (n_tok, n_rows) = x @ W.T; W in layout `kind` (nibble_int8's IQ3, Q4K, Q6K, Q5K) as (n_rows, nb, block
    bytes), x float32 (n_tok, nb, 256): nibble_int8.matvec's results, bit for bit. table: IQ3's code values."""
    n_rows, nb, nbytes = raw3.shape
    as_f32, as_i32 = (raw3.view(dt).reshape(n_rows, nb, nbytes // 4) for dt in (np.float32, np.int32))
    _gemm(raw3, as_f32, as_i32, x3, out, table, kind, *panel_layout(kind), numba.get_num_threads())


def multiply(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray, table: np.ndarray, kind: int) -> None:
    """out = x @ W.T for any token count: this GEMM from MIN_TOK tokens, nibble_int8.matvec below (same bits)."""
    if x3.shape[0] >= MIN_TOK:
        matmul(raw3, x3, out, table, kind)
    else:
        nib.matvec(raw3, x3, out, table, kind)
