"""Causal GQA attention over the paged int8 KV cache (CUDA C in attention.cu).

Cache layout per layer (kernels/kv_layout.py): k_pages/v_pages int8 (n_pages, page_size, n_kv_heads, head_dim),
k_scales/v_scales float32 (n_pages, page_size, n_kv_heads, head_dim // 32). Semantics match
kernels/cpu/attention.attention: token t attends to positions 0..token_pos[t] of sequence token_seq[t].

Flash-decoding with a FIXED number of keys per split (`keys_per_split`), the splits folded in groups of
`group_splits(n, width)` consecutive ones (n: the token's own split count; width: the model's kv heads x
head tiles): a token's splits, groups and the order they are folded in depend only on its own position and
the model, never on the batch (batch invariance). Two modes,
chosen from host ints, give the same bits (attention.cu explains why):
  * split-parallel (n_tok <= ws.split_tokens): grid (n_tok, n_kv_heads * head tiles, Z), CTA z computing
    groups z, z + Z, ... split by split (`split_stride`: about split_min_ctas CTAs per SM, each loading its next split
    while it computes one), one partial per group to the workspace, then attn_merge folds each token's
    own groups;
  * looped (more tokens, or max_keys <= keys_per_split): one CTA per (token, kv head, head tile) walks its
    groups (kernels named *_looped); no workspace traffic, no merge;
  * tiled (the looped case at head_dim 64 and 128, while TILED is on): one CTA per 16 / head tile tokens
    (16 mma columns of (token, head) pairs; a prompt chunk's consecutive tokens of one sequence), kv head and
    head tile walks the splits of their keys, each split's K and V rows staged and converted once for all of
    them (kernels *_tiled; the same bits as the looped kernels).
CTAs past a token's key count exit at once, so a graph captured with max_keys = context length replays
for any positions. Index validity (token_seq, token_pos, page_tables) is the caller's, checked when the
batch is built; `max_keys` must be >= token_pos + 1 of every token.

Host/device placement: arrays are cupy (device); sizes, scale and max_keys are host numbers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import runtime
from ..kv_layout import kv_scale_groups

__all__ = ["keys_per_split", "group_splits", "AttentionWorkspace", "attention_workspace", "attention"]

keys_per_split = 128        # KPS in attention.cu
_CU = "attention.cu"
_THREADS = 128              # NT in attention.cu
_HEAD_DIMS = (64, 128, 256)
_SPLIT_TOKENS = 64          # default cap on tokens run split-parallel (bounds the workspace)
_LOG2E = 1.4426950408889634


GROUP_CTAS = 512            # GROUP_CTAS in attention.cu


def group_splits(n_split: int, width: int) -> int:
    """Consecutive splits folded into one partial for a token with n_split splits, width = kv heads x head
    tiles (group_splits in attention.cu): the largest of 1, 2, 4, 8 that leaves the token GROUP_CTAS work
    items (groups x width). The 8B shape (width 8): 2 splits from 16K keys, 4 from 32K, 8 from 64K; the 0.5B
    shape (width 2): 2 from 64K. A function of the token and the model only."""
    r = n_split * width // GROUP_CTAS
    return 8 if r >= 8 else 4 if r >= 4 else 2 if r >= 2 else 1


@dataclass(frozen=True)
class AttentionWorkspace:
    """Split partials for up to `split_tokens` tokens of one launch (reused by every layer)."""
    acc: object             # (split_tokens, n_splits, n_heads, head_dim) float32: group partials (<= splits)
    ml: object              # (split_tokens, n_splits, n_heads, 2) float32: running max (log2 units), sum
    max_tokens: int
    split_tokens: int
    n_heads: int
    head_dim: int
    max_keys: int
    n_splits: int


def attention_workspace_nbytes(max_tokens: int, n_heads: int, head_dim: int, max_keys: int,
                               split_tokens: int = _SPLIT_TOKENS) -> int:
    """Device bytes attention_workspace allocates for these sizes (the VRAM plan checks them first)."""
    st = min(max_tokens, split_tokens)
    return 4 * st * runtime.cdiv(max_keys, keys_per_split) * n_heads * (head_dim + 2)


def attention_workspace(max_tokens: int, n_heads: int, head_dim: int, max_keys: int,
                        split_tokens: int = _SPLIT_TOKENS) -> AttentionWorkspace:
    """Allocate once (cupy) for launches of up to max_tokens tokens and max_keys keys. Launches of more than
    `split_tokens` tokens run looped (same results), so the buffers stay
    min(max_tokens, split_tokens) * ceil(max_keys / keys_per_split) * n_heads * (head_dim + 2) floats."""
    if min(max_tokens, n_heads, head_dim, max_keys, split_tokens) < 1:
        raise ValueError("attention_workspace sizes must be >= 1")
    cp = runtime.cupy()
    st = min(max_tokens, split_tokens)
    ns = runtime.cdiv(max_keys, keys_per_split)
    return AttentionWorkspace(acc=cp.empty((st, ns, n_heads, head_dim), cp.float32),
                              ml=cp.empty((st, ns, n_heads, 2), cp.float32),
                              max_tokens=max_tokens, split_tokens=st, n_heads=n_heads, head_dim=head_dim,
                              max_keys=max_keys, n_splits=ns)


def _head_tile(group: int, head_dim: int) -> int:
    """Query heads per CTA: the group rounded up to a power of two, at most 8 (4 for head_dim 256)."""
    cap = 4 if head_dim == 256 else 8
    return min(cap, 1 << (group - 1).bit_length())


# Compile-time overrides of the split-parallel kernels' CTAs per SM (attention.cu ATTN_MIN_CTAS) for A/B builds
# (perf/bench_gpu.py --attn-ab times each at several shapes, --attn-build runs a whole benchmark on one).
# H200 (2026-12-06, perf/kernel_notes.md "Attention at five CTAs an SM"): both measured slower than the default.
# `tiled1` / `tiled4`: the tiled kernels with 1 / 4 n-tiles (8 / 32 columns) instead of 2 (perf/bench_gpu.py
# --prefill-attn; H100, 2026-12-06, 60fb8d2: both 1.25-1.37x slower at 32K keys, perf/kernel_notes.md "Prompt
# attention"). Every build takes the weights P' of the p.V products as one f16 (attention.cu phase_values: each
# output within 2^-11 of the float sum over |V|); `q16` also q' of the q.k products (ATTN_Q_LO: half phase A's
# mma; each score moved by up to 2^-11 of its sum over |q k|, reference.f16_rounding_bound). perf/kernel_notes.md,
# "Phase C's weights in one f16".
BUILDS = {"default": {}, "d128_min5": {"ATTN_D128_MIN_CTAS": 5}, "h8_min5": {"ATTN_H8_MIN_CTAS": 5},
          "tiled1": {"ATTN_TILED_NTL": 1}, "tiled4": {"ATTN_TILED_NTL": 4}, "q16": {"ATTN_Q_LO": 0}}
BUILD = "default"           # the build every launch takes (set by perf/bench_gpu.py --attn-build for A/B runs)


def f16_rounding(build: str) -> tuple:
    """(P' in one f16, q' in one f16) of a build's kernels: P' always; q' in `q16` only, so the other builds keep
    the default build's bits."""
    return True, BUILDS[build].get("ATTN_Q_LO", 1) == 0


