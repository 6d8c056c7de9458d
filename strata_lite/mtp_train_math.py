"""Forward and hand-written backward of one llama-style decoder block in numpy, for MTP training.

The same math as models/transformer.py decoder_block (RMSNorm, q/k/v with optional biases and per-head
q/k norms, RoPE, causal GQA attention, output projection, residual, RMSNorm, SwiGLU, residual), on a
batch of equal-length sequences x (B, T, n_embd) at positions 0..T-1, in float (no int8 KV, no
activation rounding: the engine's quantization noise is not part of what is trained). Every function is
generic over the dtype of its inputs (float32 for training, float64 for the finite-difference check) and
over their array module (numpy, or CuPy on the GPU: mtp_train_device.array_module). Each *_fwd returns
(output, cache); the matching *_bwd takes the output's gradient and that cache.
A chained draft's rows (depth >= 2, mtp_train_model.chain_fwd) run the same block with mixed attention: each
row attends to constant keys/values of earlier positions (the depth-1 rows), to the chain's earlier drafts
(constants) and to its own key/value.
Weights are (n_out, n_in) as GGUF stores them: y = x @ W.T.
"""
from __future__ import annotations

import math

import numpy as np

from .mtp_train_device import array_module, to_device


def rmsnorm_fwd(x, w, eps):
    """x (..., n), w (n,) -> x / rms(x) * w."""
    r = 1.0 / array_module(x).sqrt((x * x).mean(-1, keepdims=True) + eps)
    xh = x * r
    return xh * w, (xh, r, w)


def rmsnorm_bwd(dy, cache):
    """-> (dx, dw)."""
    xh, r, w = cache
    dw = (dy * xh).reshape(-1, w.size).sum(0)
    dxh = dy * w
    return r * (dxh - xh * (dxh * xh).mean(-1, keepdims=True)), dw


def linear_fwd(x, w, b=None):
    """x (..., n_in) @ w.T (+ b) -> (..., n_out)."""
    y = x @ w.T
    return (y + b if b is not None else y), x


def linear_bwd(dy, x, w, has_bias=False):
    """-> (dx, dw, db or None)."""
    d2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    return dy @ w, d2.T @ x2, (d2.sum(0) if has_bias else None)


