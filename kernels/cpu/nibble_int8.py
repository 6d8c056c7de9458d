"""The AVX2 int8 mat-vec shared by the 4-bit-code layouts (iq3_int8.py: IQ3_XXS, q4_k_int8.py: Q4_K,
q5_k_int8.py: Q5_K, q6_k_int8.py: Q6_K).

Both layouts keep 256 weights per block as 4-bit codes in ggml's nibble order and start with the same
144 bytes:
  [0:128)   codes: byte 32p + j holds weight 64p + j in its low nibble, 64p + 32 + j in its high one
  [128:136) 8 sub-block scales (uint8), sub-block s = weights 32s .. 32s + 31
  [136:140) float32 d (the block's scale)
  [140:144) int32 C = sum over sub-blocks of scale * (sum of the sub-block's weight values)
and a weight is d * scale[s] * value(code) (- dmin * min[s] for Q4_K, whose block adds
  [144:152) 8 sub-block mins (uint8), [152:156) float32 dmin, [156:160) padding).
value(code) is a 16-entry int8 table looked up with pshufb (IQ3_XXS: a sign and one of 8 grid levels)
or the code itself (Q4_K: 0..15). Q5_K's layout puts each weight's fifth bit in a plane of 32 bytes after
the codes (bit 2p of byte j: weight 64p + j, bit 2p + 1: weight 64p + 32 + j, the file's qh) and its
scales, d, C, mins and dmin 32 bytes later (q5_k_int8.py): value = code | fifth bit << 4 (0..31). Q6_K's
puts two high bits a weight in a plane of 64 bytes after the codes, then 16 int8 scales (one per 16
weights), d and C (q6_k_int8.py): value = (code | high bits << 4) - 32 (-32..31).

Activations are rounded like llama.cpp's Q8_K (per 256: int8 q = rint(-127 x / x_signed_max), the
rounding act_quant.py reproduces) and stored offset by +128 as uint8, because pmaddubsw multiplies
unsigned by signed bytes: sum (q + 128) w = sum q w + 128 sum w, the second term is 128 C per block.
The Q4_K mins need each sub-block's activation sum (`bsums`, int32, without the offset).
No overflow: |pair sum| <= 2 * 255 * 62 < 2^15 (pmaddubsw saturates at int16; Q5_K: 2 * 255 * 31), and the
scaled int32 sums stay below 2^27 per block.

Float order, per (token, row): acc = fma(float(v_b), fl(d_w d_a), acc) over the blocks b from 0, v_b the block's
exact integer dot (the 8 lanes of scaled pair sums added in integers) minus 128 C; Q4_K / Q5_K also
mins = fma(float(m_b), fl(dmin d_a), mins), m_b = sum_s min_s bsum_s exact; the result is acc - mins. The prompt
GEMM (nibble_gemm.py) forms the same integers another way and then the same float steps: the same bits.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from .act_quant_ir import q8_k_block
from .prefetch import emit_prefetch

QK = 256
MAX_TOK = 4       # tokens per kernel call
# the layouts, by the `kind` argument of matvec, and the byte offsets of their fields in a block: (scales, d, C,
# mins, dmin), the mins only in Q4_K's and Q5_K's
IQ3, Q4K, Q6K, Q5K = 0, 1, 2, 3
FIELDS = ((128, 136, 140, 0, 0), (128, 136, 140, 144, 152), (192, 208, 212, 0, 0), (160, 168, 172, 176, 184))
# One token over rows of at least this many bytes: one row a call (one weight stream a thread), else four rows a
# call (four streams 1 row apart). Rows are summed alike either way (the same bits). 2-core AMD EPYC Zen 5 VM, the
# default model's ffn_down (Q6_K / Q4_K repackings, 4,104 / 3,040-byte rows), kernels alone from DRAM against a
# plain read of the same bytes: 0.76-0.84 -> 0.90-0.95 (three processes an arm, alternating); its decode in one
# process, 6 alternating rounds of 128 tokens: 106.5 -> 107.8 tok/s (per round 0.98-1.06x). Over ~1 KB rows (the
# 1.5B-shape IQ3_XXS file's 1536-weight rows) one row a call was 0.75-0.85x: those keep four (docs/cpu.md).
ONE_ROW_MIN_BYTES = 2048
ROW_GROUP = 4     # rows per work item with several tokens (a 4096-weight row is ~2.3 KB in these layouts)


# -------------------------------------------------------------------------------- layout plumbing

def repack_rows(raw: np.ndarray, n_cols: int, src_block_bytes: int, block_bytes: int, kernel, *tables) -> np.ndarray:
    """File rows (uint8 (n_rows, n_cols // 256 * src_block_bytes)) -> a layout's rows (uint8 (n_rows,
    n_cols // 256 * block_bytes)) by kernel(src blocks, dst blocks, the same bytes as float32 and as
    int32, *tables), one 256-weight block per row of those views."""
    nb = n_cols // QK
    n_rows = raw.shape[0]
    dst = np.zeros((n_rows * nb, block_bytes), dtype=np.uint8)
    if n_rows * nb:
        kernel(np.ascontiguousarray(raw).reshape(n_rows * nb, src_block_bytes), dst, dst.view(np.float32),
               dst.view(np.int32), *tables)
    return dst.reshape(n_rows, nb * block_bytes)


# ------------------------------------------------------------------------------------- activations

@njit(cache=True)
def _quantize_block(x3, q, d, bs, t, b):
    # x3[t, b] (256 float32) -> q[t, b] (q8 + 128, uint8), d[t, b], bs[t, b] (8 sub-block sums of q8):
    # llama.cpp's Q8_K rounding (act_quant_ir.q8_k_block)
    q8_k_block(x3, t, b, q, d, bs, t)


@njit(cache=True, parallel=True)
def quantize_q8_k(x3, q, d, bs):
    nb = x3.shape[1]
    if x3.shape[0] == 1:          # one token: a few microseconds, less than waking the thread pool
        for b in range(nb):
            _quantize_block(x3, q, d, bs, 0, b)
    else:
        for i in prange(x3.shape[0] * nb):
            _quantize_block(x3, q, d, bs, i // nb, i % nb)


def quantize_activations(x: np.ndarray):
    """x float32 (n_tok, n_cols), n_cols % 256 == 0 -> (q uint8 (n_tok, nb, 256) = q8 + 128,
    d float32 (n_tok, nb), bsums int32 (n_tok, nb, 8))."""
    n_tok, n_cols = x.shape
    x3 = x.reshape(n_tok, n_cols // QK, QK)
    q = np.empty(x3.shape, dtype=np.uint8)
    d = np.empty(x3.shape[:2], dtype=np.float32)
    bs = np.empty(x3.shape[:2] + (8,), dtype=np.int32)
    quantize_q8_k(x3, q, d, bs)
    return q, d, bs


# ------------------------------------------------------------------------------------------ kernel

def make_dot(lookup: bool = False, mins: bool = False, wide: bool = False, high: bool = False,
             one_row: bool = False):
    """The intrinsic dot(raw3, r0, xq, xd, xb, t0, n_tok, out, table): out[t0 + j, r] = W[r] . x[t0 + j]
    for j < n_tok (a literal 1..MAX_TOK) and rows r0 .. r0 + R - 1 (R = 4 for one token, else 1; one_row: R = 1
    at one token too; rows past the last are clamped to it, i.e. computed again).
    raw3 uint8 (rows, blocks, block bytes); xq uint8 (tokens, blocks, 256); xd float32 (tokens, blocks);
    xb int32 (tokens, blocks, 8) bsums (read when `mins`); out float32 (tokens, rows);
    table: 16 int8 code values twice, one copy per 128-bit lane (used when `lookup`).
    wide: the Q6_K layout (q6_k_int8.py): codes with two high bits each in a plane at byte 128, 16 int8
    scales (one per 16 weights) at byte 192, d at 208, C at 212. high: the Q5_K layout (q5_k_int8.py): the fifth bits' plane
    at byte 128, the other fields 32 bytes later than Q4_K's."""
    scale_off, d_off, c_off, mins_off, dmin_off = FIELDS[Q6K if wide else Q5K if high else Q4K]
    block_bytes = 216 if wide else 192 if high else 160

    @intrinsic
    def dot(typingctx, raw3, r0, xq, xd, xb, t0, n_tok, out, table):
        if not (L.c_arrays((raw3, types.uint8, 3), (xq, types.uint8, 3), (xd, types.float32, 2),
                           (xb, types.int32, 3), (out, types.float32, 2), (table, types.int8, 1))
                and L.tile_args(r0, t0, n_tok, MAX_TOK)):
            return None
        sig = types.void(raw3, types.intp, xq, xd, xb, types.intp, n_tok, out, table)
        T = n_tok.literal_value
        R = 1 if one_row else 4 if T == 1 else 1

        def codegen(context, builder, signature, args):
            pshufb, maddubs, maddwd = (L.avx2(builder, n) for n in ("pshuf.b", "pmadd.ub.sw", "pmadd.wd"))
            const = L.const

            def load(ptr, off, ty, align=1):
                return L.load(builder, ptr, off, ty, align)

            (praw, rstr, rshape), (pxq, qstr, _), (pxd, dstr, _), (pxb, bstr, _), (pout, ostr, _), \
                (ptab, _, _) = (L.array_arg(context, builder, signature.args[i], args[i]) for i in (0, 2, 3, 4, 7, 8))
            tab = load(ptab, 0, L.V32B)
            low4 = ir.Constant(L.V32B, [15] * 32)

            def plane_bits(plane, bit, mask):   # <32 x i8>: bits from `bit` of each plane byte, moved to bit 4, masked
                w = builder.bitcast(plane, L.V16W)   # shifted in 16-bit lanes: the mask drops what crosses bytes
                w = builder.shl(w, ir.Constant(L.V16W, [4 - bit] * 16)) if bit < 4 else \
                    builder.lshr(w, ir.Constant(L.V16W, [bit - 4] * 16)) if bit > 4 else w
                return builder.and_(builder.bitcast(w, L.V32B), ir.Constant(L.V32B, [mask] * 32))

            thirty_two = ir.Constant(L.V32B, [32] * 32)
            r_idx = L.clamped_rows(builder, args[1], R, rshape[0])
            t_idx = [builder.add(args[5], const(j)) for j in range(T)]
            row0 = [builder.gep(praw, [builder.mul(r, rstr[0])]) for r in r_idx]
            xq0 = [builder.gep(pxq, [builder.mul(t, qstr[0])]) for t in t_idx]
            xd0 = [builder.gep(pxd, [builder.mul(t, dstr[0])]) for t in t_idx]
            xb0 = [builder.gep(pxb, [builder.mul(t, bstr[0])]) for t in t_idx]

            def accumulators(ty, value):
                return [[cgutils.alloca_once_value(builder, ir.Constant(ty, value)) for _ in range(T)]
                        for _ in range(R)]

            acc_ptr, min_ptr = accumulators(L.F32, 0.0), accumulators(L.F32, 0.0)
            # software prefetch of the rows this thread reads two calls from now (prange hands each thread a
            # contiguous range; rows of ~1 KB are too short a stream for the hardware prefetcher) into L2.
            # Streaming 28 distinct 17920x1536 IQ3_XXS matrices on 2 threads: no prefetch 12.9 G weights/s,
            # next group into L1 (prefetcht0, as matvec.py) 29.0, into L2 (prefetcht1) 52.3, two groups
            # ahead into L2 57.2 (32 GB/s; a plain read loop reaches 24), four 55.7.
            ahead = builder.mul(const(2 * R), rstr[0])
            with cgutils.for_range(builder, rshape[1]) as blk:
                rows = [builder.gep(p, [builder.mul(blk.index, rstr[1])]) for p in row0]
                for p in rows:          # every cache line of the block (160 / 192 bytes: 3, 216: 4)
                    for o in range(0, block_bytes, 64):
                        emit_prefetch(builder, builder.gep(p, [builder.add(ahead, const(o))]), locality=2)
                xqb = [builder.gep(p, [builder.mul(blk.index, qstr[1])]) for p in xq0]
                da = [load(p, builder.mul(blk.index, dstr[1]), L.F32, 4) for p in xd0]
                isum = [[ir.Constant(L.V8I, None)] * T for _ in range(R)]
                scales = []
                for p in rows:          # 8 sub-block scales (uint8) or 16 scales of 16 weights (int8) -> i16
                    if wide:
                        scales.append(builder.sext(load(p, scale_off, ir.VectorType(L.I8, 16)), L.V16W))
                    else:
                        scales.append(builder.zext(load(p, scale_off, ir.VectorType(L.I8, 8)), ir.VectorType(L.I16, 8)))

                def lanes(k, sub):      # <16 x i16>: the scale of each pair of products of sub-block `sub`
                    idx = [2 * sub] * 8 + [2 * sub + 1] * 8 if wide else [sub] * 16
                    return builder.shuffle_vector(scales[k], scales[k], ir.Constant(ir.VectorType(L.I32, 16), idx))

                planes = [[load(p, o, L.V32B) for o in ((128, 160) if wide else (128,))] for p in rows] \
                    if wide or high else []
                for pair in range(4):
                    xa = [(load(p, 64 * pair, L.V32B), load(p, 64 * pair + 32, L.V32B)) for p in xqb]
                    for k, p in enumerate(rows):
                        codes = load(p, 32 * pair, L.V32B)
                        w_lo = builder.and_(codes, low4)
                        w_hi = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(codes, L.V16W),
                                                                         ir.Constant(L.V16W, [4] * 16)), L.V32B),
                                            low4)
                        if wide:
                            plane, e = planes[k][pair // 2], 4 * (pair % 2)     # two high bits each
                            w_lo = builder.sub(builder.or_(w_lo, plane_bits(plane, e, 0x30)), thirty_two)
                            w_hi = builder.sub(builder.or_(w_hi, plane_bits(plane, e + 2, 0x30)), thirty_two)
                        if lookup:
                            w_lo, w_hi = builder.call(pshufb, [tab, w_lo]), builder.call(pshufb, [tab, w_hi])
                        if high:
                            w_lo = builder.or_(w_lo, plane_bits(planes[k][0], 2 * pair, 0x10))
                            w_hi = builder.or_(w_hi, plane_bits(planes[k][0], 2 * pair + 1, 0x10))
                        s_lo, s_hi = lanes(k, 2 * pair), lanes(k, 2 * pair + 1)
                        for j in range(T):
                            m_lo = builder.call(maddwd, [builder.call(maddubs, [xa[j][0], w_lo]), s_lo])
                            m_hi = builder.call(maddwd, [builder.call(maddubs, [xa[j][1], w_hi]), s_hi])
                            isum[k][j] = builder.add(isum[k][j], builder.add(m_lo, m_hi))
                for k, p in enumerate(rows):
                    dw = load(p, d_off, L.F32)
                    c128 = builder.mul(load(p, c_off, L.I32), const(128, L.I32))
                    if mins:
                        mins8 = builder.zext(load(p, mins_off, ir.VectorType(L.I8, 8)), L.V8I)
                        dmin = load(p, dmin_off, L.F32)
                    for j in range(T):
                        # the block's exact integer dot (the +128 offset taken back in integers), then one FMA
                        v = builder.sub(L.hsum(builder, isum[k][j]), c128)
                        a = acc_ptr[k][j]
                        builder.store(builder.fadd(builder.fmul(builder.sitofp(v, L.F32), builder.fmul(dw, da[j]),
                                                                flags=L.CONTRACT),
                                                   builder.load(a), flags=L.CONTRACT), a)
                        if mins:        # sum over sub-blocks of min * (activation sum), exact, scaled by dmin * da
                            bsum = load(xb0[j], builder.mul(blk.index, bstr[1]), L.V8I)
                            m = L.hsum(builder, builder.mul(mins8, bsum))
                            mp = min_ptr[k][j]
                            builder.store(builder.fadd(builder.fmul(builder.sitofp(m, L.F32), builder.fmul(dmin, da[j]),
                                                                    flags=L.CONTRACT),
                                                       builder.load(mp), flags=L.CONTRACT), mp)

            def result(k, j):           # subtract the mins
                v = builder.load(acc_ptr[k][j])
                return builder.fsub(v, builder.load(min_ptr[k][j])) if mins else v

            L.store_tile(builder, pout, ostr, t_idx, r_idx, result)
            return context.get_dummy_value()

        return sig, codegen

    return dot


def _by_token_count(dot):
    """An inlined caller of intrinsic `dot` taking the token count as a runtime value (the intrinsic
    needs a literal)."""
    @njit(cache=True, inline="always")
    def call(raw3, r0, xq, xd, xb, t0, nt, out, table):
        if nt == 1:
            dot(raw3, r0, xq, xd, xb, t0, 1, out, table)
        elif nt == 2:
            dot(raw3, r0, xq, xd, xb, t0, 2, out, table)
        elif nt == 3:
            dot(raw3, r0, xq, xd, xb, t0, 3, out, table)
        else:
            dot(raw3, r0, xq, xd, xb, t0, 4, out, table)
    return call


_DOT_IQ3 = _by_token_count(make_dot(lookup=True))     # IQ3_XXS codes through the table
_DOT_Q4K = _by_token_count(make_dot(mins=True))       # Q4_K codes and mins
_DOT_Q6K = _by_token_count(make_dot(wide=True))       # Q6_K int8 weights, scales per 16
_DOT_Q5K = _by_token_count(make_dot(mins=True, high=True))   # Q5_K codes, fifth bits and mins


# one token, one row a call (matvec's rows of ONE_ROW_MIN_BYTES and more)
_DOT1_IQ3 = make_dot(lookup=True, one_row=True)
_DOT1_Q4K = make_dot(mins=True, one_row=True)
_DOT1_Q6K = make_dot(wide=True, one_row=True)
_DOT1_Q5K = make_dot(mins=True, high=True, one_row=True)


@njit(cache=True, inline="always")
def one_row_calls(raw3):
    """Whether one-token calls over raw3 (rows, blocks, block bytes) take one row a call (_dot1) instead of four."""
    return raw3.shape[1] * raw3.shape[2] >= ONE_ROW_MIN_BYTES


@njit(cache=True, inline="always")
def _dot1(kind, raw3, r, xq, xd, xb, out, table):
    if kind == IQ3:
        _DOT1_IQ3(raw3, r, xq, xd, xb, 0, 1, out, table)
    elif kind == Q4K:
        _DOT1_Q4K(raw3, r, xq, xd, xb, 0, 1, out, table)
    elif kind == Q5K:
        _DOT1_Q5K(raw3, r, xq, xd, xb, 0, 1, out, table)
    else:
        _DOT1_Q6K(raw3, r, xq, xd, xb, 0, 1, out, table)


@njit(cache=True, inline="always")
def _dot(kind, raw3, r0, xq, xd, xb, t0, nt, out, table):
    if kind == IQ3:
        _DOT_IQ3(raw3, r0, xq, xd, xb, t0, nt, out, table)
    elif kind == Q4K:
        _DOT_Q4K(raw3, r0, xq, xd, xb, t0, nt, out, table)
    elif kind == Q5K:
        _DOT_Q5K(raw3, r0, xq, xd, xb, t0, nt, out, table)
    else:
        _DOT_Q6K(raw3, r0, xq, xd, xb, t0, nt, out, table)


@njit(cache=True, parallel=True)
def matvec(raw3, x3, out, table, kind):
    """out (n_tok, n_rows) = x @ W.T; W in layout `kind` (IQ3, Q4K, Q6K, Q5K) as (n_rows, nb, block bytes), x
    float32 (n_tok, nb, 256) quantized here (one compiled call per mat-mul: the rounding costs no extra
    launch). table: the code values of the IQ3 layout (ignored by the others)."""
    n, n_tok = raw3.shape[0], x3.shape[0]
    xq = np.empty(x3.shape, dtype=np.uint8)
    xd = np.empty(x3.shape[:2], dtype=np.float32)
    xb = np.empty(x3.shape[:2] + (8,), dtype=np.int32)
    quantize_q8_k(x3, xq, xd, xb)
    if n_tok == 1 and one_row_calls(raw3):
        for r in prange(n):
            _dot1(kind, raw3, r, xq, xd, xb, out, table)
    elif n_tok == 1:
        for g in prange((n + 3) // 4):
            _dot(kind, raw3, 4 * g, xq, xd, xb, 0, 1, out, table)
    else:
        # work item: ROW_GROUP rows, chunk-major: a chunk's activations stay in L1 while it meets each row
        n_chunks = (n_tok + MAX_TOK - 1) // MAX_TOK      # chunks of 2..4 tokens, as even as possible
        for g in prange((n + ROW_GROUP - 1) // ROW_GROUP):
            for c in range(n_chunks):
                t0 = n_tok * c // n_chunks
                for r in range(g * ROW_GROUP, min(n, (g + 1) * ROW_GROUP)):
                    _dot(kind, raw3, r, xq, xd, xb, t0, n_tok * (c + 1) // n_chunks - t0, out, table)
