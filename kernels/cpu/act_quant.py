"""Activation rounding that reproduces llama.cpp's numerics: before a quantized mat-mul, ggml quantizes
the activations to Q8_0 (32-blocks, scale amax/127 stored as f16) for Q4_0/Q5_0/Q8_0/IQ4_NL weights
and to Q8_K (256-blocks, scale -max/127 by the signed extreme, float32) for K-quants and IQ3_XXS.
Doing the same rounding here (values only, computing in float) makes our logits track llama.cpp's:
on the golden set it fixes the near-tie argmax flips that float activations give.
"""
import math

import numpy as np
from gguf import GGMLQuantizationType as QType
from numba import njit, prange

Q8_0_ACT = frozenset({QType.Q4_0, QType.Q5_0, QType.Q8_0, QType.IQ4_NL})
Q8_K_ACT = frozenset({QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ3_XXS})


@njit(cache=True, inline="always")
def round_f16(v):
    """float32 -> the nearest float16 value (ties to even), as a float; v >= 0."""
    if v == 0.0:
        return 0.0
    if v >= 65520.0:
        return np.inf
    m, e = math.frexp(v)           # v = m * 2**e, 0.5 <= m < 1
    e = max(e - 1, -14)            # exponent of the leading bit, clamped to f16's subnormal range
    ulp = math.ldexp(1.0, e - 10)
    return np.rint(v / ulp) * ulp


@njit(cache=True, parallel=True)
def _q8_0_rows(x, out):
    n, d = x.shape
    for i in prange(n):
        for b in range(d // 32):
            amax = np.float32(0.0)
            for j in range(b * 32, b * 32 + 32):
                amax = max(amax, abs(x[i, j]))
            s = np.float32(amax / np.float32(127.0))
            inv = np.float32(1.0) / s if s != 0 else np.float32(0.0)
            s16 = np.float32(round_f16(s))
            for j in range(b * 32, b * 32 + 32):
                out[i, j] = np.float32(np.rint(x[i, j] * inv)) * s16


@njit(cache=True, parallel=True)
def _q8_k_rows(x, out):
    n, d = x.shape
    for i in prange(n):
        for b in range(d // 256):
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            for j in range(b * 256, b * 256 + 256):
                a = abs(x[i, j])
                if a > amax:
                    amax, mx = a, x[i, j]
            if amax == 0:
                for j in range(b * 256, b * 256 + 256):
                    out[i, j] = 0.0
                continue
            iscale = np.float32(-127.0) / mx
            s = np.float32(1.0) / iscale
            for j in range(b * 256, b * 256 + 256):
                out[i, j] = np.float32(min(127.0, np.rint(iscale * x[i, j]))) * s


def activation_format(qtype) -> str | None:
    """How activations are rounded before a mat-mul with this weight type: "q8_0", "q8_k" or None."""
    qtype = QType(int(qtype))
    return "q8_0" if qtype in Q8_0_ACT else "q8_k" if qtype in Q8_K_ACT else None


def round_activations(qtype, x: np.ndarray) -> np.ndarray:
    """x (n, n_in) float32 -> a new array with llama.cpp's activation rounding for this weight type
    (x itself for float weight types)."""
    qtype = QType(int(qtype))
    if qtype in Q8_0_ACT:
        out = np.empty_like(x)
        _q8_0_rows(x, out)
        return out
    if qtype in Q8_K_ACT:
        out = np.empty_like(x)
        _q8_k_rows(x, out)
        return out
    return x
