"""MTP drafts: the model's own multi-token-prediction block (models/mtp.py) proposes the next tokens.

KV: the block has its own layer in the engine's paged int8 KV cache, index n_layers (the runner makes the
cache one layer deeper), so pages shared through the prefix trie, parked to host RAM, written to disk or
trimmed after rejected drafts carry it like the main layers. Row i of it is the block run on (the main
model's last hidden state at i, the token at i + 1) at rope position i (models/mtp.py).

Filling (`fill`, the scheduler's hook after a step's tokens are accepted, before its pages are committed):
every position the step computed and kept (prompt chunks, the pending token, accepted drafted tokens) gets
its row, from the step's hidden states (Transformer.forward(all_hidden=True)) and the now known next
tokens; the last prompt position gets its row in the step that samples the first generated token. For a
decoding sequence the row of its last computed position predicts the token after the pending one: the
first draft token, with its block output kept for the chain.

Drafting (`propose`, at plan time): per sequence, step j feeds the block its own previous block output as
the hidden state and its own previous argmax as the token, at the next position (rows past n_computed,
overwritten by `fill` once the true tokens are known). Drafts are greedy argmaxes; a token's confidence
is the product of the softmax probabilities along the draft (SpecController's auto widths read it as a
path probability, like a suffix draft's frequency). One forward per chain step for all sequences.

A placement keeps one cached token less (TieredKV reread_last): the row of the last cached position needs
the main model's hidden state there, which is not cached.
"""
from __future__ import annotations

import numpy as np

from ..batch import Batch
from ..kernels.sample_rows import SampleRows
from ..loader.gguf_file import GGUFFile
from ..loader.mtp import load_mtp, load_mtp_file
from ..models.mtp import MtpHead
from .suffix_index import Draft


class NoMtpBlock(ValueError):
    """--spec mtp for a model without an MTP block (and no --mtp file)."""


def mtp_weights(model_path: str, config, mtp_file: str | None):
    """The MTP block for a model: from mtp_file (a sidecar, loader/mtp.py) when given, else embedded in the
    model file, else None."""
    if mtp_file is not None:
        return load_mtp_file(str(mtp_file), config)
    if config.n_mtp_layers == 1:
        return load_mtp(GGUFFile(model_path), config)
    return None


def block_for_spec(model_path: str, config, spec, mtp_file: str | None):
    """The MTP block a drafting mode uses: mtp_weights for spec "auto" or "mtp", None for the others;
    NoMtpBlock for "mtp" without one."""
    if spec not in ("auto", "mtp"):
        return None
    weights = mtp_weights(model_path, config, mtp_file)
    if weights is None and spec == "mtp":
        raise NoMtpBlock(no_block_message(model_path, config))
    return weights


def no_block_message(model_path: str, config) -> str:
    return (f"--spec mtp needs an MTP block: {model_path} has none ('{config.arch}.nextn_predict_layers' is "
            f"{config.n_mtp_layers}); give one with --mtp FILE (a sidecar GGUF), or use --spec auto|suffix")


def check_mtp_available(model: str | None, spec, mtp_file: str | None) -> None:
    """Before serving: NoMtpBlock (one line) when spec is 'mtp' and neither the model file nor mtp_file has
    an MTP block; a GGUFError naming the field when mtp_file does not fit the model."""
    if spec != "mtp" and mtp_file is None:
        return
    from ..loader.known_models import resolve_model
    from ..loader.model_config import config_from_metadata
    path = resolve_model(model)
    cfg = config_from_metadata(GGUFFile(path).metadata, path)
    if mtp_file is not None:
        load_mtp_file(str(mtp_file), cfg)        # raises on a mismatch
    elif spec == "mtp" and cfg.n_mtp_layers != 1:
        raise NoMtpBlock(no_block_message(path, cfg))


