"""MTP drafting on the CUDA backend: the block's forwards replayed as captured graphs (the fill's KV rows and
the chain steps, spec/mtp_drafter.py capture()) give the eager forward's bits, a chain queued on the device
(run_chain) drafts what the host loop drafts, and the engine's greedy
output with `--spec mtp` equals `--spec off` token for token with the graphs in use. A tiny model with a
random MTP block (tests/tiny_model.py) at head_dim 64, the smallest the CUDA attention takes."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tiny_model import write_tiny_model

from strata_lite.spec.mtp_drafter import _First

pytestmark = pytest.mark.gpu

N_CTX = 512


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtpcuda") / "mtp.gguf"
    return str(write_tiny_model(path, mtp=True, arch="qwen2", qtype=QT.Q8_0, n_embd=256, n_ff=512, n_heads=4,
                                n_kv_heads=2))


class _Counted:
    """A StepGraphs whose replays are counted."""

    def __init__(self, graphs):
        self.graphs, self.runs = graphs, 0

    def accepts(self, batch):
        return self.graphs.accepts(batch)

    def run(self, batch, *inputs):
        self.runs += 1
        return self.graphs.run(batch, *inputs)

    def run_chain(self, batches, *args):
        self.runs += len(batches)
        return self.graphs.run_chain(batches, *args)


class _Seq:
    """What MtpDrafter.propose and fill read of a sequence."""

    def __init__(self, n_computed, pages, tokens=()):
        self.n_computed, self.pages, self.tokens, self.spec = n_computed, pages, list(tokens), object()
        self.pending_finish = False

    def page_row(self):
        return np.asarray(self.pages, np.int32)


def _runner(mtp_path):
    """A CUDA ModelRunner of the tiny model with its MTP block (graphs captured)."""
    from strata_lite.runner import ModelRunner, load_model
    from strata_lite.spec.mtp_drafter import mtp_weights
    loaded = load_model(mtp_path, backend="cuda")
    return ModelRunner(loaded, kv_tokens=1024, page_size=64, host_bytes=0, n_ctx=N_CTX, max_step_tokens=64,
                       max_seqs=4, mtp_weights=mtp_weights(mtp_path, loaded.config, None))


def test_block_graphs_give_the_eager_bits(mtp_path):
    runner = _runner(mtp_path)
    cfg, be, kv, d = runner.loaded.config, runner.backend, runner.kv, runner.mtp
    fill, chain = _Counted(d.fill_graphs), _Counted(d.chain_graphs)
    rng = np.random.default_rng(0)
    pages = kv.alloc(2)
    ids = [int(t) for t in rng.integers(0, cfg.n_vocab, 50)]

    def hidden(n):
        return be.from_host(rng.standard_normal((n, cfg.n_embd)).astype(np.float32))

    def layer_rows():
        return [be.to_host(a).copy() for a in kv.layer(d.layer)]

    # a prompt's 40 rows (more than the largest bucket: eager, their K and V alone), then a verify-shaped fill of
    # 3 rows (the last one's block output kept) and a chain step, each through the graphs and again eagerly over
    # the same positions (the eager fill: K and V of the first two rows, the whole block on the third)
    d._fill_rows(hidden(40), list(range(40)), ids[1:41], list(range(40)), [0] * 40, [pages], [])
    h3, h1 = hidden(3), hidden(1)

    def fill_step():
        out, at_row = d._fill_rows(h3, [0, 1, 2], ids[41:44], [40, 41, 42], [0] * 3, [pages], [2])
        return [be.to_host(out)[at_row[2]]]

    def chain_step():
        out, logits = d._forward(h1, [ids[44]], [43], [0], [pages])
        return [be.to_host(out), be.to_host(logits)]

    for step, counted in ((fill_step, fill), (chain_step, chain)):
        d.fill_graphs, d.chain_graphs = fill, chain
        runs = counted.runs
        got = step() + layer_rows()
        assert counted.runs == runs + 1
        d.fill_graphs = d.chain_graphs = None
        want = step() + layer_rows()
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["vocab", "draft_vocab"])
def test_device_chain_equals_the_step_loop(mtp_path, draft_vocab):
    """propose's chain as one run_chain (argmax feeding the next replay on the device) gives the tokens and
    confidences, bit for bit, of the host loop of one forward per token, with sequences of different caps,
    one stopped by its confidence floor and one by its free pages; with a draft vocabulary (a permutation of
    the columns here) mapped on the device as the host maps it."""
    runner = _runner(mtp_path)
    cfg, be, kv, d = runner.loaded.config, runner.backend, runner.kv, runner.mtp
    rng = np.random.default_rng(1)
    if draft_vocab:
        d.head.vocab = rng.permutation(cfg.n_vocab).astype(np.int32)
        d._vocab_dev = be.from_host(d.head.vocab)
    seqs = [_Seq(n, kv.alloc(2)) for n in (30, 45, 61)]
    for s in seqs:                                   # the block's KV rows of each prompt, eagerly
        n = s.n_computed
        hid = be.from_host(rng.standard_normal((n, cfg.n_embd)).astype(np.float32))
        d._fill_rows(hid, list(range(n)), [int(t) for t in rng.integers(0, cfg.n_vocab, n)], list(range(n)),
                     [0] * n, [s.pages], [])
    outs = be.from_host(rng.standard_normal((3, cfg.n_embd)).astype(np.float32))
    caps = {seqs[0]: 5, seqs[1]: 4, seqs[2]: 3}
    floors = {seqs[1]: [0.0, 0.0, 1.0]}             # seqs[1] stops before its third token
    d.grow = lambda s, n: min(n, 1) if s is seqs[2] else n      # seqs[2]: one chain row's page only

    def propose():
        for i, s in enumerate(seqs):
            d.first[s] = _First(s.n_computed, outs, i, None, None)
        return d.propose(caps, 0.0, floors)

    counted = _Counted(d.chain_graphs)
    d.chain_graphs = counted
    on_device = propose()
    assert counted.runs == 4                          # seqs[0]'s 4 chain steps (the others: prefixes of them)
    d.chain_graphs = None
    looped = propose()
    assert [len(on_device[s].tokens) for s in seqs] == [5, 2, 2]
    for s in seqs:
        assert on_device[s].tokens == looped[s].tokens
        assert on_device[s].conf == looped[s].conf


@pytest.mark.parametrize("kept", ["greedy", "other"])
def test_rows_filled_in_the_step_graph_equal_the_eager_fill(mtp_path, kept):
    """A decode step replayed through the runner's graph (step_forward: the block's row beside the main
    forward, with the greedy token) leaves the block's KV row and the first draft's block output that an
    eager fill with the kept token gives, bit for bit: taken as is when the kept token is the greedy one (no
    fill graph runs; the first draft token is the graph's head argmax, equal to the eager head's), computed
    again when it is another (sampling)."""
    from types import SimpleNamespace
    from strata_lite.batch import Batch
    runner = _runner(mtp_path)
    cfg, be, kv, d = runner.loaded.config, runner.backend, runner.kv, runner.mtp
    rng = np.random.default_rng(2)
    seq = _Seq(0, kv.alloc(2), [int(t) for t in rng.integers(0, cfg.n_vocab, 41)])
    prompt = Batch.single(seq.tokens[:40], 0, seq.pages, [39])
    runner.forward(prompt)                                   # eager (40 rows): the block's rows by fill
    seq.n_computed = 40
    d.fill(SimpleNamespace(batch=prompt, seqs=[seq], n_tokens=[40]))
    step = Batch.single(seq.tokens[40:41], 40, seq.pages, [0])
    assert runner.graphs.accepts(step)
    greedy = int(be.to_host(runner.forward(step)).argmax())
    hidden = be.to_host(d.hidden).copy()
    assert d.fused is not None
    nxt = greedy if kept == "greedy" else (greedy + 1) % cfg.n_vocab
    seq.tokens.append(nxt)
    seq.n_computed = 41
    fill = _Counted(d.fill_graphs)
    d.fill_graphs = fill
    d.fill(SimpleNamespace(batch=step, seqs=[seq], n_tokens=[1]))
    assert fill.runs == (0 if kept == "greedy" else 1)
    out, row, first = d.first[seq].out, d.first[seq].row, d.first[seq].token
    if kept == "greedy":          # the step graph's head gave the first draft token: the eager head's
        assert first == d._argmax(d.head.logits(be.take_rows(out, be.from_host(np.array([row], np.int32)))))[0]
    else:
        assert first is None      # the head runs when a draft asks for it
    got = [be.to_host(out)[row]] + [be.to_host(a).copy() for a in kv.layer(d.layer)]
    d.fill_graphs = None                                     # the reference: the row again, eagerly
    ref, at_row = d._fill_rows(be.from_host(hidden), [0], [nxt], [40], [0], [seq.pages], [0])
    want = [be.to_host(ref)[at_row[0]]] + [be.to_host(a).copy() for a in kv.layer(d.layer)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    if kept == "greedy":          # the row is the graph's own buffer: a chain goes on from it until the next replay
        assert d.first[seq].chainable() and len(d.propose({seq: 3})[seq].tokens) == 3
        runner.forward(step)
        assert not d.first[seq].chainable() and d.propose({seq: 3})[seq].tokens == [first[0]]


def _greedy(eng, prompts, tag):
    from strata_lite.engine_events import DoneEvent, TokenEvent
    from strata_lite.sequence import Request
    handles = [eng.submit(Request(f"{tag}{i}", tuple(p), max_tokens=24, logprobs=2)) for i, p in enumerate(prompts)]
    out = []
    for h in handles:
        events = list(h.events(timeout=300))
        assert isinstance(events[-1], DoneEvent), events[-1]
        out.append([(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent)])
    return out


def test_engine_greedy_with_mtp_graphs_equals_spec_off(mtp_path):
    from spec_engines import start_engine
    prompts = [[5, 17, 200, 3, 99], [42, 7, 7, 120, 64, 33, 8], [1, 2, 3]]
    off = start_engine(mtp_path, "off", N_CTX, backend="cuda")
    try:
        want = [_greedy(off, [p], "o") for p in prompts[:1]] + [_greedy(off, prompts, "O")]
    finally:
        off.stop()
    on = start_engine(mtp_path, "mtp", N_CTX, backend="cuda")
    try:
        d = on._runner.mtp
        d.fill_graphs, d.chain_graphs = _Counted(d.fill_graphs), _Counted(d.chain_graphs)
        fused, keep = [], d.keep_hidden

        def counted_keep(hidden, out=None, results=None):
            fused.append(results is not None)
            keep(hidden, out, results)
        d.keep_hidden = counted_keep
        on._spec.width = 3
        got = [_greedy(on, [p], "m") for p in prompts[:1]] + [_greedy(on, prompts, "M")]
        assert got == want
        assert on._spec.by_source["mtp"]["drafted"] > 20
        # decode / verify steps filled the block's rows inside their own graph (greedy: nothing refilled);
        # the fill graphs ran for the prompts' rows only
        assert sum(fused) > 20 and d.fill_graphs.runs <= 4 and d.chain_graphs.runs > 10
    finally:
        on.stop()
