"""MTP drafts: the model's own multi-token-prediction block (models/mtp.py) proposes the next tokens.

KV: the block has its own layer in the engine's paged int8 KV cache, index n_layers (the runner makes the
cache one layer deeper), so pages shared through the prefix trie, parked to host RAM, written to disk or
trimmed after rejected drafts carry it like the main layers. Row i of it is the block run on (the main
model's last hidden state at i, the token at i + 1) at rope position i (models/mtp.py).

Filling (`fill`, the scheduler's hook after a step's tokens are accepted, before its pages are committed):
every position the step computed and kept (prompt chunks, the pending token, accepted drafted tokens) gets
its row, from the step's hidden states (Transformer.forward(all_hidden=True)) and the now known next
tokens; the last prompt position gets its row in the step that samples the first generated token. For a
decoding sequence the row of its last computed position predicts the token after the pending one: its
block output is kept, and the head (the vocabulary-wide mat-mul) runs on it only when the first draft
token is asked for (`first_token`, `propose`), so an eager step in which no sequence drafts from the block
runs the block for its KV rows and no head. Where the step was a captured graph of step_forward (CUDA), the
graph already ran the block on every row with the row's greedy token, and the head and its argmax too;
fill keeps those rows for sequences whose kept tokens are the greedy ones (with their first draft token:
nothing runs after the step for it) and computes only the others. On the CPU backend the fill defers the rows
(`defer`, `pending`: the hidden states on the host and the tokens after them) until a draft asks for the
sequence's first token, the step completes the page of its first waiting row (before the scheduler commits
that page to the prefix trie) or DEFER_MAX_ROWS rows wait, and then writes them in one forward (their K and V;
the whole block only on a row whose output a first draft reads: _fill_rows): a sequence that does not draft
from the block pays for its rows in forwards of up to DEFER_MAX_ROWS rows (where a row costs less than alone:
docs/speculative.md) instead of once a step. The rows' bits are the same
either way (batch invariance).

Drafting (`propose`, at plan time): per sequence, step j feeds the block its own previous block output as
the hidden state and its own previous argmax as the token, at the next position (rows past n_computed,
overwritten by `fill` once the true tokens are known). Drafts are greedy argmaxes; a token's confidence
is the product of the softmax probabilities along the draft (SpecController's auto widths read it as a
path probability, like a suffix draft's frequency). One forward per chain step for all sequences; where the
block's forwards are captured graphs (CUDA), the chain after the first token is queued as back-to-back
replays whose argmax feeds the next replay's token on the device (StepGraphs.run_chain), so a chain costs
one host round trip, not one per token.

Cost (`mtp_cost`): drafting k tokens costs k heads and k - 1 block forwards, in target decode steps from
the weights' byte sizes, the first head nothing where the step graphs run it anyway (capture), one block
forward more where the fill is deferred (the waiting rows' forward, which a draft now causes);
SpecController weighs it against a draft's expected gain.

A placement keeps one cached token less (TieredKV reread_last): the row of the last cached position needs
the main model's hidden state there, which is not cached.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..batch import Batch
from ..loader.gguf_file import GGUFFile
from ..loader.known_models import resolve_model, shipped_mtp_head
from ..loader.mtp import load_mtp, load_mtp_file
from ..models.mtp import MtpHead
from .suffix_index import Draft


# deferred KV rows of one sequence are written once this many wait, even before their page is complete: on a
# 2-core Zen 5 CPU (AVX-512 VNNI) the shipped block's fill of 32 rows (their K and V, the last row's whole block:
# _fill_rows) takes 0.52 ms, 0.016 a row, against 0.21 for one row alone (perf/bench_mtp_block.py), and the step
# that writes them carries half a page's rows instead of a whole one
DEFER_MAX_ROWS = 32


class NoMtpBlock(ValueError):
    """--spec mtp for a model without an MTP block (and no --mtp file)."""


def mtp_source(model_path: str, config, mtp_file: str | None, shipped: bool = True) -> str | None:
    """The file an MTP block comes from: mtp_file (a sidecar, loader/mtp.py) when given, else the model file
    when it embeds one, else (with shipped) the sidecar this package ships for that model
    (loader/known_models.py shipped_mtp_head), else None."""
    if mtp_file is not None:
        return str(mtp_file)
    if config.n_mtp_layers == 1:
        return model_path
    return shipped_mtp_head(model_path) if shipped else None


def mtp_weights(model_path: str, config, mtp_file: str | None, shipped: bool = True):
    """The MTP block for a model (mtp_source), or None."""
    if mtp_file is None and config.n_mtp_layers == 1:
        return load_mtp(GGUFFile(model_path), config)
    source = mtp_source(model_path, config, mtp_file, shipped)
    return None if source is None else load_mtp_file(source, config)


def block_for_spec(model_path: str, config, spec, mtp_file: str | None, shipped: bool = True):
    """The MTP block a drafting mode uses: mtp_weights for spec "auto" or "mtp" (a shipped sidecar only with
    shipped), None for the others; NoMtpBlock for "mtp" without one."""
    if spec not in ("auto", "mtp"):
        return None
    weights = mtp_weights(model_path, config, mtp_file, shipped)
    if weights is None and spec == "mtp":
        raise NoMtpBlock(no_block_message(model_path, config))
    return weights


def use_shipped(mode: str, backend) -> bool:
    """Whether drafting mode `mode` ("auto", "mtp", ...) takes the sidecar shipped for the model: "mtp" on any
    backend, "auto" on the CPU only (on CUDA, auto with it measured 1.4-1.6x on repetitive turns but 0.58x on
    prose, whose mostly rejected drafts cost more there than the cost rule prices them: docs/speculative.md)."""
    return mode == "mtp" or backend.name == "cpu"


def no_block_message(model_path: str, config) -> str:
    return (f"--spec mtp needs an MTP block: {model_path} has none ('{config.arch}.nextn_predict_layers' is "
            f"{config.n_mtp_layers}); give one with --mtp FILE (a sidecar GGUF), or use --spec auto|suffix")


def check_mtp_available(model: str | None, spec, mtp_file: str | None) -> None:
    """Before serving: NoMtpBlock (one line) when spec is 'mtp' and there is no MTP block (mtp_source); a
    GGUFError naming the field when mtp_file does not fit the model."""
    if spec != "mtp" and mtp_file is None:
        return
    from ..loader.model_config import config_from_metadata
    path = resolve_model(model)
    cfg = config_from_metadata(GGUFFile(path).metadata, path)
    if mtp_file is not None:
        load_mtp_file(str(mtp_file), cfg)        # raises on a mismatch
    elif spec == "mtp" and mtp_source(path, cfg, None) is None:
        raise NoMtpBlock(no_block_message(path, cfg))


class MtpCost(NamedTuple):
    """What MTP drafting costs, in target decode steps (mtp_cost)."""
    head: float      # the head over the vocabulary: once per drafted token
    block: float     # one forward of the block (eh_proj and its decoder block): per drafted token after the first
    first_head: bool = True   # the first token's head is the drafter's (False: every step runs it anyway)
    first_block: bool = False  # the first token also pays a block forward: the deferred KV rows' (MtpDrafter.defer)

    def token(self, i: int) -> float:
        """Drafted token i (from 0): the head (not for the first token when the step runs it anyway), plus
        from the second token on a block forward; the first token's block forward is the fill's, which the
        KV row needs anyway, unless the fill is deferred until a draft asks for it (first_block)."""
        if i:
            return self.block + self.head
        return (self.head if self.first_head else 0.0) + (self.block if self.first_block else 0.0)

    def draft(self, k: int) -> float:
        """A draft of k tokens: k * head + (k - 1) * block (one head less without first_head)."""
        return sum(self.token(i) for i in range(k))


def _matrix_bytes(lw) -> int:
    """Bytes of a decoder block's weight matrices (loader.weights.LayerWeights)."""
    return sum(m.nbytes for m in (lw.attn_q, lw.attn_k, lw.attn_v, lw.attn_output, lw.ffn_gate, lw.ffn_up,
                                  lw.ffn_down))


