"""IQ3_XXS row quantizer (GGML block layout), written for Numba.

Block (256 weights, 98 bytes):
    f16 d | 64 bytes: one grid index (0..255) per group of 4 weights |
    8 x uint32 (one per 32-weight sub-block): bits 0..27 = 4 x 7 sign bits
    (the 8th sign of each group of 8 is implied: the number of negatives is even),
    bits 28..31 = 4-bit sub-block scale s; the sub-block scale is d * (0.5 + s) / 2.
A grid point holds 4 magnitudes (2*l + 1) with l in 0..7; the 256 allowed
points are the "iq3xxs" grid.

The search follows llama.cpp's quantize_row_iq3_xxs_impl (grid size 256) step
by step, in float32 and in the same order of operations, so that its bytes are
identical to llama.cpp's (quantize_iq3_xxs(..., refine=False)); by default a
refinement pass (below) then re-picks grid points for the stored scales:

* per 256-weight block: sigma2 = 2 * mean(x^2);
  per weight w = imatrix[j] * sqrt(sigma2 + x_j^2)  (w = x_j^2 without imatrix);
* per group of 8: take |x|, and if the number of negatives is odd, flip the
  sign of the weight with the smallest w * x^2 (its magnitude becomes negative);
* per 32-weight sub-block: try 31 scales (15 + 0.2*k)/max, k = -15..15; for
  each, round every group of 4 onto the 8-level lattice; when the lattice point
  is not a grid point, pick the best of its precomputed grid neighbours
  (weighted by sqrt(w)); keep the scale with the best weighted least-squares
  fit; then re-round the off-grid groups at the fitted scale and refit;
* per block: d = max_scale / 31, stored as f16(d * 1.0125); the 4-bit scales
  are nearest_int((scale / d - 1) / 2).

Tables (built once at import with numpy, from gguf-py's copy of the grid):
    GRID_LEVELS  int8   [256, 4]   l of each grid point (magnitude 2l+1)
    GRID_VALUES  float32[256, 4]   2l+1
    KMAP         int32  [4096]     lattice code (l0 | l1<<3 | l2<<6 | l3<<9) -> grid index, or -1
    NB_START/NB_COUNT int32[4096]  slice of NB_LIST with the neighbours of an off-grid code
    NB_LIST      int16             grid indices, sorted by (squared distance, index), covering the
                                   two smallest distances (as llama.cpp's iq3xs_init_impl)
    NB_LEV       uint8  [N, 4]     the levels of each NB_LIST entry

Speed (measured on the shared 2-core box, CPU time): ~2.0-2.4 M weights per core-second,
i.e. ~270-330 s for 1.3 G weights on 2 cores; ~65 % of it is the neighbour search.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from gguf.quants import IQ2_XXS as _GGUF_IQ2_XXS
from gguf.quants import IQ3_XXS as _GGUF_IQ3_XXS

QK_K = 256
BLOCK_BYTES = 98
_KMAXQ = 8
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_F2 = np.float32(2.0)
_FHALF = np.float32(0.5)
_F15 = np.float32(2 * _KMAXQ - 1)
_F02 = np.float32(0.2)
_F31 = np.float32(31.0)
_FUDGE = np.float32(1.0125)
_EPS = np.float32(1e-8)          # GROUP_MAX_EPS_IQ3_XXS
_FQK = np.float32(QK_K)
_MAGIC = np.float32(12582912.0)


def _build_tables():
    _GGUF_IQ3_XXS.init_grid()
    vals = np.asarray(_GGUF_IQ3_XXS.grid, dtype=np.float32).reshape(256, 4)
    gmap = np.asarray(_GGUF_IQ3_XXS.grid_map, dtype=np.float32)
    levels = np.searchsorted(gmap, vals).astype(np.int8)          # l in 0..7
    assert np.array_equal(gmap[levels], vals)
    codes = (levels.astype(np.int32) << np.array([0, 3, 6, 9], dtype=np.int32)).sum(axis=1)
    kmap = np.full(4096, -1, dtype=np.int32)
    kmap[codes] = np.arange(256, dtype=np.int32)
    assert (kmap >= 0).sum() == 256

    gpos = (2 * levels.astype(np.int32) + 1)                       # [256, 4]
    allcodes = np.arange(4096, dtype=np.int32)
    lpos = 2 * ((allcodes[:, None] >> np.array([0, 3, 6, 9])) & 7) + 1   # [4096, 4]
    d2 = ((lpos[:, None, :] - gpos[None, :, :]) ** 2).sum(axis=-1)       # [4096, 256]
    nb_start = np.zeros(4096, dtype=np.int32)
    nb_count = np.zeros(4096, dtype=np.int32)
    chunks = []
    pos = 0
    nwant = 2
    for u in range(4096):
        if kmap[u] >= 0:
            continue
        row = d2[u]
        order = np.argsort(row, kind="stable")      # ties broken by grid index, as qsort on (d2, j)
        distinct = np.unique(row)[:nwant]
        take = order[row[order] <= distinct[-1]]
        nb_start[u] = pos
        nb_count[u] = take.size
        chunks.append(take.astype(np.int16))
        pos += take.size
    nb_list = np.concatenate(chunks)
    return levels, gpos.astype(np.float32), kmap, nb_start, nb_count, nb_list


GRID_LEVELS, GRID_VALUES, KMAP, NB_START, NB_COUNT, NB_LIST = _build_tables()
NB_LEV = np.ascontiguousarray(GRID_LEVELS[NB_LIST.astype(np.int64)].astype(np.uint8))   # [N, 4] levels of each listed neighbour
_KSIGNS = np.frombuffer(_GGUF_IQ2_XXS.ksigns, dtype=np.uint8).copy()   # 7-bit sign index -> 8 signs (even parity)


@njit(cache=True, inline="always")
def _nearest_int(v):
    # llama.cpp's nearest_int (|v| < 2^22): adding 1.5 * 2^23 in float32 rounds to an integer,
    # ties to even; subtracting it back is exact. Cheaper than a rint call.
    return int((v + _MAGIC) - _MAGIC)


@njit(cache=True, inline="always")
def _best_neighbour(u, xval, waux, off, sq, nb_start, nb_count, nb_list, nb_lev, terms):
    """Grid neighbour of lattice code u minimising sum_i waux_i (scale*q_i - x_i)^2.

    Same float32 arithmetic as llama.cpp's iq3_find_best_neighbour: with sq[l] = scale*(2l+1),
    each term is (waux_i * diff) * diff, diff = sq[l_i] - x_i, summed left to right from 0,
    and the first strict minimum wins (neighbours are listed by distance, then index).
    The 4 x 8 possible terms are computed once per call.
    """
    for i in range(4):
        w = waux[off + i]
        x = xval[off + i]
        for l in range(8):
            diff = sq[l] - x
            terms[i, l] = w * diff * diff
    best_d2 = np.float32(3.4028234663852886e38)
    best = -1
    s = nb_start[u]
    for j in range(s, s + nb_count[u]):
        d2 = _F0 + terms[0, nb_lev[j, 0]]
        d2 += terms[1, nb_lev[j, 1]]
        d2 += terms[2, nb_lev[j, 2]]
        d2 += terms[3, nb_lev[j, 3]]
        if d2 < best_d2:
            best_d2 = d2
            best = nb_list[j]
    return best


@njit(cache=True)
def _quantize_block(xbl, qw, has_qw, out, grid_levels, kmap, nb_start, nb_count, nb_list, nb_lev,
                    weight, xval, waux, L, Laux, scales, signs_word, terms, sq, wx, wq2):
    """Quantize 256 floats into out[0:96] (everything after d); returns the f32 value of d."""
    for i in range(96):
        out[i] = 0
    sumx2 = _F0
    for i in range(QK_K):
        sumx2 += xbl[i] * xbl[i]
    sigma2 = _F2 * sumx2 / _FQK
    max_scale = _F0
    is_on_grid = np.empty(8, dtype=np.bool_)
    is_on_grid_aux = np.empty(8, dtype=np.bool_)
    block_signs = np.empty(4, dtype=np.int32)
    for ib in range(8):
        signs_word[ib] = 0
        base = 32 * ib
        if has_qw:
            for i in range(32):
                x = xbl[base + i]
                weight[i] = qw[base + i] * np.sqrt(sigma2 + x * x)
        else:
            for i in range(32):
                x = xbl[base + i]
                weight[i] = x * x
        for i in range(32):
            waux[i] = np.sqrt(weight[i])
        for k in range(4):
            nflip = 0
            s = 0
            for i in range(8):
                x = xbl[base + 8 * k + i]
                if x >= _F0:
                    xval[8 * k + i] = x
                else:
                    xval[8 * k + i] = -x
                    nflip += 1
                    s |= 1 << i
            if nflip % 2 == 1:
                imin = 0
                x = xbl[base + 8 * k]
                mn = weight[8 * k] * x * x
                for i in range(1, 8):
                    x = xbl[base + 8 * k + i]
                    ax = weight[8 * k + i] * x * x
                    if ax < mn:
                        mn = ax
                        imin = i
                xval[8 * k + imin] = -xval[8 * k + imin]
                s ^= 1 << imin
            block_signs[k] = s & 127
        mx = xval[0]
        for i in range(1, 32):
            if xval[i] > mx:
                mx = xval[i]
        for i in range(32):
            L[i] = 0
        if mx < _EPS:
            scales[ib] = _F0
            continue
        for i in range(32):
            w = weight[i]
            wx[i] = w * xval[i]
            for l in range(8):
                q = np.float32(2 * l + 1)
                wq2[i, l] = w * q * q
        best = _F0
        scale = mx / _F15
        for k in range(8):
            is_on_grid[k] = True
        for istep in range(-15, 16):
            idv = (_F15 + np.float32(istep) * _F02) / mx
            this_scale = _F1 / idv
            for l in range(8):
                sq[l] = this_scale * np.float32(2 * l + 1)
            for k in range(8):
                u = 0
                for i in range(4):
                    l = _nearest_int(_FHALF * (idv * xval[4 * k + i] - _F1))
                    if l < 0:
                        l = 0
                    elif l > _KMAXQ - 1:
                        l = _KMAXQ - 1
                    Laux[4 * k + i] = l
                    u |= l << (3 * i)
                if kmap[u] >= 0:
                    is_on_grid_aux[k] = True
                else:
                    is_on_grid_aux[k] = False
                    g = _best_neighbour(u, xval, waux, 4 * k, sq, nb_start, nb_count, nb_list, nb_lev, terms)
                    for i in range(4):
                        Laux[4 * k + i] = grid_levels[g, i]
            sumqx = _F0
            sumq2 = _F0
            for i in range(32):
                l = Laux[i]
                sumqx += wx[i] * np.float32(2 * l + 1)
                sumq2 += wq2[i, l]
            if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                for i in range(32):
                    L[i] = Laux[i]
                for k in range(8):
                    is_on_grid[k] = is_on_grid_aux[k]
        n_not_ongrid = 0
        for k in range(8):
            if not is_on_grid[k]:
                n_not_ongrid += 1
        if n_not_ongrid > 0 and scale > _F0:
            idv = _F1 / scale
            for l in range(8):
                sq[l] = scale * np.float32(2 * l + 1)
            for k in range(8):
                if is_on_grid[k]:
                    continue
                u = 0
                for i in range(4):
                    l = _nearest_int(_FHALF * (idv * xval[4 * k + i] - _F1))
                    if l < 0:
                        l = 0
                    elif l > _KMAXQ - 1:
                        l = _KMAXQ - 1
                    u |= l << (3 * i)
                g = kmap[u]
                if g < 0:
                    g = _best_neighbour(u, xval, waux, 4 * k, sq, nb_start, nb_count, nb_list, nb_lev, terms)
                for i in range(4):
                    L[4 * k + i] = grid_levels[g, i]
            sumqx = _F0
            sumq2 = _F0
            for i in range(32):
                w = weight[i]
                q = np.float32(2 * L[i] + 1)
                sumqx += w * xval[i] * q
                sumq2 += w * q * q
            if sumq2 > _F0:
                scale = sumqx / sumq2
        if scale < _F0:
            scale = -scale
            for k in range(4):
                block_signs[k] = (~block_signs[k]) & 127
        for k in range(8):
            u = 0
            for i in range(4):
                u |= int(L[4 * k + i]) << (3 * i)
            g = kmap[u]
            # every L written above comes from a grid point, so g >= 0
            out[8 * ib + k] = g
        signs_word[ib] = block_signs[0] | (block_signs[1] << 7) | (block_signs[2] << 14) | (block_signs[3] << 21)
        scales[ib] = scale
        if scale > max_scale:
            max_scale = scale
    if max_scale == _F0:
        for i in range(96):
            out[i] = 0
        return _F0
    d = max_scale / _F31
    idd = _F1 / d
    for ib in range(8):
        l = _nearest_int(_FHALF * (idd * scales[ib] - _F1))
        if l < 0:
            l = 0
        elif l > 15:
            l = 15
        word = signs_word[ib] | (l << 28)
        for b in range(4):
            out[64 + 4 * ib + b] = (word >> (8 * b)) & 0xFF
    return d * _FUDGE


@njit(cache=True, parallel=True)
def _quantize_rows(rows, qw, has_qw, out, dvals, grid_levels, kmap, nb_start, nb_count, nb_list, nb_lev):
    n_rows, n_cols = rows.shape
    nb = n_cols // QK_K
    for r in prange(n_rows):
        weight = np.empty(32, dtype=np.float32)
        xval = np.empty(32, dtype=np.float32)
        waux = np.empty(32, dtype=np.float32)
        L = np.empty(32, dtype=np.int8)
        Laux = np.empty(32, dtype=np.int8)
        scales = np.empty(8, dtype=np.float32)
        signs_word = np.empty(8, dtype=np.int64)
        terms = np.empty((4, 8), dtype=np.float32)
        sq = np.empty(8, dtype=np.float32)
        wx = np.empty(32, dtype=np.float32)
        wq2 = np.empty((32, 8), dtype=np.float32)
        for b in range(nb):
            xbl = rows[r, b * QK_K:(b + 1) * QK_K]
            qwb = qw[b * QK_K:(b + 1) * QK_K] if has_qw else qw
            ob = out[r, b * BLOCK_BYTES + 2:(b + 1) * BLOCK_BYTES]
            dvals[r, b] = _quantize_block(xbl, qwb, has_qw, ob, grid_levels, kmap,
                                          nb_start, nb_count, nb_list, nb_lev,
                                          weight, xval, waux, L, Laux, scales, signs_word, terms, sq, wx, wq2)


# ------------------------------------------------------------------------------ refinement pass
# llama.cpp picks each sub-block's grid points at its own unrounded best scale, then rounds that scale
# to 4 bits (and assumes magnitudes 2l+1 where the grid's largest is 15.5, byte 62): the points are
# no longer the best ones for the scale actually stored. This pass keeps llama.cpp's scales and signs
# and re-picks every group's grid point for the stored scale, minimising the importance-weighted
# squared error among the grid points near the group's lattice code (the current point competes, so
# no row's error can rise). Measured (docs/quantize.md), 1.5B all-IQ3_XXS with our imatrix: PPL
# 4.6042 -> 4.5793, mean KL vs Q4_K_M 0.2386 -> 0.2284. Re-fitting the 4-bit scales as well lowered
# the weighted error more but raised the perplexity to 4.6660: llama.cpp stores d x 1.0125 on
# purpose and a least-squares refit undoes that, so the scales stay.

_IQ3_BYTES = np.array([4, 12, 20, 28, 36, 44, 52, 62], dtype=np.float32)   # magnitude of level l


def _candidate_tables():
    """For each lattice code (4096): the grid points within squared level distance (nearest + 4) of it,
    as CSR (start [4097], list). 8.7 candidates on average instead of all 256; on the fixture rows the
    result equals the exhaustive search's."""
    codes = np.arange(4096)
    lat = np.stack([(codes >> (3 * i)) & 7 for i in range(4)], axis=1)
    d2 = ((lat[:, None, :] - GRID_LEVELS[None, :, :].astype(np.int64)) ** 2).sum(axis=2)
    near = d2 <= d2.min(axis=1, keepdims=True) + 4
    start = np.zeros(4097, dtype=np.int32)
    start[1:] = np.cumsum(near.sum(axis=1))
    return start, np.nonzero(near)[1].astype(np.int16)


