"""Prompt-chunk GEMM for the Q8_0 family (Q8_0, and Q5_0 / Q4_0 / IQ4_NL in their own blocks), with the bits
of q8_0_int8.mv_avx2.

mv_avx2 keeps, per (token, row), an 8-lane float accumulator whose lane j sums, block by block, the exact
integer dot of weights 4j .. 4j + 3 with their int8 activations times fl(d_w d_a) (one FMA per block),
and returns the 3-level lane sum (llvm_ir.hsum): llama.cpp's AVX2 order. Per block and (token, row) it
reloads the activations and forms and splats the scale product, ~9 µops (3.3-3.8 cycles on the 2-core
AVX2 VM, one thread).

Here the same lanes are computed transposed: a tile is one row and 8 tokens, accumulator j holds lane j of
the 8 tokens (vector lane l = token l), so the activations are packed with lane group j of the 8 tokens
side by side (4 bytes each) and the weights' lane group j is one broadcast. A block then costs, for the
8 tokens, one multiply for the 8 scale products and per lane group pmaddubsw + pmaddwd + convert + FMA:
the four multiply-pipe µops of the integer dot and its scaling, 2.2 instead of 3.8 cycles per (token,
row, block) on Q5_0. The final sum adds the 8 accumulators in hsum's order. Every integer and every float
operation per (token, row) is the kernel's, so are the bits. How the integers are formed:
  * Q5_0 / Q4_0 ("offset" kinds): the weight codes c = w + o (0..31 / 0..15) are unsigned bytes, so
    pmaddubsw(c, x) needs no sign moves; o times the activations' lane sums (made with the packing) is
    subtracted as int32: sum c x - o sum x = sum w x, exactly.
  * Q8_0 / IQ4_NL ("signed" kinds, weights down to -128 / -127, where w + 128 would overflow pmaddubsw's
    int16 pair sums): pmaddubsw(|w|, sign(w) x) as mv_avx2, with |w| unpacked once.
Each thread unpacks PANEL rows at a time (codes, |w|, float32 scales) and multiplies them with its range of
token groups, whose packed activations stay in L1 while they meet every row of the panel.
On a VNNI CPU (isa.py) vpdpbusd replaces pmaddubsw + pmaddwd, as in mv_avx2: the same integers (unsigned
operands |w| <= 128 or codes <= 31: no pair sum saturates; llvm_ir.dot_u8s8).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from . import q8_0_int8 as q8
from .act_quant_ir import q8_0_block
from .gemm_work import token_chunks
from .isa import AVX2, INT8_ISA, VNNI, VNNI_BUILT

MIN_TOK = 16          # from here on the GEMM (every matrix: small ones too, split over token ranges); below,
                      # q8_0_int8.mv_avx2 (perf/bench_prompt_gemm.py)
T = 8                 # tokens a tile: the 8 lanes of a vector (one row a tile: 8 accumulators)
PANEL = 48            # rows a thread unpacks at a time (48 x 28 blocks x 36 bytes: 48 KB at 896 columns)
OFFSET = {q8.Q5_0_KIND: 16, q8.Q4_0_KIND: 8}     # kinds whose codes are w + offset, unsigned


# ------------------------------------------------------------------------------------------- panels
# A panel: PANEL rows unpacked for the tile, (rows, blocks, w_rec) bytes; record [i, b] holds block b of
# the panel's row i: 32 codes (offset kinds) or weights, then for the signed kinds 32 |w|, then the
# float32 scale.

def _w_rec(signed):
    return 68 if signed else 36


def _make_unpack(codes, signed):
    """The intrinsic unpack(raw3, r, pw, i): row r of raw3 into row i of panel pw."""
    @intrinsic
    def unpack(typingctx, raw3, r, pw, i):
        if not (L.c_arrays((raw3, types.uint8, 3), (pw, types.uint8, 3))
                and isinstance(r, types.Integer) and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            (praw, rstr, rshape), (ppw, wstr, _) = (
                L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 2))
            psign = L.avx2(builder, "psign.b")
            src0 = builder.gep(praw, [builder.mul(args[1], rstr[0])])
            dst0 = builder.gep(ppw, [builder.mul(args[3], wstr[0])])
            with cgutils.for_range(builder, rshape[1]) as loop:
                b = loop.index
                c, d = codes(builder, builder.gep(src0, [builder.mul(b, rstr[1])]))
                dst = builder.gep(dst0, [builder.mul(b, wstr[1])])
                builder.store(c, builder.bitcast(dst, L.V32B.as_pointer()), align=1)
                if signed:
                    builder.store(builder.call(psign, [c, c]),
                                  builder.bitcast(builder.gep(dst, [L.const(32)]), L.V32B.as_pointer()), align=1)
                L.store_f32(builder, dst, L.const(64 if signed else 32), d)
            return context.get_dummy_value()

        return types.void(raw3, types.intp, pw, types.intp), codegen
    return unpack


_unpack_q8_0 = _make_unpack(q8._q8_0_weights, True)
_unpack_iq4_nl = _make_unpack(q8._iq4_nl_weights, True)
_unpack_q5_0 = _make_unpack(q8._q5_0_codes, False)
_unpack_q4_0 = _make_unpack(q8._q4_0_codes, False)


@njit(cache=True, inline="always")
def _unpack_row(kind, raw3, r, pw, i):
    if kind == q8.Q5_0_KIND:
        _unpack_q5_0(raw3, r, pw, i)
    elif kind == q8.Q4_0_KIND:
        _unpack_q4_0(raw3, r, pw, i)
    elif kind == q8.IQ4_NL_KIND:
        _unpack_iq4_nl(raw3, r, pw, i)
    else:
        _unpack_q8_0(raw3, r, pw, i)


# ------------------------------------------------------------------------------------- activations
# Packed activations, tokens in lanes: (tokens / 8, blocks, a_rec) bytes; record [g, b] for block b of tokens
# 8 g .. 8 g + 7 (a short last group repeats the last token):
#   [32 j, 32 j + 32)  lane group j (activations 4 j .. 4 j + 3 of the block) of the 8 tokens, 4 bytes each
#   [256, 288)         the 8 tokens' float32 scales
#   [288 + 32 j, ...)  offset kinds: the 8 tokens' int32 sums of offset x activations 4 j .. 4 j + 3
A_X, A_D, A_C = 0, 256, 288


def _a_rec(signed):
    return 288 if signed else 544


@njit(cache=True, parallel=True)
def _pack_activations(x3, a, a_f32, a_i32, offset):
    # a uint8 (groups, blocks, a_rec); a_f32 / a_i32: the same bytes as float32 / int32
    n_tok, nb = x3.shape[0], x3.shape[1]
    for t in prange(a.shape[0] * T):
        q = np.empty((1, nb, 32), dtype=np.int8)
        d = np.empty((1, nb), dtype=np.float32)
        tx = min(np.intp(t), n_tok - 1)
        g, lane = t // T, t % T
        for b in range(nb):
            q8_0_block(x3, tx, b, q, d, 0)
            for j in range(8):
                s = np.int32(0)
                for i in range(4):
                    v = q[0, b, 4 * j + i]
                    a[g, b, A_X + 32 * j + 4 * lane + i] = np.uint8(v & 255)
                    s += np.int32(v)
                if offset:
                    a_i32[g, b, A_C // 4 + 8 * j + lane] = offset * s
            a_f32[g, b, A_D // 4 + lane] = d[0, b]


# --------------------------------------------------------------------------------------------- tile

def _make_tile(signed, isa):
    """The intrinsic tile(pw, i, a, g, out, r, t0): out[t0 + l, r] for the 8 tokens l of group g (stores past
    the last token go to the last one: the packing repeated it, so the value is the same) from row i of
    panel pw. acc[j] holds lane j of the 8 tokens' accumulators (vector lane l = token l), so the block's
    scale products d_w d_a of the 8 tokens are one multiply. Integer dots with isa's instructions."""
    @intrinsic
    def tile(typingctx, pw, i, a, g, out, r, t0):
        if not (L.c_arrays((pw, types.uint8, 3), (a, types.uint8, 3)) and L.strided_array(out, types.float32, 2)
                and all(isinstance(v, types.Integer) for v in (i, g, r, t0))):
            return None
        sig = types.void(pw, types.intp, a, types.intp, out, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            psign = L.avx2(builder, "psign.b")
            (ppw, wstr, wshape), (pa, astr, _), (pout, ostr, oshape) = (
                L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 2, 4))
            w0 = builder.gep(ppw, [builder.mul(args[1], wstr[0])])
            a0 = builder.gep(pa, [builder.mul(args[3], astr[0])])
            acc = [cgutils.alloca_once_value(builder, ir.Constant(L.V8F, None)) for _ in range(8)]

            def dword(p, off):          # 4 bytes at p + off, in each of the 8 lanes
                return builder.bitcast(L.splat(builder, L.load(builder, p, off, L.I32), L.V8I), L.V32B)

            with cgutils.for_range(builder, wshape[1]) as loop:
                pwb = builder.gep(w0, [builder.mul(loop.index, wstr[1])])
                pab = builder.gep(a0, [builder.mul(loop.index, astr[1])])
                s = builder.fmul(L.splat(builder, L.load(builder, pwb, 64 if signed else 32, L.F32), L.V8F),
                                 L.load(builder, pab, A_D, L.V8F))       # lane l: d_w * d_a of token l
                for j in range(8):
                    xa = L.load(builder, pab, A_X + 32 * j, L.V32B)
                    if signed:
                        sx = builder.call(psign, [xa, dword(pwb, 4 * j)])
                        isum = L.dot_u8s8(builder, isa, dword(pwb, 32 + 4 * j), sx)
                    else:
                        isum = L.dot_u8s8(builder, isa, dword(pwb, 4 * j), xa)
                        isum = builder.sub(isum, L.load(builder, pab, A_C + 32 * j, L.V8I))
                    builder.store(builder.fadd(builder.fmul(builder.sitofp(isum, L.V8F), s, flags=L.CONTRACT),
                                               builder.load(acc[j]), flags=L.CONTRACT), acc[j])
            v = [builder.load(p) for p in acc]
            # llvm_ir.hsum's order over the lanes j, for the 8 tokens at once
            total = builder.fadd(builder.fadd(builder.fadd(v[0], v[4]), builder.fadd(v[2], v[6])),
                                 builder.fadd(builder.fadd(v[1], v[5]), builder.fadd(v[3], v[7])))
            toks = L.clamped_rows(builder, args[6], T, oshape[0])
            L.store_tile(builder, pout, ostr, toks, [args[5]],
                         lambda k, l: builder.extract_element(total, L.const(l, L.I32)))
            return context.get_dummy_value()

        return sig, codegen
    return tile