def mtp_cost(weights, mtp) -> MtpCost:
    """The cost of MTP drafting relative to one target decode step, as a ratio of weight bytes read (decode
    is bound by reading the weights). weights: the main model's loader.weights.Weights; mtp: MtpWeights.

        target = sum over the n_layers main blocks of their matrices' bytes + bytes(output matrix)
        block  = (bytes(eh_proj) + bytes(the MTP block's attention and FFN matrices)) / target
        head   = bytes(the MTP head: shared_head_head, else the model's output matrix; only the draft
                 vocabulary's rows when the block has one: loader.mtp.draft_head) / target

    Drafting k tokens costs k * head + (k - 1) * block target decode steps (MtpCost.token; one block more
    where the fill is deferred, MtpDrafter sets first_block). Embedding
    tables count for neither (a forward reads one row per token), nor do norm vectors and biases."""
    target = sum(_matrix_bytes(lw) for lw in weights.layers) + weights.output.nbytes
    block = mtp.eh_proj_embed.nbytes + mtp.eh_proj_hidden.nbytes + _matrix_bytes(mtp.block)
    out = weights.output       # draft_head's rows, counted without gathering them (every row has the same bytes)
    head = (mtp.head.nbytes if mtp.head is not None else
            out.nbytes if mtp.draft_vocab is None else out.nbytes // out.n_out * len(mtp.draft_vocab))
    return MtpCost(head / target, block / target)


class MtpDrafter:
    """Fills the MTP block's KV layer and proposes chained greedy drafts (module docstring)."""

    def __init__(self, model, weights, kv, layer: int):
        """model: the main Transformer; weights: loader.mtp.MtpWeights; kv: the engine's KVCache, whose
        layer `layer` (= the main model's n_layers) is the block's."""
        self.head = MtpHead(model, weights)
        self.model, self.backend, self.kv, self.layer = model, model.backend, kv, layer
        self.n_vocab = model.cfg.n_vocab
        # the CPU: KV rows wait in self.pending until a draft or a full page needs them (the CUDA backend's
        # workspaces are sized for a step's rows, and its step graphs fill the rows inside the step anyway)
        self.defer = self.backend.name == "cpu"
        self.cost = mtp_cost(model.weights, weights)._replace(first_block=self.defer)   # in target decode steps
        self.pending: dict = {}  # seq -> _Pending: computed positions whose block rows are not written yet
        self.hidden = None       # the open step's last hidden state at every batch row (device (n, n_embd))
        self.first: dict = {}    # seq -> _First: where its first draft token comes from
        self.grow = None         # (seq, n_tokens) -> how many fit in its pages: TieredKV.grow_free
        self.fill_graphs = self.chain_graphs = None     # captured block forwards (capture())
        self._vocab_dev = None   # the draft vocabulary's column -> token id map on the device (chain graphs)
        self.fused = None        # (block outputs, StepResults) of a step_forward graph's step, for fill()

    def capture(self, decode_graphs) -> None:
        """Replay the block's forwards as captured graphs where the backend captures them: decode_graphs is
        the backend's (kernels/backend.py) with the engine's page and key limits bound. Two sets: the fill's
        (KV rows only, no head) and the chain steps' (block and head on every row), each with the hidden
        states as a per-row input; a step the graphs do not accept (more rows than the largest bucket, a
        prompt chunk's fill) runs eagerly, with the same bits (kernels/cuda/graphs.py). With graphs, the
        decode steps (step_forward) run the head for the first draft token: it costs a drafting sequence
        nothing more (MtpCost.first_head)."""
        layer_kv, width = self.kv.layer(self.layer), self.model.cfg.n_embd
        self.fill_graphs = decode_graphs(lambda b, h: self.head.forward(b, h, layer_kv)[1], logits=False,
                                         row_inputs=(width,))
        self.chain_graphs = decode_graphs(lambda b, h: self.head.forward(b, h, layer_kv), row_inputs=(width,))
        if self.chain_graphs is not None:
            self.cost = self.cost._replace(first_head=False)
            if self.head.vocab is not None:
                self._vocab_dev = self.backend.from_host(self.head.vocab.astype(np.int32))

    # filling the KV layer
    def step_forward(self):
        """The main model's decode / verify forward for a captured graph, with the block's KV rows and first
        draft tokens fused in: forward(batch) -> (logits, step results (Backend.step_results: every row's
        greedy id, and the head's argmax column and probability), hidden states, block outputs). Row i of
        the block runs on the row's hidden state and the greedy argmax of its logits as the token at i + 1,
        which is the token a greedy sequence then keeps (an accepted draft equals it, and so does the sampled
        one), so for such rows fill() has nothing left to compute and the head's argmax at the row is the
        draft token after it; rows whose kept token differs (sampling, penalties) are filled again (fill).
        Rows past what a step keeps hold rows past n_computed, which later steps overwrite before anything
        reads them, as in the main layers."""
        be, layer_kv = self.backend, self.kv.layer(self.layer)

        def forward(batch):
            logits, hidden = self.model.forward(batch, self.kv, all_hidden=True)
            ids = be.argmax_ids(logits)
            res = be.step_results(logits, ids)
            head_logits, out = self.head.forward(_NextTokenRows(batch, ids), hidden, layer_kv)
            be.draft_results(head_logits, res)
            return logits, res, hidden, out
        return forward

    def target_forward(self, batch):
        """The main model's forward of a validated batch -> logits; its hidden states at every row
        (Transformer.forward(all_hidden=True): nothing more is computed) are kept for fill()."""
        logits, self.hidden = self.model.forward(batch, self.kv, all_hidden=True)
        self.fused = None
        return logits

    def keep_hidden(self, hidden, out=None, results=None) -> None:
        """The hidden states of a forward run elsewhere (a captured graph's, valid until its next replay:
        fill() reads them in the same step); with out and results, that forward was step_forward's: the block
        outputs of the rows it filled and its StepResults (greedy ids, first draft tokens)."""
        self.hidden = hidden
        self.fused = None if results is None else (out, results)

    def fill(self, plan) -> None:
        """Scheduler hook (complete_step, after acceptance, before commit): the block's rows for every
        position of the plan's sequences computed and kept in this step, [first position, n_computed);
        for sequences that then decode, the block output their first draft token comes from (the head
        runs on it when first_token or propose asks). With defer (the CPU) the rows wait in self.pending
        instead, except those of a page the step completed (_defer)."""
        hidden, self.hidden = self.hidden, None
        fused, self.fused = self.fused, None
        if hidden is None:
            raise RuntimeError("MtpDrafter.fill without the step's hidden states")
        b = plan.batch
        rows, ids, pos, seq_of, first_rows, first_seqs, tables = [], [], [], [], [], [], []
        greedy = None if fused is None else fused[1].greedy_ids()
        filled = []              # (seq, batch row of its first draft's block output): rows the step filled
        deferred = []            # (seq, first batch row, first position, rows) left for later (self.defer)
        at = 0
        for seq, n in zip(plan.seqs, plan.n_tokens):
            start = int(b.positions[at])
            end = min(seq.n_computed, len(seq.tokens) - 1)         # row i needs the token at i + 1
            k = max(0, min(end - start, n))
            if k and greedy is not None and np.array_equal(greedy[at:at + k], seq.tokens[start + 1:start + k + 1]):
                if start + k == len(seq.tokens) - 1 and _drafts_on(seq):
                    filled.append((seq, at + k - 1))
            elif k and self.defer:
                deferred.append((seq, at, start, k))
            elif k:
                r = len(tables)
                tables.append(seq.page_row())
                rows.extend(range(at, at + k))
                ids.extend(seq.tokens[start + 1:start + k + 1])
                pos.extend(range(start, start + k))
                seq_of.extend([r] * k)
                if start + k == len(seq.tokens) - 1 and _drafts_on(seq):    # the pending token is known
                    first_rows.append(len(ids) - 1)
                    first_seqs.append(seq)
            at += n
        if deferred:
            self._defer(hidden, deferred)
        if filled:               # the graph's own block outputs: valid until its next replay (_First.step)
            columns, probs = fused[1].drafts()
            tokens = self.head.token_ids(columns)
            for seq, row in filled:
                self.first[seq] = _First(seq.n_computed, fused[0], row, (int(tokens[row]), float(probs[row])),
                                         fused[1])
        if not rows:
            return
        out, at_row = self._fill_rows(hidden, rows, ids, pos, seq_of, tables, first_rows)
        if first_seqs and self.fill_graphs is not None:
            out = out.copy()      # kept past the step (a sequence may sit the next one out): off the graph's buffer
        for seq, row in zip(first_seqs, first_rows):
            self.first[seq] = _First(seq.n_computed, out, at_row[row], None, None)

    def _defer(self, hidden, deferred) -> None:
        """Keep the rows `deferred` ((seq, first batch row, first position, rows) of this step) in self.pending:
        the main model's hidden states there (copied to the host: the step's buffers are reused) and the
        tokens after them. A sequence whose first pending row lies in a page the step completed is filled
        now, so that the page is whole when the step commits it to the prefix trie, and so is one with
        DEFER_MAX_ROWS rows waiting."""
        be = self.backend
        idx = [at + i for _, at, _, k in deferred for i in range(k)]
        rows = be.to_host(be.take_rows(hidden, be.from_host(np.asarray(idx, np.int32))))
        due, at, P = [], 0, self.kv.page_size
        for seq, _, start, k in deferred:
            p = self.pending.setdefault(seq, _Pending())
            p.add(start, seq.tokens[start + 1:start + k + 1], rows[at:at + k])
            at += k
            if p.pos[0] // P < seq.n_computed // P or len(p.pos) >= DEFER_MAX_ROWS:
                due.append(seq)
        self._flush(due)

    def _flush(self, seqs) -> None:
        """Write the pending rows of seqs (one forward of the block over all of them, positions in order per
        sequence, as a prompt chunk's); a sequence whose last pending row is the one before its pending
        token gets its first-draft block output from it (the head runs when a draft asks: _first_tokens)."""
        seqs = [s for s in seqs if self.pending.get(s)]
        if not seqs:
            return
        ids, pos, seq_of, tables, parts, last = [], [], [], [], [], []
        for r, seq in enumerate(seqs):
            p = self.pending.pop(seq)
            tables.append(seq.page_row())
            ids.extend(p.ids)
            pos.extend(p.pos)
            seq_of.extend([r] * len(p.pos))
            parts.extend(p.rows)
            last.append(len(ids) - 1 if _gives_first_draft(seq, p) else None)
        hidden = self.backend.from_host(np.concatenate(parts))
        keep = [row for row in last if row is not None]
        out, at_row = self._fill_rows(hidden, list(range(len(ids))), ids, pos, seq_of, tables, keep)
        for seq, row in zip(seqs, last):
            if row is not None:
                self.first[seq] = _First(seq.n_computed, out, at_row[row], None, None)

    def fill_eagerly(self) -> None:
        """Write the block's KV rows in the step that computes them from now on (no deferral; the first
        drafted token priced without the rows' forward), for A/B runs (perf/bench_spec.py --eager-fill)."""
        self.settle()
        self.defer = False
        self.cost = self.cost._replace(first_block=False)

    def settle(self, seqs=None) -> None:
        """Write every pending row of seqs (default: all sequences): afterwards the block's KV layer holds the
        row of every position the fill has seen, as without deferral."""
        self._flush(list(self.pending) if seqs is None else seqs)

    def _batch(self, ids, pos, seq_of, tables, logit_rows) -> Batch:
        """A validated Batch of the block's rows: token ids, positions, row -> table index, page tables."""
        width = max(len(t) for t in tables)
        page_tables = np.zeros((len(tables), width), np.int32)
        for r, t in enumerate(tables):
            page_tables[r, :len(t)] = t
        batch = Batch(np.asarray(ids, np.int32), np.asarray(pos, np.int32), np.asarray(seq_of, np.int32),
                      page_tables, np.asarray(logit_rows, np.int64))
        batch.validate(self.kv.n_pages, self.kv.page_size, self.n_vocab)
        return batch

    def _forward(self, hidden, ids, pos, seq_of, tables):
        """One chain step: the block and head on every row (hidden: one row each) -> (block outputs, logits)."""
        batch = self._batch(ids, pos, seq_of, tables, list(range(len(ids))))
        if self.chain_graphs is not None and self.chain_graphs.accepts(batch):
            logits, out = self.chain_graphs.run(batch, hidden)
            return out, logits
        logits, out = self.head.forward(batch, hidden, self.kv.layer(self.layer))
        return out, logits

    def _fill_rows(self, hidden, rows, ids, pos, seq_of, tables, keep):
        """A fill's block rows: the main model's states hidden[rows], the tokens after them (ids) at positions pos
        -> (block outputs, {index in ids: its row in them}) for the rows `keep` (indices into ids: each the last
        of its sequence's rows) whose block output a first draft reads. A captured fill graph runs the whole block
        on every row. Eagerly the other rows only store their K and V (MtpHead.block_at_rows: the block's attention,
        output projection and FFN, ~90 % of its arithmetic a row, skipped), then the kept rows run the block,
        their attention reading those rows; the KV rows and the kept outputs are the bits of one whole forward."""
        be = self.backend
        if rows != list(range(hidden.shape[0])):
            hidden = be.take_rows(hidden, be.from_host(np.asarray(rows, np.int32)))
        batch = self._batch(ids, pos, seq_of, tables, [])
        if self.fill_graphs is not None and self.fill_graphs.accepts(batch):
            return self.fill_graphs.run(batch, hidden), {r: r for r in keep}
        out = self.head.block_at_rows(batch, hidden, self.kv.layer(self.layer), keep)
        return out, {r: i for i, r in enumerate(keep)}

    def _argmax(self, logits) -> list[tuple[int, float]]:
        """(argmax token, its softmax probability) per row (Backend.argmax_prob)."""
        if logits.shape[0] == 0:
            return []
        columns, probs = self.backend.argmax_prob(logits)
        tokens = self.head.token_ids(columns)        # a draft vocabulary's columns -> token ids
        return [(int(t), float(p)) for t, p in zip(tokens, probs)]

    # drafting
    def ready(self, seq) -> bool:
        """Whether seq has a first draft token to give: the last fill kept its block output at the position
        before its pending token (nothing is computed here)."""
        f = self.first.get(seq)
        if f is not None and f.pos == seq.n_computed:
            return True
        p = self.pending.get(seq)
        return bool(p) and _gives_first_draft(seq, p)

    def first_token(self, seq) -> tuple[int, float] | None:
        """(token, probability) of seq's first draft token (the head runs now if it has not for this
        position); None if the last fill left nothing for its current position."""
        return self._first_tokens([seq]).get(seq)

    def _first_tokens(self, seqs) -> dict:
        """{seq: (first draft token, probability)} for those of seqs that are ready(); the head runs once, on
        the kept block outputs of those whose token is not known yet."""
        seqs = [s for s in seqs if self.ready(s)]
        self._flush(seqs)         # deferred rows first (those with any): one forward for all
        todo = [s for s in seqs if self.first[s].token is None]
        if todo:
            x = self._gather([(self.first[s].out, self.first[s].row) for s in todo])
            for s, tp in zip(todo, self._argmax(self.head.logits(x))):
                self.first[s] = self.first[s]._replace(token=tp)
        return {s: self.first[s].token for s in seqs}

    def propose(self, caps: dict, min_conf: float = 0.0, floors: dict | None = None) -> dict:
        """caps: seq -> most tokens to draft (>= 1). -> {seq: Draft} of greedy chains, each stopped at its cap,
        when no free page is left for its next row (self.grow: free pages only, as for drafted tokens), or
        when its confidence falls under min_conf or under floors[seq][j], the least confidence at which
        drafted token j could still pay for itself (SpecController): token j is drafted only while the
        confidence so far (an upper bound of token j's) reaches it."""
        floors = floors or {}

        def more(s) -> bool:
            toks, conf = drafts[s]
            j, floor = len(toks), floors.get(s, ())
            return j < state[s][0] and conf[-1] >= max(min_conf, floor[j] if j < len(floor) else 0.0)

        drafts, state = {}, {}
        firsts = self._first_tokens([s for s, cap in caps.items() if cap >= 1])
        for seq, (tok, p) in firsts.items():
            f = self.first[seq]
            drafts[seq] = ([tok], [p])
            state[seq] = (caps[seq] if f.chainable() else 1, f.out, f.row)
        live = [s for s in drafts if more(s)]
        if live and self.chain_graphs is not None and self._chain_on_device(live, state, drafts, more):
            live = []
        j = 1
        while live:
            if self.grow is not None:     # step j writes the row at n_computed + j - 1: its page, if one is free
                live = [s for s in live if self.grow(s, j) >= j]
                if not live:
                    break
            hidden = self._gather([state[s][1:] for s in live])
            idx = list(range(len(live)))
            out, logits = self._forward(hidden, [drafts[s][0][-1] for s in live],
                                        [s.n_computed + j - 1 for s in live], idx, [s.page_row() for s in live])
            for i, (s, (tok, p)) in enumerate(zip(live, self._argmax(logits))):
                toks, conf = drafts[s]
                toks.append(tok)
                conf.append(conf[-1] * p)
                state[s] = (state[s][0], out, i)
            j += 1
            live = [s for s in live if more(s)]
        return {s: Draft(t, c, 0) for s, (t, c) in drafts.items()}

    def _chain_on_device(self, live, state, drafts, more) -> bool:
        """propose's further tokens (from the second on) for the sequences `live`, as one
        StepGraphs.run_chain: the whole chain is queued on the device and its argmaxes come back in one copy,
        instead of a host round trip per token. Each sequence runs to its cap or its free pages (self.grow);
        its confidence stop (more) is applied afterwards to the tokens computed, and since rows are
        independent the tokens kept are those the step-by-step loop gives (rows computed past the stop only
        wrote KV rows past n_computed, which fill() overwrites). False, with nothing drafted, when a step
        does not fit the graphs (more rows than the largest bucket, longer page tables than captured)."""
        steps = {s: state[s][0] - 1 for s in live}        # chain steps after the first token: cap - 1
        if self.grow is not None:                         # step j writes the row at n_computed + j - 1
            steps = {s: min(k, self.grow(s, k)) for s, k in steps.items()}
        order = sorted((s for s in live if steps[s] > 0), key=lambda s: -steps[s])   # each step a prefix
        if not order:
            return True
        batches = []
        for j in range(1, steps[order[0]] + 1):
            rows = order[:sum(steps[s] >= j for s in order)]
            idx = list(range(len(rows)))
            ids = [drafts[s][0][-1] for s in rows] if j == 1 else [0] * len(rows)    # j > 1: from the device
            batches.append(self._batch(ids, [s.n_computed + j - 1 for s in rows], idx, [s.page_row() for s in rows],
                                       idx))
        if not all(self.chain_graphs.accepts(b) for b in batches):
            return False
        hidden = self._gather([state[s][1:] for s in order])
        columns, probs = self.chain_graphs.run_chain(batches, hidden, self._vocab_dev)
        for i, s in enumerate(order):
            toks, conf = drafts[s]
            tokens = self.head.token_ids(columns[:steps[s], i])
            for tok, p in zip(tokens, probs[:steps[s], i]):
                if not more(s):
                    break
                toks.append(int(tok))
                conf.append(conf[-1] * float(p))
        return True

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
        last forward handed over) as a fill writes them, the head and the greedy sampling on the last one, then
        one chain row."""
        hidden, self.hidden = self.hidden, None
        n = hidden.shape[0]
        idx = list(range(n))
        out, at_row = self._fill_rows(hidden, idx, list(next_ids[:n]), idx, [0] * n, [pages], [n - 1])
        last = self._gather([(out, at_row[n - 1])])
        self._argmax(self.head.logits(last))
        if n > 1:
            self._forward(last, [int(next_ids[0])], [n - 1], [0], [pages])

    def forget(self, seq) -> None:
        self.first.pop(seq, None)
        self.pending.pop(seq, None)


def _drafts_on(seq) -> bool:
    """Whether seq may draft after this step: it drafts at all, and nothing ended it while the step ran (a
    cancel, or a stop string found while the step was in flight: its first-draft entry would outlive it)."""
    return seq.spec is not None and not seq.pending_finish


def _gives_first_draft(seq, p) -> bool:
    """Whether seq's pending rows p reach the position before its pending token (their forward then gives its
    first draft token's block output) and seq drafts."""
    return p.pos[-1] == seq.n_computed - 1 and _drafts_on(seq)


