"""Q5_0, Q4_0, IQ4_NL and Q8_0 with 4 rows interleaved (repacked at load, the same bytes: 5.5 / 4.5 / 4.5 / 8.5
bits per weight) for an int8 kernel that keeps each block's integer dot whole and scales 4 rows with one convert
and one FMA.

Why: in the row-by-row kernel (q8_0_int8.py) every (row, block) costs the unpacking of a 22-byte block (~10
vector ops: nibbles, the fifth bits spread from qh) plus a convert and an FMA per 8 lanes, ~16 ops per 32
weights: Q5_0 matrices ran compute-bound at 13-20 GB/s on 2 threads against ~29 GB/s of DRAM bandwidth
(docs/cpu.md). Interleaving 4 rows lets one 32-byte load carry 64 nibbles of 4 rows, the fifth bits of 128
weights come as one 16-byte plane placed so that a shift and an AND put each where it belongs, and the 4
rows' dots share the activations: ~4.5 ops per 32 weights.

Layout of a row group (rows 4g .. 4g + 3) and 32-column block b, 88 bytes for Q5_0 (72 for Q4_0 / IQ4_NL):
  [0:32)   low nibbles: code vector 0, high nibbles: code vector 1
  [32:64)  low nibbles: code vector 2, high nibbles: code vector 3
  [64:80)  Q5_0: the fifth bits; bit 2v + h of byte m is the fifth bit of vector v's byte m + 16 h
  [80:88)  the 4 rows' f16 scales d (Q4_0 / IQ4_NL: at [64:72))
Q8_0, 136 bytes: [0:128) the 4 code vectors holding the signed weights themselves, [128:136) the scales.
Code vector v (32 bytes, 8 dwords): dword q holds the codes of row q % 4, weights 4 (2v + q // 4) .. + 3: the
unsigned weight + 16 (Q5_0) or + 8 (Q4_0), IQ4_NL's table index (pshufb gives the value), or Q8_0's weight.
The activations are permuted to match once per token and block (xp, 4 x 32 bytes: dword q of vector v = activations
4 (2v + q // 4) .. + 3), so vpdpbusd (or pmaddubsw + pmaddwd) of the 4 vectors, summed, leaves in dwords q
and q + 4 the two halves of row q % 4's block dot. The stored matrix keeps its row count (n_rows, blocks *
block bytes); row group g's block b is at byte (4 g) * row bytes + 4 b * block bytes. Only matrices with a
multiple of 4 rows take it (repack.py).

Arithmetic, per (token, row): s_b = the exact integer dot sum w x of block b (x: llama.cpp's Q8_0 rounding of
the activations), formed as the dot of unsigned codes w + o with x minus o times the block's activation sum
(o = 16, 8; IQ4_NL and Q8_0: 128 with VNNI, whose vpdpbusd does not saturate), or, for IQ4_NL and Q8_0 on
AVX2 (pmaddubsw saturates pairs of 241 x 127), as |w| times x signed by w; then
acc = fma(float(s_b), fl(d_w d_a), acc) over b = 0, 1, ... from 0. Every (token, row) is that sequence whatever else is in the call (batch invariance;
the same bits with AVX2 or VNNI: the integers are exact). This is another float order than the row-by-row
kernel's 8 lanes (a different rounding of the same sum; bounds in the tests). Q8_0 gains less than the packed
kinds (no unpacking to save), but its prompt GEMM scales 4 rows with one convert and FMA a block instead of
q8_0_gemm.py's 8 lanes of 4 weights each.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from .act_quant_ir import q8_0_block, rows4_copy
from .dequant import IQ4NL_VALUES
from .isa import AVX2, INT8_ISA, VNNI, VNNI_BUILT
from .prefetch import emit_prefetch

QK = 32
ROWS = 4          # rows interleaved in a group
MAX_TOK = 8       # tokens per kernel call: a group's unpacked codes serve them all
GROUP_RUN = 4     # row groups per work item with several tokens (16 rows: their blocks stay in L1 while a
                  # chunk of 8 tokens meets them)
V16B = ir.VectorType(L.I8, 16)
V4F = ir.VectorType(L.F32, 4)
V4I = ir.VectorType(L.I32, 4)
Q5_0_KIND, Q4_0_KIND, IQ4_NL_KIND, Q8_0_KIND = 0, 1, 2, 3
NAMES = ("Q5_0", "Q4_0", "IQ4_NL", "Q8_0")
KINDS = range(4)
BLOCK_BYTES = (22, 18, 18, 34)      # per row and 32 columns, by kind (the file's)
_D_OFF = (80, 64, 64, 128)          # the scales' offset in a group block, by kind
_IQ4_NL = [int(v) for v in IQ4NL_VALUES]


@njit(cache=True, inline="always")
def sign_form(kind, isa):
    """IQ4_NL and Q8_0 on AVX2: |w| times x signed by w (their values + 128 would saturate pmaddubsw's pair
    sums). Called at code generation and inside the kernels (rows4_gemm._tile)."""
    return (kind == IQ4_NL_KIND or kind == Q8_0_KIND) and not (VNNI_BUILT and isa == VNNI)


@njit(cache=True, inline="always")
def offset(kind, isa):
    """o of the unsigned codes w + o (0: the sign form); the kernels' VNNI branch is taken as in _dot."""
    if kind == Q5_0_KIND:
        return 16
    if kind == Q4_0_KIND:
        return 8
    return 128 if (VNNI_BUILT and isa == VNNI) else 0


