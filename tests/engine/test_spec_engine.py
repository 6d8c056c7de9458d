"""Speculative decoding in the engine on a tiny model: with drafts (right, wrong, partly right) every
request gets exactly the tokens, text, logprobs and finish reason it gets without drafting, greedy or
seeded; sampled tokens follow the model's distribution (chi-square against the exact probabilities,
with deliberately bad drafts); the statistics count what was drafted and accepted."""
import math
import random
import time

import numpy as np
import pytest
from prometheus_client import generate_latest

from strata_lite import LLM, SamplingParams
from strata_lite.engine_events import DoneEvent, TokenEvent
from strata_lite.sequence import Request
from strata_lite.spec.suffix_index import Draft
from spec_engines import start_engine
from tiny_model import write_tiny_model

N_CTX = 256


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("spec") / "tiny-spec.gguf", arch="qwen2", n_embd=64,
                                n_ff=128, n_heads=4, n_kv_heads=2))


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, backend="cpu", n_ctx=N_CTX)


def _engine(model_path, spec, **kw):
    return start_engine(model_path, spec, N_CTX, **kw)


class OracleDrafter:
    """Drafts the model's own greedy continuation (from a separate LLM), corrupted from a random depth
    in a share of the steps: accepted, partly accepted and rejected drafts all occur."""

    def __init__(self, llm, seed=0, p_corrupt=0.4):
        self.llm, self.rng, self.p_corrupt = llm, random.Random(seed), p_corrupt

    def propose(self, index, max_len):
        true = self.llm.generate(list(index.tokens), max_tokens=max_len).token_ids
        if self.rng.random() < self.p_corrupt:
            cut = self.rng.randrange(len(true))
            true = true[:cut] + [(t + 1) % self.llm.config.n_vocab for t in true[cut:]]
        return Draft(true, [1.0] * len(true), 32)

    def finished(self, output):
        pass


class RandomDrafter:
    """Bad drafts: random tokens (now and then the greedy token, so both outcomes occur)."""

    def __init__(self, n_vocab, seed=0):
        self.n_vocab, self.rng = n_vocab, random.Random(seed)

    def propose(self, index, max_len):
        return Draft([self.rng.randrange(self.n_vocab) for _ in range(max_len)], [1.0] * max_len, 32)

    def finished(self, output):
        pass


def _run_all(eng, requests, timeout=120):
    handles = [eng.submit(r) for r in requests]
    out = []
    for h in handles:
        events = list(h.events(timeout=timeout))
        assert isinstance(events[-1], DoneEvent), events[-1]
        toks = [e for e in events if isinstance(e, TokenEvent)]
        out.append(([t.token_id for t in toks], [(t.logprob, t.top_logprobs) for t in toks], events[-1].text,
                    events[-1].finish_reason, events[-1].completion_tokens))
    return out


def _requests(tag, prompts, **kw):
    params = {k: kw.pop(k) for k in list(kw) if k in SamplingParams.__dataclass_fields__}
    return [Request(f"{tag}{i}", tuple(p), SamplingParams(**params), **kw) for i, p in enumerate(prompts)]


PROMPTS = [[5, 17, 200, 3, 99], [42, 7, 7, 120, 64, 33, 8], list(range(60, 100)), [1, 2, 3]]


@pytest.fixture(scope="module")
def engines(model_path, llm):
    off = _engine(model_path, "off")
    on = _engine(model_path, 4)
    on._spec.drafter = OracleDrafter(llm)
    yield off, on
    off.stop()
    on.stop()


@pytest.mark.parametrize("kw", [dict(max_tokens=20, logprobs=3),
                                dict(max_tokens=30, temperature=0.9, top_p=0.95, seed=11),
                                dict(max_tokens=25, temperature=1.3, top_k=20, seed=5, logprobs=0)],
                         ids=["greedy-logprobs", "seeded-top-p", "seeded-top-k"])
def test_drafting_changes_nothing_the_client_sees(engines, kw):
    off, on = engines
    before = dict(on._spec.totals)
    want = _run_all(off, _requests("a", PROMPTS, **kw))
    got = _run_all(on, _requests("b", PROMPTS, **kw))
    assert got == want
    drafted = on._spec.totals["drafted"] - before["drafted"]
    accepted = on._spec.totals["accepted"] - before["accepted"]
    assert drafted > 0 and 0 < accepted < drafted        # both accepted and rejected drafts were verified


