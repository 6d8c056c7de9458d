"""Forward pass of llama-style decoder blocks (qwen2, qwen3, llama), written once against Backend.

Differences between the architectures are flags on ModelConfig (q/k/v bias, q/k norm, rope style).
"""
from __future__ import annotations

import math

import numpy as np

from ..batch import Batch
from .k_smoothing import k_channel_scales


class Transformer:
    def __init__(self, backend, cfg, weights):
        self.backend, self.cfg, self.weights = backend, cfg, weights
        be, group = backend, cfg.n_heads // cfg.n_kv_heads
        self.layers = [_Layer(be, lw) for lw in weights.layers]
        self.group = group
        self.token_embd = be.upload_weight(weights.token_embd)
        tied = weights.output is weights.token_embd       # loader/weights.py: the same QuantTensor when tied
        self.output = self.token_embd if tied else be.upload_weight(weights.output, vocab_rows=True)
        self.output_norm = be.from_host(weights.output_norm)
        self.k_scales = [k_channel_scales(cfg, lw) for lw in weights.layers]  # host copies, for tests
        for layer, s in zip(self.layers, self.k_scales):
            layer.smooth_k(be, s, group)
            layer.compile(be, cfg)      # after smooth_k: a compiled block takes the scales as they are

    def reserve(self, max_tokens: int, max_keys: int, max_rows: int) -> None:
        """Let the backend size its workspaces once for forwards of up to max_tokens tokens at positions
        < max_keys, sampling up to max_rows logit rows per call."""
        cfg = self.cfg
        width = max(cfg.n_embd, cfg.n_ff, cfg.n_heads * cfg.head_dim)     # the widest mat-mul input
        self.backend.reserve(max_tokens, width, cfg.n_heads, cfg.head_dim, max_keys, cfg.n_vocab, max_rows)

    def forward(self, batch: Batch, kv, observer=None, return_hidden: bool = False, all_hidden: bool = False):
        """-> logits (len(batch.logit_rows), n_vocab) float32, on the device; with return_hidden also the last
        block's output at those rows (before the output norm: what an MTP block reads), as (logits, hidden);
        with all_hidden, (logits, hidden) with the last block's output at every row of the batch (n, n_embd)
        (the MTP drafter fills its KV layer for every computed position). Neither costs any computation:
        the hidden state is the array the output norm reads. The batch was validated (Batch.validate) by the
        caller; its arrays may be host numpy or already on the device.

        observer: optional callable(weight_name, x) called before each weight mat-mul with that weight's
        GGUF tensor name and its input activations x (host float32 (n_tok, n_in)); used by the imatrix."""
        be, cfg = self.backend, self.cfg
        obs = _observe(be, observer)
        n = len(batch.token_ids)
        rows = BlockRows(be, batch)
        x = be.embed(self.token_embd, rows.ids)                         # (n, n_embd)
        # the last block's output is read at the logit rows only (unless every row's hidden state is asked for,
        # or an observer sees every row): the other rows need just their K and V there
        last_at_logit_rows = (obs is None and not all_hidden and len(batch.logit_rows) < n
                              and isinstance(batch.token_ids, np.ndarray))
        blocks = list(zip(self.layers, self.weights.layers))
        for i, (lw, hw) in enumerate(blocks[:-1] if last_at_logit_rows else blocks):
            decoder_block(be, cfg, lw, hw, x, rows, kv.layer(i), obs)
        if last_at_logit_rows:
            i = len(blocks) - 1
            x = block_at_rows(be, cfg, *blocks[i], x, batch, batch.logit_rows, kv.layer(i))
            x = be.empty((0, cfg.n_embd)) if x is None else x
        x_all = x
        if len(batch.logit_rows) == 0:                                  # a prompt chunk that ends mid-prompt
            empty = be.empty((0, cfg.n_vocab))
            if all_hidden:
                return empty, x_all
            return (empty, be.empty((0, cfg.n_embd))) if return_hidden else empty
        if x.shape[0] != len(batch.logit_rows):                         # all rows: no copy
            x = be.take_rows(x, be.from_host(batch.logit_rows))
        h = be.rmsnorm(x, self.output_norm, cfg.rms_eps)
        if obs is not None:
            obs(h, self.weights.output)
        logits = be.qmatmul(self.output, h)
        if all_hidden:
            return logits, x_all
        return (logits, x) if return_hidden else logits


class BlockRows:
    """A batch's per-token arrays on the device, as every block reads them."""

    def __init__(self, be, batch: Batch):
        self.ids, self.pos = be.from_host(batch.token_ids), be.from_host(batch.positions)
        self.seq, self.tables = be.from_host(batch.token_seq), be.from_host(batch.page_tables)
        self.max_keys = batch.max_pos
        self.short_rows = batch.short_run_rows
        self.prompt_runs = getattr(batch, "prompt_runs", ())   # captured steps' batches hold no prompt runs


