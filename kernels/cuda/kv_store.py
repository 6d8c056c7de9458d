"""Quantize K/V rows into the paged int8 cache, bit-identical to kernels/cpu/attention.kv_store (the CUDA
C kernel in kv_store.cu, a CuPy RawKernel: one launch costs the host a CuPy launch, where a Numba launch
with nine cupy arrays measured ~0.65 ms per call on the H200 machine, most of a 0.5B prompt's time).

Layout (kernels/kv_layout.py), per layer:
    k_pages  int8    (n_pages, page_size, n_kv_heads, head_dim)
    k_scales float32 (n_pages, page_size, n_kv_heads, n_groups)      v_pages / v_scales: same.
Token t goes to page page_tables[token_seq[t], token_pos[t] // page_size], slot token_pos[t] % page_size.
Per group of head_dim / n_groups channels: scale = amax / 127 (float32 true division),
q = round_half_away_from_zero(x / scale) clipped to +-127; an all-zero group gets scale 0 and q 0.

Host/device placement: every array is a device (cupy) array; sizes are read from shapes on the host.
Index validity is the caller's (checked when the batch is built). Launches on CuPy's current stream
(graph-capturable). rope_kv_store: elementwise.rope_qk and kv_store in one launch (the same bits).
"""
from __future__ import annotations

import numpy as np

from ..kv_layout import KV_GROUP, kv_scale_groups
from . import elementwise as ew
from .runtime import launch

__all__ = ["kv_store", "rope_kv_store"]

_MAX_THREADS = 1024            # one block covers n_groups * span channels (KV_MAX_THREADS in kv_store.cu)
CU = "kv_store.cu"


def _span(head_dim: int) -> int:
    """Padded group width: 32 for grouped rows, else the next power of two >= head_dim (one group)."""
    if head_dim % KV_GROUP == 0:
        return KV_GROUP
    return 1 << (head_dim - 1).bit_length()


def _check(name, arr, dtype, ndim):
    if arr.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _store_args(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales) -> tuple:
    """Checks of a store -> (threads per CTA, n_groups, span)."""
    for name, arr, dt, nd in (("k", k, np.float32, 3), ("v", v, np.float32, 3), ("token_seq", token_seq, np.int32, 1),
                              ("token_pos", token_pos, np.int32, 1), ("page_tables", page_tables, np.int32, 2),
                              ("k_pages", k_pages, np.int8, 4), ("v_pages", v_pages, np.int8, 4),
                              ("k_scales", k_scales, np.float32, 4), ("v_scales", v_scales, np.float32, 4)):
        _check(name, arr, dt, nd)
    if v.shape != k.shape:
        raise ValueError(f"v {v.shape} != k {k.shape}")
    n_tok, n_kv, head_dim = k.shape
    if token_seq.shape != (n_tok,) or token_pos.shape != (n_tok,):
        raise ValueError(f"token_seq {token_seq.shape} / token_pos {token_pos.shape} must be ({n_tok},)")
    if v_pages.shape != k_pages.shape or k_pages.shape[2:] != (n_kv, head_dim):
        raise ValueError(f"k_pages {k_pages.shape} / v_pages {v_pages.shape} do not match k {k.shape}")
    want = k_pages.shape[:3] + (kv_scale_groups(head_dim),)
    if k_scales.shape != want or v_scales.shape != want:
        raise ValueError(f"k_scales {k_scales.shape} / v_scales {v_scales.shape} must be {want}")
    span = _span(head_dim)
    threads = want[3] * span
    if threads > _MAX_THREADS:
        raise ValueError(f"head_dim {head_dim} too large for kv_store (at most {_MAX_THREADS} padded channels)")
    return threads, want[3], span


def kv_store(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales) -> None:
    """Quantize k, v (n_tok, n_kv_heads, head_dim) float32 into the paged cache (written in place).

    token_seq, token_pos (n_tok,) int32; page_tables (n_seqs, max_pages) int32; pages int8 and scales
    float32 of one layer, as above. Launches on CuPy's current stream (graph-capturable)."""
    threads, n_groups, span = _store_args(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages,
                                          v_scales)
    n_tok, n_kv, head_dim = k.shape
    if n_tok == 0:
        return
    launch(CU, "kv_store", (n_tok, n_kv, 2), (threads,),
           (k, v, token_seq, token_pos, page_tables, np.int32(page_tables.shape[1]), k_pages, k_scales, v_pages,
            v_scales, np.int32(n_kv), np.int32(head_dim), np.int32(n_groups), np.int32(k_pages.shape[1]),
            np.int32(span)))


def rope_kv_store(q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                  freq_base: float, n_rot: int, neox: bool, q_scale=None, k_scale=None, table=None) -> None:
    """ew.rope_qk(q, k, token_pos, freq_base, n_rot, neox, q_scale, k_scale, table) then kv_store(k, v, ...)
    in one launch, the same bits: q (n_tok, n_q, head_dim) and k rotated in place, k and v stored.
    n_q must be a multiple of k's n_kv (grouped-query attention: CTA (t, h) rotates query heads
    h * n_q / n_kv ...)."""
    threads, n_groups, span = _store_args(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages,
                                          v_scales)
    n_tok, n_q, head_dim, n_rot = ew.check_rope_shape(q, "q", token_pos, n_rot, q_scale)
    ew.check_rope_shape(k, "k", token_pos, n_rot, k_scale)
    n_kv = k.shape[1]
    if q.shape[2] != head_dim or n_q % n_kv:
        raise ValueError(f"q {q.shape} must share head_dim with k {k.shape} and have a multiple of its heads")
    tab = ew.rope_table_args(table, freq_base, n_rot)
    if n_tok == 0:
        return
    launch(CU, "rope_kv_store", (n_tok, n_kv, 3), (threads,),
           (q, k, v, token_seq, token_pos, page_tables, np.int32(page_tables.shape[1]), k_pages, k_scales, v_pages,
            v_scales, np.int32(n_q), np.int32(n_kv), np.int32(head_dim), np.int32(n_groups),
            np.int32(k_pages.shape[1]), np.int32(span), np.float64(freq_base), np.int32(n_rot),
            np.int32(bool(neox)), ew.NULL_PTR if q_scale is None else q_scale, ew.NULL_PTR if k_scale is None else k_scale,
            *tab))