_CAND_START, _CAND_LIST = _candidate_tables()


@njit(cache=True, inline="always")
def _pick_points(xs, ww, db, grid_levels, cand_start, cand_list, out, o, terms):
    # per group of 4: the grid point near the group's lattice code minimising sum w_i (db * byte_i - xs_i)^2
    inv = _F1 / (np.float32(4.0) * db)
    for k in range(8):
        u = 0
        for i in range(4):
            w = ww[4 * k + i]
            x = xs[4 * k + i]
            for lev in range(8):
                e = db * _IQ3_BYTES[lev] - x
                terms[i, lev] = w * e * e
            l = _nearest_int(_FHALF * (x * inv - _F1))
            l = 0 if l < 0 else (_KMAXQ - 1 if l > _KMAXQ - 1 else l)
            u |= l << (3 * i)
        best = out[o + k]                  # the current point competes too: the error never rises
        best_e = (terms[0, grid_levels[best, 0]] + terms[1, grid_levels[best, 1]]
                  + terms[2, grid_levels[best, 2]] + terms[3, grid_levels[best, 3]])
        for j in range(cand_start[u], cand_start[u + 1]):
            g = cand_list[j]
            e = (terms[0, grid_levels[g, 0]] + terms[1, grid_levels[g, 1]]
                 + terms[2, grid_levels[g, 2]] + terms[3, grid_levels[g, 3]])
            if e < best_e:
                best_e = e
                best = g
        out[o + k] = best


