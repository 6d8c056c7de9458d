"""The MTP block (models/mtp.py's forward) as float numpy arrays: parameters, forward, loss, backward.

    e = enorm(embed(t[i+1])),  hh = hnorm(h[i]),  x = E @ e + H @ hh,  x = block(x)
    logits = head(head_norm(x))                        -> the token at i + 2
Trainable (MtpParams, by the GGUF names of loader/mtp.py): eh_embed (E), eh_hidden (H), enorm, hnorm and
the block's arrays. Frozen (FrozenHead): the embedding, the shared head norm (the model's output_norm)
and the output matrix. The loss is the cross-entropy against soft targets over k token ids per row
(k = 1, probability 1: the model's own greedy token; k > 1: its renormalized top-k distribution, i.e.
the KL to it up to a constant), computed in row chunks so that only (chunk, n_vocab) logits live at once.
Chained drafts (chain_fwd): at depth 2 row i + 1 is run again on the block's own output x[i] in place of
h[i + 1], with the text token t[i+2], predicting the model's token at i + 3; its attention sees the depth-1
rows' keys/values of positions <= i and its own (mixed_attention_fwd), all of pass 1 held constant. Depth
D runs row i + D - 1 on depth D - 1's output at i + D - 2 and also sees the chain's rows of depths 2..D-1
between. The training loss is loss1 + sum over D = 2..chain_depth of chain_weight^(D-1) * lossD
(loss_and_grads).
Everything is generic over the dtype of the parameters (float32 to train, float64 for the gradient check)
and over their array module (numpy, or CuPy with every input on the GPU: FrozenHead.to, tree_to).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernels.cpu.dequant import dequantize
from .loader.weights import QuantTensor
from .mtp_train_device import array_module, to_device, to_host
from .mtp_train_math import block_bwd, block_fwd, block_kv, rmsnorm_bwd, rmsnorm_fwd, rope_tables

BLOCK_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
BLOCK_VECTORS = ("attn_norm", "ffn_norm", "attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_q_norm",
                 "attn_k_norm")
HEAD_CHUNK_ROWS = 64     # rows of logits computed at once: (64, 151936) float32 = 39 MB for Qwen2.5
GPU_HEAD_CHUNK_ROWS = 2048   # on the GPU: 1.2 GB for Qwen2.5, and mat-muls large enough to fill the device


def dequant(w) -> np.ndarray:
    """QuantTensor -> float32 (n_out, n_in)."""
    return dequantize(w.qtype, np.ascontiguousarray(np.asarray(w.raw)), w.n_in)


def params_from_block(block, eh_embed, eh_hidden, enorm, hnorm) -> dict:
    """MtpParams (dict name -> float32 array) from a LayerWeights (its quantized matrices dequantized)
    and the eh_proj halves and input norms as float arrays."""
    p = {"eh_embed": np.array(eh_embed, np.float32), "eh_hidden": np.array(eh_hidden, np.float32),
         "enorm": np.array(enorm, np.float32), "hnorm": np.array(hnorm, np.float32)}   # copies: updated in place
    for name in BLOCK_MATRICES:
        p[name] = dequant(getattr(block, name))
    for name in BLOCK_VECTORS:
        v = getattr(block, name)
        if v is not None:
            p[name] = np.array(v, np.float32)
    return p


def params_from_mtp(mtp) -> dict:
    """MtpParams of an existing MTP block (loader.mtp.MtpWeights)."""
    return params_from_block(mtp.block, dequant(mtp.eh_proj_embed), dequant(mtp.eh_proj_hidden), mtp.enorm, mtp.hnorm)


def init_params(cfg, weights, hidden_rms: float) -> dict:
    """The starting point of training: the model's last decoder block, eh_proj = [0 | I] (the hidden state
    passes through, the embedding enters only once E has learned to use it), enorm = hnorm = hidden_rms
    (the typical RMS of the last hidden states: x starts at the scale the copied block was trained on,
    and E sees inputs of that scale too, so Adam moves E and H at comparable relative rates)."""
    n = cfg.n_embd
    s = np.full(n, hidden_rms, np.float32)
    return params_from_block(weights.layers[-1], np.zeros((n, n), np.float32), np.eye(n, dtype=np.float32), s, s)


@dataclass
class FrozenHead:
    """The frozen parts, as float arrays of the training dtype (numpy, or cupy after to())."""
    embed: object            # QuantTensor (host only: rows dequantized on demand) or a float (n_vocab, n_embd) array
    head_norm: object        # (n_embd,)
    head: object             # (n_vocab, n_embd)

    @classmethod
    def from_model(cls, weights, dtype=np.float32, mtp=None) -> "FrozenHead":
        """The model's embedding, output_norm and output; mtp (MtpWeights): its own ones where it has them."""
        out = weights.output if mtp is None or mtp.head is None else mtp.head
        emb = weights.token_embd if mtp is None or mtp.embed_tokens is None else mtp.embed_tokens
        norm = weights.output_norm if mtp is None or mtp.head_norm is None else mtp.head_norm
        head = dequant(out).astype(dtype, copy=False)
        return cls(head if out is emb else emb, norm.astype(dtype), head)

    def to(self, xp) -> "FrozenHead":
        """This head with its arrays on xp's device (explicit copies). A quantized embedding is dequantized
        whole for cupy (n_vocab x n_embd floats, like the head), so rows are gathered on the device; a tied
        embedding stays the head's one array."""
        if xp is np:
            return self
        head = to_device(xp, self.head)
        if self.embed is self.head:
            embed = head
        elif isinstance(self.embed, QuantTensor):
            embed = to_device(xp, dequant(self.embed).astype(self.head.dtype, copy=False))
        else:
            embed = to_device(xp, self.embed)
        return FrozenHead(embed, to_device(xp, self.head_norm), head)

    def embed_rows(self, ids, dtype):
        """Embedding rows of ids (any shape; arrays of the embedding's module) -> (ids.size, n_embd)."""
        if not isinstance(self.embed, QuantTensor):
            return self.embed[ids.reshape(-1)].astype(dtype, copy=False)
        ids = np.asarray(ids).reshape(-1)
        return dequantize(self.embed.qtype, np.ascontiguousarray(np.asarray(self.embed.raw)[ids]),
                          self.embed.n_in).astype(dtype, copy=False)


