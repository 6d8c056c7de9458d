"""The suffix drafter (spec/suffix_index.py) and the draft-width controller (spec/controller.py)."""
import numpy as np
import pytest

from strata_lite.spec.controller import (MAX_DRAFT, PROBE_EVERY, Acceptance, SpecController, StepCost,
                                         parse_spec)
from strata_lite.spec.suffix_index import (GlobalIndex, SequenceIndex, SuffixDrafter, _hash, _window_hashes)


def test_window_hashes_equal_the_scalar_hash():
    rng = np.random.default_rng(0)
    t = rng.integers(0, 150_000, 300)
    for L in (1, 2, 7, 32):
        h = _window_hashes(t, L)
        assert [int(x) for x in h[:20]] == [_hash(t[i:i + L]) for i in range(20)]


def test_drafts_the_continuation_of_the_longest_repeated_suffix():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50, 51, 1, 2, 3]
    d = SuffixDrafter().propose(SequenceIndex(tokens), 5)
    assert d.tokens == [4, 5, 6, 7, 8] and d.match_len == 2 and d.conf == [1.0] * 5


def test_most_frequent_continuation_wins_and_confidence_falls():
    tokens = [5, 7, 8, 1, 6, 7, 8, 2, 4, 7, 8, 2, 3, 7, 8, 2, 9, 7, 8]      # "7 8" is followed by 1, 2, 2, 2
    d = SuffixDrafter().propose(SequenceIndex(tokens), 1)
    assert d.tokens == [2] and d.conf[0] == pytest.approx(3 / 4)


def test_generated_tokens_are_indexed_as_they_come():
    tokens = [100, 101, 102]
    index, drafter = SequenceIndex(tokens), SuffixDrafter()
    assert len(drafter.propose(index, 4)) == 0                # nothing repeats yet
    tokens += [103, 104, 100, 101]                              # "generated": 100 101 occurred before
    assert drafter.propose(index, 3).tokens == [102, 103, 104]


def test_global_index_drafts_from_other_requests_outputs():
    drafter = SuffixDrafter()
    call = [500, 501, 502, 503, 504, 505, 506, 507]
    drafter.finished([9, 9] + call)
    d = drafter.propose(SequenceIndex([1, 2, 3] + call[:4]), 4)
    assert d.tokens == call[4:8] and d.match_len >= 4
    assert len(drafter.propose(SequenceIndex([1, 2, 3, call[0]]), 4)) == 0    # 1-token suffix: too weak


def test_global_index_is_bounded():
    g = GlobalIndex(max_requests=3, max_tokens=1000)
    for i in range(10):
        g.add([i] * 5 + [1000 + i, 2000 + i, 3000 + i, 4000 + i])
    assert len(g.texts) == 3 and g.n_tokens == 27
    assert not list(g.occurrences(4, _hash([1000, 2000, 3000, 4000])))      # dropped with its text


def test_parse_spec():
    assert parse_spec("auto") == "auto" and parse_spec("OFF") == "off" and parse_spec(3) == 3
    for bad in ("0", "-1", "33", "maybe", ""):
        with pytest.raises(ValueError, match="auto.*off"):
            parse_spec(bad)


def test_step_cost_line():
    c = StepCost()
    assert c.line() is None
    for n, t in [(1, 0.020), (2, 0.022), (4, 0.026), (8, 0.034)] * 3:
        c.observe(n, t)
    icpt, slope = c.line()
    assert icpt == pytest.approx(0.018) and slope == pytest.approx(0.002)


