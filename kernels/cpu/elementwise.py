"""Elementwise / per-row kernels (Numba, CPU): rmsnorm, rope, silu_mul, add.

All take float32 C-contiguous arrays and write into caller-allocated outputs (rope works in
place).  The Python launchers validate shapes/dtypes once per call (ValueError), then call a
``parallel=True`` kernel (prange over rows/tokens) or, for small inputs where thread start-up
would dominate (decode of a single token), a serial copy of the same loop.

exp() in silu uses a vectorizable polynomial exp2 (``exp2_inplace``; ~2e-7 relative error,
about 7x faster than libm expf per element, which LLVM cannot vectorize here).
"""
import math

import numpy as np
from numba import njit, prange

__all__ = ["rmsnorm", "rope", "silu_mul", "add", "exp2_inplace"]

# reassociation + FMA contraction only (vectorized reductions); keep inf/nan semantics
_FM = {"reassoc", "contract", "nsz"}

# below this many elements a call runs single-threaded (parallel launch costs ~10 us)
_PAR_MIN = 1 << 15
_LOG2E = 1.4426950408889634


def _req(arr, name, ndim=None):
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.float32:
        raise ValueError(f"{name} must be float32, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


# ----------------------------------------------------------------------------- exp2

@njit(cache=True, inline="always")
def exp2_poly(f):
    """2**f for f in [-0.5, 0.5], float32: degree-7 Taylor polynomial (coefficients ln2^j / j!),
    relative error < 3e-7; callers add the integer part to the exponent bits."""
    r = np.float32(1.5252733804059840e-05)
    r = r * f + np.float32(1.5403530393381609e-04)
    r = r * f + np.float32(1.3333558146428443e-03)
    r = r * f + np.float32(9.6181291076284772e-03)
    r = r * f + np.float32(5.5504108664821580e-02)
    r = r * f + np.float32(2.4022650695910071e-01)
    r = r * f + np.float32(6.9314718055994531e-01)
    return r * f + np.float32(1.0)


@njit(cache=True, fastmath=_FM, inline="always")
def exp2_inplace(x, ebits):
    """x[i] <- 2**x[i] for a contiguous float32 vector, inputs clamped to [-126, 126];
    ebits is int32 scratch of the same length.  Degree-7 Taylor polynomial of 2**f on
    f in [-0.5, 0.5] (truncation < 1e-8) + exponent-field insertion: rel. error ~2e-7."""
    n = x.shape[0]
    for i in range(n):
        v = min(max(x[i], np.float32(-126.0)), np.float32(126.0))
        k = np.floor(v + np.float32(0.5))
        f = v - k
        x[i] = exp2_poly(f)
        ebits[i] = np.int32(k) << 23
    xb = x.view(np.int32)
    for i in range(n):
        xb[i] += ebits[i]


# ----------------------------------------------------------------------------- rmsnorm

@njit(cache=True, fastmath=_FM, inline="always")
def _rmsnorm_row(x, w, eps, out, i):
    d = x.shape[1]
    ss = 0.0
    for j in range(d):
        v = np.float64(x[i, j])
        ss += v * v
    sc = np.float32(1.0 / math.sqrt(ss / d + eps))
    for j in range(d):
        out[i, j] = x[i, j] * sc * w[j]


@njit(cache=True, fastmath=_FM, parallel=True)
def _rmsnorm_par(x, w, eps, out):
    for i in prange(x.shape[0]):
        _rmsnorm_row(x, w, eps, out, i)


@njit(cache=True, fastmath=_FM)
def _rmsnorm_ser(x, w, eps, out):
    for i in range(x.shape[0]):
        _rmsnorm_row(x, w, eps, out, i)


def rmsnorm(x, weight, eps, out):
    """out = x / sqrt(mean(x**2, last axis) + eps) * weight.

    x (n, d) float32 (any leading dims are accepted and flattened, e.g. per-head q/k norm
    on (n_tok, n_heads, head_dim) with weight (head_dim,)), weight (d,), out like x; out may
    alias x.  Sum of squares accumulated in float64 (as ggml does)."""
    _req(x, "x")
    _req(weight, "weight", 1)
    _req(out, "out")
    if x.ndim < 1 or out.shape != x.shape:
        raise ValueError(f"out {out.shape} must match x {x.shape}")
    d = x.shape[-1] if x.ndim else 0
    if weight.shape[0] != d or d == 0:
        raise ValueError(f"weight {weight.shape} must be ({d},) matching x's last axis (d > 0)")
    x2 = x.reshape(-1, d)
    o2 = out.reshape(-1, d)
    fn = _rmsnorm_par if x.size >= _PAR_MIN and x2.shape[0] > 1 else _rmsnorm_ser
    fn(x2, weight, float(eps), o2)


# ----------------------------------------------------------------------------- rope

# rope without fast-math: contracting a * cs - b * sn into an FMA is a choice LLVM makes per loop, and
# it made the parallel and serial kernels round differently (a token's q / k then depended on how many
# tokens shared the call: batch invariance)
@njit(cache=True, inline="always")
def _rope_tok(x, positions, inv_freq, n_rot, neox, scale, has_scale, t, cs, sn):
    half = n_rot // 2
    p = np.float64(positions[t])
    for i in range(half):
        th = p * inv_freq[i]
        cs[i] = np.float32(math.cos(th))
        sn[i] = np.float32(math.sin(th))
    for h in range(x.shape[1]):
        if neox:
            for i in range(half):
                a = x[t, h, i]
                b = x[t, h, i + half]
                x[t, h, i] = a * cs[i] - b * sn[i]
                x[t, h, i + half] = a * sn[i] + b * cs[i]
        else:
            for i in range(half):
                a = x[t, h, 2 * i]
                b = x[t, h, 2 * i + 1]
                x[t, h, 2 * i] = a * cs[i] - b * sn[i]
                x[t, h, 2 * i + 1] = a * sn[i] + b * cs[i]
        if has_scale:               # the head's row is still in L1: the per-channel factor costs ~nothing
            for d in range(x.shape[2]):
                x[t, h, d] *= scale[h, d]


@njit(cache=True, parallel=True)
def _rope_par(x, positions, inv_freq, n_rot, neox, scale, has_scale):
    half = n_rot // 2
    for t in prange(x.shape[0]):
        cs = np.empty(half, np.float32)
        sn = np.empty(half, np.float32)
        _rope_tok(x, positions, inv_freq, n_rot, neox, scale, has_scale, t, cs, sn)


@njit(cache=True)
def _rope_ser(x, positions, inv_freq, n_rot, neox, scale, has_scale):
    half = n_rot // 2
    cs = np.empty(half, np.float32)
    sn = np.empty(half, np.float32)
    for t in range(x.shape[0]):
        _rope_tok(x, positions, inv_freq, n_rot, neox, scale, has_scale, t, cs, sn)


_inv_freq_cache = {}


def _inv_freq(freq_base, n_rot):
    key = (float(freq_base), int(n_rot))
    inv = _inv_freq_cache.get(key)
    if inv is None:
        inv = float(freq_base) ** (-2.0 * np.arange(n_rot // 2, dtype=np.float64) / n_rot)
        if len(_inv_freq_cache) < 64:
            _inv_freq_cache[key] = inv
    return inv


_NO_SCALE = np.ones((1, 1), np.float32)


def rope(x, positions, freq_base, n_rot, neox, channel_scale=None):
    """Rotary embedding, in place on x (n_tok, n_heads, head_dim) float32; then, if channel_scale
    (n_heads, head_dim) float32 is given, every channel multiplied by it (K smoothing, k_smoothing.py).

    theta_i = positions[t] * freq_base**(-2i/n_rot), i < n_rot/2; neox=True rotates pairs
    (i, i + n_rot/2) (qwen2/qwen3), neox=False pairs (2i, 2i+1) (llama "normal"); dims >=
    n_rot are untouched.  Angles and their cos/sin are computed in float64 with pow per dim
    (llama.cpp builds theta in float32 by repeated multiplication theta *= theta_scale, whose
    error grows with position, ~1e-3 rad at 32K), then rounded to float32 for the rotation."""
    _req(x, "x", 3)
    if not isinstance(positions, np.ndarray) or positions.dtype != np.int32 or positions.ndim != 1:
        raise ValueError("positions must be a 1-D int32 array")
    n_tok, n_heads, hd = x.shape
    if positions.shape[0] != n_tok:
        raise ValueError(f"positions {positions.shape} must have length n_tok={n_tok}")
    n_rot = int(n_rot)
    if n_rot <= 0 or n_rot % 2 or n_rot > hd:
        raise ValueError(f"n_rot={n_rot} must be even and in (0, head_dim={hd}]")
    if channel_scale is not None:
        _req(channel_scale, "channel_scale", 2)
        if channel_scale.shape != (n_heads, hd):
            raise ValueError(f"channel_scale {channel_scale.shape} must be (n_heads, head_dim) = {(n_heads, hd)}")
    if n_tok == 0:
        return
    inv = _inv_freq(freq_base, n_rot)
    fn = _rope_par if x.size >= _PAR_MIN and n_tok > 1 else _rope_ser
    scale = _NO_SCALE if channel_scale is None else channel_scale
    fn(x, positions, inv, n_rot, bool(neox), scale, channel_scale is not None)


# ----------------------------------------------------------------------------- silu_mul

@njit(cache=True, fastmath=_FM, inline="always")
def _silu_mul_row(gate, up, out, i, e, ebits):
    f = gate.shape[1]
    for j in range(f):
        e[j] = gate[i, j] * np.float32(-_LOG2E)
    exp2_inplace(e, ebits)                       # e = exp(-g)
    for j in range(f):
        out[i, j] = gate[i, j] / (np.float32(1.0) + e[j]) * up[i, j]


@njit(cache=True, fastmath=_FM, parallel=True)
def _silu_mul_par(gate, up, out):
    f = gate.shape[1]
    for i in prange(gate.shape[0]):
        e = np.empty(f, np.float32)
        ebits = np.empty(f, np.int32)
        _silu_mul_row(gate, up, out, i, e, ebits)


@njit(cache=True, fastmath=_FM)
def _silu_mul_ser(gate, up, out):
    f = gate.shape[1]
    e = np.empty(f, np.float32)
    ebits = np.empty(f, np.int32)
    for i in range(gate.shape[0]):
        _silu_mul_row(gate, up, out, i, e, ebits)


def silu_mul(gate, up, out):
    """out = silu(gate) * up = gate / (1 + exp(-gate)) * up; all (n, f) float32.
    out may alias gate or up."""
    _req(gate, "gate", 2)
    _req(up, "up", 2)
    _req(out, "out", 2)
    if up.shape != gate.shape or out.shape != gate.shape:
        raise ValueError(f"gate {gate.shape}, up {up.shape}, out {out.shape} must match")
    if gate.size == 0:
        return
    fn = _silu_mul_par if gate.size >= _PAR_MIN and gate.shape[0] > 1 else _silu_mul_ser
    fn(gate, up, out)


# ----------------------------------------------------------------------------- add

@njit(cache=True, parallel=True)
def _add_par(a, b, out):
    n = a.shape[0]
    nb = (n + 4095) // 4096
    for k in prange(nb):
        lo = k * 4096
        hi = min(n, lo + 4096)
        for i in range(lo, hi):
            out[i] = a[i] + b[i]


@njit(cache=True)
def _add_ser(a, b, out):
    for i in range(a.shape[0]):
        out[i] = a[i] + b[i]


def add(a, b, out):
    """out = a + b (same shapes, float32, no broadcasting); out may alias a or b."""
    _req(a, "a")
    _req(b, "b")
    _req(out, "out")
    if b.shape != a.shape or out.shape != a.shape:
        raise ValueError(f"a {a.shape}, b {b.shape}, out {out.shape} must match")
    a1, b1, o1 = a.reshape(-1), b.reshape(-1), out.reshape(-1)
    fn = _add_par if a.size >= 4 * _PAR_MIN else _add_ser
    fn(a1, b1, o1)