_tile_signed, _tile_offset, _tile_signed_vnni, _tile_offset_vnni = (
    _make_tile(signed, isa) for isa in (AVX2, VNNI) for signed in (True, False))


@njit(cache=True, inline="always")
def _tile(offset, isa, pw, i, a, g, out, r, t0):
    """The tile of the offset or signed kinds with isa's instructions (VNNI where compiled: as q8._dot)."""
    if VNNI_BUILT and isa == VNNI:
        if offset:
            _tile_offset_vnni(pw, i, a, g, out, r, t0)
        else:
            _tile_signed_vnni(pw, i, a, g, out, r, t0)
    elif offset:
        _tile_offset(pw, i, a, g, out, r, t0)
    else:
        _tile_signed(pw, i, a, g, out, r, t0)


# -------------------------------------------------------------------------------------------- GEMM

@njit(cache=True, parallel=True)
def _gemm(raw3, kind, x3, out, offset, w_rec, a_rec, n_threads, isa):
    n_rows, nb = raw3.shape[0], raw3.shape[1]
    n_tg = (x3.shape[0] + T - 1) // T
    a = np.empty((n_tg, nb, a_rec), dtype=np.uint8)
    _pack_activations(x3, a, a.view(np.float32), a.view(np.int32), offset)
    n_pan = (n_rows + PANEL - 1) // PANEL
    n_ch = token_chunks(n_pan, n_tg, n_threads)
    for item in prange(n_pan * n_ch):
        p, c = item // n_ch, item % n_ch
        r0 = p * PANEL
        n_in_pan = min(PANEL, n_rows - r0)
        pw = np.empty((n_in_pan, nb, w_rec), dtype=np.uint8)
        for i in range(n_in_pan):
            _unpack_row(kind, raw3, r0 + i, pw, i)
        for g in range(n_tg * c // n_ch, n_tg * (c + 1) // n_ch):
            for i in range(n_in_pan):
                _tile(offset, isa, pw, i, a, g, out, r0 + i, g * T)


def matmul(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray, kind: int, isa: int = INT8_ISA) -> None:
    """out (n_tok, n_rows) = x @ W.T, W (n_rows, blocks, block bytes) in block format `kind` (q8_0_int8.py's
    kinds), x float32 (n_tok, blocks, 32): q8_0_int8.mv_avx2's results, bit for bit. isa: isa.AVX2 or VNNI."""
    signed = kind not in OFFSET
    _gemm(raw3, kind, x3, out, OFFSET.get(kind, 0), _w_rec(signed), _a_rec(signed),
          numba.get_num_threads(), isa)