def trunk_fwd(cfg, p, frozen, hidden, next_ids, ctx_kv=None, first=0):
    """hidden (B, T, n_embd), next_ids (B, T) -> (block output x (B, T, n_embd), cache; trunk_kv reads the
    rows' roped keys/values from it). ctx_kv: None for depth-1 rows at rope positions 0..T-1 (causal
    attention); for the rows of a chained pass (chain_fwd) at positions first..first+T-1, the constant
    (k_ctx, v_ctx, chain) of mtp_train_math.mixed_attention_fwd."""
    B, T, n = hidden.shape
    dt = p["eh_hidden"].dtype
    e = frozen.embed_rows(next_ids, dt).reshape(B, T, n)
    en, c_e = rmsnorm_fwd(e, p["enorm"], cfg.rms_eps)
    hn, c_h = rmsnorm_fwd(hidden.astype(dt, copy=False), p["hnorm"], cfg.rms_eps)
    x0 = en @ p["eh_embed"].T + hn @ p["eh_hidden"].T
    cos, sin = rope_tables(first + T, cfg.rope_freq_base, cfg.n_rot, dt, array_module(p["eh_hidden"]))
    cs = (cos[first:], sin[first:])
    x, c_blk = block_fwd(cfg, p, x0, cs, ctx_kv)
    return x, (en, c_e, hn, c_h, c_blk, cs)


def trunk_kv(cache):
    """The roped keys and values (B, T, Hkv, head_dim) of a trunk_fwd's rows."""
    return block_kv(cache[4])


