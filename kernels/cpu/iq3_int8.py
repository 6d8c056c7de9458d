"""IQ3_XXS as 4-bit codes, multiplied in int8 with AVX2 (pshufb + pmaddubsw + pmaddwd).

Every IQ3_XXS weight is d * (2 ls + 1) / 4 * (+-g) with g one of 8 grid levels {4, 12, .., 52, 62}: a
sign and a 3-bit level index, i.e. exactly a 4-bit code. The file's 3.06 bits/weight come from the
256-entry grid (4 weights per byte) and 7-bit sign groups, which x86 can only decode with table
look-ups per 4 weights: the float kernel in matvec.py spends ~2 µops per weight on it and is µop-bound
(IQ3_XXS 1.5B decode 10.5 tok/s on 2 Zen 4 cores, llama.cpp's AVX2 kernel 10.0). Repacked once at
load to 4-bit codes, 32 weights decode with one pshufb from a 16-entry int8 table and multiply-add
against int8 activations with pmaddubsw/pmaddwd: ~0.25 µops per weight. The price is memory:
4.5 bits/weight instead of 3.06 (the 1.5B model's matrices: 591 -> 868 MB), which the decode streams
once per token.

Block layout (144 bytes per 256 weights, little-endian):
  [0:128)   codes: byte 32p + j holds weight 64p + j in its low nibble and 64p + 32 + j in its high
            nibble (p = 0..3); code = level index | sign << 3, value IQ3_CODE_VALUES[code]
  [128:136) the 8 sub-block scales 2 ls + 1 (uint8, 1..31)
  [136:140) float32 d / 4
  [140:144) int32 C = sum over sub-blocks of scale * (sum of the sub-block's signed values)
Weight i of block b dequantizes to (d / 4) * scale[i // 32] * value[code_i], the same value the file
holds (rounding of the float32 scale product aside).

Activations are quantized like llama.cpp's Q8_K (per 256: int8 q = rint(-127 x / x_signed_max), the
rounding act_quant.py reproduces) and stored offset by +128 as uint8, because pmaddubsw multiplies
unsigned by signed bytes: sum (q + 128) w = sum q w + 128 sum w, the second term is 128 C per block.
No overflow: |pair sum| <= 2 * 255 * 62 < 2^15 (pmaddubsw saturates at int16), and the scaled int32
sums stay below 2^27 per block.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from .dequant import IQ2_KSIGNS, IQ3XXS_GRID, f16_at
from .prefetch import emit_prefetch

BLOCK_BYTES = 144
QK = 256
IQ3_LEVELS = np.array([4, 12, 20, 28, 36, 44, 52, 62], dtype=np.int8)
IQ3_CODE_VALUES = np.concatenate([IQ3_LEVELS, -IQ3_LEVELS]).astype(np.int8)   # code -> signed value
# grid byte -> level index (the grid only uses the 8 levels)
_LEVEL_OF = np.full(256, 255, dtype=np.uint8)
_LEVEL_OF[IQ3_LEVELS.astype(np.uint8)] = np.arange(8, dtype=np.uint8)
_GRID_U8 = np.ascontiguousarray(IQ3XXS_GRID.astype(np.uint8))                  # (256, 4)
assert np.all(_LEVEL_OF[_GRID_U8] != 255)
MAX_TOK = 4       # tokens per kernel call


# ------------------------------------------------------------------------------------------ layout

@njit(cache=True, parallel=True)
def _repack(src, dst, dst_f32, dst_i32, f16t, grid, ksigns, level_of):
    # src (n_blocks, 98) IQ3_XXS: d f16 [0:2], grid indices [2:66], 8 x u32 [66:98] = 4 sign indices
    # of 7 bits + a 4-bit scale; dst (n_blocks, 144), dst_f32 / dst_i32 the same bytes (n_blocks, 36)
    for b in prange(src.shape[0]):
        c_total = np.int32(0)
        for ib in range(8):
            p = 66 + 4 * ib
            aux = (np.uint32(src[b, p]) | (np.uint32(src[b, p + 1]) << 8) | (np.uint32(src[b, p + 2]) << 16)
                   | (np.uint32(src[b, p + 3]) << 24))
            scale = np.int32(2 * (aux >> 28) + 1)
            dst[b, 128 + ib] = np.uint8(scale)
            wsum = np.int32(0)
            pair, half = ib // 2, ib % 2
            for l in range(4):
                signs = ksigns[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                for k in range(8):
                    g = grid[src[b, 2 + 8 * ib + 2 * l + k // 4], k % 4]
                    neg = (signs >> k) & 1
                    code = level_of[g] | (neg << 3)
                    wsum += -np.int32(g) if neg else np.int32(g)
                    o = 32 * pair + 8 * l + k
                    if half == 0:
                        dst[b, o] = (dst[b, o] & np.uint8(0xF0)) | np.uint8(code)
                    else:
                        dst[b, o] = (dst[b, o] & np.uint8(0x0F)) | np.uint8(code << 4)
            c_total += scale * wsum
        dst_f32[b, 34] = f16_at(src, b, 0, f16t) * np.float32(0.25)
        dst_i32[b, 35] = c_total


def repack_iq3_xxs(raw: np.ndarray, n_cols: int, f16t) -> np.ndarray:
    """IQ3_XXS rows (uint8 (n_rows, n_cols // 256 * 98)) -> this layout (uint8 (n_rows, n_cols // 256 * 144))."""
    nb = n_cols // QK
    n_rows = raw.shape[0]
    dst = np.zeros((n_rows * nb, BLOCK_BYTES), dtype=np.uint8)
    if n_rows * nb:
        _repack(np.ascontiguousarray(raw).reshape(n_rows * nb, 98), dst, dst.view(np.float32), dst.view(np.int32),
                f16t, _GRID_U8, IQ2_KSIGNS, _LEVEL_OF)
    return dst.reshape(n_rows, nb * BLOCK_BYTES)


@njit(cache=True)
def dq_row(blk, blk_f32, o, values):
    """One repacked row (n_blocks, 144), blk_f32 the same bytes (n_blocks, 36) -> float32 o (n_blocks * 256)."""
    for b in range(blk.shape[0]):
        d = blk_f32[b, 34]
        for p in range(4):
            s0 = d * np.float32(blk[b, 128 + 2 * p])
            s1 = d * np.float32(blk[b, 129 + 2 * p])
            base = 256 * b + 64 * p
            for j in range(32):
                v = blk[b, 32 * p + j]
                o[base + j] = s0 * np.float32(values[v & 15])
                o[base + 32 + j] = s1 * np.float32(values[v >> 4])


@njit(cache=True, parallel=True)
def _dq_rows(raw3, raw3_f32, out, values):
    for r in prange(raw3.shape[0]):
        dq_row(raw3[r], raw3_f32[r], out[r], values)


def dequantize_into(raw: np.ndarray, out: np.ndarray) -> None:
    """Repacked rows (uint8 (n, nb * 144), C-contiguous) -> float32 out (n, nb * 256)."""
    raw3 = raw.reshape(raw.shape[0], -1, BLOCK_BYTES)
    _dq_rows(raw3, raw3.view(np.float32), out, IQ3_CODE_VALUES)


# ------------------------------------------------------------------------------------- activations

@njit(cache=True)
def _quantize_block(x3, q, d, t, b):
    # x3[t, b] (256 float32) -> q[t, b] (q8 + 128, uint8), d[t, b]: llama.cpp's Q8_K rounding
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for j in range(QK):
        a = abs(x3[t, b, j])
        if a > amax:
            amax, mx = a, x3[t, b, j]
    if amax == 0:
        d[t, b] = 0.0
        for j in range(QK):
            q[t, b, j] = 128
        return
    iscale = np.float32(-127.0) / mx
    d[t, b] = np.float32(1.0) / iscale
    for j in range(QK):
        q[t, b, j] = np.uint8(np.int32(min(np.float32(127.0), np.rint(iscale * x3[t, b, j]))) + 128)


@njit(cache=True, parallel=True)
def _quantize_q8_k(x3, q, d):
    nb = x3.shape[1]
    if x3.shape[0] == 1:          # one token: a few microseconds, less than waking the thread pool
        for b in range(nb):
            _quantize_block(x3, q, d, 0, b)
    else:
        for i in prange(x3.shape[0] * nb):
            _quantize_block(x3, q, d, i // nb, i % nb)


def quantize_activations(x: np.ndarray):
    """x float32 (n_tok, n_cols), n_cols % 256 == 0 -> (q uint8 (n_tok, nb, 256), d float32 (n_tok, nb))."""
    n_tok, n_cols = x.shape
    x3 = x.reshape(n_tok, n_cols // QK, QK)
    q = np.empty(x3.shape, dtype=np.uint8)
    d = np.empty(x3.shape[:2], dtype=np.float32)
    _quantize_q8_k(x3, q, d)
    return q, d


# ------------------------------------------------------------------------------------------ kernel

@intrinsic
def _dot_avx2(typingctx, raw3, r0, xq, xd, t0, n_tok, out, table):
    """out[t0 + j, r] = dot(W[r], x[t0 + j]) for j < n_tok (a literal 1..MAX_TOK), rows r0 .. r0 + R - 1
    (R = 4 for one token, else 1; rows past the last are clamped to it, i.e. computed again).
    raw3 uint8 (rows, blocks, 144); xq uint8 (tokens, blocks, 256); xd float32 (tokens, blocks);
    out float32 (tokens, rows); table: IQ3_CODE_VALUES twice (32 int8, one copy per 128-bit lane)."""
    if not (L.c_arrays((raw3, types.uint8, 3), (xq, types.uint8, 3), (xd, types.float32, 2),
                       (out, types.float32, 2), (table, types.int8, 1))
            and L.tile_args(r0, t0, n_tok, MAX_TOK)):
        return None
    sig = types.void(raw3, types.intp, xq, xd, types.intp, n_tok, out, table)
    T = n_tok.literal_value
    R = 4 if T == 1 else 1

    def codegen(context, builder, signature, args):
        pshufb, maddubs, maddwd = (L.avx2(builder, n) for n in ("pshuf.b", "pmadd.ub.sw", "pmadd.wd"))
        const = L.const

        def load(ptr, off, ty, align=1):
            return L.load(builder, ptr, off, ty, align)

        (praw, rstr, rshape), (pxq, qstr, _), (pxd, dstr, _), (pout, ostr, _), (ptab, _, _) = (
            L.array_arg(context, builder, signature.args[i], args[i]) for i in (0, 2, 3, 6, 7))
        tab = load(ptab, 0, L.V32B)
        low4 = ir.Constant(L.V32B, [15] * 32)
        r_idx = L.clamped_rows(builder, args[1], R, rshape[0])
        t_idx = [builder.add(args[4], const(j)) for j in range(T)]
        row0 = [builder.gep(praw, [builder.mul(r, rstr[0])]) for r in r_idx]
        xq0 = [builder.gep(pxq, [builder.mul(t, qstr[0])]) for t in t_idx]
        xd0 = [builder.gep(pxd, [builder.mul(t, dstr[0])]) for t in t_idx]
        acc_ptr = [[cgutils.alloca_once_value(builder, ir.Constant(L.V8F, None)) for _ in range(T)]
                   for _ in range(R)]
        corr_ptr = [[cgutils.alloca_once_value(builder, ir.Constant(L.F32, 0.0)) for _ in range(T)]
                    for _ in range(R)]
        # software prefetch of the rows this thread reads two calls from now (prange hands each thread a
        # contiguous range; rows of ~1 KB are too short a stream for the hardware prefetcher) into L2.
        # Streaming 28 distinct 17920x1536 matrices on 2 threads: no prefetch 12.9 G weights/s, next
        # group into L1 (prefetcht0, as matvec.py) 29.0, into L2 (prefetcht1) 52.3, two groups ahead
        # into L2 57.2 (32 GB/s; a plain read loop reaches 24), four 55.7.
        ahead = builder.mul(const(2 * R), rstr[0])
        with cgutils.for_range(builder, rshape[1]) as blk:
            rows = [builder.gep(p, [builder.mul(blk.index, rstr[1])]) for p in row0]
            for p in rows:          # a 144-byte block spans at most 3 cache lines
                for o in (0, 64, 128):
                    emit_prefetch(builder, builder.gep(p, [builder.add(ahead, const(o))]), locality=2)
            xqb = [builder.gep(p, [builder.mul(blk.index, qstr[1])]) for p in xq0]
            da = [load(p, builder.mul(blk.index, dstr[1]), L.F32, 4) for p in xd0]
            isum = [[ir.Constant(L.V8I, None)] * T for _ in range(R)]
            scales = []
            for p in rows:          # 8 sub-block scales -> <8 x i16>
                sc8 = load(p, 128, ir.VectorType(L.I8, 8))
                scales.append(builder.zext(sc8, ir.VectorType(L.I16, 8)))
            for pair in range(4):
                xa = [(load(p, 64 * pair, L.V32B), load(p, 64 * pair + 32, L.V32B)) for p in xqb]
                for k, p in enumerate(rows):
                    codes = load(p, 32 * pair, L.V32B)
                    lo = builder.and_(codes, low4)
                    hi = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(codes, L.V16W),
                                                                   ir.Constant(L.V16W, [4] * 16)), L.V32B), low4)
                    w_lo = builder.call(pshufb, [tab, lo])
                    w_hi = builder.call(pshufb, [tab, hi])
                    s_lo, s_hi = (builder.shuffle_vector(scales[k], scales[k],      # one sub-block's scale, all lanes
                                                         ir.Constant(ir.VectorType(L.I32, 16), [i] * 16))
                                  for i in (2 * pair, 2 * pair + 1))
                    for j in range(T):
                        m_lo = builder.call(maddwd, [builder.call(maddubs, [xa[j][0], w_lo]), s_lo])
                        m_hi = builder.call(maddwd, [builder.call(maddubs, [xa[j][1], w_hi]), s_hi])
                        isum[k][j] = builder.add(isum[k][j], builder.add(m_lo, m_hi))
            for k, p in enumerate(rows):
                dw = load(p, 136, L.F32)
                c = builder.sitofp(load(p, 140, L.I32), L.F32)
                for j in range(T):
                    s = builder.fmul(dw, da[j])
                    a = acc_ptr[k][j]
                    builder.store(builder.fadd(builder.fmul(builder.sitofp(isum[k][j], L.V8F),
                                                            L.splat(builder, s, L.V8F), flags=L.CONTRACT),
                                               builder.load(a), flags=L.CONTRACT), a)
                    cp = corr_ptr[k][j]
                    builder.store(builder.fadd(builder.fmul(s, c, flags=L.CONTRACT), builder.load(cp),
                                               flags=L.CONTRACT), cp)
        L.store_tile(builder, pout, ostr, t_idx, r_idx, lambda k, j: builder.fsub(       # undo the +128 offset
            L.hsum(builder, builder.load(acc_ptr[k][j])),
            builder.fmul(ir.Constant(L.F32, 128.0), builder.load(corr_ptr[k][j]))))
        return context.get_dummy_value()

    return sig, codegen


CODE_TABLE = np.concatenate([IQ3_CODE_VALUES, IQ3_CODE_VALUES])      # one copy per 128-bit lane


@njit(cache=True, parallel=True)
def mv_avx2(raw3, x3, out, table):
    """out (n_tok, n_rows) = x @ W.T; W repacked (n_rows, nb, 144), x float32 (n_tok, nb, 256), quantized
    here (one compiled call per mat-mul: the activation rounding costs no extra launch)."""
    n, n_tok = raw3.shape[0], x3.shape[0]
    xq = np.empty(x3.shape, dtype=np.uint8)
    xd = np.empty(x3.shape[:2], dtype=np.float32)
    _quantize_q8_k(x3, xq, xd)
    if n_tok == 1:
        for g in prange((n + 3) // 4):
            _dot_avx2(raw3, 4 * g, xq, xd, 0, 1, out, table)
    else:
        n_chunks = (n_tok + MAX_TOK - 1) // MAX_TOK      # chunks of 2..4 tokens, as even as possible
        for g in prange(n):
            for c in range(n_chunks):
                t0 = n_tok * c // n_chunks
                nt = n_tok * (c + 1) // n_chunks - t0
                if nt == 4:
                    _dot_avx2(raw3, g, xq, xd, t0, 4, out, table)
                elif nt == 3:
                    _dot_avx2(raw3, g, xq, xd, t0, 3, out, table)
                else:
                    _dot_avx2(raw3, g, xq, xd, t0, 2, out, table)
