"""Prompt attention of one sequence's chunk through an f16 copy of its keys (CUDA C in attention_f16.cu): the
backend's opt-in prompt path (`--prompt-attention f16`, CudaBackend.attention), timed against attention.py's tiled
kernels by perf/bench_gpu.py --prefill-attn (mode `f16flash`). Its outputs are within
tests/kernels/reference.py f16_flash_bound of the float64 result, not the bits the decode kernels (attention.py)
give the same token.

Two launches: kv_to_f16 writes keys 0 .. n_keys - 1 of the sequence (K and V times their scales, each rounded once
to f16; V transposed) into a scratch copy, then fa_f16 runs a flash attention over it, one CTA per 64 (token,
query head) pairs of a kv head. Arrays are cupy (device); the sequence id, key count and scale are host numbers.
"""
from __future__ import annotations

import numpy as np

from . import runtime
from .attention import _LOG2E   # log2(e), folded into the scale as the exact kernels fold it

__all__ = ["prompt_attention_f16", "f16_scratch", "fa_smem_bytes", "KEY_TILE", "HEAD_DIMS"]

_CU = "attention_f16.cu"
KEY_TILE = 64               # FA_KT: keys per tile (the copy's key count is padded to a multiple)
_ROWS = 64                  # FA_ROWS: (token, head) pairs per CTA
HEAD_DIMS = (64, 128)


def fa_smem_bytes(head_dim: int) -> int:
    """sizeof(FaSmem<head_dim>) in attention_f16.cu: two stages of a K tile (64 keys x head_dim + 8 halves) and a
    V^T tile (head_dim x 72 halves), then two ints."""
    return 2 * KEY_TILE * (head_dim + 8) * 2 + 2 * head_dim * (KEY_TILE + 8) * 2 + 8


def f16_scratch(n_kv: int, head_dim: int, n_keys: int):
    """(kf, vt): the f16 copy of n_keys keys (padded to KEY_TILE) of n_kv heads that prompt_attention_f16 writes;
    made outside a graph capture and passed to captured calls."""
    cp = runtime.cupy()
    n_pad = runtime.cdiv(n_keys, KEY_TILE) * KEY_TILE
    return cp.empty((n_kv, n_pad, head_dim), cp.uint16), cp.empty((n_kv, head_dim, n_pad), cp.uint16)


def prompt_attention_f16(q, seq: int, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                         scale: float, out, n_keys: int, scratch=None) -> None:
    """out (n_tok, n_heads, head_dim) float32 = causal attention of q (same shape), every token of sequence `seq`
    (host int) at token_pos (n_tok,) int32, over keys 0 .. n_keys - 1 of that sequence (host int, >= every
    position + 1) in the paged int8 cache (attention.attention's layout). scratch: f16_scratch's pair for at
    least n_keys keys (made here when None)."""
    n_tok, n_heads, hd = q.shape
    n_kv = k_pages.shape[2]
    if hd not in HEAD_DIMS:
        raise ValueError(f"head_dim {hd} not supported by the f16 prompt attention (one of {HEAD_DIMS})")
    if n_heads % n_kv:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv}")
    if n_tok == 0:
        return
    kf, vt = f16_scratch(n_kv, hd, n_keys) if scratch is None else scratch
    n_pad = kf.shape[1]
    if kf.shape != (n_kv, n_pad, hd) or vt.shape != (n_kv, hd, n_pad) or n_pad < n_keys:
        raise ValueError(f"scratch {kf.shape} / {vt.shape} does not hold {n_keys} keys of {n_kv} x {hd}")
    page_size = k_pages.shape[1]
    runtime.launch(_CU, f"kv_to_f16_d{hd}", (n_pad // KEY_TILE, n_kv), (256,),
                   (k_pages, k_scales, v_pages, v_scales, page_tables, np.int32(seq), np.int32(page_tables.shape[1]),
                    np.int32(page_size), np.int32(n_kv), np.int32(n_keys), np.int32(n_pad), kf, vt))
    group = n_heads // n_kv
    runtime.launch(_CU, f"fa_f16_d{hd}", (runtime.cdiv(n_tok * group, _ROWS), n_kv), (128,),
                   (q, token_pos, kf, vt, out, np.float32(float(scale) * _LOG2E), np.int32(n_tok),
                    np.int32(n_heads), np.int32(group), np.int32(n_pad)),
                   shared_mem=fa_smem_bytes(hd))
