"""Paged int8 KV cache and causal attention over it (Numba, CPU).

KV cache layout, per layer (kernels/kv_layout.py):
    k_pages  int8    (n_pages, page_size, n_kv_heads, head_dim)
    k_scales float32 (n_pages, page_size, n_kv_heads, n_groups)
    v_pages / v_scales: same.
Sequence ``s`` keeps position ``p`` at page ``page_tables[s, p // page_size]``, slot
``p % page_size``.  Each group of head_dim / n_groups channels of a (token, kv head) row is
quantized symmetrically: ``scale = max|x| / 127``, ``q = round_half_away_from_zero(x / scale)``
clipped to [-127, 127] (an all-zero group gets scale 0 and q 0), so ``x ~= q * scale``.

``attention`` is a flash-attention-style kernel:
  * work item = (tile of up to ``_TILE_Q`` consecutive query tokens of one sequence,
    kv head[, key split]); the tile's queries are all the query heads of that kv head's
    GQA group for those tokens, so each dequantized K/V block is reused by
    tile_tokens * group_size query rows;
  * keys are processed in blocks of ``_BK`` positions: the block's scores for every query row
    (float path: K dequantized (int8 * scale -> float32) into a row buffer, then per eight keys
    one 8-lane accumulator a key over the channels and one reduction tree for the eight
    (attention_int8.scores_float; head sizes that are not whole 8-channel chunks: dot products
    register-blocked 2 rows x 2 keys); integer paths: the int8 rows gathered, integer dots,
    below), V dequantized into a row buffer, then for every query row online softmax in
    float32 (running max / running sum, base-2 with log2(e) folded into the query's
    scale; the block's probabilities kept per row), then acc += P @ V for all rows at once, a
    group of rows' accumulators in registers over the block (attention_pv.py; one fused
    multiply-add per (row, channel, key) in key order);
  * exp2 is a branch-free polynomial (Taylor degree 6 on [-0.5, 0.5], rel. error
    < 2e-7) that LLVM vectorizes, ~7x faster than calling libm expf per score;
  * items are spread over threads longest-first (greedy least-loaded), because causal
    prefill items have very different costs; when there are fewer items than threads
    (small decode batches) the key range is split and partial results merged
    (flash-decoding).

Batch invariance: a query's result does not depend on what else is in the call (other
sequences, how its own prompt was chunked, how many threads split its keys). Keys are always
processed in fixed chunks of ``_CHUNK_KEYS`` absolute positions; each chunk's softmax state
starts fresh and the chunks are folded left to right by one function (``_fold``), whether one
thread folds them as it goes or a split writes them out for ``merge_one``. Numba compiles a
callee with its caller's fast-math flags (and its own), so a work item (``_make_item``) and
``merge_one`` carry the kernel's flags themselves, whoever calls them: with plain flags ``_fold``
was not contracted to FMAs where the kernel's was, and a split query differed from the unsplit one
in the last bit (1 KV head, 2 threads; 2026-12-02).

The scores q.k of a block have three paths (``QK_PATHS``, chosen by ``qk_path``): the K block
dequantized to float32 and multiplied with the float query ("float", the default), or integer dot
products of the int8 K rows with the query rounded per 32 channels to int16 ("int16") or to int8 as
ggml rounds activations ("int8"; attention_int8.py), taken with STRATA_LITE_ATTN_QK=int16|int8.
The integer paths measured 10-21% faster (docs/cpu.md, "CPU attention at long context") but a
score's error grows with the largest |q| of its group: the engine folds K's smoothing scales into q
(|q| up to 7,353 in the tiny test model's second layer), and there int16 put its logits 0.9% of
their spread off the float64 reference (float: 3e-6; tests/engine/test_api.py allows 1e-4).
"""
import math
import os

import numba
import numpy as np
from numba import njit, prange

from .attention_pv import CHUNK as PV_CHUNK, pv_rows
from .attention_int8 import (GROUP, dequant_key, quantize_row, quantize_row16, scores_float, scores_int16,
                             scores_int8)
from .elementwise import exp2_poly
from .isa import int8_enabled
from ..kv_layout import KV_GROUP, kv_scale_groups