def chain_fwd(cfg, p, frozen, x_prev, kvs, next_ids):
    """Depth D = len(kvs) + 1 >= 2, as a chained draft runs at inference. x_prev (B, T - D + 2, n_embd): the
    block output of pass D - 1; kvs: the roped (k, v) of passes 1..D-1 (pass j's (B, T - j + 1, Hkv,
    head_dim) each); all constants (no gradient flows back into earlier passes); next_ids (B, T): the text
    tokens t[i+1] of pass 1's rows. Row i (i = 0..T-D, rope position i + D - 1) gets hidden x_prev[i] (the
    previous draft's output, position i + D - 2) and token next_ids[i + D - 1] = t[i+D], and attends to
    pass 1's rows 0..i, row i of each pass 2..D-1 (the chain's drafts at positions i + 1..i + D - 2) and its
    own key/value. At D = 2: row i + 1 on x1[i] and t[i+2], seeing pass 1's rows 0..i.
    -> (x_D (B, T - D + 1, n_embd) predicting the tokens at i + D + 1, the targets of rows D-1..T-1; cache)."""
    n = x_prev.shape[1] - 1
    (k1, v1), chain = kvs[0], tuple((k[:, :n], v[:, :n]) for k, v in kvs[1:])
    return trunk_fwd(cfg, p, frozen, x_prev[:, :n], next_ids[:, len(kvs):], (k1[:, :n], v1[:, :n], chain),
                     first=len(kvs))


def trunk_bwd(cfg, p, dx, cache) -> dict:
    en, c_e, hn, c_h, c_blk, cs = cache
    dx0, g = block_bwd(cfg, p, dx, c_blk, cs)
    d2 = dx0.reshape(-1, dx0.shape[-1])
    g["eh_embed"] = d2.T @ en.reshape(d2.shape)
    g["eh_hidden"] = d2.T @ hn.reshape(d2.shape)
    g["enorm"] = rmsnorm_bwd(dx0 @ p["eh_embed"], c_e)[1]
    g["hnorm"] = rmsnorm_bwd(dx0 @ p["eh_hidden"], c_h)[1]
    return g


def head_loss(cfg, frozen, x, tgt_ids, tgt_p, want_grad=True):
    """x (N, n_embd); tgt_ids, tgt_p (N, k) -> (mean loss, dx (N, n_embd) or None, top-1 hits vs tgt_ids[:, 0]).
    The per-chunk loss and hits stay device scalars until the end: one device -> host copy per call."""
    N, xp = x.shape[0], array_module(x)
    xn, c_n = rmsnorm_fwd(x, frozen.head_norm.astype(x.dtype, copy=False), cfg.rms_eps)
    W = frozen.head if frozen.head.dtype == x.dtype else frozen.head.astype(x.dtype)
    dxn = xp.empty_like(xn) if want_grad else None
    chunk = HEAD_CHUNK_ROWS if xp is np else GPU_HEAD_CHUNK_ROWS
    losses, hits = [], []
    for lo in range(0, N, chunk):
        hi = min(lo + chunk, N)
        z = xn[lo:hi] @ W.T                                       # (c, n_vocab)
        hits.append((z.argmax(-1) == tgt_ids[lo:hi, 0]).sum())
        z -= z.max(-1, keepdims=True)
        rows, ids = xp.arange(hi - lo)[:, None], tgt_ids[lo:hi]
        zt = z[rows, ids]                                         # (c, k) shifted target logits
        xp.exp(z, out=z)
        s = z.sum(-1, keepdims=True)
        q = tgt_p[lo:hi].astype(x.dtype)
        losses.append(-(q * (zt - xp.log(s))).sum())
        if want_grad:
            z /= s                                               # softmax; d loss / d z = softmax * sum(q) - q
            z *= q.sum(-1, keepdims=True)
            z[rows, ids] -= q                                     # a row's k ids are distinct
            dxn[lo:hi] = (z @ W) / N
    dx = rmsnorm_bwd(dxn, c_n)[0] if want_grad else None
    loss = sum(float(v) for v in to_host(xp.stack(losses)))     # summed in float64, chunk by chunk
    return loss / N, dx, int(to_host(xp.stack(hits)).sum())


