"""Prompt-chunk GEMM for Q5_0 / Q4_0 / IQ4_NL / Q8_0 interleaved by 4 rows (rows4_int8.py), with the bits of its mat-vec
kernel.

rows4_int8's kernel gives, per (token, row), acc = fma(float(s_b), fl(d_w d_a), acc) over the blocks b, s_b the
block's exact integer dot minus offset x the activations' sum. Here a tile is one row group (4 rows) and 2 x 8
tokens, the tokens in the lanes of the accumulators (one int32 and one float vector per row and 8 tokens): per
block and lane group j (4 activations) of 8 tokens, one load of their packed activations serves the 4 rows,
each row's 4 codes are broadcast from the unpacked panel once for both 8-token groups (2 groups a tile:
default model's Q5_0 mat-muls at 512 tokens 739 -> 621 ms, prompt 1.15-1.18x end to end on the 2-core AVX-512
EPYC VM; on AVX2 the order of the code decides what stays in the 16 vector registers, see _make_tile), and
vpdpbusd (pmaddubsw + pmaddwd + add on AVX2) sums into
the row's int32 vector (IQ4_NL and Q8_0 on AVX2, the sign form: |w| times x signed by w, one more op); then per row one
subtract, one convert, one multiply (the 8 scale products) and one FMA. ~11 vector ops per 32 (token, row) multiply-adds of a block against ~13 per token and row group in the
mat-vec kernel's 8-token calls (and ~2.2 cycles per (token, row, block) in q8_0_gemm.py's 8-lane order).
Every integer and float operation per (token, row) is the mat-vec kernel's, so are the bits (tests). With AVX-512
VNNI the tiles may hold 16 tokens a vector instead (512-bit vpdpbusd; isa.GEMM_LANES says where): the same
operations per token.

Each thread unpacks PANEL groups at a time (codes, the sign form's signed weights, float32 scales: 144 or 272
bytes a group and block) and multiplies
them with its range of token groups, whose packed activations stay in L1 while they meet every group of the
panel (as q8_0_gemm.py).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from . import rows4_int8 as r4
from .act_quant_ir import q8_0_block
from .gemm_work import token_chunks
from .isa import AVX2, INT8_ISA, SIGN_TILE_ROW_LOOP, VNNI, VNNI_BUILT, WIDE_BUILT, tile_lanes

LANES, ROWS_UNROLLED, ROW_LOOP = 0, 1, 2    # the orders of a tile's code (_make_tile)
MIN_TOK = 16      # from here on the GEMM; below, rows4_int8's mat-vec kernel (8-token calls)
PANEL = 12        # row groups a thread unpacks at a time (48 rows; 12 x 28 blocks x 144 B = 48 KB at 896 columns)
# a panel record: the 4 code vectors (128 bytes), for the sign form the 4 signed weight vectors (128), then the
# 4 rows' float32 scales
def _w_rec(sign: bool) -> int:
    return 272 if sign else 144



@njit(cache=True, inline="always")
def a_record(lanes):
    """Activation record of `lanes` tokens (8, or 16 with 512-bit vectors) and a block, byte offsets (A_X, A_D,
    A_C, A_REC): lane group j (4 activations) of token l at A_X + 4 lanes j + 4 l, the tokens' float32 scales at
    A_D + 4 l, offset x their block sums (int32) at A_C + 4 l; A_REC bytes a record."""
    return 0, 32 * lanes, 36 * lanes, 40 * lanes


# ------------------------------------------------------------------------------------------- panels

def _make_unpack(kind: int, isa: int):
    """The intrinsic unpack(raw3, g, pw, i): row group g of raw3 into group i of panel pw (groups, blocks, w_rec)."""
    bb = r4.BLOCK_BYTES[kind]

    @intrinsic
    def unpack(typingctx, raw3, g, pw, i):
        if not (L.c_arrays((raw3, types.uint8, 3), (pw, types.uint8, 3))
                and isinstance(g, types.Integer) and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            (praw, rstr, rshape), (ppw, wstr, _) = (
                L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 2))
            src0 = builder.gep(praw, [builder.mul(args[1], builder.mul(L.const(r4.ROWS), rstr[0]))])
            dst0 = builder.gep(ppw, [builder.mul(args[3], wstr[0])])
            with cgutils.for_range(builder, rshape[1]) as loop:
                b = loop.index
                codes, signed, d = r4.unpack_group(
                    builder, builder.gep(src0, [builder.mul(b, L.const(r4.ROWS * bb))]), kind, isa)
                dst = builder.gep(dst0, [builder.mul(b, wstr[1])])
                for v, c in enumerate(codes + (signed or [])):
                    builder.store(c, builder.bitcast(builder.gep(dst, [L.const(32 * v)]), L.V32B.as_pointer()), align=1)
                d_at = L.const(_w_rec(signed is not None) - 16)
                builder.store(d, builder.bitcast(builder.gep(dst, [d_at]), r4.V4F.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(raw3, types.intp, pw, types.intp), codegen
    return unpack


_UNPACK = {(kind, isa): _make_unpack(kind, isa) for kind in r4.KINDS for isa in (AVX2, VNNI)}
_unpack_q5, _unpack_q4, _unpack_nl, _unpack_q8 = (_UNPACK[k, AVX2] for k in r4.KINDS)
_unpack_q5_vnni, _unpack_q4_vnni, _unpack_nl_vnni, _unpack_q8_vnni = (_UNPACK[k, VNNI] for k in r4.KINDS)


@njit(cache=True, inline="always")
def _unpack(kind, isa, raw3, g, pw, i):
    if VNNI_BUILT and isa == VNNI:
        if kind == r4.Q5_0_KIND:
            _unpack_q5_vnni(raw3, g, pw, i)
        elif kind == r4.Q4_0_KIND:
            _unpack_q4_vnni(raw3, g, pw, i)
        elif kind == r4.Q8_0_KIND:
            _unpack_q8_vnni(raw3, g, pw, i)
        else:
            _unpack_nl_vnni(raw3, g, pw, i)
    elif kind == r4.Q5_0_KIND:
        _unpack_q5(raw3, g, pw, i)
    elif kind == r4.Q4_0_KIND:
        _unpack_q4(raw3, g, pw, i)
    elif kind == r4.Q8_0_KIND:
        _unpack_q8(raw3, g, pw, i)
    else:
        _unpack_nl(raw3, g, pw, i)


# ------------------------------------------------------------------------------------- activations

@njit(cache=True, parallel=True)
def _pack_activations(x3, a, a_f32, a_i32, offset, lanes):
    # a uint8 (token groups, blocks, a_record(lanes)'s A_REC); a_f32 / a_i32 the same bytes (a short last group
    # repeats the last token). llama.cpp's Q8_0 rounding (act_quant_ir.q8_0_block).
    n_tok, nb = x3.shape[0], x3.shape[1]
    _, a_d, a_c, _ = a_record(lanes)
    for t in prange(a.shape[0] * lanes):
        g, lane = t // lanes, t % lanes
        tx = min(np.intp(t), n_tok - 1)
        q = np.empty((1, nb, 32), dtype=np.int8)
        d = np.empty((1, nb), dtype=np.float32)
        for b in range(nb):
            q8_0_block(x3, tx, b, q, d, 0)
            tot = np.int32(0)
            for j in range(32):
                a[g, b, 4 * lanes * (j // 4) + 4 * lane + j % 4] = np.uint8(q[0, b, j] & 255)
                tot += np.int32(q[0, b, j])
            a_f32[g, b, a_d // 4 + lane] = d[0, b]
            a_i32[g, b, a_c // 4 + lane] = offset * tot


# --------------------------------------------------------------------------------------------- tile

def _make_tile(isa, sign: bool, lanes: int = 8, order: int = 0):
    """The intrinsic tile(pw, i, a, g0, g1, out, r0): out[lanes g + l, r0 + q] for the `lanes` tokens l of the
    token groups g = g0 and g1 (g1 may equal g0: then its values are stored twice; stores past the last token go
    to the last one: the packing repeated it) and the 4 rows q of panel group i; each weight broadcast serves both
    groups. sign: the panel holds the sign form (|w|, then w); lanes: 8 (256-bit vectors) or 16 (512-bit, VNNI).
    AVX2 without the sign form (Q5_0's and Q4_0's codes) adds L.CODE5_INT16_SUMS lane groups' pmaddubsw in int16
    before each pmaddwd, the same integers with fewer operations.
    order: how the code walks a block (the same operations and bits; what differs is what LLVM keeps in AVX2's
    16 vector registers). LANES: lane group by lane group, each of the 4 rows' sums beside the others (8 integer
    and 8 float accumulators live). ROWS_UNROLLED: row by row, the block's 16 activation vectors loaded once.
    ROW_LOOP: the 4 rows as a loop LLVM does not unroll (its trip count comes from the panel's stride), the
    float accumulators in memory, the activations loaded again per row. Measured at 512 tokens (docs/cpu.md,
    "Prompt GEMM tiles and AVX2's registers"): AVX2's Q5_0 / Q4_0 tiles take ROWS_UNROLLED (the 2-core AMD
    EPYC VM, one thread: 896 x 9728 63-68 -> 57-58 ms; the Xeon host, forced to AVX2, 2 threads: 26.2-26.6 ->
    25.8-26.1); the sign form takes ROW_LOOP on AMD Zen (isa.sign_tile_row_loop; IQ4_NL 896 x 9728: LANES 95-164
    ms by process, ROW_LOOP 92-103) and LANES elsewhere (the Xeon forced to AVX2: 42.0-42.6 against ROW_LOOP's
    46.7); VNNI's tiles take LANES (the Xeon: Q5_0 896 x 9728 13.3-13.9 ms against ROWS_UNROLLED's 15.6-15.8).
    """
    A_X, A_D, A_C, _ = a_record.py_func(lanes)
    sums16 = L.CODE5_INT16_SUMS if isa == AVX2 and not sign else 1
    VI, VF, VB = (ir.VectorType(t, n) for t, n in ((L.I32, lanes), (L.F32, lanes), (L.I8, 4 * lanes)))
    n_groups = 2

    @intrinsic
    def tile(typingctx, pw, i, a, g0, g1, out, r0):
        sig = L.gemm_tile_signature(pw, i, a, g0, g1, out, r0)
        if sig is None:
            return None

        def codegen(context, builder, signature, args):
            psign = L.avx2(builder, "psign.b")
            d_at = _w_rec(sign) - 16
            w0, (wstr, wshape), a0, astr, (pout, ostr, oshape) = L.gemm_tile_operands(context, builder, signature,
                                                                                   args)
            # float accumulators acc[k][q] of token group k and row q
            acc = cgutils.alloca_once(builder, VF, size=n_groups * r4.ROWS)
            for k in range(n_groups * r4.ROWS):
                builder.store(ir.Constant(VF, None), builder.gep(acc, [L.const(k)]))

            def dword(p, off):          # 4 bytes at p + off, in each lane
                return builder.bitcast(L.splat(builder, L.load(builder, p, off, L.I32), VI), VB)

            def accumulate(j, w, ws, x, st):
                """Lane group j of one row (its code broadcast w, the sign form's ws) and token group (its
                activations x) into st = [int32 sums, pending int16 sums]."""
                xs = builder.call(psign, [x, ws]) if sign else x
                if sums16 == 1:
                    st[0] = L.dot_u8s8(builder, isa, w, xs, st[0])
                    return
                m = L.maddubs(builder, w, xs)          # codes: sums16 of them stay within int16
                st[1] = m if j % sums16 == 0 else builder.add(st[1], m)
                if j % sums16 == sums16 - 1:
                    st[0] = L.widen_add(builder, st[1], st[0])

            def codes(pq, j):    # row q's code dword of lane group j: at pq + 32 (j // 2) + 16 (j % 2)
                at = 32 * (j // 2) + 16 * (j % 2)
                return dword(pq, at), (dword(pq, 128 + at) if sign else None)

            def row_sums(pq, pab, xa):
                """[token group k's int32 sums of the block's 32 products] for the row whose codes start at pq;
                xa(j, k): activations."""
                st = [[None, None] for _ in pab]
                for j in range(8):
                    w, ws = codes(pq, j)
                    for k in range(len(pab)):
                        accumulate(j, w, ws, xa(j, k), st[k])
                return [c[0] for c in st]

            def fold(pq, p, isum, q_at):
                """acc[q_at] += float(isum - offset x sums) x d_w d_a (the mat-vec kernel's operations)."""
                corr = L.load(builder, p, A_C, VI)
                da = L.load(builder, p, A_D, VF)
                s = builder.fmul(L.splat(builder, L.load(builder, pq, d_at, L.F32), VF), da)
                f = builder.sitofp(builder.sub(isum, corr), VF)
                cell = builder.gep(acc, [q_at])
                builder.store(builder.fadd(builder.fmul(f, s, flags=L.CONTRACT), builder.load(cell),
                                           flags=L.CONTRACT), cell)

            with cgutils.for_range(builder, wshape[1]) as loop:
                pwb = builder.gep(w0, [builder.mul(loop.index, wstr[1])])
                pab = [builder.gep(p, [builder.mul(loop.index, astr[1])]) for p in a0]
                if order == ROW_LOOP:
                    n_rows = builder.udiv(wstr[1], L.const(_w_rec(sign) // r4.ROWS))   # 4, unseen by LLVM
                    with cgutils.for_range(builder, n_rows) as rl:
                        q = rl.index
                        pq = builder.gep(pwb, [builder.mul(q, L.const(4))])
                        isum = row_sums(pq, pab, lambda j, k: L.load(builder, pab[k], A_X + 4 * lanes * j, VB))
                        for k, p in enumerate(pab):
                            fold(pq, p, isum[k], builder.add(builder.mul(L.const(k), L.const(r4.ROWS)), q))
                elif order == LANES:
                    pq = [builder.gep(pwb, [L.const(4 * q)]) for q in range(r4.ROWS)]
                    st = [[[None, None] for _ in pab] for _ in pq]
                    for j in range(8):
                        xa = [L.load(builder, p, A_X + 4 * lanes * j, VB) for p in pab]
                        for q in range(r4.ROWS):
                            w, ws = codes(pq[q], j)
                            for k, x in enumerate(xa):
                                accumulate(j, w, ws, x, st[q][k])
                    for k, p in enumerate(pab):
                        for q in range(r4.ROWS):
                            fold(pq[q], p, st[q][k][0], L.const(k * r4.ROWS + q))
                else:
                    xs = [[L.load(builder, p, A_X + 4 * lanes * j, VB) for p in pab] for j in range(8)]
                    for q in range(r4.ROWS):
                        pq = builder.gep(pwb, [L.const(4 * q)])
                        isum = row_sums(pq, pab, lambda j, k: xs[j][k])
                        for k, p in enumerate(pab):
                            fold(pq, p, isum[k], L.const(k * r4.ROWS + q))
            rows = [builder.add(args[6], L.const(q)) for q in range(r4.ROWS)]
            for k, g in enumerate((args[3], args[4])):
                vals = [builder.load(builder.gep(acc, [L.const(k * r4.ROWS + q)])) for q in range(r4.ROWS)]
                toks = L.clamped_rows(builder, builder.mul(g, L.const(lanes)), lanes, oshape[0])
                L.store_tile(builder, pout, ostr, toks, rows,
                             lambda q, l: builder.extract_element(vals[q], L.const(l, L.I32)))
            return context.get_dummy_value()

        return sig, codegen
    return tile


_tile_avx2, _tile_vnni = _make_tile(AVX2, False, order=ROWS_UNROLLED), _make_tile(VNNI, False)
_tile_avx2_sign = _make_tile(AVX2, True, order=ROW_LOOP if SIGN_TILE_ROW_LOOP else LANES)   # by CPU
_tile_wide = _make_tile(VNNI, False, 16)


@njit(cache=True, inline="always")
def _tile(kind, isa, lanes, pw, i, a, g0, g1, out, r0):
    if WIDE_BUILT and lanes == 16:
        _tile_wide(pw, i, a, g0, g1, out, r0)
    elif VNNI_BUILT and isa == VNNI:
        _tile_vnni(pw, i, a, g0, g1, out, r0)
    elif r4.sign_form(kind, isa):
        _tile_avx2_sign(pw, i, a, g0, g1, out, r0)
    else:
        _tile_avx2(pw, i, a, g0, g1, out, r0)


# -------------------------------------------------------------------------------------------- GEMM

@njit(cache=True, parallel=True)
def _gemm(raw3, x3, out, kind, w_rec, n_threads, isa, lanes):
    # lanes: tokens a vector, 8 (256-bit) or 16 (512-bit: WIDE_BUILT and isa VNNI)
    n_groups, nb = raw3.shape[0] // r4.ROWS, raw3.shape[1]
    n_tg = (x3.shape[0] + lanes - 1) // lanes
    a = np.empty((n_tg, nb, a_record(lanes)[3]), dtype=np.uint8)
    _pack_activations(x3, a, a.view(np.float32), a.view(np.int32), r4.offset(kind, isa), lanes)
    n_pan = (n_groups + PANEL - 1) // PANEL
    n_ch = token_chunks(n_pan, n_tg, n_threads)
    for item in prange(n_pan * n_ch):
        p, c = item // n_ch, item % n_ch
        g0 = p * PANEL
        n_in_pan = min(PANEL, n_groups - g0)
        pw = np.empty((n_in_pan, nb, w_rec), dtype=np.uint8)
        for i in range(n_in_pan):
            _unpack(kind, isa, raw3, g0 + i, pw, i)
        tg0, tg1 = n_tg * c // n_ch, n_tg * (c + 1) // n_ch
        for tg in range(tg0, tg1, 2):             # two token groups a tile (the last may repeat: same values)
            for i in range(n_in_pan):
                _tile(kind, isa, lanes, pw, i, a, tg, min(tg + 1, tg1 - 1), out, r4.ROWS * (g0 + i))


def matmul(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray, kind: int, isa: int = INT8_ISA,
           lanes: int | None = None) -> None:
    """out (n_tok, n_rows) = x @ W.T, W the interleaved layout of `kind` (rows4_int8's kinds) viewed (n_rows, nb,
    its block bytes), x float32 (n_tok, nb, 32): rows4_int8's mat-vec results, bit for bit. lanes: tokens a
    vector, 16 (512-bit) only with AVX-512 VNNI and isa VNNI; by default isa.GEMM_LANES on VNNI, else 8."""
    _gemm(raw3, x3, out, kind, _w_rec(r4.sign_form(kind, isa)), numba.get_num_threads(), isa, tile_lanes(isa, lanes))
