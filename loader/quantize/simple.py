"""Q8_0, Q4_0, Q5_0 and IQ4_NL row quantizers (GGML block layouts), written for Numba.

All use 32-weight blocks and follow llama.cpp's code in float32:

* Q8_0 (34 bytes: f16 d, 32 x int8): d = amax / 127, q = roundf(x / d) (half away
  from zero). Same bytes as llama.cpp's quantize_row_q8_0_ref and gguf-py's
  quantize. llama.cpp ignores the importance matrix for Q8_0; so do we.
* Q4_0 (18 bytes: f16 d, 16 bytes of nibbles, low nibble = weight j, high = j + 16):
  d = (signed value of largest magnitude) / -8, q = min(15, trunc(x / d + 8.5)).
  Same bytes as quantize_row_q4_0_ref and gguf-py. The importance matrix is
  ignored (llama.cpp's imatrix variant of Q4_0, quantize_row_q4_0_impl, is not
  ported).
* Q5_0 (22 bytes: f16 d, u32 qh = the 5th bits, 16 bytes of low nibbles, same order as
  Q4_0). Without an importance matrix: llama.cpp's quantize_row_q5_0_ref (d = signed
  largest-magnitude value / -16, q = min(31, trunc(x / d + 16.5))), the same bytes as gguf-py.
  With one: quantize_row_q5_0_impl, i.e. per block weights imatrix_j * sqrt(sigma2 + x_j^2)
  (sigma2 = mean x^2 over the whole row) and make_qx_quants(nmax = 16): round at scale
  -16 / max, then 18 trial scales -(16 + 0.1 k) / max, keeping the weighted least-squares best.
* IQ4_NL (18 bytes: f16 d, 16 bytes of nibbles indexing the 16 non-linear values
  kvalues_iq4nl, same nibble order as Q4_0): llama.cpp's quantize_iq4_nl, i.e.
  quantize_row_iq4_nl_impl(32, 32, 16 values, ntry = 7): per block
  sigma2 = 2 * mean(x^2), weights imatrix_j * sqrt(sigma2 + x_j^2) (x_j^2 without
  imatrix), initial d = max / -127 from the signed largest-magnitude value, then
  15 trial scales (itry - 127) / max, each refit by weighted least squares;
  d stored as f16, indices re-picked with 1/d.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from gguf.quants import IQ4_NL as _GGUF_IQ4_NL

QK = 32
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_EPS15 = np.float32(1e-15)   # GROUP_MAX_EPS
KVALUES_IQ4NL = np.asarray(_GGUF_IQ4_NL.kvalues, dtype=np.int8)


def _finish(out, dvals, block_bytes):
    n_rows, nb = dvals.shape
    out.reshape(n_rows, nb, block_bytes)[:, :, 0:2] = dvals.astype(np.float16).view(np.uint8).reshape(n_rows, nb, 2)
    return out


def _quantize_blocks(rows, block_bytes, run):
    """Allocate the output blocks and per-block scales, run(out, dvals) (a row kernel), store the scales."""
    n_rows, n_cols = rows.shape
    out = np.zeros((n_rows, n_cols // QK * block_bytes), dtype=np.uint8)
    dvals = np.zeros((n_rows, n_cols // QK), dtype=np.float32)
    if n_rows:
        run(out, dvals)
    return _finish(out, dvals, block_bytes)


def _importance(imatrix):
    """(weights array, has weights) for the Numba kernels (they need an array either way)."""
    return (imatrix, True) if imatrix is not None else (np.zeros(QK, dtype=np.float32), False)


def _check(rows, imatrix=None):
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError("rows must be a 2-D array")
    if rows.shape[1] % QK:
        raise ValueError(f"rows must be a multiple of {QK} weights, got {rows.shape[1]}")
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if imatrix.shape[0] != rows.shape[1]:
            raise ValueError(f"imatrix has {imatrix.shape[0]} entries, rows have {rows.shape[1]}")
    return rows, imatrix


# ----------------------------------------------------------------------------- Q8_0

@njit(cache=True, parallel=True)
def _q8_0_rows(rows, out, dvals):
    n_rows, n_cols = rows.shape
    nb = n_cols // QK
    for r in prange(n_rows):
        for b in range(nb):
            o = b * 34
            amax = _F0
            for j in range(QK):
                a = abs(rows[r, b * QK + j])
                if a > amax:
                    amax = a
            d = amax / np.float32(127.0)
            idv = _F1 / d if d != _F0 else _F0
            dvals[r, b] = d
            for j in range(QK):
                v = rows[r, b * QK + j] * idv
                a = np.float64(abs(v))
                q = np.floor(a + 0.5)          # exact for float32 inputs: roundf, half away from zero
                qi = int(q) if v >= _F0 else -int(q)
                out[r, o + 2 + j] = np.uint8(qi & 0xFF)


def quantize_q8_0(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    rows, _ = _check(rows, imatrix)
    return _quantize_blocks(rows, 34, lambda out, dvals: _q8_0_rows(rows, out, dvals))


# ----------------------------------------------------------------------------- Q4_0

@njit(cache=True, parallel=True)
def _q4_0_rows(rows, out, dvals):
    n_rows, n_cols = rows.shape
    nb = n_cols // QK
    for r in prange(n_rows):
        for b in range(nb):
            o = b * 18
            amax = _F0
            mx = _F0
            for j in range(QK):
                v = rows[r, b * QK + j]
                if amax < abs(v):
                    amax = abs(v)
                    mx = v
            d = mx / np.float32(-8.0)
            idv = _F1 / d if d != _F0 else _F0
            dvals[r, b] = d
            for j in range(QK // 2):
                x0 = rows[r, b * QK + j] * idv + np.float32(8.5)
                x1 = rows[r, b * QK + QK // 2 + j] * idv + np.float32(8.5)
                q0 = min(15, int(x0))          # int() truncates, like the C cast
                q1 = min(15, int(x1))
                out[r, o + 2 + j] = np.uint8(q0 | (q1 << 4))


def quantize_q4_0(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    rows, _ = _check(rows, imatrix)
    return _quantize_blocks(rows, 18, lambda out, dvals: _q4_0_rows(rows, out, dvals))


# ----------------------------------------------------------------------------- Q5_0

@njit(cache=True, inline="always")
def _q5_0_pack(out, o, L):
    # L: 32 levels 0..31 -> 4 bytes of 5th bits (bit j: weight j), then low nibbles (j | j + 16 << 4)
    qh = 0
    for j in range(QK // 2):
        qh |= ((L[j] >> 4) & 1) << j
        qh |= ((L[j + QK // 2] >> 4) & 1) << (j + QK // 2)
        out[o + 4 + j] = np.uint8((L[j] & 15) | ((L[j + QK // 2] & 15) << 4))
    for k in range(4):
        out[o + k] = np.uint8((qh >> (8 * k)) & 0xFF)


@njit(cache=True, inline="always")
def _nearest_int(v):
    return int(np.rint(v))           # ggml's nearest_int: round half to even (the float magic-number trick)


@njit(cache=True, inline="always")
def _qx_fit(xb, w, iscale, nmax):
    # (sum w x l, sum w l^2) for levels l = clamp(nearest_int(iscale x), -nmax, nmax - 1)
    sumlx = _F0
    suml2 = _F0
    for j in range(QK):
        l = max(-nmax, min(nmax - 1, _nearest_int(iscale * xb[j])))
        sumlx += w[j] * xb[j] * np.float32(l)
        suml2 += w[j] * np.float32(l * l)
    return sumlx, suml2


@njit(cache=True, parallel=True)
def _q5_0_rows(rows, qw, has_qw, out, dvals):
    n_rows, n_cols = rows.shape
    nb = n_cols // QK
    nmax = 16
    for r in prange(n_rows):
        L = np.empty(QK, dtype=np.int64)
        w = np.empty(QK, dtype=np.float32)
        sigma2 = _F0
        if has_qw:
            for j in range(n_cols):
                sigma2 += rows[r, j] * rows[r, j]
            sigma2 /= np.float32(n_cols)
        for b in range(nb):
            xb = rows[r, b * QK:(b + 1) * QK]
            amax = _F0
            mx = _F0
            for j in range(QK):
                if amax < abs(xb[j]):
                    amax = abs(xb[j])
                    mx = xb[j]
            if not has_qw:                                  # quantize_row_q5_0_ref
                d = mx / np.float32(-16.0)
                idv = _F1 / d if d != _F0 else _F0
                for j in range(QK):
                    L[j] = min(31, int(xb[j] * idv + np.float32(16.5)))
            elif amax < _EPS15:                             # make_qx_quants' all-zero block: levels 0
                d = _F0
                for j in range(QK):
                    L[j] = 0
            else:                                           # make_qx_quants(32, 16, x, L, 1, weight)
                for j in range(QK):
                    w[j] = qw[b * QK + j] * np.sqrt(sigma2 + xb[j] * xb[j])
                best_is = np.float32(-nmax) / mx
                sumlx, suml2 = _qx_fit(xb, w, best_is, nmax)
                d = sumlx / suml2 if suml2 > _F0 else _F0
                best = d * sumlx
                for k in range(-9, 10):
                    if k == 0:
                        continue
                    iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(k)) / mx
                    sumlx, suml2 = _qx_fit(xb, w, iscale, nmax)
                    if suml2 > _F0 and sumlx * sumlx > best * suml2:
                        d = sumlx / suml2
                        best = d * sumlx
                        best_is = iscale
                for j in range(QK):
                    L[j] = nmax + max(-nmax, min(nmax - 1, _nearest_int(best_is * xb[j])))
            dvals[r, b] = d
            _q5_0_pack(out[r], b * 22 + 2, L)


def quantize_q5_0(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    rows, imatrix = _check(rows, imatrix)
    qw, has_qw = _importance(imatrix)
    return _quantize_blocks(rows, 22, lambda out, dvals: _q5_0_rows(rows, qw, has_qw, out, dvals))


# ----------------------------------------------------------------------------- IQ4_NL

@njit(cache=True, inline="always")
def _best_index(values, x):
    # values sorted ascending (16 entries); picks level i once x reaches the midpoint of
    # values[i-1] and values[i] (ties go up), as llama.cpp's best_index_int8.
    x2 = x + x
    idx = 0
    step = 8
    while step > 0:
        j = idx + step
        if x2 >= np.float32(int(values[j - 1]) + int(values[j])):
            idx = j
        step >>= 1
    return idx


@njit(cache=True, parallel=True)
def _iq4_nl_rows(rows, qw, has_qw, values, out, dvals, ntry):
    n_rows, n_cols = rows.shape
    nb = n_cols // QK
    v0 = np.float32(values[0])
    for r in prange(n_rows):
        weight = np.empty(QK, dtype=np.float32)
        L = np.empty(QK, dtype=np.int64)
        for b in range(nb):
            base = b * QK
            sigma2 = _F0
            for j in range(QK):
                x = rows[r, base + j]
                sigma2 += x * x
            sigma2 *= np.float32(2.0 / QK)
            if has_qw:
                for j in range(QK):
                    x = rows[r, base + j]
                    weight[j] = qw[base + j] * np.sqrt(sigma2 + x * x)
            else:
                for j in range(QK):
                    x = rows[r, base + j]
                    weight[j] = x * x
            amax = _F0
            mx = _F0
            for j in range(QK):
                ax = abs(rows[r, base + j])
                if ax > amax:
                    amax = ax
                    mx = rows[r, base + j]
            if amax < _EPS15:
                d = _F0
            else:
                d = -mx / v0 if ntry > 0 else mx / v0
                idv = _F1 / d
                sumqx = _F0
                sumq2 = _F0
                for j in range(QK):
                    x = rows[r, base + j]
                    l = _best_index(values, idv * x)
                    q = np.float32(values[l])
                    w = weight[j]
                    sumqx += w * q * x
                    sumq2 += w * q * q
                d = sumqx / sumq2 if sumq2 > _F0 else _F0
                best = d * sumqx
                for itry in range(-ntry, ntry + 1):
                    idv = np.float32(itry + int(values[0])) / mx
                    sumqx = _F0
                    sumq2 = _F0
                    for j in range(QK):
                        x = rows[r, base + j]
                        l = _best_index(values, idv * x)
                        q = np.float32(values[l])
                        w = weight[j]
                        sumqx += w * q * x
                        sumq2 += w * q * q
                    if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                        d = sumqx / sumq2
                        best = d * sumqx
            dvals[r, b] = d
            idv = _F1 / d if d != _F0 else _F0
            for j in range(QK):
                L[j] = _best_index(values, idv * rows[r, base + j])
            o = b * 18 + 2
            for j in range(QK // 2):
                out[r, o + j] = np.uint8(L[j] | (L[j + QK // 2] << 4))


def quantize_iq4_nl(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    rows, imatrix = _check(rows, imatrix)
    qw, has_qw = _importance(imatrix)
    return _quantize_blocks(rows, 18, lambda out, dvals: _iq4_nl_rows(rows, qw, has_qw, KVALUES_IQ4NL, out,
                                                                      dvals, 7))