class MtpDrafter:
    """Fills the MTP block's KV layer and proposes chained greedy drafts (module docstring)."""

    def __init__(self, model, weights, kv, layer: int):
        """model: the main Transformer; weights: loader.mtp.MtpWeights; kv: the engine's KVCache, whose
        layer `layer` (= the main model's n_layers) is the block's."""
        self.head = MtpHead(model, weights)
        self.model, self.backend, self.kv, self.layer = model, model.backend, kv, layer
        self.n_vocab = model.cfg.n_vocab
        self.hidden = None       # the open step's last hidden state at every batch row (device (n, n_embd))
        self.first: dict = {}    # seq -> (position of its pending token, first draft token, its probability,
                                 #         block outputs (device), row in them)
        self.grow = None         # (seq, n_tokens) -> how many fit in its pages: TieredKV.grow_free

    # filling the KV layer
    def target_forward(self, batch):
        """The main model's forward of a validated batch -> logits; its hidden states at every row
        (Transformer.forward(all_hidden=True): nothing more is computed) are kept for fill()."""
        logits, self.hidden = self.model.forward(batch, self.kv, all_hidden=True)
        return logits

    def fill(self, plan) -> None:
        """Scheduler hook (complete_step, after acceptance, before commit): the block's rows for every
        position of the plan's sequences computed and kept in this step, [first position, n_computed);
        for sequences that then decode, also their first draft token."""
        hidden, self.hidden = self.hidden, None
        if hidden is None:
            raise RuntimeError("MtpDrafter.fill without the step's hidden states")
        b = plan.batch
        rows, ids, pos, seq_of, logit_rows, logit_seqs, tables = [], [], [], [], [], [], []
        at = 0
        for seq, n in zip(plan.seqs, plan.n_tokens):
            start = int(b.positions[at])
            end = min(seq.n_computed, len(seq.tokens) - 1)         # row i needs the token at i + 1
            k = max(0, min(end - start, n))
            if k:
                r = len(tables)
                tables.append(seq.pages)
                rows.extend(range(at, at + k))
                ids.extend(seq.tokens[start + 1:start + k + 1])
                pos.extend(range(start, start + k))
                seq_of.extend([r] * k)
                if start + k == len(seq.tokens) - 1 and seq.spec is not None:    # the pending token is known
                    logit_rows.append(len(ids) - 1)
                    logit_seqs.append(seq)
            at += n
        if not rows:
            return
        out, logits = self._forward(hidden, rows, ids, pos, seq_of, tables, logit_rows)
        for j, (tok, p) in enumerate(self._argmax(logits)):
            seq = logit_seqs[j]
            self.first[seq] = (seq.n_computed, tok, p, out, logit_rows[j])

    def _forward(self, hidden, rows, ids, pos, seq_of, tables, logit_rows):
        be = self.backend
        width = max(len(t) for t in tables)
        page_tables = np.zeros((len(tables), width), np.int32)
        for r, t in enumerate(tables):
            page_tables[r, :len(t)] = t
        batch = Batch(np.asarray(ids, np.int32), np.asarray(pos, np.int32), np.asarray(seq_of, np.int32),
                      page_tables, np.asarray(logit_rows, np.int64))
        batch.validate(self.kv.n_pages, self.kv.page_size, self.n_vocab)
        n_hidden = hidden.shape[0]
        if len(rows) != n_hidden or rows != list(range(n_hidden)):
            hidden = be.take_rows(hidden, be.from_host(np.asarray(rows, np.int32)))
        logits, out = self.head.forward(batch, hidden, self.kv.layer(self.layer))
        return out, logits

    def _argmax(self, logits) -> list[tuple[int, float]]:
        """(argmax token, its softmax probability) per row: the backend's greedy sampling with logprobs."""
        m = logits.shape[0]
        if m == 0:
            return []
        s = self.backend.sample(logits, SampleRows.from_rows([{"n_logprobs": 0}] * m), None)
        return [(int(t), float(np.exp(lp))) for t, lp in zip(s.ids[:m], s.logprob[:m])]

    # drafting
    def first_token(self, seq) -> tuple[int, float] | None:
        """(token, probability) of seq's first draft token, known since the last fill; None if stale."""
        f = self.first.get(seq)
        if f is None or f[0] != seq.n_computed:
            return None
        return f[1], f[2]

    def propose(self, caps: dict, min_conf: float = 0.0) -> dict:
        """caps: seq -> most tokens to draft (>= 1). -> {seq: Draft} of greedy chains, each stopped at its cap,
        when no free page is left for its next row (self.grow: free pages only, as for drafted tokens), or
        when its confidence falls under min_conf."""
        drafts, state = {}, {}
        for seq, cap in caps.items():
            f = self.first.get(seq)
            if f is None or f[0] != seq.n_computed or cap < 1:
                continue
            drafts[seq] = ([f[1]], [f[2]])
            state[seq] = (cap, f[3], f[4])
        live = [s for s in drafts if state[s][0] > 1 and drafts[s][1][-1] >= min_conf]
        j = 1
        while live:
            if self.grow is not None:     # step j writes the row at n_computed + j - 1: its page, if one is free
                live = [s for s in live if self.grow(s, j) >= j]
                if not live:
                    break
            hidden = self._gather([state[s][1:] for s in live])
            idx = list(range(len(live)))
            out, logits = self._forward(hidden, idx, [drafts[s][0][-1] for s in live],
                                        [s.n_computed + j - 1 for s in live], idx, [s.pages for s in live], idx)
            for i, (s, (tok, p)) in enumerate(zip(live, self._argmax(logits))):
                toks, conf = drafts[s]
                toks.append(tok)
                conf.append(conf[-1] * p)
                state[s] = (state[s][0], out, i)
            j += 1
            live = [s for s in live if len(drafts[s][0]) < state[s][0] and drafts[s][1][-1] >= min_conf]
        return {s: Draft(t, c, 0) for s, (t, c) in drafts.items()}

    def _gather(self, srcs):
        """Rows (array, row) of device block outputs as one (m, n_embd) array."""
        be = self.backend
        arrays = {id(a): a for a, _ in srcs}
        if len(arrays) == 1:
            a = srcs[0][0]
            idx = [r for _, r in srcs]
            if idx == list(range(a.shape[0])):
                return a
            return be.take_rows(a, be.from_host(np.asarray(idx, np.int32)))
        parts = [be.take_rows(a, be.from_host(np.asarray([r], np.int32))) for a, r in srcs]
        return _stack(be, parts)

    def warm_up(self, next_ids, pages) -> None:
        """Compile the block's kernels: its rows over the runner's warm-up prompt (whose hidden states the
        last forward handed over), the head and the greedy sampling on the last one, then one chain row."""
        hidden, self.hidden = self.hidden, None
        n = hidden.shape[0]
        idx = list(range(n))
        out, logits = self._forward(hidden, idx, list(next_ids[:n]), idx, [0] * n, [pages], [n - 1])
        self._argmax(logits)
        if n > 1:
            self._forward(self._gather([(out, n - 1)]), [0], [int(next_ids[0])], [n - 1], [0], [pages], [0])

    def forget(self, seq) -> None:
        self.first.pop(seq, None)


def _stack(be, parts):
    """(1, n) device rows -> one (m, n) array (host round trip: only when chains come from different
    steps' outputs, which propose never mixes; kept for safety)."""
    return be.from_host(np.concatenate([be.to_host(p) for p in parts]))