def test_stop_strings_and_finish_reasons_with_drafts(engines, llm):
    off, on = engines
    greedy = llm.generate([9, 8, 7, 6], max_tokens=12)
    stop = llm.detokenize(greedy.token_ids[4:6])            # text the greedy chain produces mid-way
    reqs = lambda tag: _requests(tag, [[9, 8, 7, 6]], max_tokens=12, stop=(stop,))      # noqa: E731
    want, got = _run_all(off, reqs("c")), _run_all(on, reqs("d"))
    assert got == want and want[0][3] == "stop"


def test_statistics_reach_slots_and_metrics(engines):
    _, on = engines
    _run_all(on, _requests("e", [list(range(10, 40))], max_tokens=16))
    text = generate_latest(on.metrics_registry).decode()
    drafted = float(next(line.split()[-1] for line in text.splitlines()
                         if line.startswith("strata_spec_draft_tokens_total")))
    accepted = float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("strata_spec_accepted_tokens_total")))
    assert drafted == on._spec.totals["drafted"] and accepted == on._spec.totals["accepted"] > 0
    assert "strata_spec_accepted_length_bucket" in text and "strata_spec_steps_total" in text
    assert all({"drafted", "draft_accepted"} <= set(s) for s in on.slots())


def _sampling_probs(llm, ids, temperature, top_k):
    """Exact next-token probabilities of the sampler (kernels/sample_rows.py) for this row, float64."""
    z = llm.logits(ids)[-1].astype(np.float64) / temperature
    top = np.argsort(-z, kind="stable")[:top_k]
    p = np.exp(z[top] - z[top].max())
    return dict(zip(top.tolist(), (p / p.sum()).tolist()))


def _chi2_p(observed, expected):
    """Upper-tail p-value of Pearson's chi-square (Wilson-Hilferty normal approximation)."""
    x = float(((observed - expected) ** 2 / expected).sum())
    k = len(observed) - 1
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_follow_the_model_with_bad_drafts(model_path, llm):
    """Token 2 is sampled by the row that verifies a random drafted token. Over 1200 unseeded requests
    the joint frequencies of (token 1, token 2) match the exact sampling probabilities (chi-square,
    cells pooled to expected counts >= 5); fixed seeds make the test deterministic."""
    T, K, N = 0.8, 6, 1200
    prompt = [3, 14, 15, 92, 65]
    eng = _engine(model_path, 1)
    eng._spec.drafter = RandomDrafter(llm.config.n_vocab)
    try:
        reqs = _requests("s", [prompt] * N, max_tokens=3, temperature=T, top_k=K)
        reqs = [Request(r.id, r.prompt_ids, SamplingParams(T, K, seed=1000 + i), max_tokens=3)
                for i, r in enumerate(reqs)]
        outs = [o for i in range(0, N, 60) for o in _run_all(eng, reqs[i:i + 60])]
        verified = eng._spec.totals["steps"]
    finally:
        eng.stop()
    assert verified >= N * 0.9                          # nearly every token 2 came from a verify row
    p1 = _sampling_probs(llm, prompt, T, K)
    cells = {(a, b): pa * pb for a, pa in p1.items() for b, pb in _sampling_probs(llm, prompt + [a], T, K).items()}
    counts = {}
    for ids, *_ in outs:
        counts[tuple(ids[:2])] = counts.get(tuple(ids[:2]), 0) + 1
    assert set(counts) <= set(cells)
    order = sorted(cells, key=cells.get, reverse=True)
    obs, exp, acc_o, acc_e = [], [], 0, 0.0
    for c in order:                                     # pool the rarest cells
        acc_o, acc_e = acc_o + counts.get(c, 0), acc_e + N * cells[c]
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o, acc_e = 0, 0.0
    if acc_e:
        obs[-1] += acc_o
        exp[-1] += acc_e
    assert _chi2_p(np.array(obs, float), np.array(exp, float)) > 1e-3


def test_cancel_while_drafting_leaves_the_kv_accounted(engines, llm):
    """Cancel a request that verifies drafts every step: it ends "cancelled", the pages and trie audit
    clean, and the next request on the same prompt gets the tokens it gets without drafting."""
    off, on = engines
    prompt = list(range(120, 150))
    h = on.submit(Request("cancel-me", tuple(prompt), max_tokens=200))
    seen = 0
    for ev in h.events(timeout=60):
        if isinstance(ev, TokenEvent):
            seen += 1
            if seen == 6:
                h.cancel()
        elif isinstance(ev, DoneEvent):
            assert ev.finish_reason == "cancelled"
            break
    deadline = time.monotonic() + 30
    while any(s["state"] != "idle" for s in on.slots()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert on._sched.tiers.audit(on._sched.running, on._reserved_pages()) == []
    assert _run_all(on, _requests("f", [prompt], max_tokens=24)) == _run_all(off, _requests("g", [prompt], max_tokens=24))
