"""A float64 numpy forward pass (activations rounded before each mat-mul as ggml does) of the llama-style models, straight from gguf.quants dequantization:
the reference the engine's forward (int8 KV, int8 activations in matvec) is compared with."""
import numpy as np
from gguf.quants import dequantize

from act_reference import round_like_ggml
from strata_lite.kernels.kv_layout import kv_scale_groups


def _mat(w):
    return dequantize(np.asarray(w.raw), w.qtype).reshape(w.n_out, w.n_in).astype(np.float64)


def _mm(x, w):
    """x @ W.T with the activations rounded as ggml (and the engine) round them for W's type."""
    return round_like_ggml(w.qtype, x).astype(np.float64) @ _mat(w).T


def _rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, base, n_rot, neox):
    # x (n, heads, hd)
    x = x.copy()
    i = np.arange(n_rot // 2)
    theta = pos[:, None] * base ** (-2.0 * i / n_rot)            # (n, n_rot/2)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if neox:
        a, b = x[..., :n_rot // 2].copy(), x[..., n_rot // 2:n_rot].copy()
        x[..., :n_rot // 2], x[..., n_rot // 2:n_rot] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
        x[..., 0:n_rot:2], x[..., 1:n_rot:2] = a * c - b * s, a * s + b * c
    return x


def _int8_roundtrip(x):
    """The engine's KV storage (kernels/kv_layout.py): symmetric int8 per (token, head, group of channels),
    scale = max|x|/127."""
    ng = kv_scale_groups(x.shape[-1])
    xg = x.reshape(x.shape[:-1] + (ng, x.shape[-1] // ng))
    scale = np.abs(xg).max(-1, keepdims=True) / 127.0
    q = np.clip(np.round(np.divide(xg, scale, out=np.zeros_like(xg), where=scale > 0)), -127, 127)
    return (q * scale).reshape(x.shape)


def _block(cfg, lw, x, k_scale, int8_kv):
    """x + attention + FFN of one decoder block over the causal sequence x (n, n_embd), positions 0.."""
    n = x.shape[0]
    pos = np.arange(n, dtype=np.float64)
    group = cfg.n_heads // cfg.n_kv_heads
    mask = np.triu(np.full((n, n), -np.inf), 1)
    h = _rmsnorm(x, lw.attn_norm, cfg.rms_eps)
    q, k, v = _mm(h, lw.attn_q), _mm(h, lw.attn_k), _mm(h, lw.attn_v)
    if lw.attn_q_bias is not None:
        q, k, v = q + lw.attn_q_bias, k + lw.attn_k_bias, v + lw.attn_v_bias
    q = q.reshape(n, cfg.n_heads, cfg.head_dim)
    k = k.reshape(n, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(n, cfg.n_kv_heads, cfg.head_dim)
    if lw.attn_q_norm is not None:
        q, k = _rmsnorm(q, lw.attn_q_norm, cfg.rms_eps), _rmsnorm(k, lw.attn_k_norm, cfg.rms_eps)
    q = _rope(q, pos, cfg.rope_freq_base, cfg.n_rot, cfg.rope_neox)
    k = _rope(k, pos, cfg.rope_freq_base, cfg.n_rot, cfg.rope_neox)
    if int8_kv:
        s = k_scale if k_scale is not None else 1.0
        k, v = _int8_roundtrip(k / s) * s, _int8_roundtrip(v)
    out = np.empty_like(q)
    for hd in range(cfg.n_heads):
        s = q[:, hd] @ k[:, hd // group].T / np.sqrt(cfg.head_dim) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, hd] = (p / p.sum(-1, keepdims=True)) @ v[:, hd // group]
    x = x + _mm(out.reshape(n, -1), lw.attn_output)
    h = _rmsnorm(x, lw.ffn_norm, cfg.rms_eps)
    g, u = _mm(h, lw.ffn_gate), _mm(h, lw.ffn_up)
    return x + _mm(g / (1 + np.exp(-g)) * u, lw.ffn_down)


def reference_hidden(cfg, weights, ids, int8_kv=True, k_scales=None):
    """float64 (len(ids), n_embd): the last block's output (before the output norm) from an empty cache."""
    x = _mat(weights.token_embd)[np.asarray(ids)]
    for li, lw in enumerate(weights.layers):
        x = _block(cfg, lw, x, None if k_scales is None else k_scales[li], int8_kv)
    return x


def reference_logits(cfg, weights, ids, int8_kv=True, k_scales=None):
    """float64 (len(ids), n_vocab): causal forward from an empty cache. With int8_kv, K/V are rounded to
    int8 like the engine's cache, K after division by its per-channel smoothing scales (k_scales[layer])."""
    x = reference_hidden(cfg, weights, ids, int8_kv, k_scales)
    return _mm(_rmsnorm(x, weights.output_norm, cfg.rms_eps), weights.output)


def reference_mtp_logits(cfg, weights, mtp, ids, hidden, k_scale=None):
    """float64 (len(ids) - 1, n_vocab): the MTP block (loader/mtp.py) at positions i = 0 .. n - 2 from
    hidden[i] (the main model's last hidden state, as float64) and the token ids[i + 1]."""
    embed = weights.token_embd if mtp.embed_tokens is None else mtp.embed_tokens
    e = _rmsnorm(_mat(embed)[np.asarray(ids[1:])], mtp.enorm, cfg.rms_eps)
    h = _rmsnorm(np.asarray(hidden[:-1], np.float64), mtp.hnorm, cfg.rms_eps)
    x = _block(cfg, mtp.block, _mm(e, mtp.eh_proj_embed) + _mm(h, mtp.eh_proj_hidden), k_scale, True)
    norm = weights.output_norm if mtp.head_norm is None else mtp.head_norm
    return _mm(_rmsnorm(x, norm, cfg.rms_eps), weights.output if mtp.head is None else mtp.head)
