"""F16 / BF16 weights against float32 activations for decode-sized calls (up to MATVEC_MAX_TOK tokens): each
output is one row's dot product with one token, 16 weights at a time converted to float32 in registers
(F16: the hardware conversion, `vcvtph2ps` under F16C / AVX-512; BF16: a shift into the float's high half),
fused multiply-adds into 16 lanes, then the lanes' fixed halving sum. Weights are read once per call from
their file layout (2 bytes each, no float32 copy): the decode of an F16 model is then bound by the bytes it
reads, where the tile path (dequantize to float32, then BLAS) spent ~1 ns a weight converting.

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
_V16F = ir.VectorType(L.F32, LANES)
_V16H = ir.VectorType(ir.HalfType(), LANES)
_V16I = ir.VectorType(L.I32, LANES)


def _make_dot(bf16: bool):
    @intrinsic
    def dot(typingctx, w, r, x, t):
        """sum over k of float32(w[r, k]) * x[t, k]: w uint16 (n_out, k) F16 or BF16 bits, x float32 (n_tok, k),
        C-contiguous, k a multiple of LANES."""
        if not (L.c_arrays((w, types.uint16, 2), (x, types.float32, 2))
                and isinstance(r, types.Integer) and isinstance(t, types.Integer)):
            return None
        sig = types.float32(w, types.intp, x, types.intp)

        def codegen(context, builder, signature, args):
            (pw, wstr, wshape), (px, xstr, _) = (L.array_arg(context, builder, signature.args[k], args[k])
                                                 for k in (0, 2))
            wrow = builder.gep(pw, [builder.mul(args[1], wstr[0])])
            xrow = builder.gep(px, [builder.mul(args[3], xstr[0])])
            acc = cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * LANES))
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3),
                                                 "llvm.fma.v16f32")
            with cgutils.for_range(builder, builder.sdiv(wshape[1], L.const(LANES))) as loop:
                i = loop.index
                wf = _widen(builder, L.load(builder, wrow, builder.mul(i, L.const(2 * LANES)), L.V16W), bf16)
                xv = L.load(builder, xrow, builder.mul(i, L.const(4 * LANES)), _V16F)
                builder.store(builder.call(fma, [wf, xv, builder.load(acc)]), acc)
            return L.hsum(builder, builder.load(acc))

        return sig, codegen
    return dot


def _widen(builder, bits, bf16: bool):
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
                f = _widen(builder, L.load(builder, wrow, builder.mul(i, L.const(2 * LANES)), L.V16W), bf16)
                builder.store(f, builder.bitcast(builder.gep(orow, [builder.mul(i, L.const(4 * LANES))]),
                                                 _V16F.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen
    return row_to_f32


_dot_f16 = _make_dot(False)
_dot_bf16 = _make_dot(True)
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
def _mv(w, x, out, bf16):
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _dot_bf16(w, r, x, t) if bf16 else _dot_f16(w, r, x, t)


def fits(n_in: int) -> bool:
    """Whether rows of n_in weights take this kernel (whole steps of LANES)."""
    return n_in % LANES == 0


def matvec(raw: np.ndarray, bf16: bool, x: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_out) = x (n_tok, n_in) @ W.T for raw (n_out, 2 * n_in) uint8 rows of F16 (bf16 False) or
    BF16 values; x float32 C-contiguous, fits(n_in)."""
    _mv(np.asarray(raw).view(np.uint16), x, out, bf16)