def rope_tables(n_pos, base, n_rot, dtype, xp=np):
    """cos, sin (n_pos, n_rot/2) as xp arrays: theta = pos * base**(-2i/n_rot), in float64 on the host as
    the kernels do (one small explicit copy to the device per forward for cupy)."""
    inv = base ** (-2.0 * np.arange(n_rot // 2) / n_rot)
    theta = np.arange(n_pos, dtype=np.float64)[:, None] * inv
    return to_device(xp, np.cos(theta).astype(dtype)), to_device(xp, np.sin(theta).astype(dtype))


def rope(x, cos, sin, n_rot, neox, inverse=False):
    """Rotate pairs of x (B, T, heads, head_dim) by theta[t] (or -theta: the backward, R^T = R(-theta))."""
    c, s = cos[None, :, None, :], (-sin if inverse else sin)[None, :, None, :]
    y = x.copy()
    if neox:
        a, b = x[..., :n_rot // 2], x[..., n_rot // 2:n_rot]
        y[..., :n_rot // 2], y[..., n_rot // 2:n_rot] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        y[..., 0:n_rot:2], y[..., 1:n_rot:2] = a * c - b * s, a * s + b * c
    return y


def attention_fwd(q, k, v):
    """Causal GQA: q (B, T, Hq, d), k and v (B, T, Hkv, d); query head h reads kv head h // (Hq/Hkv).
    -> (B, T, Hq, d)."""
    B, T, Hq, d = q.shape
    Hkv, xp = k.shape[2], array_module(q)
    g = Hq // Hkv
    qg = q.reshape(B, T, Hkv, g, d).transpose(0, 2, 3, 1, 4)       # (B, Hkv, g, T, d)
    kt, vt = k.transpose(0, 2, 1, 3)[:, :, None], v.transpose(0, 2, 1, 3)[:, :, None]   # (B, Hkv, 1, T, d)
    scale = 1.0 / math.sqrt(d)
    s = (qg @ kt.swapaxes(-1, -2)) * scale
    s = s + xp.triu(xp.full((T, T), -np.inf, dtype=s.dtype), 1)
    p = xp.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ vt                                                        # (B, Hkv, g, T, d)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, d), (qg, kt, vt, p, scale)


def attention_bwd(do, cache):
    """-> (dq, dk, dv) in the shapes of q, k, v."""
    qg, kt, vt, p, scale = cache
    B, Hkv, g, T, d = qg.shape
    dog = do.reshape(B, T, Hkv, g, d).transpose(0, 2, 3, 1, 4)
    dv = (p.swapaxes(-1, -2) @ dog).sum(2)                           # (B, Hkv, T, d)
    dp = dog @ vt.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = ds @ kt                                                      # (B, Hkv, g, T, d)
    dk = (ds.swapaxes(-1, -2) @ qg).sum(2)
    return (dq.transpose(0, 3, 1, 2, 4).reshape(B, T, Hkv * g, d), dk.transpose(0, 2, 1, 3),
            dv.transpose(0, 2, 1, 3))


def mixed_attention_fwd(q, k, v, k_ctx, v_ctx, chain=()):
    """The attention of a chained draft's rows. q (B, T, Hq, d), k and v (B, T, Hkv, d): the rows' own
    query, key and value; k_ctx, v_ctx (B, T, Hkv, d): constant keys/values of the preceding positions,
    aligned so that query row t sees context rows 0..t (row t of a draft at depth D, position p = t + D - 1,
    sees the depth-1 rows at positions 0..t); chain: the (k, v) pairs (B, T, Hkv, d) of the chain's earlier
    drafts (depths 2..D-1, constants), row t of each the draft before it at the positions between; then
    its own key. GQA as attention_fwd. -> (B, T, Hq, d). One softmax over the T context scores (masked past
    t), the chain's scores and the own score, in that order."""
    B, T, Hq, d = q.shape
    Hkv, xp = k.shape[2], array_module(q)
    qg = q.reshape(B, T, Hkv, Hq // Hkv, d).transpose(0, 2, 3, 1, 4)   # (B, Hkv, g, T, d)
    kc, vc = k_ctx.transpose(0, 2, 1, 3)[:, :, None], v_ctx.transpose(0, 2, 1, 3)[:, :, None]
    # the row-aligned keys/values, the own last: (B, Hkv, 1, T, R, d), R = len(chain) + 1
    kr = xp.stack([a.transpose(0, 2, 1, 3) for a, _ in chain] + [k.transpose(0, 2, 1, 3)], -2)[:, :, None]
    vr = xp.stack([a.transpose(0, 2, 1, 3) for _, a in chain] + [v.transpose(0, 2, 1, 3)], -2)[:, :, None]
    scale = 1.0 / math.sqrt(d)
    s_ctx = (qg @ kc.swapaxes(-1, -2)) * scale                        # (B, Hkv, g, T, T)
    s_ctx = s_ctx + xp.triu(xp.full((T, T), -np.inf, dtype=s_ctx.dtype), 1)
    s_rows = (qg[..., None, :] * kr).sum(-1) * scale                  # (B, Hkv, g, T, R)
    s = xp.concatenate([s_ctx, s_rows], -1)                           # (B, Hkv, g, T, T + R)
    p = xp.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p[..., :T] @ vc + (p[..., T:, None] * vr).sum(-2)             # (B, Hkv, g, T, d)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, d), (qg, kr, vr, kc, vc, p, scale)


def mixed_attention_bwd(do, cache):
    """-> (dq, dk, dv) in the shapes of q, k, v; none for k_ctx, v_ctx or the chain's rows (constants:
    stop-gradient)."""
    qg, kr, vr, kc, vc, p, scale = cache
    B, Hkv, g, T, d = qg.shape
    dog = do.reshape(B, T, Hkv, g, d).transpose(0, 2, 3, 1, 4)
    dp = array_module(do).concatenate([dog @ vc.swapaxes(-1, -2), (dog[..., None, :] * vr).sum(-1)], -1)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale           # (B, Hkv, g, T, T + R)
    dq = ds[..., :T] @ kc + (ds[..., T:, None] * kr).sum(-2)          # (B, Hkv, g, T, d)
    dk = (ds[..., -1:] * qg).sum(2)                                   # (B, Hkv, T, d): the own key's column
    dv = (p[..., -1:] * dog).sum(2)
    return (dq.transpose(0, 3, 1, 2, 4).reshape(B, T, Hkv * g, d), dk.transpose(0, 2, 1, 3),
            dv.transpose(0, 2, 1, 3))


def block_fwd(cfg, p, x, rope_cs, ctx_kv=None):
    """One decoder block: x (B, T, n_embd) -> x + attn + ffn. p: the block's float arrays by GGUF name
    (attn_norm, attn_q, ..., attn_q_bias or None, attn_q_norm or None). rope_cs: (cos, sin) of the rows'
    rope positions, (T, n_rot/2) each (rope_tables, sliced for rows not at 0..T-1). ctx_kv: None for causal
    attention among the rows; else (k_ctx, v_ctx, chain) of mixed_attention_fwd (constants).
    The cache's last entry is the rows' roped (k, v) (B, T, Hkv, head_dim): block_kv."""
    B, T, _ = x.shape
    hd, cos, sin = cfg.head_dim, rope_cs[0], rope_cs[1]
    h, c_an = rmsnorm_fwd(x, p["attn_norm"], cfg.rms_eps)
    q, _ = linear_fwd(h, p["attn_q"], p.get("attn_q_bias"))
    k, _ = linear_fwd(h, p["attn_k"], p.get("attn_k_bias"))
    v, _ = linear_fwd(h, p["attn_v"], p.get("attn_v_bias"))
    q, k, v = (q.reshape(B, T, -1, hd), k.reshape(B, T, -1, hd), v.reshape(B, T, -1, hd))
    c_qn = c_kn = None
    if p.get("attn_q_norm") is not None:
        q, c_qn = rmsnorm_fwd(q, p["attn_q_norm"], cfg.rms_eps)
        k, c_kn = rmsnorm_fwd(k, p["attn_k_norm"], cfg.rms_eps)
    q = rope(q, cos, sin, cfg.n_rot, cfg.rope_neox)
    k = rope(k, cos, sin, cfg.n_rot, cfg.rope_neox)
    if ctx_kv is None:
        a, c_att = attention_fwd(q, k, v)
        c_att = (attention_bwd, c_att)
    else:
        a, c_att = mixed_attention_fwd(q, k, v, *ctx_kv)
        c_att = (mixed_attention_bwd, c_att)
    a = a.reshape(B, T, -1)
    x1 = x + linear_fwd(a, p["attn_output"])[0]
    f, c_fn = rmsnorm_fwd(x1, p["ffn_norm"], cfg.rms_eps)
    gate, up = linear_fwd(f, p["ffn_gate"])[0], linear_fwd(f, p["ffn_up"])[0]
    sg = 1.0 / (1.0 + array_module(gate).exp(-gate))
    act = gate * sg * up
    x2 = x1 + linear_fwd(act, p["ffn_down"])[0]
    return x2, (h, c_an, c_qn, c_kn, c_att, a, f, c_fn, gate, up, sg, act, (k, v))


def block_kv(cache):
    """The roped keys and values (B, T, Hkv, head_dim) of a block_fwd's rows."""
    return cache[-1]


def block_bwd(cfg, p, dx2, cache, rope_cs):
    """-> (dx, {name: gradient}) for the block's arrays (biases and q/k norms only where present)."""
    h, c_an, c_qn, c_kn, (att_bwd, c_att), a, f, c_fn, gate, up, sg, act, _ = cache
    B, T, _ = dx2.shape
    hd, cos, sin = cfg.head_dim, rope_cs[0], rope_cs[1]
    g = {}
    dact, g["ffn_down"], _ = linear_bwd(dx2, act, p["ffn_down"])
    dup = dact * gate * sg
    dgate = dact * up * sg * (1.0 + gate * (1.0 - sg))
    df, g["ffn_gate"], _ = linear_bwd(dgate, f, p["ffn_gate"])
    df2, g["ffn_up"], _ = linear_bwd(dup, f, p["ffn_up"])
    dx1, g["ffn_norm"] = rmsnorm_bwd(df + df2, c_fn)
    dx1 = dx1 + dx2
    da, g["attn_output"], _ = linear_bwd(dx1, a, p["attn_output"])
    dq, dk, dv = att_bwd(da.reshape(B, T, -1, hd), c_att)
    dq = rope(dq, cos, sin, cfg.n_rot, cfg.rope_neox, inverse=True)
    dk = rope(dk, cos, sin, cfg.n_rot, cfg.rope_neox, inverse=True)
    if c_qn is not None:
        dq, g["attn_q_norm"] = rmsnorm_bwd(dq, c_qn)
        dk, g["attn_k_norm"] = rmsnorm_bwd(dk, c_kn)
    has_bias = p.get("attn_q_bias") is not None
    dh = None
    for name, d in (("attn_q", dq), ("attn_k", dk), ("attn_v", dv)):
        dhi, g[name], db = linear_bwd(d.reshape(B, T, -1), h, p[name], has_bias)
        if has_bias:
            g[name + "_bias"] = db
        dh = dhi if dh is None else dh + dhi
    dx, g["attn_norm"] = rmsnorm_bwd(dh, c_an)
    return dx + dx1, g