def rows_loss(cfg, frozen, x, tgt_ids, tgt_p, want_grad=True):
    """head_loss over block outputs x (B, T, n_embd) and targets (B, T, k) -> (mean loss, dx (B, T, n_embd)
    or None, top-1 hits)."""
    k = tgt_ids.shape[-1]
    loss, dx, hits = head_loss(cfg, frozen, x.reshape(-1, x.shape[-1]), tgt_ids.reshape(-1, k),
                               tgt_p.reshape(-1, k), want_grad)
    return loss, (dx.reshape(x.shape) if want_grad else None), hits


def feature_loss(cfg, frozen, x, h_next, weight):
    """The feature term of a pass: its block outputs x (B, R, n_embd) against the model's own last hidden
    states h_next (B, R, n_embd) of the positions one further (the states whose greedy tokens x's rows
    draft), both as the head reads them (rmsnorm with the head norm): weight * mean over rows of the squared
    distance over the mean square of the targets' normalized rows. A pass's output is the next chained
    pass's hidden-state input, which pass 1 reads from the model: pulled towards the model's state, a chained
    draft sees what pass 1 was trained on (EAGLE's feature regression, on normalized states: the hidden
    states' few very large channels would rule a plain squared error). -> (loss, dx like x)."""
    xp, w = array_module(x), frozen.head_norm.astype(x.dtype, copy=False)
    y, c_y = rmsnorm_fwd(x, w, cfg.rms_eps)
    t, _ = rmsnorm_fwd(h_next.astype(x.dtype, copy=False), w, cfg.rms_eps)
    scale = weight / ((t * t).mean() * (y.shape[0] * y.shape[1]))    # weight / (R2 * rows): a device scalar
    d = y - t
    loss = float(scale * xp.sum(d * d) / y.shape[2])       # a host number, as rows_loss's
    return loss, rmsnorm_bwd(2.0 * scale / y.shape[2] * d, c_y)[0]


def _add_feature(cfg, frozen, x, dx, hidden, depth, weight):
    """Adds pass `depth`'s feature term (feature_loss) to its loss gradient dx in place: rows r < T - depth
    of x (position r + depth - 1) against hidden[:, r + depth]. -> the term's loss (0.0 without one)."""
    rows = hidden.shape[1] - depth
    if not weight or rows <= 0:
        return 0.0
    loss, d = feature_loss(cfg, frozen, x[:, :rows], hidden[:, depth:], weight)
    dx[:, :rows] += d
    return loss


def depth1_loss_and_grads(cfg, p, frozen, batch, feature_weight=0.0):
    """Pass 1 -> (mean loss, {name: gradient}, top-1 hits, its block output x, its roped (k, v)): the last
    two are the chained passes' constant inputs (chain_fwd). feature_weight: its feature term's weight
    (feature_loss; 0: none), included in the loss."""
    hidden, next_ids, tgt_ids, tgt_p = batch
    x, cache = trunk_fwd(cfg, p, frozen, hidden, next_ids)
    loss, dx, hits = rows_loss(cfg, frozen, x, tgt_ids, tgt_p)
    loss = loss + _add_feature(cfg, frozen, x, dx, hidden, 1, feature_weight)
    return loss, trunk_bwd(cfg, p, dx, cache), hits, x, trunk_kv(cache)


def chain_loss_and_grads(cfg, p, frozen, batch, x_prev, kvs, feature_weight=0.0):
    """Pass D = len(kvs) + 1 on the earlier passes' constants x_prev, kvs (chain_fwd) against the targets of
    rows D-1..T-1 (the model's tokens i + D + 1) -> (mean loss, {name: gradient}, top-1 hits, its block
    output, its roped (k, v)): the last two are the next pass's constant inputs. feature_weight as
    depth1_loss_and_grads'."""
    hidden, next_ids, tgt_ids, tgt_p = batch
    x, cache = chain_fwd(cfg, p, frozen, x_prev, kvs, next_ids)
    loss, dx, hits = rows_loss(cfg, frozen, x, tgt_ids[:, len(kvs):], tgt_p[:, len(kvs):])
    loss = loss + _add_feature(cfg, frozen, x, dx, hidden, len(kvs) + 1, feature_weight)
    return loss, trunk_bwd(cfg, p, dx, cache), hits, x, trunk_kv(cache)


