"""MTP drafting (spec/mtp_drafter.py) on a tiny model with a random MTP block (tests/tiny_model.py): the block's
KV layer in the engine's paged cache and its drafts equal the block run from scratch (and the float64
reference), greedy output with `--spec mtp` equals `--spec off` (1 slot, 3 slots, beside a long prompt read),
a sidecar block drafts like the embedded one, `--spec mtp` without a block fails with one line, and a drafter
rigged to propose the model's own continuation gets its drafts accepted and emitted."""
import argparse
import random
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite import LLM
from strata_lite.batch import Batch
from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.engine_events import DoneEvent, TokenEvent
from strata_lite.kernels.sample_rows import SampleRows
from strata_lite.loader.errors import GGUFError
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.mtp import write_mtp_file
from strata_lite.models.mtp import MtpHead
from strata_lite.runner import ModelRunner, load_model
from strata_lite.sampling import SamplingParams
from strata_lite.scheduler import Scheduler
from strata_lite.sequence import Request
from strata_lite.spec import SpecController
from strata_lite.spec.mtp_drafter import MtpCost, NoMtpBlock, mtp_cost, mtp_weights
from strata_lite.spec.suffix_index import Draft
from reference_model import reference_mtp_logits
from fake_engine import VOCAB, FakeBackend, FakeRunner, chain, reference_generation
from spec_engines import start_engine
from tiny_model import write_tiny_model

N_CTX = 256
REL_TOL = 1e-4          # as tests/engine/test_mtp.py
FLIP_TOL = 0.03         # as tests/engine/test_api.py: only where the backend is not batch-invariant


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtpd")
    kw = dict(arch="qwen2", qtype=QT.Q8_0, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2)
    embedded = write_tiny_model(d / "mtp.gguf", mtp=True, **kw)
    plain = write_tiny_model(d / "plain.gguf", **kw)           # the same main weights, no block
    side = d / "plain.mtp.gguf"
    llm = LLM(str(embedded), backend="cpu", n_ctx=N_CTX)
    write_mtp_file(GGUFFile(embedded), llm.config, str(side))
    return dict(embedded=str(embedded), plain=str(plain), sidecar=str(side))


@pytest.fixture(scope="module")
def llm(files):
    return LLM(files["embedded"], backend="cpu", n_ctx=N_CTX)


def _same(llm, got, want):
    if llm.backend.int8:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=FLIP_TOL * np.abs(want).max())


