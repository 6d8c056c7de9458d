"""Mat-muls in int8 with AVX2 (pmaddubsw + pmaddwd) for Q8_0 weights and for Q5_0, Q4_0 and IQ4_NL weights
in their own blocks, unpacked in registers (nibbles; Q5_0's fifth bits from qh, minus 16; Q4_0 minus 8;
IQ4_NL's codes through its 16-value table with pshufb). A block unpacks to exactly the integers its
lossless Q8_0 repacking (repack.py) stores and goes through the same sums, so the results are
bit-identical to that repacking's, with 5.5 / 4.5 instead of 8.5 bits per weight to read (Q5_0 on the
default model, 2-core AVX2 VM, 2026-12-01, alternating runs: decode 19.3 against 16.0 tok/s, prompt 93.7
against 94.6 tok/s, peak RSS -90 MiB). Up to 8 tokens per call share a block's unpacking and scale.

llama.cpp multiplies these types with activations rounded to Q8_0 (32-blocks, scale amax/127 stored
as f16; act_quant.py reproduces it). Keeping that rounding as int8 values makes each 32-weight block
one integer dot: pmaddubsw takes unsigned x signed bytes, so it gets |w| and sign(w) * a (psignb),
the int16 pair sums (|w| <= 128, |a| <= 127: < 2^15) are widened by pmaddwd, and one float FMA per
block applies d_w * d_a. Q5_0 and Q4_0 skip the signs: their unsigned codes (w + 16, w + 8) go into
pmaddubsw as they are, and each lane's dot loses 16 (8) times the lane's activation sum, formed once per
token and block for all the rows of a call: the same integers with two instructions less per row and block
(default model, decode, 2-core AVX-512 VM, 3 alternating runs: 40.7-43.4 -> 42.7-52.2 tok/s, within this
VM's noise of a few percent). The float kernel in matvec.py (int8 -> float32 conversions + FMAs) is
compute-bound at ~17 G weights/s on 2 threads; this one is memory-bound (bench_cpu_kernels.py).
On a VNNI CPU (isa.py) vpdpbusd replaces pmaddubsw + pmaddwd: the same integers (|w| <= 128, so no pair sum
saturates; llvm_ir.dot_u8s8), so the same bits.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from .act_quant_ir import q8_0_block
from .dequant import IQ4NL_VALUES
from .isa import AVX2, INT8_ISA, VNNI, VNNI_BUILT
from .prefetch import emit_prefetch

QK = 32
BLOCK_BYTES = 34
MAX_TOK = 8       # tokens per kernel call (a block's unpacking and scale serve them all)


@njit(cache=True)
def _quantize_block(x3, q, d, t, b):
    # x3[t, b] (32 float32) -> q[t, b] int8, d[t, b] = the f16-rounded scale: llama.cpp's Q8_0 rounding
    q8_0_block(x3, t, b, q, d, t)


@njit(cache=True)
def _quantize_rows(x3, q, d):
    for t in range(x3.shape[0]):
        for b in range(x3.shape[1]):
            _quantize_block(x3, q, d, t, b)


def quantize_activations(x: np.ndarray):
    """x float32 (n_tok, n_cols), n_cols % 32 == 0 -> (q int8 (n_tok, nb, 32), d float32 (n_tok, nb))."""
    x3 = x.reshape(x.shape[0], -1, QK)
    q = np.empty(x3.shape, dtype=np.int8)
    d = np.empty(x3.shape[:2], dtype=np.float32)
    _quantize_rows(x3, q, d)
    return q, d


V16B = ir.VectorType(L.I8, 16)
Q8_0_KIND, Q5_0_KIND, Q4_0_KIND, IQ4_NL_KIND = 0, 1, 2, 3   # block formats (the `kind` of mv_avx2)
_IQ4_NL_TABLE = [int(v) for v in IQ4NL_VALUES] * 2          # the 16 codes' values, once per 128-bit lane


def _q8_0_weights(builder, p):
    """(32 int8 weights, f16 scale as f32) of the Q8_0 block at i8* p."""
    return L.load(builder, p, 2, L.V32B), _f16(builder, p)


def _q5_0_codes(builder, p):
    """(the 32 unsigned 5-bit codes w + 16, scale) of a Q5_0 block, unpacked in registers (ggml: weight j <
    16 is the low nibble of qs[j] plus bit j of qh as 16, weight j + 16 the high nibble plus bit j + 16;
    minus 16). The kernels multiply the codes unsigned and subtract 16 times the activations' sum: the
    integers of the lossless Q8_0 repacking's dots, so every float after them is the same."""
    nib = _nibbles(builder, p, 6)
    qh = builder.bitcast(L.load(builder, p, 2, L.I32), ir.VectorType(L.I8, 4))
    spread = builder.shuffle_vector(qh, ir.Constant(ir.VectorType(L.I8, 4), None),
                                    ir.Constant(ir.VectorType(L.I32, 32), [i // 8 for i in range(32)]))
    bit = ir.Constant(L.V32B, [1 << (i % 8) for i in range(32)])
    fifth = builder.select(builder.icmp_unsigned("==", builder.and_(spread, bit), bit),
                           ir.Constant(L.V32B, [16] * 32), ir.Constant(L.V32B, [0] * 32))
    return builder.or_(nib, fifth), _f16(builder, p)


def _nibbles(builder, p, off):
    """The 32 4-bit codes of 16 bytes at p + off, in value order (low nibbles 0..15, high 16..31)."""
    qs = L.load(builder, p, off, V16B)
    lo = builder.and_(qs, ir.Constant(V16B, [15] * 16))
    hi = builder.lshr(qs, ir.Constant(V16B, [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(L.I32, 32), list(range(32))))


def _q4_0_codes(builder, p):
    """(the 32 unsigned codes w + 8, scale) of a Q4_0 block (f16 d, 16 bytes of codes): weight = code - 8."""
    return _nibbles(builder, p, 2), _f16(builder, p)


def _iq4_nl_weights(builder, p):
    """An IQ4_NL block (f16 d, 16 bytes of codes): weight = the table value of the code (pshufb)."""
    table = ir.Constant(L.V32B, [v & 255 for v in _IQ4_NL_TABLE])
    return builder.call(L.avx2(builder, "pshuf.b"), [table, _nibbles(builder, p, 2)]), _f16(builder, p)


def _f16(builder, p):
    return builder.fpext(builder.bitcast(L.load(builder, p, 0, L.I16), ir.HalfType()), L.F32)


def _make_dot(block_weights, doc_format: str, isa: int, offset: int = 0):
    """offset 0: block_weights gives signed weights, multiplied as |w| by sign(w) x (psign); offset > 0 (a
    power of two): it gives unsigned codes w + offset, multiplied as they are, and each lane's dot loses
    offset times the lane's activation sum (formed once per token and block): per lane the
    same integer either way."""
    @intrinsic
    def dot(typingctx, raw3, r0, xq, xd, t0, n_tok, out):
        if not (L.c_arrays((raw3, types.uint8, 3), (xq, types.int8, 3), (xd, types.float32, 2))
                and L.strided_array(out, types.float32, 2)          # a column slice of an output too
                and L.tile_args(r0, t0, n_tok, MAX_TOK)):
            return None
        sig = types.void(raw3, types.intp, xq, xd, types.intp, n_tok, out)
        T = n_tok.literal_value
        # one row a call for any token count: one stream of weights a thread (rows4_int8.py's one-token kernel says
        # why; 4 rows a call read the output matrix at 0.87-0.89 of a plain read, 1 row at 1.03-1.06: 2-core Zen 5
        # VM, 2026-12-07)

        def codegen(context, builder, signature, args):
            psign = L.avx2(builder, "psign.b")
            ones = ir.Constant(L.V32B, [1] * 32)
            shift = ir.Constant(L.V8I, [max(offset, 1).bit_length() - 1] * 8)
            (praw, rstr, rshape), (pxq, qstr, _), (pxd, dstr, _), (pout, ostr, _) = (
                L.array_arg(context, builder, signature.args[i], args[i]) for i in (0, 2, 3, 6))
            r_idx = L.clamped_rows(builder, args[1], 1, rshape[0])
            t_idx = [builder.add(args[4], L.const(j)) for j in range(T)]
            row0 = builder.gep(praw, [builder.mul(r_idx[0], rstr[0])])
            xq0 = [builder.gep(pxq, [builder.mul(t, qstr[0])]) for t in t_idx]
            xd0 = [builder.gep(pxd, [builder.mul(t, dstr[0])]) for t in t_idx]
            acc_ptr = [cgutils.alloca_once_value(builder, ir.Constant(L.V8F, None)) for _ in range(T)]
            ahead = builder.mul(L.const(2), rstr[0])       # prefetch two calls' rows ahead, into L2
            with cgutils.for_range(builder, rshape[1]) as loop:
                blk = loop.index
                p = builder.gep(row0, [builder.mul(blk, rstr[1])])
                emit_prefetch(builder, builder.gep(p, [ahead]), locality=2)   # 22/34-byte blocks: a line every 2-3
                xa = [L.load(builder, p, builder.mul(blk, qstr[1]), L.V32B) for p in xq0]
                da = [L.load(builder, p, builder.mul(blk, dstr[1]), L.F32, 4) for p in xd0]
                if offset:                                  # offset * (lane sums of x), per token
                    corr = [builder.shl(L.dot_u8s8(builder, isa, ones, x), shift) for x in xa]
                w, dw = block_weights(builder, p)
                if not offset:
                    uw = builder.call(psign, [w, w])        # |w|; -128 stays 0x80 = 128 unsigned
                for j in range(T):
                    if offset:
                        isum = builder.sub(L.dot_u8s8(builder, isa, w, xa[j]), corr[j])
                    else:
                        isum = L.dot_u8s8(builder, isa, uw, builder.call(psign, [xa[j], w]))
                    s = L.splat(builder, builder.fmul(dw, da[j]), L.V8F)
                    a = acc_ptr[j]
                    builder.store(builder.fadd(builder.fmul(builder.sitofp(isum, L.V8F), s, flags=L.CONTRACT),
                                               builder.load(a), flags=L.CONTRACT), a)
            L.store_tile(builder, pout, ostr, t_idx, r_idx,
                         lambda k, j: L.hsum(builder, builder.load(acc_ptr[j])))
            return context.get_dummy_value()

        return sig, codegen

    dot.__doc__ = f"""out[t0 + j, r0] = dot(W[r0], x[t0 + j]) for j < n_tok (a literal 1..MAX_TOK). raw3 uint8 (rows,
    blocks, bytes) {doc_format}; xq int8 (tokens, blocks, 32); xd float32 (tokens, blocks); out float32 (tokens, rows).
    Integer dots with isa's instructions (isa.AVX2 or VNNI)."""
    return dot


def _by_token_count(dot):
    """dot (an intrinsic that needs its token count as a literal) for a run-time count nt (1..MAX_TOK)."""
    @njit(cache=True, inline="always")
    def call(raw3, r, xq, xd, t0, nt, out):
        if nt == 8:
            dot(raw3, r, xq, xd, t0, 8, out)
        elif nt == 7:
            dot(raw3, r, xq, xd, t0, 7, out)
        elif nt == 6:
            dot(raw3, r, xq, xd, t0, 6, out)
        elif nt == 5:
            dot(raw3, r, xq, xd, t0, 5, out)
        elif nt == 4:
            dot(raw3, r, xq, xd, t0, 4, out)
        elif nt == 3:
            dot(raw3, r, xq, xd, t0, 3, out)
        elif nt == 2:
            dot(raw3, r, xq, xd, t0, 2, out)
        else:
            dot(raw3, r, xq, xd, t0, 1, out)
    return call


def _by_kind(isa):
    """The kernels of every block format for isa's instructions, by run-time `kind`."""
    q8_0, q5_0, q4_0, iq4_nl = (_by_token_count(_make_dot(w, name, isa, off)) for w, name, off in (
        (_q8_0_weights, "Q8_0", 0), (_q5_0_codes, "Q5_0", 16), (_q4_0_codes, "Q4_0", 8),
        (_iq4_nl_weights, "IQ4_NL", 0)))

    @njit(cache=True, inline="always")
    def call(kind, raw3, r, xq, xd, t0, nt, out):
        if kind == Q5_0_KIND:
            q5_0(raw3, r, xq, xd, t0, nt, out)
        elif kind == Q4_0_KIND:
            q4_0(raw3, r, xq, xd, t0, nt, out)
        elif kind == IQ4_NL_KIND:
            iq4_nl(raw3, r, xq, xd, t0, nt, out)
        else:
            q8_0(raw3, r, xq, xd, t0, nt, out)
    return call


_dot_avx2, _dot_vnni = _by_kind(AVX2), _by_kind(VNNI)


@njit(cache=True, inline="always")
def _dot(kind, isa, raw3, r, xq, xd, t0, nt, out):
    """The kernel of block format `kind` for nt (1..MAX_TOK) tokens from t0 (row r); isa
    VNNI takes the VNNI kernels where they are compiled (a constant: the other branch is pruned), else AVX2."""
    if VNNI_BUILT and isa == VNNI:
        _dot_vnni(kind, raw3, r, xq, xd, t0, nt, out)
    else:
        _dot_avx2(kind, raw3, r, xq, xd, t0, nt, out)


ROW_GROUP = 16    # rows per work item with several tokens: their blocks (16 x 34 B per 32 weights) and a
                  # chunk of the tokens' activations stay in L1 while the chunk meets every row


@njit(cache=True, inline="always")
def _row_group(kind, isa, raw3, g, xq, xd, out):
    """Rows g*ROW_GROUP .. for every token, MAX_TOK tokens (at least 2) per kernel call, chunk-major."""
    n_tok = xq.shape[0]
    r0 = g * ROW_GROUP
    r1 = min(raw3.shape[0], r0 + ROW_GROUP)
    n_chunks = (n_tok + MAX_TOK - 1) // MAX_TOK
    for c in range(n_chunks):
        t0 = n_tok * c // n_chunks
        nt = n_tok * (c + 1) // n_chunks - t0
        for r in range(r0, r1):
            _dot(kind, isa, raw3, r, xq, xd, t0, nt, out)


@njit(cache=True, parallel=True)
def mv_avx2(raw3, x3, out, kind=Q8_0_KIND, isa=INT8_ISA):
    """out (n_tok, n_rows) = x @ W.T; W Q8_0 or Q5_0 (`kind`) as (n_rows, nb, block bytes), x float32
    (n_tok, nb, 32) quantized here. Any n_tok: each (token, row) is the same sum in the same order
    whatever else is in the call, and a Q5_0 matrix gives the bits its Q8_0 repacking gives. isa: AVX2 or
    VNNI (isa.py; the import-time choice by default), the same bits."""
    n, n_tok = raw3.shape[0], x3.shape[0]
    xq = np.empty(x3.shape, dtype=np.int8)
    xd = np.empty(x3.shape[:2], dtype=np.float32)
    _quantize_rows(x3, xq, xd)
    if n_tok == 1:
        for r in prange(n):
            _dot(kind, isa, raw3, r, xq, xd, 0, 1, out)
    else:
        for g in prange((n + ROW_GROUP - 1) // ROW_GROUP):
            _row_group(kind, isa, raw3, g, xq, xd, out)


@njit(cache=True)
def mv_avx2_serial(raw3, x3, out, kind=Q8_0_KIND, isa=INT8_ISA):
    """mv_avx2 on the calling thread (small matrices: a parallel launch costs more than it saves);
    bit-identical results."""
    n, n_tok = raw3.shape[0], x3.shape[0]
    xq = np.empty(x3.shape, dtype=np.int8)
    xd = np.empty(x3.shape[:2], dtype=np.float32)
    _quantize_rows(x3, xq, xd)
    if n_tok == 1:
        for r in range(n):
            _dot(kind, isa, raw3, r, xq, xd, 0, 1, out)
    else:
        for g in range((n + ROW_GROUP - 1) // ROW_GROUP):
            _row_group(kind, isa, raw3, g, xq, xd, out)