def decoder_block(be, cfg, lw, hw, x, rows: BlockRows, layer_kv, obs=None) -> None:
    """One decoder block on x (n, n_embd) in place: attention (this step's K/V stored into layer_kv
    first) and the SwiGLU FFN, each added to x. lw: the block as the backend holds it (_Layer), hw: its
    host weights (names for the observer obs, see _observe; None: no observer). Steps the backend's
    compiled block takes (lw.compiled: the same bits in one call) run there."""
    n = x.shape[0]
    if obs is None:
        if lw.compiled is not None and n <= lw.compiled.max_tokens:
            lw.compiled(x, rows.seq, rows.pos, rows.tables, *layer_kv)
            return
        obs = _ignore
    q = store_kv(be, cfg, lw, x, rows, layer_kv, lambda h: obs(h, hw.attn_q, hw.attn_k, hw.attn_v))
    a = be.attention(q, rows.seq, rows.pos, rows.tables, *layer_kv, 1.0 / math.sqrt(cfg.head_dim),
                     max_keys=rows.max_keys, split_rows=rows.short_rows,
                     runs=rows.prompt_runs)                              # (n, n_heads, head_dim)
    a = a.reshape(n, cfg.n_heads * cfg.head_dim)
    obs(a, hw.attn_output)
    be.qmatmul_add(lw.attn_output, a, x)
    h = be.rmsnorm(x, lw.ffn_norm, cfg.rms_eps, round_for=lw.gate_up or lw.ffn_gate)
    obs(h, hw.ffn_gate, hw.ffn_up)
    if lw.gate_up is not None:
        act = be.qmatmul_glu(lw.gate_up, h)
    else:
        g = be.qmatmul(lw.ffn_gate, h)
        act = be.silu_mul(g, be.qmatmul(lw.ffn_up, h), out=g)
    obs(act, hw.ffn_down)
    be.qmatmul_add(lw.ffn_down, act, x)


def store_kv(be, cfg, lw, x, rows: BlockRows, layer_kv, obs=None):
    """The first part of decoder_block on x (n, n_embd): its K and V rows stored into layer_kv (the same bits
    as the whole block stores: every step is row by row). -> q (n, n_heads, head_dim), roped, for the
    attention; rows that only need their KV rows written (models/mtp.py) stop here. obs(h): the observer of
    the normed input, if any."""
    h = be.rmsnorm(x, lw.attn_norm, cfg.rms_eps, round_for=lw.qkv or lw.qk or lw.attn_q)
    if obs is not None:
        obs(h)
    q, k, v = _project_qkv(be, cfg, lw, h)
    if cfg.qk_norm:
        q = be.rmsnorm(q.reshape(-1, cfg.head_dim), lw.attn_q_norm, cfg.rms_eps).reshape(q.shape)
        k = be.rmsnorm(k.reshape(-1, cfg.head_dim), lw.attn_k_norm, cfg.rms_eps).reshape(k.shape)
    # K smoothing (k_smoothing.py) folded into rope: q*s . k/s = q . k
    be.rope_kv_store(q, k, v, rows.seq, rows.pos, rows.tables, *layer_kv, cfg.rope_freq_base, cfg.n_rot,
                     cfg.rope_neox, lw.q_scale, lw.k_inv_scale)
    return q


def block_at_rows(be, cfg, lw, hw, x, batch: Batch, keep, layer_kv):
    """decoder_block on x (n, n_embd) where only the rows `keep` (host indices into the batch) are read after it:
    the other rows store their K and V alone (store_kv: their attention, output projection and FFN skipped), then
    the whole block runs on the kept rows, their attention reading those rows. -> the kept rows' outputs
    (len(keep), n_embd), None without kept rows. The rows stored and the outputs are the bits of the whole block
    on every row (batch invariance)."""
    keep = np.asarray(keep, dtype=np.int64)
    n = len(batch.token_ids)
    if len(keep) and lw.compiled is not None and n <= lw.compiled.max_tokens:
        # a decode-sized batch (an MTP fill's few rows): the backend's one-call block on every row reads the block's
        # weights once, where the split below reads the q/k/v projections twice and makes ~10 calls (CPU, the
        # default model's MTP fill: ~0.3 ms less a drafted step); the same rows stored, the same kept outputs
        y = x.copy()
        decoder_block(be, cfg, lw, hw, y, BlockRows(be, batch), layer_kv)
        return be.take_rows(y, be.from_host(keep.astype(np.int32)))
    rest = np.setdiff1d(np.arange(n), keep)
    if len(rest):
        part = x if not len(keep) else be.take_rows(x, be.from_host(rest.astype(np.int32)))
        store_kv(be, cfg, lw, part, BlockRows(be, batch.select(rest)), layer_kv)
    if not len(keep):
        return None
    y = be.take_rows(x, be.from_host(keep.astype(np.int32)))
    decoder_block(be, cfg, lw, hw, y, BlockRows(be, batch.select(keep)), layer_kv)
    return y


