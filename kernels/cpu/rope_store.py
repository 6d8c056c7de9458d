"""rope of q and k and the KV store of k and v in one call (the decode step's per-block glue on the CPU).

The same per-token functions as `elementwise.rope` and `attention.kv_store` (so the same bits), in one Numba
call instead of three (rope q, rope k, store): a decode step runs this once per block, and at one token the
three calls' dispatch and argument checks cost ~20 us where the arithmetic costs ~2 (0.5B model, 24 blocks).
Indices are not checked here: the engine validated the batch (Batch.validate), as the Backend contract says.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .attention import _store_token
from .elementwise import _NO_SCALE, _PAR_MIN, _inv_freq, _rope_tok

__all__ = ["rope_kv_store"]


@njit(cache=True, inline="always")
def _token(t, q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
           inv, n_rot, neox, q_scale, has_q, k_scale, has_k, cs, sn):
    _rope_tok(q, token_pos, inv, n_rot, neox, q_scale, has_q, t, cs, sn)
    _rope_tok(k, token_pos, inv, n_rot, neox, k_scale, has_k, t, cs, sn)
    _store_token(t, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales)


@njit(cache=True)
def _serial(q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
            inv, n_rot, neox, q_scale, has_q, k_scale, has_k):
    cs = np.empty(n_rot // 2, np.float32)
    sn = np.empty(n_rot // 2, np.float32)
    for t in range(q.shape[0]):
        _token(t, q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
               inv, n_rot, neox, q_scale, has_q, k_scale, has_k, cs, sn)


@njit(cache=True, parallel=True)
def _parallel(q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
              inv, n_rot, neox, q_scale, has_q, k_scale, has_k):
    for t in prange(q.shape[0]):
        cs = np.empty(n_rot // 2, np.float32)
        sn = np.empty(n_rot // 2, np.float32)
        _token(t, q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
               inv, n_rot, neox, q_scale, has_q, k_scale, has_k, cs, sn)


def rope_kv_store(q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                  freq_base, n_rot, neox, q_scale=None, k_scale=None) -> None:
    """rope(q, token_pos, ..., q_scale); rope(k, ..., k_scale); kv_store(k, v, token_seq, token_pos, ...):
    q (n, n_heads, head_dim), k and v (n, n_kv_heads, head_dim) float32 C-contiguous, indices int32 and
    already validated. Tokens in parallel once q holds _PAR_MIN values (as rope does)."""
    if q.shape[0] == 0:
        return
    fn = _parallel if q.size >= _PAR_MIN and q.shape[0] > 1 else _serial
    fn(q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
       _inv_freq(freq_base, n_rot), int(n_rot), bool(neox),
       _NO_SCALE if q_scale is None else q_scale, q_scale is not None,
       _NO_SCALE if k_scale is None else k_scale, k_scale is not None)