class _Pending:
    """Positions of one sequence computed with their block rows not written yet (MtpDrafter.defer), in order:
    per position the token after it and the main model's hidden state there (host rows)."""

    def __init__(self):
        self.pos: list[int] = []
        self.ids: list[int] = []
        self.rows: list = []       # host (k, n_embd) arrays, one per step, together len(pos) rows

    def __bool__(self) -> bool:
        return bool(self.pos)

    def add(self, start: int, ids, rows) -> None:
        """Rows of positions start, start + 1, ...; pending ones from start on (a re-read: placement on a
        shorter cached prefix, the last cached token read again) are replaced."""
        if self.pos and self.pos[-1] >= start:
            keep = sum(p < start for p in self.pos)
            flat = np.concatenate(self.rows)[:keep]
            self.pos, self.ids, self.rows = self.pos[:keep], self.ids[:keep], [flat] if keep else []
        self.pos.extend(range(start, start + len(rows)))
        self.ids.extend(int(t) for t in ids)
        self.rows.append(rows)


class _First(NamedTuple):
    """Where a sequence's first draft token comes from: the block output at its last computed position."""
    pos: int         # the position of its pending token (ready while the sequence's n_computed equals it)
    out: object      # device block outputs (n, n_embd) holding the row
    row: int
    token: tuple | None   # (first draft token, its probability) once a head ran on the row, else None
    step: object     # the StepResults whose graph buffers out is (valid until their next replay), None: a copy

    def chainable(self) -> bool:
        """Whether the block output still holds the row, so that a chain can go on from it (a step graph's
        buffer is overwritten by its next replay: a sequence that sat a step out drafts its first token
        only)."""
        return self.step is None or self.step.current()


class _NextTokenRows:
    """A captured step's batch as the block reads it, with each row's token replaced by device ids (the
    greedy token after the row: step_forward); every row a logit row (the head runs on all of them)."""

    short_run_rows = 0   # as the captured step's (graphs._StaticBatch): decode and verify rows only

    def __init__(self, batch, ids):
        self.token_ids, self.positions, self.token_seq = ids, batch.positions, batch.token_seq
        self.page_tables, self.max_pos = batch.page_tables, batch.max_pos
        self.logit_rows = np.arange(ids.shape[0], dtype=np.int64)


def _stack(be, parts):
    """(1, n) device rows -> one (m, n) array (host round trip: only when rows come from different steps'
    outputs: a sequence that was ready before a step it sat out, beside one the last fill made ready)."""
    return be.from_host(np.concatenate([be.to_host(p) for p in parts]))

