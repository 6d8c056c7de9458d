"""Per-channel smoothing of K before it is stored as int8.

Qwen2-style K projections carry a large bias on a few channels (|k| up to ~150 where the rest are
~1-10), so one int8 scale per token per head rounds the small channels away: logits moved by up to
3.4 against llama.cpp. Since q.k = (q*s).(k/s) for any per-channel s, K is divided by a static
per-channel magnitude estimate before quantization and q is multiplied by it (q stays float32).
The estimate of channel c (after the attention RMSNorm, activations have unit RMS):
|bias_c| + ||W_k[c, :] * attn_norm||_2, and for rope pairs the norm of the pair (rope mixes them).
With it the same input moves by at most 0.81 (llama.cpp's own code paths differ by up to 0.58).
"""
from __future__ import annotations

import numpy as np
from gguf.quants import dequantize


def k_channel_scales(cfg, layer) -> np.ndarray:
    """float32 (n_kv_heads, head_dim) divisor for K, >= a small floor. Host numpy from the host weights
    (gguf.quants dequantizes bit-exactly as the kernels do, so no kernel module is imported here)."""
    if cfg.qk_norm:   # normalized per head: magnitude is the norm weight
        m = np.tile(np.abs(layer.attn_k_norm.astype(np.float64)), (cfg.n_kv_heads, 1))
    else:
        w = dequantize(np.asarray(layer.attn_k.raw), layer.attn_k.qtype).astype(np.float64)   # (kv_dim, n_embd)
        m = np.sqrt(((w * layer.attn_norm) ** 2).sum(axis=1))
        if layer.attn_k_bias is not None:
            m = m + np.abs(layer.attn_k_bias)
        m = m.reshape(cfg.n_kv_heads, cfg.head_dim)
    m = _pair_norms(m, cfg.n_rot, cfg.rope_neox)
    return np.maximum(m, 1e-3 * max(float(m.max()), 1e-30)).astype(np.float32)


def _pair_norms(m: np.ndarray, n_rot: int, neox: bool) -> np.ndarray:
    m = m.copy()
    if neox:
        a, b = m[:, :n_rot // 2], m[:, n_rot // 2:n_rot]
    else:
        a, b = m[:, 0:n_rot:2], m[:, 1:n_rot:2]
    p = np.sqrt(a * a + b * b)
    if neox:
        m[:, :n_rot // 2], m[:, n_rot // 2:n_rot] = p, p
    else:
        m[:, 0:n_rot:2], m[:, 1:n_rot:2] = p, p
    return m