def test_step_cost_line_is_the_least_squares_fit_of_its_window():
    """The running-sum fit equals numpy's polyfit over the last `window` samples, also long after samples
    started leaving the window (the float sums are recomputed, so rounding does not build up), and
    falls back to the prior slope while the window holds one token count."""
    rng = np.random.default_rng(0)
    c = StepCost(window=32)
    for _ in range(40):
        c.observe(1, 0.01)
    icpt, slope = c.line()
    assert icpt == pytest.approx(0.01, rel=1e-12) and slope == pytest.approx(0.001, rel=1e-12)
    for i in range(1000):
        c.observe(int(rng.integers(1, 9)), float(0.01 + 0.001 * rng.random()))
        if i % 97 == 0 or i == 999:
            n = np.array([x[0] for x in c.samples], np.float64)
            t = np.array([x[1] for x in c.samples], np.float64)
            want_slope, want_icpt = np.polyfit(n, t, 1)
            one = want_icpt + want_slope
            got_icpt, got_slope = c.line()
            assert got_icpt == pytest.approx(want_icpt, rel=1e-9, abs=1e-15)
            assert got_slope == pytest.approx(max(want_slope, 0.01 * one), rel=1e-9, abs=1e-15)


def test_acceptance_counts_depths_reached():
    a = Acceptance(depth=4)
    for _ in range(200):
        a.observe(16, 4, 1)                    # first accepted, second rejected, 3rd / 4th never reached
    assert a.rate(16, 0) > 0.95 and a.rate(16, 1) < 0.05 and a.rate(16, 2) == pytest.approx(0.5)


class _Seq:
    def __init__(self, tokens):
        self.tokens, self.spec, self.n_prompt = tokens, None, len(tokens)


def _repetitive():
    return list(range(40)) * 3 + list(range(10))


def test_auto_drafts_alone_and_stops_when_many_slots_share_the_step():
    ctl = SpecController("auto")
    for n, t in [(1, 0.020), (2, 0.0205), (3, 0.021), (5, 0.022), (8, 0.0235)] * 10:
        ctl.cost.observe(n, t)                  # a verify token costs ~2.5% of a step: drafting pays
    one = _Seq(_repetitive())
    ctl.attach(one)
    for _ in range(50):
        ctl.acceptance.observe(32, 8, 8)        # long matches were always right
    assert len(ctl.drafts([one], {one: 100})[one]) == MAX_DRAFT
    ctl2 = SpecController("auto")
    for n, t in [(16, 0.10), (32, 0.20), (48, 0.30), (64, 0.40)] * 10:
        ctl2.cost.observe(n, t)                 # compute-bound: every token costs as much as a decode
    many = [_Seq(_repetitive()) for _ in range(16)]
    for s in many:
        ctl2.attach(s)
    for _ in range(50):
        ctl2.acceptance.observe(32, 8, 2)       # and drafts are mostly wrong past depth 2
    assert ctl2.drafts(many, {s: 100 for s in many}) == {}


def test_a_failing_sequence_stops_drafting_then_probes():
    ctl = SpecController("auto")
    for n, t in [(1, 0.020), (2, 0.026), (3, 0.032)] * 10:
        ctl.cost.observe(n, t)                  # each verify token costs 30% of a step
    seq = _Seq(_repetitive())
    ctl.attach(seq)
    for _ in range(30):                         # its drafts keep failing, until it stops drafting
        if not ctl.drafts([seq], {seq: 100}):
            break
        ctl.observe(seq, len(seq.spec.draft), 0)
    else:
        raise AssertionError("it never stopped drafting")
    idle = 1
    for _ in range(PROBE_EVERY + 1):
        if ctl.drafts([seq], {seq: 100}):
            break
        idle += 1
    assert idle == PROBE_EVERY and len(seq.spec.draft) == 1       # off, then a one-token probe


def test_fixed_width_and_off():
    seq = _Seq(_repetitive())
    fixed = SpecController(3)
    fixed.attach(seq)
    assert len(fixed.drafts([seq], {seq: 100})[seq]) == 3
    assert fixed.drafts([seq], {seq: 2}) == {seq: seq.spec.draft.tokens} and len(seq.spec.draft) == 2
    off = SpecController("off")
    seq2 = _Seq(_repetitive())
    off.attach(seq2)
    assert not off.enabled and seq2.spec is None
