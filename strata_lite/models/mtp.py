"""The MTP block's forward (loader/mtp.py has the layout), written once against Backend.

Row i of a sequence combines the main model's last hidden state at position i (Transformer.forward with
return_hidden: it predicts the token at i + 1) with the embedding of the token at i + 1, runs one decoder
block at rope position i with the block's own KV layer, and predicts the token at i + 2 through the shared
head:
    x = eh_proj([enorm(embed(t[i+1])); hnorm(h[i])])      (as E @ enorm(e) + H @ hnorm(h): loader/mtp.py)
    x = block(x);  logits = head(head_norm(x))
The block's output x is the hidden state a chained draft feeds back in place of h. With a draft
vocabulary (loader/mtp.py) the head holds only its rows: logits column j scores token draft_vocab[j]
(token_ids maps a column back).
"""
from __future__ import annotations

import numpy as np

from ..batch import Batch
from ..loader.mtp import draft_head
from .k_smoothing import k_channel_scales
from .transformer import BlockRows, Transformer, _Layer, block_at_rows, decoder_block


class MtpHead:
    def __init__(self, model: Transformer, mtp):
        """model: the main Transformer (its embedding, output norm and head serve where the MTP block has
        none); mtp: loader.mtp.MtpWeights."""
        be, cfg = model.backend, model.cfg
        self.backend, self.cfg, self.mtp = be, cfg, mtp
        self.eh_embed = be.upload_weight(mtp.eh_proj_embed)
        self.eh_hidden = be.upload_weight(mtp.eh_proj_hidden)
        self.enorm, self.hnorm = be.from_host(mtp.enorm), be.from_host(mtp.hnorm)
        self.layer = _Layer(be, mtp.block)
        self.k_scales = k_channel_scales(cfg, mtp.block)           # host copy, for tests
        self.layer.smooth_k(be, self.k_scales, model.group)
        self.layer.compile(be, cfg)
        self.embed = model.token_embd if mtp.embed_tokens is None else be.upload_weight(mtp.embed_tokens)
        self.head_norm = model.output_norm if mtp.head_norm is None else be.from_host(mtp.head_norm)
        head = draft_head(model.weights.output, mtp)
        self.head = (model.output if head is model.weights.output else
                     be.upload_weight(head, vocab_rows=True))
        self.n_head = head.n_out             # logits columns: n_vocab, or the draft vocabulary's size
        self.vocab = mtp.draft_vocab         # None, or column -> token id (int32)

    def forward(self, batch: Batch, hidden, layer_kv):
        """batch: one row per position i (positions = i, token_ids = the token at i + 1, the sequences'
        page tables into the MTP block's KV layer layer_kv = (k_pages, k_scales, v_pages, v_scales));
        hidden (n, n_embd): the main model's last hidden state at each i (or the previous draft's block
        output). -> (logits (len(batch.logit_rows), n_vocab) of the token at i + 2 for the batch's logit
        rows, the block's output at every row (n, n_embd)). Rows that only fill the KV layer (a prompt
        chunk's) skip the head, the block's largest mat-mul (and those whose output nobody reads the block's
        attention and FFN: block_at_rows). With a draft vocabulary the logits have its n_head columns (token_ids)."""
        be = self.backend
        rows = BlockRows(be, batch)
        x = self._input(rows, hidden)
        decoder_block(be, self.cfg, self.layer, self.mtp.block, x, rows, layer_kv)
        n, sel = x.shape[0], batch.logit_rows
        if len(sel) == 0:
            return be.empty((0, self.n_head)), x
        y = x if len(sel) == n else be.take_rows(x, be.from_host(sel))
        return self.logits(y), x

    def block_at_rows(self, batch: Batch, hidden, layer_kv, keep):
        """forward's block outputs at the rows keep alone (len(keep), n_embd; None without kept rows): the other
        rows store only their K and V for later rows' attention (a fill's earlier positions), the block's attention
        and FFN skipped there (transformer.block_at_rows: forward's bits). No head."""
        rows = BlockRows(self.backend, batch)
        return block_at_rows(self.backend, self.cfg, self.layer, self.mtp.block, self._input(rows, hidden), batch,
                             keep, layer_kv)

    def _input(self, rows: BlockRows, hidden):
        """eh_proj([enorm(embed(t[i+1])); hnorm(h[i])]) -> the block's input (n, n_embd)."""
        be, cfg = self.backend, self.cfg
        e = be.rmsnorm(be.embed(self.embed, rows.ids), self.enorm, cfg.rms_eps)
        h = be.rmsnorm(hidden, self.hnorm, cfg.rms_eps)
        x = be.qmatmul(self.eh_embed, e)
        be.add(x, be.qmatmul(self.eh_hidden, h), out=x)
        return x

    def token_ids(self, columns) -> np.ndarray:
        """Logits columns (host ints) -> the token ids they score."""
        columns = np.asarray(columns, np.int64)
        return columns if self.vocab is None else self.vocab[columns].astype(np.int64)

    def logits(self, x):
        """The head alone: block outputs x (m, n_embd) -> logits (m, n_head) of the token each predicts
        (head(head_norm(x)), row by row: the same values whether run in forward or later on kept rows)."""
        return self.backend.qmatmul(self.head, self.backend.rmsnorm(x, self.head_norm, self.cfg.rms_eps))
