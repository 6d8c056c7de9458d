"""Drafted tokens verified inside the scheduler's steps, on the fake model (fake_engine.py): whatever the
drafts (right, wrong, partly right, across page boundaries, next to shared prefix pages, under memory
pressure), every sequence generates exactly what it generates without drafts, the trie holds only
accepted tokens, and every page has one owner after every step (trie_invariants.check_scheduler)."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from fake_engine import VOCAB, make_scheduler, reference_generation, run, step
from strata_lite.sequence import Request


class OracleDrafter:
    """Drafts the true continuation, then corrupts it from a random depth on (or not at all)."""

    def __init__(self, seed: int, max_len: int = 6, p_right: float = 0.5):
        self.rng, self.max_len, self.p_right = random.Random(seed), max_len, p_right
        self.observed = []

    def drafts(self, seqs, limits):
        out = {}
        for seq in seqs:
            k = min(self.rng.randint(0, self.max_len), limits.get(seq, 0))
            if k == 0:
                continue
            true = reference_generation(seq.tokens, k)
            good = k if self.rng.random() < self.p_right else self.rng.randint(0, k - 1)
            out[seq] = true[:good] + [(t + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB for t in true[good:]]
        return out

    def observe(self, seq, n_drafted, n_accepted):
        assert 0 <= n_accepted <= n_drafted
        self.observed.append((n_drafted, n_accepted))


def _generated(sched, requests):
    outs = {}
    for r in requests:
        seq = sched.add(r)
        outs[r.id] = seq
    return outs


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10 ** 6), n_req=st.integers(1, 4), page_size=st.sampled_from([2, 4, 16]),
       n_pages=st.sampled_from([12, 24, 200]), p_right=st.sampled_from([0.0, 0.5, 1.0]))
def test_drafts_never_change_the_output_and_pages_stay_owned(seed, n_req, page_size, n_pages, p_right):
    rng = random.Random(seed)
    drafter = OracleDrafter(seed, p_right=p_right)
    sched, runner = make_scheduler(n_pages=n_pages, page_size=page_size, n_slots=3, step_tokens=8,
                                   drafter=drafter)
    shared = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]       # a prefix the requests share
    requests = [Request(f"r{i}", tuple(shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 7))]),
                        max_tokens=rng.randint(1, 24)) for i in range(n_req)]
    seqs = _generated(sched, requests)
    run(sched, runner)
    for r in requests:                       # (a tiny cache also ends sequences at its capacity)
        n = min(r.max_tokens, sched.max_seq_len - len(r.prompt_ids))
        assert seqs[r.id].generated == reference_generation(list(r.prompt_ids), n)
    assert sched.counters["drafted_tokens"] == sum(k for k, _ in drafter.observed)
    if p_right == 1.0 and drafter.observed:
        assert all(a == k for k, a in drafter.observed)


def test_rejected_tokens_are_rolled_back_across_a_page_boundary():
    """A sequence whose next 3 positions straddle a page boundary verifies 4 drafted tokens, 1 right:
    it keeps 2 tokens (the right one, then the model's), the page allocated for the draft's tail goes
    back to the free list, and the trie never holds a rejected token."""

    class OneWrong:
        def drafts(self, seqs, limits):
            seq = seqs[0]
            true = reference_generation(seq.tokens, 4)
            return {seq: [true[0], (true[1] + 1) % VOCAB, true[2], true[3]]}

        def observe(self, seq, n_drafted, n_accepted):
            self.last = (n_drafted, n_accepted)

    drafter = OneWrong()
    sched, runner = make_scheduler(n_pages=16, page_size=4, n_slots=1, step_tokens=8, drafter=drafter)
    prompt = [11, 12, 13, 14, 15, 16]        # 6 tokens: the first decode is at position 6 of page 1
    seq = sched.add(Request("a", tuple(prompt), max_tokens=12))
    step(sched, runner)                      # reads the prompt, samples token 7
    free_before = sched.tiers.kv.n_free
    plan, events = step(sched, runner)       # verifies positions 6..10: pages 1 and 2
    assert plan.drafts[seq] and len(plan.drafts[seq]) == 4 and drafter.last == (4, 1)
    assert [e.token for e in events] == reference_generation(prompt, 3)[1:3]
    assert seq.n_computed == 8 and len(seq.tokens) == 9
    assert len(seq.pages) == 3 and sched.tiers.kv.n_free == free_before - 1   # page 2 kept: token 8 goes there
    run(sched, runner)
    assert seq.generated == reference_generation(prompt, 12)


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_drafts_respect_max_tokens(max_tokens):
    drafter = OracleDrafter(0, max_len=8, p_right=1.0)
    sched, runner = make_scheduler(n_pages=32, page_size=4, n_slots=2, step_tokens=8, drafter=drafter)
    seq = sched.add(Request("a", (5, 6, 7), max_tokens=max_tokens))
    run(sched, runner)
    assert seq.generated == reference_generation([5, 6, 7], max_tokens)
    assert seq.finish_reason == "length"