__all__ = ["kv_store", "attention", "attention_nocheck", "qk_path", "QK_PATHS"]

_BK = 64          # key positions per block (compile-time constant)
_TILE_Q = 16      # query tokens per work item (times group size query rows)
_CHUNK_KEYS = 512       # keys per softmax chunk (fixed positions: the unit of a key split)
_NEG = np.float32(-1.0e30)   # finite "-inf" (fastmath assumes no infinities)
_LOG2E = 1.4426950408889634

# fastmath without 'arcp' / 'nnan' / 'ninf': reassociation and contraction (for
# vectorized reductions and FMAs) only.
_FM = {"reassoc", "contract", "nsz"}
QK_PATHS = ("float", "int8", "int16")     # how a block's scores q.k are computed (_KERNELS)


# ----------------------------------------------------------------------------- kv_store

@njit(cache=True, inline="always")
def _store_row(x, pages, scales, page, slot, h):
    gs = x.shape[0] // scales.shape[3]
    for gi in range(scales.shape[3]):
        lo = gi * gs
        amax = np.float32(0.0)
        for i in range(lo, lo + gs):
            a = abs(x[i])
            if a > amax:
                amax = a
        sc = amax / np.float32(127.0)
        scales[page, slot, h, gi] = sc
        if sc == 0.0:
            for i in range(lo, lo + gs):
                pages[page, slot, h, i] = 0
            continue
        for i in range(lo, lo + gs):
            y = x[i] / sc
            r = np.float32(math.trunc(y))
            if abs(y - r) >= np.float32(0.5):       # exact in float32: round half away
                r += np.float32(1.0) if y > 0 else np.float32(-1.0)
            if r > 127.0:
                r = np.float32(127.0)
            elif r < -127.0:
                r = np.float32(-127.0)
            pages[page, slot, h, i] = np.int8(r)


