"""Forward pass of llama-style decoder blocks (qwen2, qwen3, llama), written once against Backend.

Differences between the architectures are flags on ModelConfig (q/k/v bias, q/k norm, rope style).
"""
from __future__ import annotations

import math

from ..batch import Batch


def forward(backend, cfg, weights, batch: Batch, kv) -> "array":
    """-> logits (len(batch.logit_rows), n_vocab) float32, on the backend."""
    be = backend
    n = len(batch.token_ids)
    ids, pos = be.from_host(batch.token_ids), be.from_host(batch.positions)
    seq, tables = be.from_host(batch.token_seq), be.from_host(batch.page_tables)
    attn_scale = 1.0 / math.sqrt(cfg.head_dim)
    x = be.embed(weights.token_embd, batch.token_ids)                  # (n, n_embd)
    for i, lw in enumerate(weights.layers):
        h = be.rmsnorm(x, lw.attn_norm, cfg.rms_eps)
        q = _linear(be, lw.attn_q, h, lw.attn_q_bias).reshape(n, cfg.n_heads, cfg.head_dim)
        k = _linear(be, lw.attn_k, h, lw.attn_k_bias).reshape(n, cfg.n_kv_heads, cfg.head_dim)
        v = _linear(be, lw.attn_v, h, lw.attn_v_bias).reshape(n, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = be.rmsnorm(q.reshape(-1, cfg.head_dim), lw.attn_q_norm, cfg.rms_eps).reshape(q.shape)
            k = be.rmsnorm(k.reshape(-1, cfg.head_dim), lw.attn_k_norm, cfg.rms_eps).reshape(k.shape)
        be.rope(q, pos, cfg.rope_freq_base, cfg.n_rot, cfg.rope_neox)
        be.rope(k, pos, cfg.rope_freq_base, cfg.n_rot, cfg.rope_neox)
        layer_kv = kv.layer(i)
        be.kv_store(k, v, seq, pos, tables, *layer_kv)
        a = be.attention(q, seq, pos, tables, *layer_kv, attn_scale)    # (n, n_heads, head_dim)
        o = be.qmatmul(lw.attn_output, a.reshape(n, cfg.n_heads * cfg.head_dim))
        be.add(x, o, out=x)
        h = be.rmsnorm(x, lw.ffn_norm, cfg.rms_eps)
        g = be.qmatmul(lw.ffn_gate, h)
        u = be.qmatmul(lw.ffn_up, h)
        be.add(x, be.qmatmul(lw.ffn_down, be.silu_mul(g, u, out=g)), out=x)
    x = be.take_rows(x, batch.logit_rows) if len(batch.logit_rows) != n else x
    x = be.rmsnorm(x, weights.output_norm, cfg.rms_eps)
    return be.qmatmul(weights.output, x)


def _linear(be, w, x, bias):
    y = be.qmatmul(w, x)
    return be.add(y, bias, out=y) if bias is not None else y