def loss_and_grads(cfg, p, frozen, batch, chain_weight=0.0, chain_depth=2, feature_weight=0.0):
    """batch: (hidden (B, T, n_embd), next_ids (B, T), tgt_ids (B, T, k), tgt_p (B, T, k))
    -> (mean loss, {name: gradient}, top-1 hits of pass 1). The loss is loss1 + sum over D = 2..chain_depth
    of chain_weight^(D-1) * lossD, each pass's inputs from the earlier passes held constant (the gradient
    is that of this stop-gradient objective); chain_weight 0 or chain_depth 1 runs pass 1 alone. With
    feature_weight each pass's loss has its feature term (feature_loss) of that weight."""
    loss, grads, hits, x, kv = depth1_loss_and_grads(cfg, p, frozen, batch, feature_weight)
    kvs, weight = [kv], 1.0
    for _ in range(chain_depth - 1 if chain_weight else 0):       # passes 2..chain_depth
        weight *= chain_weight
        loss_d, grads_d, _, x, kv = chain_loss_and_grads(cfg, p, frozen, batch, x, kvs, feature_weight)
        kvs.append(kv)
        loss += weight * loss_d
        for name, g in grads_d.items():
            grads[name] += weight * g
    return loss, grads, hits


def evaluate(cfg, p, frozen, batch):
    """-> (mean loss, top-1 hits, rows): the head's argmax against the model's greedy token i + 2."""
    hidden, next_ids, tgt_ids, tgt_p = batch
    x, _ = trunk_fwd(cfg, p, frozen, hidden, next_ids)
    loss, _, hits = rows_loss(cfg, frozen, x, tgt_ids, tgt_p, want_grad=False)
    return loss, hits, tgt_ids.shape[0] * tgt_ids.shape[1]


def evaluate_depths(cfg, p, frozen, batch, depth=2):
    """-> [(mean loss, top-1 hits, rows) of pass 1 (as evaluate), the same of passes 2..depth]: pass D's
    argmax against the model's greedy token i + D + 1, i.e. a chained D-th draft's agreement."""
    hidden, next_ids, tgt_ids, tgt_p = batch
    x, cache = trunk_fwd(cfg, p, frozen, hidden, next_ids)
    kvs, out = [trunk_kv(cache)], []
    for d in range(1, depth + 1):
        if d > 1:
            x, cache = chain_fwd(cfg, p, frozen, x, kvs, next_ids)
            kvs.append(trunk_kv(cache))
        ids, q = tgt_ids[:, d - 1:], tgt_p[:, d - 1:]
        loss, _, hits = rows_loss(cfg, frozen, x, ids, q, want_grad=False)
        out.append((loss, hits, ids.shape[0] * ids.shape[1]))
    return out


def draft_hits(cfg, p, frozen, batch, vocab):
    """-> (top-1 hits, rows) of a head cut to a draft vocabulary against the model's greedy token i + 2:
    frozen's head holds only the rows of vocab (ascending token ids, an integer array of the parameters'
    module), so its argmax column j drafts token vocab[j]."""
    hidden, next_ids, tgt_ids, _ = batch
    x, _ = trunk_fwd(cfg, p, frozen, hidden, next_ids)
    xn, _ = rmsnorm_fwd(x.reshape(-1, x.shape[-1]), frozen.head_norm.astype(x.dtype, copy=False), cfg.rms_eps)
    pick = vocab[(xn @ frozen.head.astype(x.dtype, copy=False).T).argmax(-1)]
    return int((pick == tgt_ids[..., 0].reshape(-1)).sum()), pick.shape[0]


def logits(cfg, p, frozen, hidden, next_ids):
    """(B, T, n_vocab) logits of the token at i + 2 (small inputs: tests)."""
    x, _ = trunk_fwd(cfg, p, frozen, hidden, next_ids)
    xn, _ = rmsnorm_fwd(x, frozen.head_norm.astype(x.dtype), cfg.rms_eps)
    return xn @ frozen.head.astype(x.dtype).T
