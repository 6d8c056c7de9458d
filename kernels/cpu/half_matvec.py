"""F16 / BF16 (and F32) weights against float32 activations for decode-sized calls (up to MATVEC_MAX_TOK
tokens): each output is one row's dot product with one token, 16 weights at a time converted to float32 in
registers (F16: the hardware conversion, `vcvtph2ps` under F16C / AVX-512; BF16: a shift into the float's high
half; F32 rows, matvec_f32, are loaded as they are),
fused multiply-adds into 16 lanes (short rows: two accumulators, steps taken in turn), then the accumulators'
and the lanes' fixed halving sum; long rows go 4 at a time through one loop (each activation load serves the
4), which changes no row's arithmetic. Weights are read once per call from their file layout (2 bytes each,
F32 4; no float32 copy): the decode of an F16 model is then bound by the bytes it reads, where the tile path
(dequantize to float32, then BLAS) spent ~1 ns a weight converting.

The order of each output's float operations depends on its row and token only, never on the token count
of the call (up to MATVEC_MAX_TOK; longer prompt chunks take the tile path, docs/bounds.md). The same
conversion, stored instead of multiplied (to_f32), is the tile path's F16 / BF16 dequantization.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L

LANES = 16                       # weights per step (one 32-byte load)
# Rows of at least LONG_ROW weights go ROW_GROUP at a time through one loop (each x load serves them all, and
# the rows' fma chains interleave); shorter rows one at a time. 2-core EPYC VM (AVX-512), 2 threads, F16, GB/s
# of weights, one row / two / four (2026-12-05): 24 distinct 896 x 4864 matrices at 1 / 4 / 8 tokens 29.4 /
# 28.8 / 30.7, 11.2 / 15.9 / 18.0, 6.6 / 10.1 / 11.1; rows of 896 weights (19,456 x 896 and 1,152 x 896) at one
# token 35.9 / 24.4 / 22.7 and 31.2 / 22.2 / 20.5 (several short rows at once defeat the streaming prefetch)
ROW_GROUP = 4
LONG_ROW = 2048
# Short rows, one at a time, keep SHORT_CHAINS accumulators (a single fma chain holds a thread to ~4 cycles a
# 16-weight step): same VM, rows of 896, GB/s with one / two / four chains, two runs: 19,456 x 896 33.2 / 35.6 /
# 35.8 and 43.4 / 59.8 / 58.3, 1,152 x 896 29.7 / 32.6 / 32.5 and 30.0 / 40.6 / 37.1, 151,936 x 896 34.3 / 36.9 /
# 36.7 and 34.4 / 36.5 / 36.5
SHORT_CHAINS = 2
_V16F = ir.VectorType(L.F32, LANES)
_V16H = ir.VectorType(ir.HalfType(), LANES)
_V16I = ir.VectorType(L.I32, LANES)


def _make_dot_rows(bf16: bool, rows: int, chains: int = 1):
    @intrinsic
    def dot_rows(typingctx, w, r0, x, t, out):
        """out[t, r0 + j] = sum over k of float32(w[r0 + j, k]) * x[t, k] for j < rows: w uint16 (n_out, k) F16 or
        BF16 bits (bf16), or float32 (F32 rows, loaded as they are; bf16 plays no part), x float32 (n_tok, k),
        out float32 (n_tok, n_out), C-contiguous, k a multiple of LANES. A row's 16-weight steps go round-robin
        into `chains` accumulators (steps past the last whole round into the first ones, in order), which are
        then added pairwise and the lanes halved: a fixed order for a row of k weights, whatever `rows` is (one
        load of x serves every row)."""
        if not ((L.c_arrays((w, types.uint16, 2)) or L.c_arrays((w, types.float32, 2)))
                and L.c_arrays((x, types.float32, 2), (out, types.float32, 2))
                and isinstance(r0, types.Integer) and isinstance(t, types.Integer)):
            return None
        sig = types.void(w, types.intp, x, types.intp, out)
        f32 = w.dtype == types.float32

        def codegen(context, builder, signature, args):
            (pw, wstr, wshape), (px, xstr, _), (po, ostr, _) = (
                L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 2, 4))
            wrows = [builder.gep(pw, [builder.mul(builder.add(args[1], L.const(j)), wstr[0])]) for j in range(rows)]
            xrow = builder.gep(px, [builder.mul(args[3], xstr[0])])
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * LANES)) for _ in range(chains)]
                    for _ in range(rows)]
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3),
                                                 "llvm.fma.v16f32")

            def step(i, c):                     # 16 weights of every row into chain c
                xv = L.load(builder, xrow, builder.mul(i, L.const(4 * LANES)), _V16F)
                for j in range(rows):
                    if f32:
                        wf = L.load(builder, wrows[j], builder.mul(i, L.const(4 * LANES)), _V16F)
                    else:
                        wf = widen(builder, L.load(builder, wrows[j], builder.mul(i, L.const(2 * LANES)), L.V16W),
                                    bf16)
                    builder.store(builder.call(fma, [wf, xv, builder.load(accs[j][c])]), accs[j][c])

            steps = builder.sdiv(wshape[1], L.const(LANES))
            rounds = builder.sdiv(steps, L.const(chains))
            with cgutils.for_range(builder, rounds) as loop:
                for c in range(chains):
                    step(builder.add(builder.mul(loop.index, L.const(chains)), L.const(c)), c)
            if chains > 1:
                base = builder.mul(rounds, L.const(chains))
                with cgutils.for_range(builder, builder.sub(steps, base)) as loop:
                    step(builder.add(base, loop.index), 0)
            orow = builder.gep(po, [builder.mul(args[3], ostr[0])])
            for j in range(rows):
                vs = [builder.load(a) for a in accs[j]]
                while len(vs) > 1:
                    vs = [builder.fadd(vs[k], vs[k + 1]) for k in range(0, len(vs), 2)]
                off = builder.mul(builder.add(args[1], L.const(j)), L.const(4))
                builder.store(L.hsum(builder, vs[0]), builder.bitcast(builder.gep(orow, [off]), L.F32.as_pointer()))
            return context.get_dummy_value()

        return sig, codegen
    return dot_rows


def widen(builder, bits, bf16: bool):
    """<16 x i16> F16 / BF16 bits -> <16 x float>, exact (F16 signaling NaNs come back quiet)."""
    if bf16:
        return builder.bitcast(builder.shl(builder.zext(bits, _V16I), ir.Constant(_V16I, [16] * LANES)), _V16F)
    return builder.fpext(builder.bitcast(bits, _V16H), _V16F)


def _make_row_to_f32(bf16: bool):
    @intrinsic
    def row_to_f32(typingctx, w, r, out):
        """out[r, :] = float32(w[r, :]): w uint16 (n, k) F16 or BF16 bits, out float32 (n, k), C-contiguous,
        k a multiple of LANES."""
        if not (L.c_arrays((w, types.uint16, 2), (out, types.float32, 2)) and isinstance(r, types.Integer)):
            return None
        sig = types.void(w, types.intp, out)

        def codegen(context, builder, signature, args):
            (pw, wstr, wshape), (po, ostr, _) = (L.array_arg(context, builder, signature.args[k], args[k])
                                                 for k in (0, 2))
            wrow = builder.gep(pw, [builder.mul(args[1], wstr[0])])
            orow = builder.gep(po, [builder.mul(args[1], ostr[0])])
            with cgutils.for_range(builder, builder.sdiv(wshape[1], L.const(LANES))) as loop:
                i = loop.index
                f = widen(builder, L.load(builder, wrow, builder.mul(i, L.const(2 * LANES)), L.V16W), bf16)
                builder.store(f, builder.bitcast(builder.gep(orow, [builder.mul(i, L.const(4 * LANES))]),
                                                 _V16F.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen
    return row_to_f32


# long rows: ROW_GROUP rows a loop (one chain each) and the last rows alone; short rows: SHORT_CHAINS chains a row
_dot_f16, _dot4_f16 = _make_dot_rows(False, 1), _make_dot_rows(False, ROW_GROUP)
_dot_bf16, _dot4_bf16 = _make_dot_rows(True, 1), _make_dot_rows(True, ROW_GROUP)
_short_f16, _short_bf16 = _make_dot_rows(False, 1, SHORT_CHAINS), _make_dot_rows(True, 1, SHORT_CHAINS)
_row_f16 = _make_row_to_f32(False)
_row_bf16 = _make_row_to_f32(True)


@njit(nogil=True, cache=True)
def _to_f32(w, out, bf16):
    for r in range(w.shape[0]):
        if bf16:
            _row_bf16(w, r, out)
        else:
            _row_f16(w, r, out)


def to_f32(raw: np.ndarray, bf16: bool, out: np.ndarray) -> None:
    """out (n, n_in) float32 = the F16 (bf16 False) or BF16 values of raw (n, 2 * n_in) uint8 rows, exactly (an
    F16 signaling NaN comes back quiet), on the calling thread without the GIL: the tile path's dequantization
    (numpy's scalar float16 cast converts ~0.55 G values/s). raw and out C-contiguous, fits(n_in)."""
    _to_f32(np.asarray(raw).view(np.uint16), out, bf16)


@njit(parallel=True, cache=True)
def _mv_rows(w, x, out, bf16, long_rows):
    """out = x @ W.T: long_rows, rows ROW_GROUP at a time through one loop and the last rows one by one, each row
    one chain; else rows one at a time in SHORT_CHAINS chains."""
    group = ROW_GROUP if long_rows else 1
    n_groups = w.shape[0] // group
    for g in prange(n_groups):
        for t in range(x.shape[0]):
            if long_rows:
                if bf16:
                    _dot4_bf16(w, g * group, x, t, out)
                else:
                    _dot4_f16(w, g * group, x, t, out)
            elif bf16:
                _short_bf16(w, g, x, t, out)
            else:
                _short_f16(w, g, x, t, out)
    for r in range(n_groups * group, w.shape[0]):
        for t in range(x.shape[0]):
            if bf16:
                _dot_bf16(w, r, x, t, out)
            else:
                _dot_f16(w, r, x, t, out)


@njit(cache=True)
def _mv(w, x, out, bf16):
    """out = x @ W.T for w uint16 (n_out, n_in) bits (rows of LONG_ROW or more weights: long_rows)."""
    _mv_rows(w, x, out, bf16, w.shape[1] >= LONG_ROW)


def fits(n_in: int) -> bool:
    """Whether rows of n_in weights take this kernel (whole steps of LANES)."""
    return n_in % LANES == 0


def matvec(raw: np.ndarray, bf16: bool, x: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_out) = x (n_tok, n_in) @ W.T for raw (n_out, 2 * n_in) uint8 rows of F16 (bf16 False) or
    BF16 values; x float32 C-contiguous, fits(n_in)."""
    _mv(np.asarray(raw).view(np.uint16), x, out, bf16)


def matvec_f32(raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """The same for raw (n_out, 4 * n_in) uint8 rows of F32 values: each row's 16-weight steps in the order the
    16-bit rows take (fits(n_in))."""
    _mv(np.asarray(raw).view(np.float32), x, out, False)