@njit(cache=True, parallel=True)
def _refine_rows(rows, qw, has_qw, out, dvals, grid_levels, ksigns, cand_start, cand_list):
    # out: llama.cpp's bytes, rewritten in place (grid indices only)
    n_rows, n_cols = rows.shape
    nb = n_cols // QK_K
    for r in prange(n_rows):
        xs = np.empty(32, dtype=np.float32)
        ww = np.empty(32, dtype=np.float32)
        terms = np.empty((4, 8), dtype=np.float32)
        for b in range(nb):
            d = dvals[r, b]
            if d == _F0:
                continue
            base = b * QK_K
            ob = b * BLOCK_BYTES
            sumx2 = _F0
            for i in range(QK_K):
                sumx2 += rows[r, base + i] * rows[r, base + i]
            sigma2 = _F2 * sumx2 / _FQK
            for ib in range(8):
                p = ob + 66 + 4 * ib
                aux = (np.uint32(out[r, p]) | (np.uint32(out[r, p + 1]) << 8) | (np.uint32(out[r, p + 2]) << 16)
                       | (np.uint32(out[r, p + 3]) << 24))
                for l in range(4):
                    sg = ksigns[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                    for k in range(8):
                        j = 8 * l + k
                        x = rows[r, base + 32 * ib + j]
                        xs[j] = -x if (sg >> k) & 1 else x
                        # with an imatrix its entry: the error the importance matrix defines (and
                        # the golden fixtures measure); without one sqrt(sigma2 + x^2), llama.cpp's
                        # formula with a flat imatrix (its x^2 lets small weights go anywhere once
                        # the lattice rounding is gone)
                        ww[j] = qw[base + 32 * ib + j] if has_qw else np.sqrt(sigma2 + x * x)
                db = d * (_FHALF + np.float32(aux >> np.uint32(28))) * _FHALF
                _pick_points(xs, ww, db, grid_levels, cand_start, cand_list, out[r], ob + 2 + 8 * ib, terms)


def quantize_iq3_xxs(rows: np.ndarray, imatrix: np.ndarray | None = None, refine: bool = True) -> np.ndarray:
    """rows: float32 [n_rows, n_cols] (n_cols % 256 == 0) -> uint8 [n_rows, n_cols/256*98].
    refine=False: llama.cpp's bytes exactly; True (default): then the refinement pass above."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n_rows, n_cols = rows.shape
    if n_cols % QK_K:
        raise ValueError(f"IQ3_XXS rows must be a multiple of {QK_K} weights, got {n_cols}")
    nb = n_cols // QK_K
    has_qw = imatrix is not None
    if has_qw:
        qw = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if qw.shape[0] != n_cols:
            raise ValueError(f"imatrix has {qw.shape[0]} entries, rows have {n_cols}")
    else:
        qw = np.zeros(QK_K, dtype=np.float32)
    out = np.zeros((n_rows, nb * BLOCK_BYTES), dtype=np.uint8)
    dvals = np.zeros((n_rows, nb), dtype=np.float32)
    if n_rows:
        _quantize_rows(rows, qw, has_qw, out, dvals, GRID_LEVELS, KMAP, NB_START, NB_COUNT, NB_LIST, NB_LEV)
    d16 = dvals.astype(np.float16)
    out.reshape(n_rows, nb, BLOCK_BYTES)[:, :, 0:2] = d16.view(np.uint8).reshape(n_rows, nb, 2)
    if refine and n_rows:
        _refine_rows(rows, qw, has_qw, out, d16.astype(np.float32), GRID_LEVELS, _KSIGNS, _CAND_START, _CAND_LIST)
    return out