@njit(cache=True, inline="always")
def _store_token(t, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales):
    ps = k_pages.shape[1]
    pos = token_pos[t]
    page = page_tables[token_seq[t], pos // ps]
    slot = pos % ps
    for h in range(k.shape[1]):
        _store_row(k[t, h], k_pages, k_scales, page, slot, h)
        _store_row(v[t, h], v_pages, v_scales, page, slot, h)


@njit(cache=True, parallel=True)
def _kv_store_par(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales):
    for t in prange(k.shape[0]):
        _store_token(t, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales)


@njit(cache=True)
def _kv_store_ser(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales):
    for t in range(k.shape[0]):
        _store_token(t, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales)


# ----------------------------------------------------------------------------- validation

def _req(arr, name, dtype, ndim):
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _check_cache(token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, n_tok, n_kv, hd):
    _req(token_seq, "token_seq", np.int32, 1)
    _req(token_pos, "token_pos", np.int32, 1)
    _req(page_tables, "page_tables", np.int32, 2)
    _req(k_pages, "k_pages", np.int8, 4)
    _req(v_pages, "v_pages", np.int8, 4)
    _req(k_scales, "k_scales", np.float32, 4)
    _req(v_scales, "v_scales", np.float32, 4)
    if token_seq.shape[0] != n_tok or token_pos.shape[0] != n_tok:
        raise ValueError(f"token_seq {token_seq.shape} / token_pos {token_pos.shape} must have length n_tok={n_tok}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages {v_pages.shape} != k_pages {k_pages.shape}")
    want = k_pages.shape[:3] + (kv_scale_groups(hd),)
    if k_scales.shape != want or v_scales.shape != want:
        raise ValueError(f"k_scales {k_scales.shape} / v_scales {v_scales.shape} must be {want}")
    if k_pages.shape[2] != n_kv or k_pages.shape[3] != hd:
        raise ValueError(f"k_pages {k_pages.shape} does not match n_kv_heads={n_kv}, head_dim={hd}")
    if k_pages.shape[1] < 1:
        raise ValueError("page_size must be >= 1")


@njit(cache=True)
def _check_indices(token_seq, token_pos, page_tables, n_pages, page_size):
    """0 if every (seq, pos) and every page it (and its prefix) lives in is valid, else an error code."""
    n_seqs, max_pages = page_tables.shape
    maxpos = np.full(n_seqs, -1, np.int64)
    for t in range(token_seq.shape[0]):
        s = token_seq[t]
        p = token_pos[t]
        if s < 0 or s >= n_seqs:
            return 1
        if p < 0 or p >= max_pages * page_size:
            return 2
        if p > maxpos[s]:
            maxpos[s] = p
    for s in range(n_seqs):
        if maxpos[s] >= 0:
            for i in range(maxpos[s] // page_size + 1):
                pg = page_tables[s, i]
                if pg < 0 or pg >= n_pages:
                    return 3
    return 0


_INDEX_ERRORS = {1: "token_seq out of range of page_tables rows",
                 2: "token_pos negative or beyond the page table's capacity",
                 3: "page_tables entry (for a used position) out of range of the pages"}


def _raise_index_error(code):
    if code:
        raise ValueError(_INDEX_ERRORS[code])


def kv_store(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales):
    """Quantize k, v (n_tok, n_kv_heads, head_dim) f32 to int8 and store them at
    (token_seq[t], token_pos[t]) in the paged cache (written in place)."""
    _req(k, "k", np.float32, 3)
    _req(v, "v", np.float32, 3)
    if v.shape != k.shape:
        raise ValueError(f"v {v.shape} != k {k.shape}")
    n_tok, n_kv, hd = k.shape
    _check_cache(token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, n_tok, n_kv, hd)
    _raise_index_error(_check_indices(token_seq, token_pos, page_tables, k_pages.shape[0], k_pages.shape[1]))
    if n_tok == 0:
        return
    fn = _kv_store_par if n_tok * n_kv * hd >= 8192 else _kv_store_ser
    fn(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales)


# ----------------------------------------------------------------------------- attention

@njit(cache=True)
def _plan(token_seq, token_pos, n_kv, n_threads, tile_q, chunk):
    """Tiles of consecutive same-sequence tokens, the key split count, and a
    longest-first greedy assignment of work items to threads (CSR lists)."""
    n_tok = token_seq.shape[0]
    tstart = np.empty(n_tok, np.int64)
    tend = np.empty(n_tok, np.int64)
    nt = 0
    t = 0
    while t < n_tok:
        e = t + 1
        while e < n_tok and e - t < tile_q and token_seq[e] == token_seq[t]:
            e += 1
        tstart[nt] = t
        tend[nt] = e
        nt += 1
        t = e
    # key split: only when there are fewer (tile, kv head) items than threads
    maxkeys = 0
    for t in range(n_tok):
        if token_pos[t] + 1 > maxkeys:
            maxkeys = token_pos[t] + 1
    n_split = 1
    base_items = nt * n_kv
    if base_items < n_threads:
        n_split = (n_threads + base_items - 1) // base_items
        lim = (maxkeys + chunk - 1) // chunk
        if n_split > lim:
            n_split = lim
    n_items = base_items * n_split
    cost = np.empty(n_items, np.float64)
    for it in range(n_items):
        ti = it // (n_kv * n_split)
        kmax = 0
        for t in range(tstart[ti], tend[ti]):
            if token_pos[t] + 1 > kmax:
                kmax = token_pos[t] + 1
        cost[it] = (kmax / n_split + 64.0) * (tend[ti] - tstart[ti] + 1.0)
    order = np.argsort(-cost)
    load = np.zeros(n_threads, np.float64)
    owner = np.empty(n_items, np.int64)
    counts = np.zeros(n_threads + 1, np.int64)
    for i in range(n_items):
        it = order[i]
        best = 0
        for th in range(1, n_threads):
            if load[th] < load[best]:
                best = th
        load[best] += cost[it]
        owner[it] = best
        counts[best + 1] += 1
    for th in range(n_threads):
        counts[th + 1] += counts[th]
    fill = counts[:n_threads].copy()
    items = np.empty(n_items, np.int64)
    for i in range(n_items):
        it = order[i]
        th = owner[it]
        items[fill[th]] = it
        fill[th] += 1
    return tstart[:nt].copy(), tend[:nt].copy(), n_split, items, counts


@njit(cache=True, inline="always")
def _exp2_block(s, p, pbits, ebits):
    """p[j] = 2**s[j] for s[j] <= 0 (clamped below at -126), vectorizable."""
    for j in range(_BK):
        x = max(s[j], np.float32(-126.0))
        n = np.floor(x + np.float32(0.5))
        f = x - n                                   # [-0.5, 0.5]
        p[j] = exp2_poly(f)
        ebits[j] = np.int32(n) << 23
    for j in range(_BK):
        pbits[j] += ebits[j]


# The two ways to score a block of keys (attention_int8.py; `_make_kernel` builds a kernel with one).
# prep: query row x (head_dim,) -> row r of the path's query buffers (float: Qs = x * qscale; int8 /
# int16: Qi / Qd, the rounded query). keys: the block's K (positions kb .. kb + nk - 1 of the sequence,
# kv head g) -> S[:rows, :_BK]; keys past nk score 0 (the caller masks them).

@njit(cache=True, inline="always")
def _prep_float(x, qscale, Qs, Qi, Qd, r):
    for d in range(x.shape[0]):
        Qs[r, d] = x[d] * qscale


@njit(cache=True, inline="always")
def _prep_int8(x, qscale, Qs, Qi, Qd, r):
    quantize_row(x, Qi, Qd, r, qscale)


@njit(cache=True, inline="always")
def _dequant_rows(pages, scales, page_tables, seq, g, kb, nk, buf):
    """Positions [kb, kb + nk) of kv head g of one sequence's K or V cache -> buf[:nk] (float32 rows, q * scale
    per group), buf[nk:_BK] zeroed."""
    ps = pages.shape[1]
    hd = pages.shape[3]
    ng = scales.shape[3]
    gs = hd // ng
    for j in range(nk):
        kp = kb + j
        page = page_tables[seq, kp // ps]
        if gs == KV_GROUP:          # 32 channels a scale (every head_dim multiple of 32): vector conversions
            dequant_key(pages, scales, page, kp % ps, g, buf, j)
            continue
        # 1-D row views first: indexing the 4-D cache inside the d loop kept it scalar
        # (decode, 600 keys, 12 heads: 210 -> 87 us per layer)
        row = pages[page, kp % ps, g]
        scr = scales[page, kp % ps, g]
        bj = buf[j]
        for gi in range(ng):
            sc = scr[gi]
            o = gi * gs
            for d in range(gs):
                bj[o + d] = np.float32(row[o + d]) * sc
    for j in range(nk, _BK):
        for d in range(hd):
            buf[j, d] = 0.0


@njit(cache=True, inline="always")
def _keys_float(k_pages, k_scales, page_tables, seq, g, kb, nk, Qs, Qi, Qd, rows, rpos, Kb, Kq, Kst, S):
    _dequant_rows(k_pages, k_scales, page_tables, seq, g, kb, nk, Kb)
    hd = k_pages.shape[3]
    if hd % 8 == 0:                               # eight keys a reduction tree (attention_int8.scores_float)
        scores_float(Qs, Kb, S, rows)
        return
    # other head sizes: S = Qs @ Kb^T, register-blocked 2 rows x 2 keys (shared loads)
    for r in range(0, rows, 2):
        r1 = min(r + 1, rows - 1)                 # odd tail: duplicate last row
        if rpos[r] < kb and rpos[r1] < kb:        # both rows fully masked here
            continue
        for j in range(0, _BK, 2):
            a00 = np.float32(0.0)
            a01 = np.float32(0.0)
            a10 = np.float32(0.0)
            a11 = np.float32(0.0)
            for d in range(hd):
                q0 = Qs[r, d]
                q1 = Qs[r1, d]
                k0 = Kb[j, d]
                k1 = Kb[j + 1, d]
                a00 += q0 * k0
                a01 += q0 * k1
                a10 += q1 * k0
                a11 += q1 * k1
            S[r, j] = a00
            S[r, j + 1] = a01
            S[r1, j] = a10
            S[r1, j + 1] = a11


@njit(cache=True, inline="always")
def _prep_int16(x, qscale, Qs, Qi, Qd, r):
    quantize_row16(x, Qi, Qd, r, qscale)


@njit(cache=True, inline="always")
def _keys_int16(k_pages, k_scales, page_tables, seq, g, kb, nk, Qs, Qi, Qd, rows, rpos, Kb, Kq, Kst, S):
    _gather_int(k_pages, k_scales, page_tables, seq, g, kb, nk, Kq, Kst)
    scores_int16(Qi, Qd, Kq, Kst, S, rows)


@njit(cache=True, inline="always")
def _keys_int8(k_pages, k_scales, page_tables, seq, g, kb, nk, Qs, Qi, Qd, rows, rpos, Kb, Kq, Kst, S):
    _gather_int(k_pages, k_scales, page_tables, seq, g, kb, nk, Kq, Kst)
    scores_int8(Qi, Qd, Kq, Kst, S, rows)


@njit(cache=True, inline="always")
def _gather_int(k_pages, k_scales, page_tables, seq, g, kb, nk, Kq, Kst):
    ps = k_pages.shape[1]
    hd = k_pages.shape[3]
    for j in range(nk):                           # the block's int8 rows, as Kq's type (int16: sign-extended)
        kp = kb + j
        page = page_tables[seq, kp // ps]
        krow = k_pages[page, kp % ps, g]
        kscr = k_scales[page, kp % ps, g]
        kqj = Kq[j]
        for d in range(hd):
            kqj[d] = krow[d]
        for gi in range(Kst.shape[0]):
            Kst[gi, j] = kscr[gi]
    for j in range(nk, _BK):
        for d in range(hd):
            Kq[j, d] = 0
        for gi in range(Kst.shape[0]):
            Kst[gi, j] = 0.0


_FLOAT_KEYS, _INT8_KEYS, _INT16_KEYS = range(3)     # how a kernel scores keys: the prep / keys pairs above


@njit(inline="always")
def _prep(kind, q, qscale, Qs, Qi, Qd, r):
    if kind == _FLOAT_KEYS:
        _prep_float(q, qscale, Qs, Qi, Qd, r)
    elif kind == _INT8_KEYS:
        _prep_int8(q, qscale, Qs, Qi, Qd, r)
    else:
        _prep_int16(q, qscale, Qs, Qi, Qd, r)


@njit(inline="always")
def _keys(kind, k_pages, k_scales, page_tables, seq, g, kb, nk, Qs, Qi, Qd, rows, rpos, Kb, Kq, Kst, S):
    if kind == _FLOAT_KEYS:
        _keys_float(k_pages, k_scales, page_tables, seq, g, kb, nk, Qs, Qi, Qd, rows, rpos, Kb, Kq, Kst, S)
    elif kind == _INT8_KEYS:
        _keys_int8(k_pages, k_scales, page_tables, seq, g, kb, nk, Qs, Qi, Qd, rows, rpos, Kb, Kq, Kst, S)
    else:
        _keys_int16(k_pages, k_scales, page_tables, seq, g, kb, nk, Qs, Qi, Qd, rows, rpos, Kb, Kq, Kst, S)


def _make_item(kind, qdtype):
    """Work item `it` of _plan's numbering (query tile, kv head, key split) of the attention kernel with one way
    to score keys (kind: _FLOAT_KEYS ..., the prep / keys pairs above; qdtype: the query's integer type). Its
    own compiled function with the kernel's fast-math flags, so that every caller (the kernel below,
    kernels/cpu/decode_block_shared.py) runs the same code: the same bits. The closure holds the kind as an
    int, not the functions: Numba's cache key hashes a closure's pickled contents, and a
    jitted function pickles with an id new in every process (every process would compile it again)."""
    @njit(cache=True, fastmath=_FM)
    def item(it, q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, qscale, out,
             tstart, tend, n_split, part_acc, part_m, part_l):
        hd = q.shape[2]
        n_kv = k_pages.shape[2]
        G = q.shape[1] // n_kv
        ng = k_scales.shape[3]
        max_rows = _TILE_Q * G
        # its work arrays, allocated here: passed in from the caller, the compiled loops lose what they know of
        # local arrays (one decode token over 4,096 keys of the default model's shape took 255 against 216 us)
        Qs = np.empty((max_rows, hd), np.float32)
        Qi = np.empty((max_rows, hd), qdtype)
        Qd = np.empty((max_rows, ng), np.float32)
        acc = np.empty((max_rows, hd), np.float32)
        m = np.empty(max_rows, np.float32)
        l = np.empty(max_rows, np.float32)
        acc_run = np.empty((max_rows, hd), np.float32)     # the chunks folded so far (n_split == 1)
        m_run = np.empty(max_rows, np.float32)
        l_run = np.empty(max_rows, np.float32)
        rpos = np.empty(max_rows, np.int64)
        Kb = np.zeros((_BK, hd), np.float32)
        Kq = np.zeros((_BK, hd), qdtype)
        Kst = np.zeros((ng, _BK), np.float32)
        S = np.empty((max_rows, _BK), np.float32)
        P = np.empty((max_rows, _BK), np.float32)
        Vb = np.zeros((_BK, hd), np.float32)
        s = np.empty(_BK, np.float32)
        p = np.empty(_BK, np.float32)
        pbits = p.view(np.int32)
        ebits = np.empty(_BK, np.int32)
        sp = it % n_split
        g = (it // n_split) % n_kv
        ti = it // (n_split * n_kv)
        t0 = tstart[ti]
        ntq = tend[ti] - t0
        seq = token_seq[t0]
        rows = ntq * G
        kmax = 0
        for a in range(ntq):
            pos = token_pos[t0 + a]
            if pos + 1 > kmax:
                kmax = pos + 1
            for hh in range(G):
                r = a * G + hh
                rpos[r] = pos
                _prep(kind, q[t0 + a, g * G + hh], qscale, Qs, Qi, Qd, r)
        for r in range(rows):
            m_run[r] = _NEG
            l_run[r] = 0.0
            for d in range(hd):
                acc_run[r, d] = 0.0
        # this split's chunks of keys
        nchunk = (kmax + _CHUNK_KEYS - 1) // _CHUNK_KEYS
        cper = (nchunk + n_split - 1) // n_split
        for c in range(sp * cper, min(nchunk, (sp + 1) * cper)):
            for r in range(rows):
                m[r] = _NEG
                l[r] = 0.0
                for d in range(hd):
                    acc[r, d] = 0.0
            k_lo = c * _CHUNK_KEYS
            k_hi = min(kmax, k_lo + _CHUNK_KEYS)
            for kb in range(k_lo, k_hi, _BK):
                nk = min(_BK, k_hi - kb)
                _keys(kind, k_pages, k_scales, page_tables, seq, g, kb, nk, Qs, Qi, Qd, rows, rpos, Kb, Kq, Kst, S)
                _dequant_rows(v_pages, v_scales, page_tables, seq, g, kb, nk, Vb)
                for r in range(rows):     # each row's online softmax: P[r] (0 where masked), acc rescaled
                    nvalid = min(nk, rpos[r] + 1 - kb)
                    if nvalid <= 0:
                        for j in range(_BK):
                            P[r, j] = 0.0
                        continue
                    mold = m[r]
                    if nvalid < _BK:
                        for j in range(nvalid, _BK):
                            S[r, j] = _NEG
                    mx = mold
                    for j in range(_BK):
                        v = S[r, j]
                        mx = v if v > mx else mx
                    for j in range(_BK):
                        s[j] = S[r, j] - mx
                    _exp2_block(s, p, pbits, ebits)
                    for j in range(nvalid, _BK):
                        p[j] = 0.0
                    psum = np.float32(0.0)
                    for j in range(_BK):
                        psum += p[j]
                        P[r, j] = p[j]
                    if mx > mold:
                        corr = np.float32(np.exp2(max(mold - mx, np.float32(-126.0))))
                        l[r] = l[r] * corr + psum
                        for d in range(hd):
                            acc[r, d] *= corr
                        m[r] = mx
                    else:
                        l[r] += psum
                # acc += P @ Vb (P is 0 beyond nvalid, Vb is 0 beyond nk): rows register-blocked
                # (attention_pv.py), one fma chain per (row, channel) in key order
                if hd % PV_CHUNK == 0:
                    pv_rows(acc, P, Vb, rows)
                else:
                    for r in range(rows):
                        for j in range(_BK):
                            pj = P[r, j]
                            for d in range(hd):
                                acc[r, d] = np.float32(pj * Vb[j, d] + acc[r, d])
            for a in range(ntq):
                for hh in range(G):
                    r = a * G + hh
                    if n_split == 1:
                        _fold(m_run, l_run, acc_run[r], r, m[r], l[r], acc[r])
                    else:
                        h = g * G + hh
                        part_m[c, t0 + a, h] = m[r]
                        part_l[c, t0 + a, h] = l[r]
                        for d in range(hd):
                            part_acc[c, t0 + a, h, d] = acc[r, d]
        if n_split == 1:
            for a in range(ntq):
                for hh in range(G):
                    r = a * G + hh
                    _finish(l_run[r], acc_run[r], out[t0 + a, g * G + hh])
    return item


ITEM_FLOAT, ITEM_INT8, ITEM_INT16 = (_make_item(_FLOAT_KEYS, np.int8), _make_item(_INT8_KEYS, np.int8),
                                     _make_item(_INT16_KEYS, np.int16))


def _make_kernel(kind):
    """The attention kernel with one way to score keys: thread th runs its items of _plan's assignment
    (counts / items, CSR lists) through the item function of that kind (the others' branches are pruned)."""
    @njit(cache=True, parallel=True)
    def kernel(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
               qscale, out, tstart, tend, n_split, items, counts,
               part_acc, part_m, part_l):
        for th in prange(counts.shape[0] - 1):
            for ii in range(counts[th], counts[th + 1]):
                if kind == _FLOAT_KEYS:
                    ITEM_FLOAT(items[ii], q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages,
                               v_scales, qscale, out, tstart, tend, n_split, part_acc, part_m, part_l)
                elif kind == _INT8_KEYS:
                    ITEM_INT8(items[ii], q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages,
                              v_scales, qscale, out, tstart, tend, n_split, part_acc, part_m, part_l)
                else:
                    ITEM_INT16(items[ii], q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages,
                               v_scales, qscale, out, tstart, tend, n_split, part_acc, part_m, part_l)
    return kernel


_KERNELS = {"float": _make_kernel(_FLOAT_KEYS), "int8": _make_kernel(_INT8_KEYS), "int16": _make_kernel(_INT16_KEYS)}


@njit(cache=True)
def _fold(m_run, l_run, acc_run, r, m, l, acc):
    """Fold one chunk's softmax state (m, l, acc (hd,)) into row r of the running state (left to
    right over chunks). Compiled with its caller's fast-math flags: its callers carry the same (_FM)."""
    if l == 0.0:
        return
    mx = max(m_run[r], m)
    c_run = np.float32(np.exp2(max(m_run[r] - mx, np.float32(-126.0))))
    c_new = np.float32(np.exp2(max(m - mx, np.float32(-126.0))))
    l_run[r] = l_run[r] * c_run + l * c_new
    for d in range(acc_run.shape[0]):
        acc_run[d] = acc_run[d] * c_run + acc[d] * c_new
    m_run[r] = mx


@njit(cache=True)
def _finish(l, acc, out):
    inv = np.float32(1.0) / l
    for d in range(acc.shape[0]):
        out[d] = acc[d] * inv


@njit(cache=True, fastmath=_FM)
def merge_one(part_acc, part_m, part_l, out, th):
    """out[t, h] (th = t * n_heads + h) = the left fold of the chunks' states (unwritten chunks have l = 0:
    skipped). Its own compiled function with the kernels' fast-math flags: every caller gets the same bits."""
    n_chunk, n_tok, n_heads, hd = part_acc.shape
    t = th // n_heads
    h = th % n_heads
    m_run = np.full(1, _NEG, np.float32)
    l_run = np.zeros(1, np.float32)
    acc_run = np.zeros(hd, np.float32)
    for c in range(n_chunk):
        _fold(m_run, l_run, acc_run, 0, part_m[c, t, h], part_l[c, t, h], part_acc[c, t, h])
    _finish(l_run[0], acc_run, out[t, h])


@njit(cache=True, parallel=True)
def _attn_merge(part_acc, part_m, part_l, out):
    for th in prange(part_acc.shape[1] * part_acc.shape[2]):
        merge_one(part_acc, part_m, part_l, out, th)


def qk_path(head_dim, qk="auto"):
    """The q.k path attention() takes: "float", or "int8" / "int16" (AVX2, head_dim a multiple of GROUP
    channels; float otherwise). "auto": STRATA_LITE_ATTN_QK if set, else float."""
    if qk == "auto":
        qk = os.environ.get("STRATA_LITE_ATTN_QK") or "float"
    if qk not in QK_PATHS:
        raise ValueError(f"qk must be one of {QK_PATHS} or 'auto', got {qk!r}")
    return qk if qk == "float" or (head_dim % GROUP == 0 and int8_enabled()) else "float"


def attention(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, out, qk="auto"):
    """Causal attention of q (n_tok, n_heads, head_dim) f32 over the int8 paged KV cache.

    Token t (sequence token_seq[t], position token_pos[t]) attends to positions
    0..token_pos[t] of its sequence (which must already be stored, including its own).
    Query head h uses kv head h // (n_heads // n_kv_heads).  Result -> out (same shape
    as q, float32). qk: the q.k path (qk_path)."""
    _req(q, "q", np.float32, 3)
    _req(out, "out", np.float32, 3)
    if out.shape != q.shape:
        raise ValueError(f"out {out.shape} != q {q.shape}")
    n_tok, n_heads, hd = q.shape
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be 4-D, got shape {getattr(k_pages, 'shape', None)}")
    n_kv = k_pages.shape[2]
    if n_kv < 1 or n_heads % n_kv:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv}")
    _check_cache(token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, n_tok, n_kv, hd)
    _raise_index_error(_check_indices(token_seq, token_pos, page_tables, k_pages.shape[0], k_pages.shape[1]))
    attention_nocheck(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, out, qk)


@njit(cache=True)
def split_states(token_pos, n_split, n_heads, hd):
    """(part_acc, part_m, part_l) for the kernel: with a key split one softmax state per chunk of keys (chunks
    past a tile's keys stay l = 0, which _attn_merge skips), else 1-element placeholders."""
    n_tok = token_pos.shape[0]
    if n_split > 1:
        n_chunk = (token_pos.max() + _CHUNK_KEYS) // _CHUNK_KEYS        # ceil((max + 1) / _CHUNK_KEYS)
        return (np.empty((n_chunk, n_tok, n_heads, hd), np.float32), np.empty((n_chunk, n_tok, n_heads), np.float32),
                np.zeros((n_chunk, n_tok, n_heads), np.float32))
    return np.empty((1, 1, 1, 1), np.float32), np.empty((1, 1, 1), np.float32), np.empty((1, 1, 1), np.float32)


def attention_nocheck(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, out,
                      qk="auto"):
    """attention() on arguments already checked: the shapes and dtypes by the caller's contract (the CPU
    backend's, whose batches the engine validated), so a decode step's 24 calls skip ~5 us of checks each."""
    n_tok, n_heads, hd = q.shape
    if n_tok == 0:
        return
    n_kv = k_pages.shape[2]
    n_threads = numba.get_num_threads()
    tstart, tend, n_split, items, counts = _plan(token_seq, token_pos, n_kv, n_threads, _TILE_Q, _CHUNK_KEYS)
    part_acc, part_m, part_l = split_states(token_pos, n_split, n_heads, hd)
    _KERNELS[qk_path(hd, qk)](q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                              np.float32(scale * _LOG2E), out, tstart, tend, n_split, items, counts,
                              part_acc, part_m, part_l)
    if n_split > 1:
        _attn_merge(part_acc, part_m, part_l, out)
