"""Quantize K/V rows into the paged int8 cache (Numba CUDA), bit-identical to kernels/cpu/attention.kv_store.

Layout (kernels/kv_layout.py), per layer:
    k_pages  int8    (n_pages, page_size, n_kv_heads, head_dim)
    k_scales float32 (n_pages, page_size, n_kv_heads, n_groups)      v_pages / v_scales: same.
Token t goes to page page_tables[token_seq[t], token_pos[t] // page_size], slot token_pos[t] % page_size.
Per group of head_dim / n_groups channels: scale = amax / 127 (float32 true division),
q = round_half_away_from_zero(x / scale) clipped to +-127; an all-zero group gets scale 0 and q 0.

One thread block per (token, kv head, K or V): thread i owns channel i of its group (groups padded to a
power of two `span` so the amax tree needs no bounds); max is exact, so the tree order does not matter.
fastmath stays off: float32 division must be IEEE round-to-nearest to match the CPU bit for bit.

Host/device placement: every array is a device (cupy) array; under the Numba simulator
(NUMBA_ENABLE_CUDASIM=1) numpy arrays. Index validity is the caller's (checked when the batch is built).
"""
from __future__ import annotations

import functools
import os

import numpy as np

from ..kv_layout import KV_GROUP, kv_scale_groups

__all__ = ["kv_store"]

_MAX_THREADS = 1024            # one block covers n_groups * span channels
cuda = None                    # numba.cuda, imported on first use; a module global so that the simulator
                               # can swap in its fake module while a kernel runs


def simulated() -> bool:
    """True when Numba CUDA runs in its simulator (numpy arrays, no CuPy)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def _span(head_dim: int) -> int:
    """Padded group width: 32 for grouped rows, else the next power of two >= head_dim (one group)."""
    if head_dim % KV_GROUP == 0:
        return KV_GROUP
    return 1 << (head_dim - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _kernel():
    global cuda
    import numba
    from numba import cuda

    f32 = numba.float32

    @cuda.jit(fastmath=False)
    def kv_store_kernel(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, span):
        # grid (n_tok, n_kv_heads, 2: K then V), block n_groups * span threads
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        i = cuda.threadIdx.x
        if cuda.blockIdx.z == 0:
            x, pages, scales = k, k_pages, k_scales
        else:
            x, pages, scales = v, v_pages, v_scales
        head_dim = x.shape[2]
        gs = head_dim // scales.shape[3]
        gi = i // span
        li = i - gi * span
        c = gi * gs + li
        ps = pages.shape[1]
        pos = token_pos[t]
        page = page_tables[token_seq[t], pos // ps]
        slot = pos % ps

        amax_sh = cuda.shared.array(_MAX_THREADS, numba.float32)
        xv = f32(0.0)
        if li < gs:
            xv = x[t, h, c]
        amax_sh[i] = abs(xv)
        stride = span // 2
        while stride > 0:
            cuda.syncthreads()
            if li < stride:
                amax_sh[i] = max(amax_sh[i], amax_sh[i + stride])
            stride //= 2
        cuda.syncthreads()
        sc = amax_sh[gi * span] / f32(127.0)
        if li == 0:
            scales[page, slot, h, gi] = sc
        if li < gs:
            q = numba.int32(0)
            if sc != f32(0.0):
                y = xv / sc
                r = f32(numba.int32(y))                 # trunc toward zero (|y| <= ~127)
                if abs(y - r) >= f32(0.5):              # exact in float32: round half away from zero
                    r += f32(1.0) if y > f32(0.0) else f32(-1.0)
                if r > f32(127.0):
                    r = f32(127.0)
                elif r < f32(-127.0):
                    r = f32(-127.0)
                q = numba.int32(r)
            pages[page, slot, h, c] = q

    return kv_store_kernel


def _check(name, arr, dtype, ndim):
    if arr.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def kv_store(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales) -> None:
    """Quantize k, v (n_tok, n_kv_heads, head_dim) float32 into the paged cache (written in place).

    token_seq, token_pos (n_tok,) int32; page_tables (n_seqs, max_pages) int32; pages int8 and scales
    float32 of one layer, as above. Launches on CuPy's current stream (graph-capturable)."""
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
    if n_tok == 0:
        return
    kern = _kernel()
    grid, block = (n_tok, n_kv, 2), (threads,)
    args = (k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, np.int32(span))
    if simulated():
        kern[grid, block](*args)
    else:
        from .runtime import cupy
        stream = cuda.external_stream(cupy().cuda.get_current_stream().ptr)
        kern[grid, block, stream](*args)