@functools.lru_cache(maxsize=None)
def build_options(build: str) -> tuple:
    """The NVRTC defines of an attention build (once per build: every launch asks)."""
    if build not in BUILDS:
        raise ValueError(f"attention build must be one of {sorted(BUILDS)}, got {build!r}")
    return tuple(f"-D{k}={v}" for k, v in sorted(BUILDS[build].items()))


def split_min_ctas(head_dim: int, head_tile: int, build: str = "default") -> int:
    """CTAs per SM the split-parallel kernel attn_d{head_dim}_h{head_tile} is compiled for (attention.cu
    ATTN_MIN_CTAS): 5 at head_dim 64 (head tiles <= 4), 4 at head tile 8, head_dim 128 and 256; the A/B builds
    ask for 5 at head_dim 128 (`d128_min5`) or at head tile 8 (`h8_min5`)."""
    over = BUILDS[build]
    if head_dim >= 256:
        return 4
    if head_tile == 8:
        return over.get("ATTN_H8_MIN_CTAS", 4)
    return over.get("ATTN_D128_MIN_CTAS", 4) if head_dim == 128 else 5


def split_stride(n_items: int, n_group: int, n_sm: int, ctas_per_sm: int) -> int:
    """Z, the CTAs per (token, kv head, head tile) of a split-parallel launch: all n_group groups (one CTA
    each) while the n_items = tokens x kv heads x tiles x n_group work items fit ctas_per_sm per SM (the
    kernel's split_min_ctas), else fewer CTAs walking several groups each (a grid choice: a group's partial is
    the same bits whichever CTA computes it)."""
    per_cta = max(1, -(-n_items // (n_sm * ctas_per_sm)))
    return -(-n_group // per_cta)


# Tiled kernels (attention.cu attn_tiled_body): 8 * ATTN_TILED_NTL mma columns of (token, head) pairs a CTA.
TILED = True                # False: many-token launches take the looped kernels (perf/bench_gpu.py --prefill-attn)


def tiled_ntl(build: str = "default") -> int:
    """n-tiles of 8 columns a tiled CTA takes in this build (attention.cu ATTN_TILED_NTL)."""
    return BUILDS[build].get("ATTN_TILED_NTL", 2)


def tiled_tokens(head_tile: int, ntl: int = 2) -> int:
    """Tokens per CTA of the tiled kernel: 8 * ntl columns of (token, head) pairs."""
    return 8 * ntl // head_tile


def tiled_smem_bytes(head_dim: int, head_tile: int, ntl: int = 2) -> int:
    """sizeof(TSmem<head_dim, head_tile, ntl>) in attention.cu (the kernel traps on less): one buffer of KPS
    rows of head_dim + 16 bytes (K, then V), K and V scales, q' fragments, scores, the fold of all groups, the
    split's row offsets, then the per-column and per-token fields, rounded up to 16 bytes."""
    kps, nw, nc = keys_per_split, 4, 8 * ntl
    ng, tt = head_dim // 32, tiled_tokens(head_tile, ntl)
    size = (kps * (head_dim + 16) + 2 * kps * ng * 4 + ng * (nc // 8) * 2 * 32 * 16 + nc * (kps + 8) * 4
            + nc * head_dim * 4 + kps * 4 + 13 * nc * 4 + 2 * nw * tt * 4 + 3 * tt * 4)
    return -(-size // 16) * 16


def _check(name, arr, dtype, shape_or_ndim):
    if arr.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype}")
    nd = shape_or_ndim if isinstance(shape_or_ndim, int) else len(shape_or_ndim)
    if arr.ndim != nd or (not isinstance(shape_or_ndim, int) and arr.shape != tuple(shape_or_ndim)):
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape_or_ndim}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def attention(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale: float,
              out, ws: AttentionWorkspace, max_keys: int, split_rows: int = 0) -> None:
    """out (n_tok, n_heads, head_dim) float32 = causal attention of q (same shape) over the int8 cache.

    token_seq, token_pos (n_tok,) int32; page_tables (n_seqs, max_pages) int32; pages/scales of one layer.
    Query head h reads kv head h // (n_heads // n_kv_heads). `scale` multiplies q.k (e.g. head_dim**-0.5).
    `max_keys` (host int, >= every token_pos + 1, <= ws.max_keys) sizes the grid. split_rows (host int): the
    first split_rows tokens are short runs of their sequences (Batch.short_run_rows: a mixed step's decode
    and verify tokens); in a launch that would go looped or tiled, up to ws.split_tokens of them go
    split-parallel first (one CTA per group of splits, not one walking the whole context) and the rest after.
    The kernels are BUILD's (every build and mode gives the same bits)."""
    build = BUILD
    options = build_options(build)
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D (n_tok, n_heads, head_dim), got shape {q.shape}")
    n_tok, n_heads, hd = q.shape
    _check("q", q, np.float32, 3)
    _check("out", out, np.float32, q.shape)
    _check("token_seq", token_seq, np.int32, (n_tok,))
    _check("token_pos", token_pos, np.int32, (n_tok,))
    _check("page_tables", page_tables, np.int32, 2)
    _check("k_pages", k_pages, np.int8, 4)
    n_pages, page_size, n_kv, _ = k_pages.shape
    _check("k_pages", k_pages, np.int8, (n_pages, page_size, n_kv, hd))
    _check("v_pages", v_pages, np.int8, k_pages.shape)
    scales_shape = (n_pages, page_size, n_kv, kv_scale_groups(hd))
    _check("k_scales", k_scales, np.float32, scales_shape)
    _check("v_scales", v_scales, np.float32, scales_shape)
    if hd not in _HEAD_DIMS:
        raise ValueError(f"head_dim {hd} not supported by the CUDA attention (one of {_HEAD_DIMS})")
    if n_kv < 1 or n_heads % n_kv:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv}")
    if (ws.n_heads, ws.head_dim) != (n_heads, hd) or n_tok > ws.max_tokens:
        raise ValueError(f"workspace for {ws.max_tokens} tokens x {ws.n_heads} heads x {ws.head_dim} does not "
                         f"fit q {q.shape}")
    if not 1 <= max_keys <= ws.max_keys:
        raise ValueError(f"max_keys={max_keys} must be in [1, {ws.max_keys}] (the workspace's)")
    if runtime.cdiv(max_keys, keys_per_split) > 65535:
        raise ValueError(f"max_keys={max_keys} needs more than 65535 splits")
    if n_tok == 0:
        return
    group = n_heads // n_kv
    ht = _head_tile(group, hd)
    n_ht = runtime.cdiv(group, ht)
    n_split = runtime.cdiv(max_keys, keys_per_split)
    looped = n_tok > ws.split_tokens or n_split == 1
    if looped and n_split > 1 and split_rows > 0:
        k = min(split_rows, ws.split_tokens, n_tok)
        for rows in (slice(0, k), slice(k, n_tok)):
            attention(q[rows], token_seq[rows], token_pos[rows], page_tables, k_pages, k_scales, v_pages, v_scales,
                      scale, out[rows], ws, max_keys)
        return
    qscale = np.float32(float(scale) * _LOG2E)
    n_group = runtime.cdiv(n_split, group_splits(n_split, n_kv * n_ht))
    if looped and TILED and hd <= 128:
        ntl = tiled_ntl(build)
        runtime.launch(_CU, f"attn_d{hd}_h{ht}_tiled", (runtime.cdiv(n_tok, tiled_tokens(ht, ntl)), n_kv * n_ht),
                       (_THREADS,),
                       (q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, out, qscale,
                        np.int32(n_tok), np.int32(n_heads), np.int32(n_kv), np.int32(group), np.int32(n_ht),
                        np.int32(page_size), np.int32(page_tables.shape[1])),
                       shared_mem=tiled_smem_bytes(hd, ht, ntl), options=options)
        return
    z = 1 if looped else split_stride(n_tok * n_kv * n_ht * n_group, n_group, runtime.sm_count(q.device.id),
                                      split_min_ctas(hd, ht, build))
    runtime.launch(_CU, f"attn_d{hd}_h{ht}" + ("_looped" if looped else ""), (n_tok, n_kv * n_ht, z), (_THREADS,),
                   (q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, out,
                    ws.acc, ws.ml, qscale, np.int32(n_heads), np.int32(n_kv), np.int32(group), np.int32(n_ht),
                    np.int32(page_size), np.int32(page_tables.shape[1]), np.int32(ws.n_splits)), options=options)
    if not looped:
        runtime.launch(_CU, "attn_merge", (n_tok, n_heads, hd // 32), (_THREADS,),
                       (ws.acc, ws.ml, token_pos, out, np.int32(n_heads), np.int32(hd), np.int32(ws.n_splits),
                        np.int32(n_kv * n_ht)), options=options)