# ------------------------------------------------------------------------------------------- repack

@njit(cache=True)
def _code(src, r, b, w, fifth):
    """The code of row r's weight w (0..31) in its block b (Q5_0 / Q4_0: weight + 16 / + 8; IQ4_NL: its table
    index), in ggml's block order (nibble j: low = weight j, high = weight j + 16; Q5_0's qh bit w = the fifth
    bit)."""
    base = 6 if fifth else 2
    v = np.int32(src[r, b, base + (w % 16)])
    c = (v >> 4) if w >= 16 else (v & 15)
    if fifth:
        qh = (np.int32(src[r, b, 2]) | (np.int32(src[r, b, 3]) << 8) | (np.int32(src[r, b, 4]) << 16)
              | (np.int32(src[r, b, 5]) << 24))
        c |= ((qh >> w) & 1) << 4
    return c


@njit(cache=True, parallel=True)
def _repack(src, dst, fifth):
    # src (n_rows, nb, 22 | 18) ggml blocks; dst (n_rows // 4, nb, 88 | 72): the layout above
    d_off = 80 if fifth else 64
    for g in prange(dst.shape[0]):
        for b in range(dst.shape[1]):
            for i in range(dst.shape[2]):
                dst[g, b, i] = 0
            for v in range(4):
                for i in range(32):
                    q, k = i // 4, i % 4
                    r = 4 * g + q % 4
                    c = _code(src, r, b, 4 * (2 * v + q // 4) + k, fifth)
                    j = i + 32 * (v // 2)
                    dst[g, b, j] |= np.uint8((c & 15) << (4 * (v % 2)))
                    if fifth:
                        dst[g, b, 64 + i % 16] |= np.uint8(((c >> 4) & 1) << (2 * v + i // 16))
            for q in range(4):
                dst[g, b, d_off + 2 * q] = src[4 * g + q, b, 0]
                dst[g, b, d_off + 2 * q + 1] = src[4 * g + q, b, 1]


@njit(cache=True, parallel=True)
def _repack_q8_0(src, dst):
    # src (n_rows, nb, 34) ggml Q8_0 blocks (f16 d, 32 int8 weights); dst (n_rows // 4, nb, 136): the 4 weight
    # vectors in the code vectors' dword order (the weights themselves, signed), then the 4 rows' d
    for g in prange(dst.shape[0]):
        for b in range(dst.shape[1]):
            for v in range(4):
                for i in range(32):
                    q, k = i // 4, i % 4
                    dst[g, b, 32 * v + i] = src[4 * g + q % 4, b, 2 + 4 * (2 * v + q // 4) + k]
            for q in range(4):
                dst[g, b, 128 + 2 * q] = src[4 * g + q, b, 0]
                dst[g, b, 128 + 2 * q + 1] = src[4 * g + q, b, 1]


@njit(cache=True)
def _q8_0_rows(src, ids, dst):
    # src (n_rows // 4, nb, 136) the interleaved Q8_0 layout; dst (len(ids), nb, 34): rows ids in ggml's blocks
    # (f16 d, 32 int8 weights), the inverse of _repack_q8_0 for those rows
    for j in range(ids.shape[0]):
        g, q = ids[j] // 4, ids[j] % 4
        for b in range(src.shape[1]):
            dst[j, b, 0] = src[g, b, 128 + 2 * q]
            dst[j, b, 1] = src[g, b, 128 + 2 * q + 1]
            for v in range(4):
                for h in range(2):            # dword q (weights 8v .. 8v + 3) and q + 4 (8v + 4 .. 8v + 7)
                    for k in range(4):
                        dst[j, b, 2 + 8 * v + 4 * h + k] = src[g, b, 32 * v + 4 * (q + 4 * h) + k]


def q8_0_rows(raw: np.ndarray, n_cols: int, ids) -> np.ndarray:
    """Rows ids of an interleaved Q8_0 matrix (raw: this layout, uint8 (n_rows, n_cols // 32 * 34)) in ggml's
    Q8_0 blocks, uint8 (len(ids), n_cols // 32 * 34): the bytes the file had (a tied output's token embedding
    looked up from its interleaved copy)."""
    nb = n_cols // QK
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= raw.shape[0]):
        raise IndexError(f"row ids outside 0 .. {raw.shape[0] - 1}")
    out = np.empty((ids.size, nb * BLOCK_BYTES[Q8_0_KIND]), dtype=np.uint8)
    _q8_0_rows(raw.reshape(raw.shape[0] // ROWS, nb, ROWS * BLOCK_BYTES[Q8_0_KIND]), ids,
               out.reshape(ids.size, nb, BLOCK_BYTES[Q8_0_KIND]))
    return out


def repack_rows(raw: np.ndarray, n_cols: int, kind: int) -> np.ndarray:
    """ggml rows of `kind`, uint8 (n_rows, n_cols // 32 * block bytes), n_rows a multiple of 4 -> this layout,
    the same shape and size (IQ4_NL's blocks are Q4_0's: an f16 d and 16 bytes of nibbles)."""
    bb = BLOCK_BYTES[kind]
    n_rows, nb = raw.shape[0], n_cols // QK
    if n_rows % ROWS or raw.shape[1] != nb * bb:
        raise ValueError(f"not {n_rows} rows of {nb} {NAMES[kind]} blocks in groups of 4")
    out = np.empty(raw.shape, dtype=np.uint8)
    src, dst = np.ascontiguousarray(raw).reshape(n_rows, nb, bb), out.reshape(n_rows // ROWS, nb, ROWS * bb)
    if kind == Q8_0_KIND:
        _repack_q8_0(src, dst)
    else:
        _repack(src, dst, kind == Q5_0_KIND)
    return out


# -------------------------------------------------------------------------------------- activations

@njit(cache=True)
def _prepare_token(x3, t, xq, xp, xd, xc, offset):
    """Token t of x3 (n_tok, nb, 32) float32 -> xd[t] (nb,) the f16-rounded scales and xq[t] the int8 values
    (llama.cpp's Q8_0 rounding, act_quant_ir.q8_0_block), xp[t] (nb, 128) those permuted to the code
    vectors' dwords, xc[t] (nb,) offset x the block's int8 sum."""
    for b in range(x3.shape[1]):
        q8_0_block(x3, t, b, xq, xd, t)
        rows4_copy(xq, xp, xc, t, b, offset)


@njit(cache=True, parallel=True)
def _prepare(x3, xq, xp, xd, xc, offset):
    for t in prange(x3.shape[0]):
        _prepare_token(x3, t, xq, xp, xd, xc, offset)


@njit(cache=True)
def _prepare_serial(x3, xq, xp, xd, xc, offset):
    for t in range(x3.shape[0]):
        _prepare_token(x3, t, xq, xp, xd, xc, offset)


# ------------------------------------------------------------------------------------------- kernel

def _shift_counts(v):
    """(shift op, per-dword counts) that bring the fifth bit of code vector v's bytes to bit 4 (bit 2v in the
    low 128-bit half, 2v + 1 in the high half; the plane is broadcast to both halves)."""
    lo, hi = 2 * v, 2 * v + 1
    if hi <= 4:
        return "shl", [4 - lo] * 4 + [4 - hi] * 4
    return "lshr", [lo - 4] * 4 + [hi - 4] * 4


def unpack_group(builder, p, kind: int, isa: int):
    """(the 4 unsigned code vectors u (<32 x i8>), the 4 signed weight vectors w for the sign form (else None),
    the 4 rows' scales d (<4 x float>)) of the group block at i8* p (the layout above): nibbles by AND / shift,
    each fifth bit moved to bit 4 by a per-dword shift of the broadcast plane; IQ4_NL's values by pshufb
    (+ 128 for the offset form, |w| and w for the sign form); Q8_0's weights as stored (w + 128 by an XOR of
    the sign bit, or |w| by psign and w)."""
    d = builder.fpext(builder.bitcast(L.load(builder, p, _D_OFF[kind], ir.VectorType(L.I16, 4)),
                                      ir.VectorType(ir.HalfType(), 4)), V4F)
    if kind == Q8_0_KIND:
        w = [L.load(builder, p, 32 * v, L.V32B) for v in range(4)]
        if sign_form(kind, isa):
            psign = L.avx2(builder, "psign.b")
            return [builder.call(psign, [c, c]) for c in w], w, d
        return [builder.xor(c, ir.Constant(L.V32B, [128] * 32)) for c in w], None, d
    fifth = kind == Q5_0_KIND
    low4 = ir.Constant(L.V32B, [15] * 32)
    codes = []
    for off in (0, 32):
        h = L.load(builder, p, off, L.V32B)
        codes.append(builder.and_(h, low4))
        hi = builder.lshr(builder.bitcast(h, L.V16W), ir.Constant(L.V16W, [4] * 16))
        codes.append(builder.and_(builder.bitcast(hi, L.V32B), low4))
    if fifth:
        bit4 = ir.Constant(L.V32B, [16] * 32)
        plane = L.load(builder, p, 64, V16B)
        plane = builder.bitcast(builder.shuffle_vector(
            plane, plane, ir.Constant(ir.VectorType(L.I32, 32), list(range(16)) * 2)), L.V8I)
        for v in range(4):
            op, counts = _shift_counts(v)
            moved = getattr(builder, op)(plane, ir.Constant(L.V8I, counts))
            codes[v] = builder.or_(codes[v], builder.and_(builder.bitcast(moved, L.V32B), bit4))
    signed = None
    if kind == IQ4_NL_KIND:
        def table(values, c):
            return builder.call(L.avx2(builder, "pshuf.b"), [ir.Constant(L.V32B, [v & 255 for v in values] * 2), c])
        if sign_form(kind, isa):
            signed = [table(_IQ4_NL, c) for c in codes]
            codes = [table([abs(v) for v in _IQ4_NL], c) for c in codes]
        else:
            codes = [table([v + 128 for v in _IQ4_NL], c) for c in codes]
    return codes, signed, d


def _make_dot(kind: int, isa: int):
    """The intrinsic dot(raw3, g0, xp, xd, xc, t0, n_tok, out) for groups of `kind`."""
    bb = BLOCK_BYTES[kind]

    @intrinsic
    def dot(typingctx, raw3, g0, xp, xd, xc, t0, n_tok, out):
        if not (L.c_arrays((raw3, types.uint8, 3), (xp, types.int8, 3), (xd, types.float32, 2),
                           (xc, types.int32, 2))
                and L.strided_array(out, types.float32, 2) and L.tile_args(g0, t0, n_tok, MAX_TOK)):
            return None
        sig = types.void(raw3, types.intp, xp, xd, xc, types.intp, n_tok, out)
        T = n_tok.literal_value
        # one row group a call, also for one token: two groups a call (2,464 bytes apart at 896 columns) made two
        # streams a thread and read the default model's gate/up at 0.83-0.86 of a plain read, one group at
        # 0.93-1.09 (2-core Zen 5 VM, 2026-12-07; docs/cpu.md)

        def codegen(context, builder, signature, args):
            (praw, rstr, rshape), (pxp, pstr, _), (pxd, dstr, _), (pxc, cstr, _), (pout, ostr, _) = (
                L.array_arg(context, builder, signature.args[i], args[i]) for i in (0, 2, 3, 4, 7))
            n_groups = builder.udiv(rshape[0], L.const(ROWS))
            g = L.clamped_rows(builder, args[1], 1, n_groups)[0]
            gstride = builder.mul(L.const(ROWS), rstr[0])
            bstride = L.const(ROWS * bb)
            base = builder.gep(praw, [builder.mul(g, gstride)])
            t_idx = [builder.add(args[5], L.const(j)) for j in range(T)]
            xp0 = [builder.gep(pxp, [builder.mul(t, pstr[0])]) for t in t_idx]
            xd0 = [builder.gep(pxd, [builder.mul(t, dstr[0])]) for t in t_idx]
            xc0 = [builder.gep(pxc, [builder.mul(t, cstr[0])]) for t in t_idx]
            acc = [cgutils.alloca_once_value(builder, ir.Constant(V4F, None)) for _ in range(T)]
            lo_idx = ir.Constant(V4I, [0, 1, 2, 3])
            psign = L.avx2(builder, "psign.b")
            hi_idx = ir.Constant(V4I, [4, 5, 6, 7])
            ahead = builder.mul(L.const(2), gstride)       # prefetch two calls' groups ahead, into L2
            with cgutils.for_range(builder, rshape[1]) as loop:
                blk = loop.index
                xv = [[L.load(builder, p, builder.add(builder.mul(blk, pstr[1]), L.const(32 * v)), L.V32B)
                       for v in range(4)] for p in xp0]
                da = [L.load(builder, p, builder.mul(blk, dstr[1]), L.F32) for p in xd0]
                corr = [L.load(builder, p, builder.mul(blk, cstr[1]), L.I32) for p in xc0]
                p = builder.gep(base, [builder.mul(blk, bstride)])
                for off in range(0, ROWS * bb, 64):   # the group block's new lines (88 bytes: 2, 136: 3)
                    emit_prefetch(builder, builder.gep(p, [builder.add(ahead, L.const(off))]), locality=2)
                codes, signed, dw = unpack_group(builder, p, kind, isa)
                for j in range(T):
                    xs = xv[j] if signed is None else [builder.call(psign, [x, w]) for x, w in zip(xv[j], signed)]
                    s01 = L.dot_u8s8(builder, isa, codes[1], xs[1], L.dot_u8s8(builder, isa, codes[0], xs[0]))
                    s23 = L.dot_u8s8(builder, isa, codes[3], xs[3], L.dot_u8s8(builder, isa, codes[2], xs[2]))
                    s8 = builder.add(s01, s23)
                    undef = ir.Constant(L.V8I, ir.Undefined)
                    s4 = builder.add(builder.shuffle_vector(s8, undef, lo_idx),
                                     builder.shuffle_vector(s8, undef, hi_idx))
                    s4 = builder.sub(s4, L.splat(builder, corr[j], V4I))
                    scale = builder.fmul(dw, L.splat(builder, da[j], V4F))
                    a = acc[j]
                    builder.store(builder.fadd(builder.fmul(builder.sitofp(s4, V4F), scale, flags=L.CONTRACT),
                                               builder.load(a), flags=L.CONTRACT), a)
            rows = [builder.add(builder.mul(g, L.const(ROWS)), L.const(q)) for q in range(ROWS)]
            vals = [builder.load(a) for a in acc]
            L.store_tile(builder, pout, ostr, t_idx, rows,
                         lambda q, j: builder.extract_element(vals[j], L.const(q, L.I32)))
            return context.get_dummy_value()

        return sig, codegen

    dot.__doc__ = f"""out[t0 + j, 4 g0 + q] for j < n_tok (a literal 1..MAX_TOK) and q < 4: row group g0 of the
    {NAMES[kind]} interleaved layout raw3 (n_rows, nb, {bb}); xp int8 (tokens, nb, 128), xd
    float32 and xc int32 (tokens, nb) from _prepare."""
    return dot


def _by_token_count(dot):
    @njit(cache=True, inline="always")
    def call(raw3, g, xp, xd, xc, t0, nt, out):
        if nt == 8:
            dot(raw3, g, xp, xd, xc, t0, 8, out)
        elif nt == 7:
            dot(raw3, g, xp, xd, xc, t0, 7, out)
        elif nt == 6:
            dot(raw3, g, xp, xd, xc, t0, 6, out)
        elif nt == 5:
            dot(raw3, g, xp, xd, xc, t0, 5, out)
        elif nt == 4:
            dot(raw3, g, xp, xd, xc, t0, 4, out)
        elif nt == 3:
            dot(raw3, g, xp, xd, xc, t0, 3, out)
        elif nt == 2:
            dot(raw3, g, xp, xd, xc, t0, 2, out)
        else:
            dot(raw3, g, xp, xd, xc, t0, 1, out)
    return call


_q5_avx2, _q4_avx2, _nl_avx2, _q8_avx2 = (_by_token_count(_make_dot(k, AVX2)) for k in KINDS)
_q5_vnni, _q4_vnni, _nl_vnni, _q8_vnni = (_by_token_count(_make_dot(k, VNNI)) for k in KINDS)


@njit(cache=True, inline="always")
def _dot(kind, isa, raw3, g, xp, xd, xc, t0, nt, out):
    if VNNI_BUILT and isa == VNNI:
        if kind == Q5_0_KIND:
            _q5_vnni(raw3, g, xp, xd, xc, t0, nt, out)
        elif kind == Q4_0_KIND:
            _q4_vnni(raw3, g, xp, xd, xc, t0, nt, out)
        elif kind == Q8_0_KIND:
            _q8_vnni(raw3, g, xp, xd, xc, t0, nt, out)
        else:
            _nl_vnni(raw3, g, xp, xd, xc, t0, nt, out)
    elif kind == Q5_0_KIND:
        _q5_avx2(raw3, g, xp, xd, xc, t0, nt, out)
    elif kind == Q4_0_KIND:
        _q4_avx2(raw3, g, xp, xd, xc, t0, nt, out)
    elif kind == Q8_0_KIND:
        _q8_avx2(raw3, g, xp, xd, xc, t0, nt, out)
    else:
        _nl_avx2(raw3, g, xp, xd, xc, t0, nt, out)


@njit(cache=True, inline="always")
def _group_run(kind, isa, raw3, item, xp, xd, xc, out):
    """Row groups item * GROUP_RUN .. for every token, chunks of up to MAX_TOK tokens, chunk-major."""
    n_tok, n_groups = xp.shape[0], raw3.shape[0] // ROWS
    g0 = item * GROUP_RUN
    g1 = min(n_groups, g0 + GROUP_RUN)
    n_chunks = (n_tok + MAX_TOK - 1) // MAX_TOK
    for c in range(n_chunks):
        t0 = n_tok * c // n_chunks
        nt = n_tok * (c + 1) // n_chunks - t0
        for g in range(g0, g1):
            _dot(kind, isa, raw3, g, xp, xd, xc, t0, nt, out)


@njit(cache=True, parallel=True)
def _matmul(raw3, x3, out, kind, isa):
    n_tok, nb, n_groups = x3.shape[0], x3.shape[1], raw3.shape[0] // ROWS
    xq = np.empty((n_tok, nb, QK), dtype=np.int8)
    xp = np.empty((n_tok, nb, 128), dtype=np.int8)
    xd = np.empty((n_tok, nb), dtype=np.float32)
    xc = np.empty((n_tok, nb), dtype=np.int32)
    if n_tok == 1:
        _prepare_serial(x3, xq, xp, xd, xc, offset(kind, isa))
        for g in prange(n_groups):
            _dot(kind, isa, raw3, g, xp, xd, xc, 0, 1, out)
    else:
        _prepare(x3, xq, xp, xd, xc, offset(kind, isa))
        for i in prange((n_groups + GROUP_RUN - 1) // GROUP_RUN):
            _group_run(kind, isa, raw3, i, xp, xd, xc, out)


@njit(cache=True)
def _matmul_serial(raw3, x3, out, kind, isa):
    n_tok, nb, n_groups = x3.shape[0], x3.shape[1], raw3.shape[0] // ROWS
    xq = np.empty((n_tok, nb, QK), dtype=np.int8)
    xp = np.empty((n_tok, nb, 128), dtype=np.int8)
    xd = np.empty((n_tok, nb), dtype=np.float32)
    xc = np.empty((n_tok, nb), dtype=np.int32)
    _prepare_serial(x3, xq, xp, xd, xc, offset(kind, isa))
    if n_tok == 1:
        for g in range(n_groups):
            _dot(kind, isa, raw3, g, xp, xd, xc, 0, 1, out)
    else:
        for i in range((n_groups + GROUP_RUN - 1) // GROUP_RUN):
            _group_run(kind, isa, raw3, i, xp, xd, xc, out)


def matvec(raw3: np.ndarray, x3: np.ndarray, out: np.ndarray, kind: int, isa: int = INT8_ISA,
           serial: bool = False) -> None:
    """out (n_tok, n_rows) = x @ W.T; raw3 the layout of `kind` viewed (n_rows, nb, BLOCK_BYTES[kind]), x3
    float32 (n_tok, nb, 32). serial: on the calling thread (small matrices), the same bits."""
    (_matmul_serial if serial else _matmul)(raw3, x3, out, kind, isa)