# ---------------------------------------------------------------- a step loop without the engine thread
class Mini:
    """ModelRunner + Scheduler + SpecController("mtp") stepped by hand, greedy."""

    def __init__(self, path, mtp_file=None, width=3, n_slots=2, step_tokens=16, page_size=16, kv_tokens=768,
                 host_bytes=1 << 22, disk_dir=None):
        loaded = load_model(path, "cpu")
        weights = mtp_weights(loaded.path, loaded.config, mtp_file)
        self.cfg = loaded.config
        self.runner = ModelRunner(loaded, kv_tokens, page_size, host_bytes, n_ctx=N_CTX,
                                  max_step_tokens=step_tokens + 64, max_seqs=64, mtp_weights=weights,
                                  disk_dir=disk_dir, disk_bytes=1 << 26)
        self.spec = SpecController("mtp")
        self.spec.width = width
        self.spec.use_mtp(self.runner.mtp)
        self.sched = Scheduler(self.runner.kv, self.runner.host, self.runner.copier, n_slots=n_slots,
                               step_tokens=step_tokens, max_seq_len=N_CTX, drafter=self.spec,
                               kv_filler=self.runner.mtp.fill, disk=self.runner.disk)
        self.runner.mtp.grow = self.sched.tiers.grow_free
        self.drafts = []          # (seq id, n_computed, draft tokens, conf) of every draft verified

    def add(self, rid, prompt, max_tokens):
        seq = self.sched.add(Request(rid, tuple(prompt), max_tokens=max_tokens))
        self.spec.attach(seq)
        return seq

    def step(self):
        plan = self.sched.plan_step()
        if plan is None:
            return None
        for seq, d in plan.drafts.items():
            self.drafts.append((seq.id, seq.n_computed, list(d), list(seq.spec.draft.conf)))
        logits = self.runner.forward(plan.batch)
        ids = self.runner.sample(logits, SampleRows.greedy(len(plan.logit_seqs))).ids[:len(plan.logit_seqs)]
        events = self.sched.complete_step(plan, [int(t) for t in ids])
        for ev in events:
            if ev.finish_reason:
                self.spec.finished(ev.seq)
        return plan

    def run(self, check=None):
        while self.sched.has_work:
            self.step()
            if check is not None:
                check(self)

    def mtp_rows(self, pages, n):
        """The MTP layer's K, K scales, V, V scales at positions 0..n-1 of a page table."""
        P, L = self.runner.kv.page_size, self.cfg.n_layers
        idx = [(pages[p // P], p % P) for p in range(n)]
        return [np.stack([a[L][pg, sl] for pg, sl in idx]) for a in
                (self.runner.kv.k_pages, self.runner.kv.k_scales, self.runner.kv.v_pages, self.runner.kv.v_scales)]


def _check_mtp_rows(mini, llm, head, seq) -> int:
    """seq's MTP rows against the block run from scratch: those of its completed pages (what a step may
    commit to the prefix trie) as they are, and after its waiting rows are written (MtpDrafter.settle) all of
    [0, n_computed). -> how many rows were waiting."""
    n, P, mtp = seq.n_computed, mini.runner.kv.page_size, mini.runner.mtp
    want = _scratch(llm, head, seq.tokens, n)[0]
    whole = n // P * P
    for got, ref in zip(mini.mtp_rows(seq.pages, n), want):
        _same(llm, got[:whole], ref[:whole])
    waiting = len(mtp.pending[seq].pos) if seq in mtp.pending else 0
    mtp.settle([seq])
    for got, ref in zip(mini.mtp_rows(seq.pages, n), want):
        _same(llm, got, ref)
    return waiting


def _scratch(llm, head, tokens, n):
    """The block run from scratch over rows 0..n-1 of tokens (hidden states from one main forward):
    (its KV rows as Mini.mtp_rows gives them, logits of every row, block outputs, main hidden states)."""
    cfg = llm.config
    batch = Batch.single(tokens[:n], 0, llm._pages)
    batch.validate(llm.kv.n_pages, llm.kv.page_size, cfg.n_vocab)
    _, hidden = llm.model.forward(batch, llm.kv, return_hidden=True)
    kv = llm.backend.kv_arrays(1, llm.kv.n_pages, llm.kv.page_size, cfg.n_kv_heads, cfg.head_dim)
    layer = tuple(a[0] for a in kv)
    b = Batch.single(tokens[1:n + 1], 0, llm._pages)
    b.validate(llm.kv.n_pages, llm.kv.page_size, cfg.n_vocab)
    logits, out = head.forward(b, hidden, layer)
    rows = [a.reshape((-1,) + a.shape[2:])[:n] for a in layer]
    return rows, logits, out, hidden, layer


def _scratch_chain(llm, head, tokens, n, k):
    """The draft of k tokens after tokens[:n + 1] (tokens[n] pending) from scratch, with its confidences."""
    _, logits, out, _, layer = _scratch(llm, head, tokens, n)
    z = np.asarray(logits[n - 1], np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    toks, conf = [int(np.argmax(z))], [float(p.max())]
    h = out[n - 1:n]
    for j in range(1, k):
        b = Batch.single([toks[-1]], n + j - 1, llm._pages)
        lg, o = head.forward(b, h, layer)
        z = np.asarray(lg[0], np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        toks.append(int(np.argmax(z)))
        conf.append(conf[-1] * float(p.max()))
        h = o
    return toks, conf


# ---------------------------------------------------------------- KV layer and drafts
def test_kv_rows_and_drafts_equal_the_block_from_scratch(files, llm):
    """Two sequences (one reading a 70-token prompt in chunks of 16 beside the other's decodes), then a
    third whose prompt extends the first one's conversation (a trie hit: the last cached token is read
    again). After every step each running sequence's MTP rows of its completed pages (those the step may
    commit to the prefix trie) equal the block run from scratch while the others may still wait
    (MtpDrafter.defer), and once they are written (settle) all its rows [0, n_computed) do; every verified
    draft equals the from-scratch chain."""
    mini = Mini(files["embedded"], width=3)
    head = MtpHead(llm.model, mtp_weights(files["embedded"], llm.config, None))
    checked = {"rows": 0, "waiting": 0}

    def check(m):
        for seq in m.sched.running:
            n = seq.n_computed
            if n < 2 or seq.n_computed >= len(seq.tokens):
                continue
            checked["waiting"] += _check_mtp_rows(m, llm, head, seq)
            checked["rows"] += n

    rng = random.Random(0)
    first = [rng.randrange(250) for _ in range(9)]
    a = mini.add("a", first, 24)
    mini.add("b", [rng.randrange(250) for _ in range(70)], 12)
    mini.run(check)
    follow = a.tokens + [rng.randrange(250) for _ in range(5)]
    c = mini.add("c", follow, 10)
    mini.step()
    assert c.records[-1].reused > 0 and c.n_computed == len(follow)   # prefix reused, last cached one re-read
    mini.run(check)
    assert checked["rows"] > 500 and checked["waiting"] > 20 and len(mini.drafts) > 20
    for sid, n, toks, conf in mini.drafts[:12]:
        seq = {"a": a, "c": c}.get(sid)
        if seq is None:
            continue
        want_t, want_c = _scratch_chain(llm, head, seq.tokens, n, len(toks))
        if toks != want_t:                  # only a rounding flip at a near tie may differ (no int8 kernels)
            assert not llm.backend.int8
            continue
        np.testing.assert_allclose(conf, want_c, rtol=1e-5)


def test_eager_fill_writes_every_row_in_its_step_and_drafts_the_same(files, llm):
    """MtpDrafter.fill_eagerly (perf/bench_spec.py --eager-fill): nothing waits after any step, every row
    [0, n_computed) equals the block from scratch as it is, and the drafts (tokens, confidences) and outputs
    equal those of the deferred fill, whose rows do wait in some steps."""
    head = MtpHead(llm.model, mtp_weights(files["embedded"], llm.config, None))
    runs = []
    for eager in (False, True):
        mini = Mini(files["embedded"], width=3)
        if eager:
            mini.runner.mtp.fill_eagerly()
        waited = [0]

        def check(m, eager=eager, waited=waited):
            waited[0] += sum(len(p.pos) for p in m.runner.mtp.pending.values())
            if eager:
                for seq in m.sched.running:
                    n = seq.n_computed
                    if 2 <= n < len(seq.tokens):
                        for got, ref in zip(m.mtp_rows(seq.pages, n), _scratch(llm, head, seq.tokens, n)[0]):
                            _same(llm, got, ref)

        a = mini.add("a", [7, 99, 3, 140, 22, 61, 5, 5, 18, 200, 11], 30)
        b = mini.add("b", [(13 * j + 5) % 250 for j in range(40)], 20)
        mini.run(check)
        runs.append((mini.drafts, a.generated, b.generated, waited[0]))
    (deferred, *out_d, waited_d), (eager, *out_e, waited_e) = runs
    assert waited_e == 0 < waited_d
    assert deferred == eager and out_d == out_e and len(eager) > 10


def test_pending_rows_read_again_replace_the_waiting_ones():
    """_Pending (MtpDrafter.defer): rows added after the waiting ones extend them; rows of positions read
    again (placement on a shorter cached prefix, the re-read last token) replace the waiting rows from there
    on, with their tokens and hidden states."""
    from strata_lite.spec.mtp_drafter import _Pending
    p = _Pending()
    assert not p
    p.add(10, [1, 2, 3], np.full((3, 4), 1.0, np.float32))
    p.add(13, [4, 5], np.full((2, 4), 2.0, np.float32))
    assert p.pos == [10, 11, 12, 13, 14] and p.ids == [1, 2, 3, 4, 5]
    p.add(12, [7, 8, 9], np.full((3, 4), 3.0, np.float32))
    assert p.pos == [10, 11, 12, 13, 14] and p.ids == [1, 2, 7, 8, 9]
    np.testing.assert_array_equal(np.concatenate(p.rows)[:, 0], [1, 1, 3, 3, 3])
    p.add(5, [6], np.full((1, 4), 4.0, np.float32))
    assert p.pos == [5] and p.ids == [6] and np.concatenate(p.rows).shape == (1, 4)


def test_first_draft_logits_match_float64_reference(files, llm):
    """The block's logits for the row that gives the first draft token match the float64 reference, and
    the drafter's first token and probability are its argmax and softmax."""
    mini = Mini(files["embedded"], width=1, n_slots=1)
    seq = mini.add("r", [7, 99, 3, 140, 22, 61, 5, 5, 18, 200, 11], 40)
    for _ in range(4):
        mini.step()
    n = seq.n_computed
    tok, p = mini.runner.mtp.first_token(seq)
    weights = mtp_weights(files["embedded"], llm.config, None)
    head = MtpHead(llm.model, weights)
    _, logits, _, hidden, _ = _scratch(llm, head, seq.tokens, n)
    ref = reference_mtp_logits(llm.config, llm.weights, weights, seq.tokens[:n + 1],
                               np.vstack([hidden, hidden[-1:]]), k_scale=head.k_scales)
    assert np.abs(np.asarray(logits, np.float64) - ref).max() <= REL_TOL * np.abs(ref).max()
    z = ref[n - 1]
    top2 = np.sort(z)[-2:]
    if top2[1] - top2[0] > 1e-3 * np.abs(z).max():
        assert tok == int(np.argmax(z))
    q = np.exp(z - z.max())
    assert abs(p - q[tok] / q.sum()) < 1e-4


def test_sidecar_drafts_like_the_embedded_block(files):
    got = []
    for path, side in ((files["embedded"], None), (files["plain"], files["sidecar"])):
        mini = Mini(path, mtp_file=side, width=4)
        mini.add("x", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 20)
        mini.add("y", list(range(30, 75)), 14)
        mini.run()
        got.append(mini.drafts)
    assert got[0] == got[1] and len(got[0]) > 10


def test_pages_stay_owned_under_memory_pressure(files, llm):
    """A device cache of 6 pages for 3 sequences: parking, restoring and trimming keep the MTP rows right
    (checked at the end against the block from scratch) and the page accounting clean."""
    mini = Mini(files["embedded"], width=4, n_slots=3, page_size=16, kv_tokens=96)
    head = MtpHead(llm.model, mtp_weights(files["embedded"], llm.config, None))
    seqs = [mini.add(f"p{i}", [(17 * i + j) % 250 for j in range(20 + 7 * i)], 18) for i in range(3)]

    waiting = [0]

    def check(m):
        assert m.sched.tiers.audit(m.sched.running) == []
        for seq in m.sched.running:
            if 2 <= seq.n_computed < len(seq.tokens):
                waiting[0] += _check_mtp_rows(m, llm, head, seq)

    mini.run(check)
    assert waiting[0] > 0
    assert all(s.finish_reason == "length" for s in seqs)
    assert mini.sched.counters["preemptions"] + mini.sched.tiers.stats["pages_parked"] > 0


def test_disk_tier_carries_the_mtp_layer(files, llm, tmp_path):
    """Pages written to the disk tier hold the MTP layer: after a restart a conversation read back from disk
    (its last page re-read from its last token on) has the rows of the block run from scratch."""
    head = MtpHead(llm.model, mtp_weights(files["embedded"], llm.config, None))
    first = Mini(files["embedded"], disk_dir=str(tmp_path))
    a = first.add("a", [(5 * j + 3) % 250 for j in range(40)], 30)
    first.run()
    second = Mini(files["embedded"], disk_dir=str(tmp_path))
    b = second.add("b", a.tokens + [1, 2, 3], 4)
    second.step()
    rec = b.records[-1]
    assert rec.from_disk == 63 and rec.read == rec.n_prompt - 63       # 4 pages less the re-read token
    n = b.n_computed
    for got, ref in zip(second.mtp_rows(b.pages, n), _scratch(llm, head, b.tokens, n)[0]):
        _same(llm, got, ref)


# ---------------------------------------------------------------- the engine: same output as --spec off
def _engine(model_path, spec, **kw):
    return start_engine(model_path, spec, N_CTX, **kw)


def _run_all(eng, prompts, tag, max_tokens=24):
    handles = [eng.submit(Request(f"{tag}{i}", tuple(p), max_tokens=max_tokens, logprobs=3))
               for i, p in enumerate(prompts)]
    out = []
    for h in handles:                    # logprobs too: the target's logits are bit for bit those without drafts
        events = list(h.events(timeout=120))
        assert isinstance(events[-1], DoneEvent), events[-1]
        toks = [e for e in events if isinstance(e, TokenEvent)]
        out.append(([e.token_id for e in toks], [(e.logprob, e.top_logprobs) for e in toks], events[-1].text,
                    events[-1].finish_reason))
    return out


PROMPTS = [[5, 17, 200, 3, 99], [42, 7, 7, 120, 64, 33, 8], [1, 2, 3]]
LONG = [(i * 37) % 250 for i in range(150)]


@pytest.fixture(scope="module")
def off_engine(files):
    eng = _engine(files["embedded"], "off")
    yield eng
    eng.stop()


@pytest.mark.parametrize("spec,width", [("mtp", 4), ("mtp", "auto"), ("auto", "auto")])
def test_greedy_output_equals_spec_off(files, off_engine, spec, width):
    on = _engine(files["embedded"], spec)
    try:
        assert on._runner.mtp is not None and on._runner.kv.k_pages.shape[0] == on._runner.loaded.config.n_layers + 1
        on._spec.width = width
        for i, prompts in enumerate(([PROMPTS[0]], PROMPTS, [LONG] + PROMPTS[1:])):
            if i == 2:                   # a long prompt is read beside the others' decodes
                handles = [on.submit(Request("long", tuple(LONG), max_tokens=8))]
                got = _run_all(on, PROMPTS[1:], f"m{i}-")
                list(handles[0].events(timeout=120))
                want = _run_all(off_engine, PROMPTS[1:], f"o{i}-")
            else:
                got, want = _run_all(on, prompts, f"m{i}-"), _run_all(off_engine, prompts, f"o{i}-")
            assert got == want
        if width != "auto":
            t = on._spec.totals
            assert t["drafted"] > 50 and on._spec.by_source["mtp"]["drafted"] == t["drafted"]
        assert on._sched.tiers.audit(on._sched.running, on._reserved_pages()) == []
    finally:
        on.stop()


def test_rigged_drafter_is_accepted(files, llm, off_engine):
    """The drafter proposes the model's own greedy continuation (from a separate LLM) with confidence 0.99:
    nearly every drafted token is accepted, auto widths draft deep, and the output is unchanged. The block's
    forwards are priced at nothing here (what they cost is tested below): the tiny model's own block is
    half its weights, at which price drafting past one token does not pay."""
    on = _engine(files["embedded"], "mtp", parallel=2)
    mtp = on._runner.mtp
    mtp.cost = MtpCost(head=0.0, block=0.0)
    # a fixed step-cost line (1 s a step + 10 ms a token: a step bound by reading the weights), not the
    # timings of this machine, which under load can price a deep draft out and make the widths flaky
    on._spec.cost.line = lambda: (1.0, 0.01)
    real = mtp.propose

    def rigged(caps, min_conf=0.0, floors=None):
        real(caps, min_conf, floors)     # keep the block's KV work as it is
        out = {}
        for seq, cap in caps.items():
            true = llm.generate(list(seq.tokens), max_tokens=cap).token_ids
            out[seq] = Draft(true, [0.99 ** (i + 1) for i in range(len(true))], 0)
        return out

    mtp.propose = rigged
    try:
        prompts = [PROMPTS[0], list(range(40, 60))]
        got = _run_all(on, prompts, "r", max_tokens=40)
        assert got == _run_all(off_engine, prompts, "q", max_tokens=40)
        t = on._spec.totals
        assert t["drafted"] >= 40 and t["accepted"] >= 0.9 * t["drafted"]
        assert t["accepted"] / t["steps"] > 2          # several tokens per verified draft
    finally:
        on.stop()


# ---------------------------------------------------------------- selection and errors
class _FakeMtp:
    cost = MtpCost(0.0, 0.0)

    def __init__(self, p1):
        self.p1 = p1

    def ready(self, seq):
        return True

    def propose(self, caps, min_conf=0.0, floors=None):
        return {s: Draft([1, 2], [self.p1, self.p1 * 0.5], 0) for s in caps}

    def forget(self, seq):
        pass


@pytest.mark.parametrize("p1,source", [(0.95, "mtp"), (0.01, "suffix")])
def test_auto_picks_the_source_with_the_larger_expected_gain(p1, source):
    from strata_lite.sequence import Sequence
    ctl = SpecController("auto")
    ctl.use_mtp(_FakeMtp(p1))
    ctl.width = 4
    seq = Sequence(Request("s", (1, 2, 3, 9, 1, 2, 4, 1, 2, 5, 1, 2), max_tokens=10))   # a weak suffix draft
    ctl.attach(seq)
    ctl.drafts([seq], {seq: 4})
    assert seq.spec.source == source and len(seq.spec.draft) >= 1


def test_spec_mtp_without_a_block_is_one_clear_error(files, capsys):
    eng = Engine(EngineConfig(model=files["plain"], backend="cpu", n_ctx=64, spec="mtp"))
    eng.start()
    with pytest.raises(NoMtpBlock, match="--spec mtp needs an MTP block: .*plain.gguf has none"):
        eng.wait_ready(60)
    from strata_lite.cli import main
    assert main(["serve", "--model", files["plain"], "--spec", "mtp", "--backend", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("strata-lite: error: --spec mtp needs an MTP block")


def test_mtp_file_of_another_model_is_one_clear_error(files, tmp_path, capsys):
    other = write_tiny_model(tmp_path / "o.gguf", n_embd=128, mtp=True)
    side = tmp_path / "o.mtp.gguf"
    write_mtp_file(GGUFFile(other), LLM(str(other), backend="cpu", n_ctx=64).config, str(side))
    from strata_lite.cli import main
    assert main(["serve", "--model", files["plain"], "--spec", "mtp", "--mtp", str(side)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "n_embd = 128, the model has 64" in err[0]
    with pytest.raises(GGUFError):
        Mini(files["plain"], mtp_file=str(side))


def test_serve_flags():
    from strata_lite.server.cli_serve import add_serve_parser, config_from_args
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    parse = lambda argv: config_from_args(parser.parse_args(["serve"] + argv))    # noqa: E731
    assert (parse([]).spec, parse([]).mtp) == ("auto", None)
    cfg = parse(["--spec", "mtp", "--mtp", "side.gguf"])
    assert (cfg.spec, cfg.mtp) == ("mtp", "side.gguf")
    assert [parse(["--spec", v]).spec for v in ("suffix", "MTP", "off", "5")] == ["suffix", "mtp", "off", 5]
    for bad in ("mtp2", "0", "33"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--spec", bad])


# ---------------------------------------------------------------- what drafting from the block costs
def test_mtp_cost_is_the_weight_bytes_ratio(files, llm):
    """mtp_cost on the tiny model against the bytes counted by hand: Q8_0 stores 32 weights in 34 bytes, so
    a row of 64 inputs is 68 bytes and one of 128 is 136. A block (n_embd 64, n_ff 128, 4 query and 2 KV
    heads of 16): q 64 rows, k and v 32, o 64, gate and up 128 rows of 68 bytes, down 64 rows of 136 bytes;
    the head is the output matrix (262 rows of 68 bytes: the block has no head of its own); eh_proj is 64
    rows of 136 bytes; embeddings and vectors do not count."""
    block = 68 * (64 + 32 + 32 + 64 + 128 + 128) + 64 * 136
    assert block == 39168 and llm.config.n_vocab == 262 and llm.config.n_layers == 2
    target = 2 * block + 262 * 68                                  # 96152 bytes per target decode step
    want_head, want_block = 262 * 68 / target, (64 * 136 + block) / target
    cost = mtp_cost(llm.model.weights, mtp_weights(files["embedded"], llm.config, None))
    assert cost == pytest.approx(MtpCost(want_head, want_block), rel=1e-12)
    assert (round(cost.head, 4), round(cost.block, 4)) == (0.1853, 0.4979)
    assert [cost.draft(k) for k in range(4)] == pytest.approx([0, want_head, 2 * want_head + want_block,
                                                               3 * want_head + 2 * want_block])
    # where the step graphs run the head on every row (MtpDrafter.capture on CUDA) the first token's head is
    # paid by every step whether it drafts or not: drafting it costs nothing more
    stepped = cost._replace(first_head=False)
    assert [stepped.draft(k) for k in range(4)] == pytest.approx([0, 0, want_head + want_block,
                                                                  2 * want_head + 2 * want_block])
    # where the block's KV rows wait for a draft (MtpDrafter.defer: the CPU) the first token pays their forward
    deferred = cost._replace(first_block=True)
    assert [deferred.draft(k) for k in range(4)] == pytest.approx([0, want_head + want_block,
                                                                   2 * want_head + 2 * want_block,
                                                                   3 * want_head + 3 * want_block])
    assert Mini(files["embedded"]).runner.mtp.cost == deferred     # what the engine's drafter prices drafts with


class _ChainMtp:
    """A stand-in MTP drafter with fixed draft confidences (the controller is what these tests check): it
    records the chains asked of it, each of which would run the head."""

    def __init__(self, conf, cost):
        self.conf, self.cost, self.calls = conf, cost, []

    def ready(self, seq):
        return True

    def propose(self, caps, min_conf=0.0, floors=None):
        self.calls.append((dict(caps), floors))
        return {s: Draft(list(range(1, cap + 1)), self.conf[:cap], 0) for s, cap in caps.items()}

    def forget(self, seq):
        pass


def _timed_controller(mode, mtp):
    """A controller whose cost line is 0.09 s + 0.01 s per token (a one-token step: 0.1 s)."""
    ctl = SpecController(mode)
    ctl.use_mtp(mtp)
    ctl.observe_step(1, 0, 0.100)
    ctl.observe_step(2, 0, 0.110)
    return ctl


def _decoding(tokens, rid="s"):
    from strata_lite.sequence import Sequence
    return Sequence(Request(rid, tuple(tokens), max_tokens=10))


@pytest.mark.parametrize("scale,width", [(0.05, 2), (0.5, 1), (4.0, 0)], ids=["cheap", "half", "dear"])
def test_mtp_width_weighs_the_blocks_cost(files, llm, scale, width):
    """The tiny model's block priced at 0.05, 0.5 and 4 times its byte ratio (head h = 0.185, block b = 0.498
    at 1x), a cost line of 0.09 s + 0.01 s per token and the acceptance priors (R_0 = 0.45, R_1 = 0.2025 for
    the chain's confidences 0.9, 0.81): token i must bring P_i = E0 / T0 * (c + m_i * t_1) = 0.1 + m_i
    tokens at one sequence. Cheap, two tokens pay; at 0.5x the first pays (R_0 = 0.45 > 0.1 + h/2 = 0.19)
    and the second does not (R_1 < 0.1 + h/2 + b/2 = 0.44); at 4x not even the first: the estimate
    (R_0 = 0.5 * 0.5 = 0.25 < 0.1 + 4h) declines before any head runs."""
    real = mtp_cost(llm.model.weights, mtp_weights(files["embedded"], llm.config, None))
    cost = MtpCost(scale * real.head, scale * real.block)
    mtp = _ChainMtp([0.9 ** (i + 1) for i in range(8)], cost)
    ctl = _timed_controller("mtp", mtp)
    seq = _decoding([7, 3, 9, 4])
    ctl.attach(seq)
    got = ctl.drafts([seq], {seq: 4})
    assert len(got.get(seq, [])) == width
    assert len(mtp.calls) == (width > 0)                  # declined: no chain, so no head
    if width:
        assert seq.spec.source == "mtp"
        # chain floors: token i is drafted only while the confidence reaches P_i / A_i (A_0 = 0.5, A_1 = 0.25)
        floors = mtp.calls[0][1][seq]
        assert floors[:2] == pytest.approx([(0.1 + cost.head) / 0.5, (0.1 + cost.head + cost.block) / 0.25])


def test_block_forwards_are_priced_at_the_steps_rate(files, llm):
    """The tiny model's block at half its byte ratio (head h = 0.093): one decoding sequence drafts a token
    (the estimate R_0 = 0.25 > P_0 = 10 / s * (0.01 s + h * 0.1 s) = 0.19), but beside three more, whose
    step the block holds up, E0 / T0 = 4 / 0.13 s and P_0 = 0.59 > 0.25: no sequence drafts, and the head
    runs for none of them."""
    real = mtp_cost(llm.model.weights, mtp_weights(files["embedded"], llm.config, None))
    cost = MtpCost(0.5 * real.head, 0.5 * real.block)
    for n, width in ((1, 1), (4, 0)):
        mtp = _ChainMtp([0.9 ** (i + 1) for i in range(8)], cost)
        ctl = _timed_controller("mtp", mtp)
        seqs = [_decoding([7, 3, 9, 4], rid=f"s{j}") for j in range(n)]
        for seq in seqs:
            ctl.attach(seq)
        got = ctl.drafts(seqs, {seq: 4 for seq in seqs})
        assert [len(got.get(seq, [])) for seq in seqs] == [width] * n
        assert len(mtp.calls) == (width > 0)
    assert ctl._token_price("mtp", 0, cost) == pytest.approx(4 / 0.13 * (0.01 + cost.head * 0.1))


def test_mtp_probes_back_off_while_the_block_does_not_pay(files, llm):
    """A block too dear to pay (4x its byte ratio, as the "dear" case above) drafts only the one-token probes:
    after 16 idle steps, then 32, 64, 128 and 256, and then every 256; once the block is picked on its price (made
    free for a step) the next probe comes after 16 idle steps again."""
    from strata_lite.spec.controller import PROBE_EVERY, PROBE_MAX
    real = mtp_cost(llm.model.weights, mtp_weights(files["embedded"], llm.config, None))
    mtp = _ChainMtp([0.3 ** (i + 1) for i in range(8)], MtpCost(4 * real.head, 4 * real.block))
    ctl = _timed_controller("mtp", mtp)
    seq = _decoding([7, 3, 9, 4])
    ctl.attach(seq)

    def probe_gaps(n_steps):
        gaps, last = [], 0
        for step in range(1, n_steps + 1):
            before = len(mtp.calls)
            got = ctl.drafts([seq], {seq: 4})
            if len(mtp.calls) > before:
                assert got == {seq: [1]}                      # a probe: one token
                gaps.append(step - last)
                last = step
        return gaps

    assert probe_gaps(1100) == [PROBE_EVERY + 1, 33, 65, 129, 257, 257, 257] and PROBE_MAX == 256
    dear = mtp.cost
    mtp.cost = MtpCost(0.0, 0.0)
    assert ctl.drafts([seq], {seq: 4})[seq] and ctl._mtp_probe is None     # picked on its price, not a probe
    assert ctl.mtp_probe_every == PROBE_EVERY
    mtp.cost = dear
    assert probe_gaps(20) == [PROBE_EVERY + 1]


def test_auto_takes_the_suffix_draft_when_the_block_does_not_pay():
    """In auto, a block too dear to pay leaves the sequence its (weak: G = 0.29) suffix draft, which costs
    nothing to produce, and no chain runs; a free block, whose estimated gain (0.33) and then its chain's
    (0.94) beat the suffix draft's, drafts instead."""
    for cost, source, want in ((MtpCost(3.0, 3.0), "suffix", [5]), (MtpCost(0.0, 0.0), "mtp", [1, 2])):
        mtp = _ChainMtp([0.999 ** (i + 1) for i in range(8)], cost)
        ctl = _timed_controller("auto", mtp)
        seq = _decoding((1, 2, 3, 9, 1, 2, 4, 1, 2, 5, 1, 2), rid=source)     # continuations vary: weak
        ctl.attach(seq)
        assert ctl.drafts([seq], {seq: 4}) == {seq: want} and seq.spec.source == source
        assert len(mtp.calls) == (source == "mtp")


def test_head_runs_only_for_mtp_drafts_and_drafts_are_unchanged(files, llm):
    """Steps priced so that no sequence drafts from the block (bar the probe every PROBE_EVERY steps) run
    the block for its KV rows but never its head (counted by wrapping MtpHead.logits, which every head
    run goes through); the rows still equal the block from scratch. Then the block is made free and every
    step drafts, and then a fixed width of 3 drafts 3-token chains. All drafts, tokens and confidences,
    equal those of the same run with the head run on every decoding sequence's fill row in every step;
    the first ones, and the first 3-token ones, equal the chain from scratch."""
    from strata_lite.spec.controller import PROBE_EVERY
    head = MtpHead(llm.model, mtp_weights(files["embedded"], llm.config, None))
    dear_steps = PROBE_EVERY + 12
    runs = []
    for eager in (False, True):
        mini = Mini(files["embedded"], width="auto")
        mtp = mini.runner.mtp
        calls = [0]
        logits = mtp.head.logits

        def counted(x, logits=logits, calls=calls):
            calls[0] += 1
            return logits(x)

        mtp.head.logits = counted
        if eager:                         # the head at fill time for every sequence that decodes next
            fill = mini.sched.kv_filler

            def fill_and_head(plan, fill=fill, mtp=mtp):
                fill(plan)
                for seq in plan.seqs:
                    mtp.first_token(seq)

            mini.sched.kv_filler = fill_and_head
        mtp.cost = MtpCost(5.0, 5.0)
        a = mini.add("a", [7, 99, 3, 140, 22, 61, 5, 5, 18, 200, 11], 48)
        b = mini.add("b", [(13 * j + 5) % 250 for j in range(70)], 36)
        steps, rows_checked = [], 0           # (head runs, MTP tokens drafted) per step
        while mini.sched.has_work:
            if len(steps) == dear_steps:
                mtp.cost = MtpCost(0.0, 0.0)
            if len(steps) == dear_steps + 8:         # a fixed width: 3-token chains from here on
                mini.spec.width = 3
            before = calls[0]
            plan = mini.step()
            steps.append((calls[0] - before, sum(len(d) for s, d in plan.drafts.items() if s.spec.source == "mtp")))
            if not eager and len(steps) in (6, 12, dear_steps):
                mtp.settle()
                for seq in mini.sched.running:
                    n = seq.n_computed
                    if 2 <= n < len(seq.tokens):
                        for got, ref in zip(mini.mtp_rows(seq.pages, n), _scratch(llm, head, seq.tokens, n)[0]):
                            _same(llm, got, ref)
                        rows_checked += n
        assert a.finish_reason == b.finish_reason == "length"
        runs.append((mini.drafts, steps, calls[0], (a.generated, b.generated)))
        if not eager:
            assert rows_checked > 100
            dear, free = steps[:dear_steps], steps[dear_steps:]
            assert all(n_drafted for n_head, n_drafted in steps if n_head)
            assert all(not n_head for n_head, n_drafted in steps if not n_drafted)
            probes = [n_drafted for n_head, n_drafted in dear if n_head]
            assert probes and set(probes) == {1} and len(probes) <= len(dear) // PROBE_EVERY
            assert sum(n for n, _ in free) > 5 and sum(d for _, d in free) > 5
    (lazy, lazy_steps, lazy_heads, lazy_out), (eager, _, eager_heads, eager_out) = runs
    assert lazy == eager and lazy_out == eager_out and len(lazy) > 10
    assert lazy_heads < eager_heads
    tokens = {"a": lazy_out[0], "b": lazy_out[1]}
    prompts = {"a": [7, 99, 3, 140, 22, 61, 5, 5, 18, 200, 11], "b": [(13 * j + 5) % 250 for j in range(70)]}
    assert max(len(t) for _, _, t, _ in lazy) == 3
    for sid, n, toks, conf in lazy[:6] + [d for d in lazy if len(d[2]) == 3][:4]:
        want_t, want_c = _scratch_chain(llm, head, prompts[sid] + tokens[sid], n, len(toks))
        if toks != want_t:                  # only a rounding flip at a near tie may differ (no int8 kernels)
            assert not llm.backend.int8
            continue
        np.testing.assert_allclose(conf, want_c, rtol=1e-5)


# ---------------------------------------------------------------- the Python API
@pytest.mark.parametrize("spec", ["mtp", "auto", 3])
@pytest.mark.parametrize("kw", [dict(max_tokens=40), dict(max_tokens=30, temperature=0.9, top_p=0.95, seed=7),
                                dict(max_tokens=20, temperature=0.7, seed=3, stop=None)],
                         ids=["greedy", "seeded-top-p", "seeded"])
def test_llm_generate_with_drafts_equals_without(files, llm, spec, kw):
    drafting = LLM(files["embedded"], backend="cpu", n_ctx=N_CTX, spec=spec)
    assert (drafting.mtp is not None) == (spec in ("mtp", "auto"))
    for prompt in ([5, 17, 200, 3, 99], list(range(60, 130)), [9, 8, 7, 9, 8, 7, 9, 8]):
        assert drafting.generate(prompt, **kw) == llm.generate(prompt, **kw)


def test_llm_spec_stop_strings_and_context_end(files, llm):
    drafting = LLM(files["embedded"], backend="cpu", n_ctx=N_CTX, spec="mtp")
    greedy = llm.generate([9, 8, 7, 6], max_tokens=12)
    stop = llm.detokenize(greedy.token_ids[4:6])
    assert drafting.generate([9, 8, 7, 6], max_tokens=12, stop=stop) == llm.generate([9, 8, 7, 6], max_tokens=12,
                                                                                     stop=stop)
    long = list(range(N_CTX - 3))                       # the context ends the generation
    assert drafting.generate(long, max_tokens=10) == llm.generate(long, max_tokens=10)


def test_llm_spec_mtp_without_a_block(files):
    with pytest.raises(NoMtpBlock, match="needs an MTP block"):
        LLM(files["plain"], backend="cpu", n_ctx=64, spec="mtp")
    side = LLM(files["plain"], backend="cpu", n_ctx=64, spec="mtp", mtp=files["sidecar"])
    assert side.mtp is not None
    with pytest.raises(ValueError, match="spec must be"):
        LLM(files["plain"], backend="cpu", n_ctx=64, spec="sometimes")


# ---------------------------------------------------------------- the KV layer's bookkeeping, on the fake model
class _FakeMtpLayer:
    """Layer 1 of the fake model's KV (fake_engine.py), filled like the MTP block's: row i := the hash of
    tokens[:i + 2], so it depends on the token after i."""

    def __init__(self, kv):
        self.H1, self.P = kv.k_pages.view(np.uint64)[1, :, :, 0, 0], kv.page_size

    def fill(self, plan):
        at = 0
        for seq, n in zip(plan.seqs, plan.n_tokens):
            start, end = int(plan.batch.positions[at]), min(seq.n_computed, len(seq.tokens) - 1)
            for i in range(start, end):
                self.H1[seq.pages[i // self.P], i % self.P] = _chain(seq.tokens[:i + 2])
            at += n

    def wrong_rows(self, seq) -> list[int]:
        return [i for i in range(seq.n_computed)
                if self.H1[seq.pages[i // self.P], i % self.P] != _chain(seq.tokens[:i + 2])]


class _FakeOracle:
    """The fake model's true continuation, corrupted from a random depth on in half the steps."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def drafts(self, seqs, limits):
        out = {}
        for seq in seqs:
            k = min(self.rng.randint(0, 6), limits.get(seq, 0))
            if k:
                true = reference_generation(seq.tokens, k)
                good = k if self.rng.random() < 0.5 else self.rng.randint(0, k - 1)
                out[seq] = true[:good] + [(t + 1) % VOCAB for t in true[good:]]
        return out

    def observe(self, seq, n_drafted, n_accepted):
        pass


def _chain(tokens):
    return np.uint64(chain(tokens))


from hypothesis import given, settings, strategies as st   # noqa: E402


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10 ** 6), page_size=st.sampled_from([2, 4, 16]), n_pages=st.sampled_from([12, 24, 200]))
def test_mtp_layer_rows_follow_their_tokens_through_trie_parking_and_drafts(seed, page_size, n_pages):
    """With the fake model (a hash chain in layer 0) and a fake MTP layer (layer 1), requests sharing prefixes,
    right and wrong drafts, a small cache (parking, restoring, copy-on-write) and a TieredKV that re-reads
    the last cached token: every running sequence's rows [0, n_computed) hold its own tokens' values, except
    possibly the last row of a page it shares through the trie (docs/speculative.md, "Known
    approximation"); output equals the fake model's, pages stay owned."""
    from strata_lite.host_pool import ArrayKVCopier, HostPool
    from strata_lite.kv_cache import KVCache
    kv = KVCache(FakeBackend(), n_layers=2, n_kv_heads=1, head_dim=8, n_pages=n_pages, page_size=page_size)
    host = HostPool.like(kv, max_bytes=64 * HostPool.like(kv, 0).page_bytes)
    layer = _FakeMtpLayer(kv)
    sched = Scheduler(kv, host, ArrayKVCopier(kv, host), n_slots=3, step_tokens=8,
                      drafter=_FakeOracle(seed), kv_filler=layer.fill)
    runner = FakeRunner(kv)
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]
    reqs = [Request(f"r{i}", tuple(shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 7))]),
                    max_tokens=rng.randint(1, 20)) for i in range(4)]
    seqs = [sched.add(r) for r in reqs]
    bad = []
    while sched.has_work:
        plan = sched.plan_step()
        assert plan is not None
        sched.complete_step(plan, runner.forward(plan))
        assert sched.tiers.audit(sched.running) == []
        for seq in sched.running:
            shared_end = seq.node.end if seq.node is not None else 0
            for i in layer.wrong_rows(seq):
                assert (i + 1) % page_size == 0 and i < shared_end, (seq, i)
                bad.append(i)
        if len(reqs) < 7 and rng.random() < 0.2:       # a later turn of a finished conversation
            done = [s for s in seqs if s.finish_reason and len(s.tokens) + 2 < sched.max_seq_len]
            if done:
                base = rng.choice(done)
                r = Request(f"r{len(reqs)}", tuple(base.tokens + [rng.randrange(VOCAB)]), max_tokens=5)
                reqs.append(r)
                seqs.append(sched.add(r))
    for r, seq in zip(reqs, seqs):
        n = min(r.max_tokens, sched.max_seq_len - len(r.prompt_ids))
        assert seq.generated == reference_generation(list(r.prompt_ids), n)


def test_stop_string_found_at_hand_out_leaves_no_draft_state(files, off_engine):
    """With the tokens handed out after the next step is launched (Backend.queues_work, CUDA's way), a stop
    string ends the request while a step that drafts for it is in flight: the text is the same as without
    drafting, and the drafter keeps nothing of the ended sequence."""
    ref = _run_all(off_engine, [PROMPTS[1]], "stop-ref-", max_tokens=24)[0][2]
    stop = ref[len(ref) // 2:len(ref) // 2 + 2]
    assert stop, ref
    on = _engine(files["embedded"], "mtp")
    try:
        on._runner.backend.queues_work = True
        on._spec.width = 4
        h = on.submit(Request("stop-mtp", tuple(PROMPTS[1]), SamplingParams(stop=(stop,)), max_tokens=24))
        done = list(h.events(timeout=120))[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "stop"
        assert done.text == ref[:ref.index(stop)]
        deadline = time.monotonic() + 30
        while on._sched.has_work and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not on._runner.mtp.first
        assert on.restarts == 0 and not on._sched.running
        assert on._sched.tiers.audit(on._sched.running, on._reserved_pages()) == []
    finally:
        on.stop()