class _Layer:
    """One block's weights as the backend holds them."""
    MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    VECTORS = ("attn_norm", "ffn_norm", "attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_q_norm", "attn_k_norm")

    def __init__(self, be, lw):
        self.k_inv_scale = self.q_scale = None      # smooth_k sets them
        self.compiled = None                        # the backend's decode_block, where it has one
        for name in self.MATRICES:
            setattr(self, name, be.upload_weight(getattr(lw, name)))
        for name in self.VECTORS:
            v = getattr(lw, name)
            setattr(self, name, None if v is None else be.from_host(v))
        # matrices that read the same input become one mat-mul where the backend can fuse them
        # (fewer kernel launches per token); the separate copies are then dropped
        # (q, k, v; else q and k where v has another type, as Q4_K_M files give some blocks a Q8_0 v)
        self.qkv = be.fuse_rows([self.attn_q, self.attn_k, self.attn_v])
        self.qk = None if self.qkv is not None else be.fuse_rows([self.attn_q, self.attn_k])
        self.qkv_bias = self.qk_bias = None
        if lw.attn_q_bias is not None and self.qkv is not None:
            self.qkv_bias = be.from_host(np.concatenate([lw.attn_q_bias, lw.attn_k_bias, lw.attn_v_bias]))
        if lw.attn_q_bias is not None and self.qk is not None:
            self.qk_bias = be.from_host(np.concatenate([lw.attn_q_bias, lw.attn_k_bias]))
        if self.qkv is not None or self.qk is not None:
            self.attn_q = self.attn_k = None
        if self.qkv is not None:
            self.attn_v = None
        self.gate_up = be.fuse_rows([self.ffn_gate, self.ffn_up])
        if self.gate_up is not None:
            self.ffn_gate = self.ffn_up = None

    def compile(self, be, cfg) -> None:
        """Ask the backend for its one-call form of this block (Backend.decode_block; None where it has
        none). After smooth_k: the compiled block takes the scales as they are then."""
        self.compiled = be.decode_block(self, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps,
                                        cfg.rope_freq_base, cfg.n_rot, cfg.rope_neox, cfg.qk_norm,
                                        1.0 / math.sqrt(cfg.head_dim))

    def smooth_k(self, be, s, group: int) -> None:
        """K smoothing's per-channel scales s (n_kv_heads, head_dim), folded into rope (k_smoothing.py)."""
        self.k_inv_scale = be.from_host((1.0 / s).astype(np.float32))       # (n_kv_heads, head_dim)
        self.q_scale = be.from_host(np.repeat(s, group, axis=0))            # (n_heads, head_dim)


def _ignore(x, *ws) -> None:
    """The observer of a forward without one."""


def _observe(be, observer):
    """obs(x, *host_weights): report x (copied to the host once) to the observer under each weight's name;
    None without an observer."""
    if observer is None:
        return None

    def obs(x, *ws):
        xh = be.to_host(x)
        for w in ws:
            observer(w.name, xh)
    return obs


def _project_qkv(be, cfg, lw, h):
    """-> q (n, n_heads, head_dim), k and v (n, n_kv_heads, head_dim)."""
    n, q_dim, kv_dim = h.shape[0], cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    if lw.qkv is not None:
        q, k, v = be.qmatmul_split(lw.qkv, h, (q_dim, kv_dim, kv_dim), lw.qkv_bias)
    elif lw.qk is not None:
        q, k = be.qmatmul_split(lw.qk, h, (q_dim, kv_dim), lw.qk_bias)
        v = be.qmatmul_split(lw.attn_v, h, (kv_dim,), lw.attn_v_bias)[0]
    else:
        q, k, v = (be.qmatmul_split(lw.attn_q, h, (q_dim,), lw.attn_q_bias)[0],
                   be.qmatmul_split(lw.attn_k, h, (kv_dim,), lw.attn_k_bias)[0],
                   be.qmatmul_split(lw.attn_v, h, (kv_dim,), lw.attn_v_bias)[0])
    return (q.reshape(n, cfg.n_heads, cfg.head_dim), k.reshape(n, cfg.n_kv_heads, cfg.head_dim),
            v.reshape(n, cfg.n_kv_heads, cfg.head_dim))

