"""BF16 weights in prompt chunks (more than MATVEC_MAX_TOK tokens) on the CPU's BF16 dot products.

Where the CPU has AVX512_BF16 (AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and later), a chunk's
activations are rounded to BF16 (to nearest, ties to even; NaN stays NaN), as ggml rounds them for its BF16
mat-muls, and each output is the dot product of a weight row's BF16 values with a token's in steps of 32:
one `vdpbf16ps` a step adds the 32 products pairwise into 16 float32 lanes (twice the multiply-adds of a
float32 FMA instruction), then the lanes' fixed halving sum. Tiles of ROWS rows by TOKENS tokens keep
ROWS * TOKENS accumulators in registers, each weight and activation load serving several of them; the tokens
of a call go in chunks of CHUNK_TOKENS so that their BF16 copy stays in L2 while every row group reads it.

The order of each output's operations depends on its row length only (the steps in order into one
accumulator, then the halving sum), not on the tile or the call's token count: a token's outputs are the same
bits in any prompt chunk of more than MATVEC_MAX_TOK tokens. Decode-sized calls keep half_matvec.py (float32
activations), so a token's outputs differ between a prompt chunk and a decode step by the activations' BF16
rounding (relative 2^-9 a value at most; with BLAS they differed in the summation order: docs/bounds.md).

Without AVX512_BF16 (BUILT False) nothing here is compiled: LLVM cannot emit vdpbf16ps for such a target, and
Numba compiles a function on its first call, which qmatmul.py makes only where BUILT.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import llvm_ir as L
from .isa import BF16_DOT, host_features

BUILT = host_features()["avx512bf16"]
STEP = 32              # BF16 values a vdpbf16ps takes from each operand
# a tile's rows and tokens: 18 accumulators + 3 weight + 6 activation vectors of 32 registers. 2-core EPYC VM
# (Zen 4), 2 threads, 512 tokens, GFLOP/s on 4864 x 896 / 896 x 4864 (rows x row length), 2026-12-05: 4 x 4 276 /
# 208, 2 x 8 212 / 164, 3 x 6 288 / 213, 4 x 6 278 / 214 (float32 BLAS on float32 weights: 189-196 / 167-195)
ROWS, TOKENS = 3, 6
CHUNK_TOKENS = 64      # tokens of a call a pass over every row group (64 x 4,864 BF16 values: 608 KB)
ENABLED = BF16_DOT     # built, and not switched off by STRATA_LITE_BF16_GEMM=0 (isa.py)


class _BFloat(ir.types.Type):
    """LLVM's bfloat (llvmlite.ir has no such type; only its vectors are used, as bitcasts of 32-bit lanes)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_V32BF = ir.VectorType(_BFloat(), STEP)
_V16I = ir.VectorType(L.I32, 16)
_V16F = ir.VectorType(L.F32, 16)


@intrinsic
def _tile(typingctx, w, r0, xb, t0, out):
    """out[t, r] = sum over k of w[r, k] * xb[t, k] (BF16 bits, products pairwise into float32 lanes) for the
    ROWS rows from r0 and TOKENS tokens from t0, each clamped to the last row / token (a short last tile computes
    the last one again and stores the same value): w uint16 (n_out, k), xb uint16 (n_tok, k), out float32 (n_tok,
    n_out), C-contiguous, k a multiple of STEP."""
    if not (L.c_arrays((w, types.uint16, 2), (xb, types.uint16, 2), (out, types.float32, 2))
            and isinstance(r0, types.Integer) and isinstance(t0, types.Integer)):
        return None
    sig = types.void(w, types.intp, xb, types.intp, out)

    def codegen(context, builder, signature, args):
        (pw, wstr, wshape), (px, xstr, xshape), (po, ostr, _) = (
            L.array_arg(context, builder, signature.args[k], args[k]) for k in (0, 2, 4))
        rows = L.clamped_rows(builder, args[1], ROWS, wshape[0])
        toks = L.clamped_rows(builder, args[3], TOKENS, xshape[0])
        wrows = [builder.gep(pw, [builder.mul(r, wstr[0])]) for r in rows]
        xrows = [builder.gep(px, [builder.mul(t, xstr[0])]) for t in toks]
        dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F, _V32BF, _V32BF]),
                                            "llvm.x86.avx512bf16.dpbf16ps.512")
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in toks] for _ in rows]
        with cgutils.for_range(builder, builder.sdiv(wshape[1], L.const(STEP))) as loop:
            off = builder.mul(loop.index, L.const(2 * STEP))
            wv = [builder.bitcast(L.load(builder, p, off, _V16I), _V32BF) for p in wrows]
            xv = [builder.bitcast(L.load(builder, p, off, _V16I), _V32BF) for p in xrows]
            for i in range(ROWS):
                for j in range(TOKENS):
                    builder.store(builder.call(dp, [builder.load(accs[i][j]), wv[i], xv[j]]), accs[i][j])
        sums = [[L.hsum(builder, builder.load(accs[i][j])) for j in range(TOKENS)] for i in range(ROWS)]
        L.store_tile(builder, po, ostr, toks, rows, lambda i, j: sums[i][j])
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, cache=True)
def _gemm(w, xb, out):
    n_groups = (w.shape[0] + ROWS - 1) // ROWS
    n_tok = xb.shape[0]
    for c0 in range(0, n_tok, CHUNK_TOKENS):
        c1 = min(n_tok, c0 + CHUNK_TOKENS)
        for g in prange(n_groups):
            for t0 in range(c0, c1, TOKENS):
                _tile(w, g * ROWS, xb, t0, out)


@njit(parallel=True, cache=True)
def _round_bf16(x, xb):
    """xb = x rounded to BF16 bits (to nearest, ties to even; a NaN keeps its sign and becomes a quiet NaN)."""
    bits = x.view(np.uint32)
    for t in prange(x.shape[0]):
        for k in range(x.shape[1]):
            b = bits[t, k]
            if (b & 0x7FFFFFFF) > 0x7F800000:
                xb[t, k] = np.uint16((b >> 16) | 0x40)
            else:
                xb[t, k] = np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


def takes(n_in: int) -> bool:
    """Whether a BF16 matrix of rows of n_in weights takes this kernel on this CPU (and it is not switched off)."""
    return ENABLED and n_in % STEP == 0


def round_bf16(x: np.ndarray) -> np.ndarray:
    """x float32 (n, k) C-contiguous -> its BF16 bits, uint16 (n, k)."""
    xb = np.empty(x.shape, np.uint16)
    _round_bf16(x, xb)
    return xb


def matmul(raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_out) = x (n_tok, n_in) rounded to BF16 @ W.T for raw (n_out, 2 * n_in) uint8 rows of BF16
    values; x float32 C-contiguous, takes(n_in)."""
    _gemm(np.asarray(raw).view(np.uint16), round_bf16(x), out)
