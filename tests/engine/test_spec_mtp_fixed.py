"""Fixed-width MTP drafting (`--spec mtp:N`, spec/controller.py) on the tiny model with a random MTP block of
tests/engine/test_mtp_drafting.py (its fixtures and helpers): every step each decoding sequence drafts exactly
min(N, its limit) tokens from the block, whatever they cost and however unsure the block is; greedy output
equals `--spec off`; the Python API takes the same value; bad values fail like other bad values."""
import argparse

import pytest

from strata_lite import LLM
from strata_lite.config import EngineConfig
from strata_lite.sequence import Request
from strata_lite.spec import SpecController, parse_spec
from strata_lite.spec.controller import split_spec
from strata_lite.spec.mtp_drafter import MtpCost, NoMtpBlock
from strata_lite.spec.suffix_index import Draft
from test_mtp_drafting import (LONG, N_CTX, PROMPTS, _ChainMtp, _decoding, _engine, _run_all,  # noqa: F401
                               _timed_controller, files, llm, off_engine)

BAD = ("mtp:0", "mtp:x", "mtp:33", "mtp:", ":3", "suffix:3", "mtp:-1", "mtp:2:2")


# ---------------------------------------------------------------- parsing
def test_parse_spec_mtp_width():
    assert [parse_spec(v) for v in ("mtp:1", "MTP:04", " mtp:32 ", "mtp", 5, "5")] == \
        ["mtp:1", "mtp:4", "mtp:32", "mtp", 5, 5]
    assert [split_spec(parse_spec(v)) for v in ("mtp:3", 3, "mtp", "auto", "off")] == \
        [("mtp", 3), ("suffix", 3), ("mtp", "auto"), ("auto", "auto"), ("off", "auto")]
    for bad in BAD:
        with pytest.raises(ValueError, match=r"spec must be 'auto', 'off', 'suffix', 'mtp', .* or 'mtp:N' "
                                             r"\(N MTP-drafted tokens, 1\.\.32\), got " + repr(bad)):
            parse_spec(bad)
    assert EngineConfig(spec="MTP:3").spec == "mtp:3"
    with pytest.raises(ValueError, match="spec must be"):
        EngineConfig(spec="mtp:0")
    ctl = SpecController("mtp:3")
    assert (ctl.spec, ctl.mode, ctl.width, ctl.max_draft, ctl.wants_mtp) == ("mtp:3", "mtp", 3, 3, True)
    ctl.use_mtp(object())
    assert ctl.sources == ("mtp",)
    ctl = SpecController(4)                      # `N` is still fixed-width suffix drafting
    assert (ctl.mode, ctl.width, ctl.max_draft, ctl.wants_mtp, ctl.sources) == ("suffix", 4, 4, False, ("suffix",))


def test_serve_flag_mtp_width(capsys):
    from strata_lite.server.cli_serve import add_serve_parser, config_from_args
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert config_from_args(parser.parse_args(["serve", "--spec", "mtp:3"])).spec == "mtp:3"
    for bad in ("mtp:0", "mtp:x", "mtp:33"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--spec", bad])
        assert "spec must be 'auto', 'off', 'suffix', 'mtp', a number of drafted tokens 1..32 or 'mtp:N'" \
               in capsys.readouterr().err


# ---------------------------------------------------------------- the controller: no cost rule
@pytest.mark.parametrize("limit", [4, 2])
def test_fixed_width_drafts_whatever_the_block_costs(limit):
    """A block priced far above what its drafts could earn, unsure of its tokens: `mtp` declines before any
    head runs, `mtp:3` asks for a chain of min(3, limit) with no floors and takes all of it."""
    conf = [0.05 ** (i + 1) for i in range(8)]
    for spec, want in (("mtp", 0), ("mtp:3", min(3, limit))):
        mtp = _ChainMtp(conf, MtpCost(4.0, 4.0))
        ctl = _timed_controller(spec, mtp)
        seq = _decoding([7, 3, 9, 4])
        ctl.attach(seq)
        got = ctl.drafts([seq], {seq: limit})
        assert len(got.get(seq, [])) == want
        if want:
            assert seq.spec.source == "mtp" and mtp.calls == [({seq: want}, {})]
        else:
            assert mtp.calls == []


# ---------------------------------------------------------------- the engine
def _record_widths(eng):
    """Wrap the engine's controller: per step, (limits, drafted tokens) of every decoding sequence."""
    ctl, steps = eng._spec, []
    real = ctl.drafts

    def drafts(seqs, limits):
        chosen = real(seqs, limits)
        steps.append([(seq, limits.get(seq, 0), len(chosen.get(seq, ())), seq.spec.source) for seq in seqs])
        return chosen

    ctl.drafts = drafts
    return steps


def _assert_fixed_widths(steps, n):
    rows = [r for step in steps for r in step if r[1] >= 1]
    assert len(rows) >= 10
    for seq, limit, k, source in rows:
        assert (k, source) == (min(n, limit), "mtp"), (seq.id, limit, k, source)


@pytest.mark.parametrize("n", [2, 5])
def test_greedy_output_with_mtp_width_equals_spec_off(files, off_engine, n):
    """mtp:N with the tiny model's random block: the same tokens and logprobs as off for one prompt, three at
    once, and two beside a long prompt read, and every step each decoding sequence drafts exactly min(N, its
    limit) tokens from the block."""
    on = _engine(files["embedded"], f"mtp:{n}")
    try:
        assert on._runner.mtp is not None and on._spec.width == n
        steps = _record_widths(on)
        for i, prompts in enumerate(([PROMPTS[0]], PROMPTS)):
            assert _run_all(on, prompts, f"w{i}-") == _run_all(off_engine, prompts, f"v{i}-")
        handle = on.submit(Request("long", tuple(LONG), max_tokens=8))     # read beside the others' decodes
        got = _run_all(on, PROMPTS[1:], "wl-")
        list(handle.events(timeout=120))
        assert got == _run_all(off_engine, PROMPTS[1:], "vl-")
        _assert_fixed_widths(steps, n)
        t = on._spec.totals
        assert on._spec.by_source["mtp"]["drafted"] == t["drafted"] > 50
        assert on._sched.tiers.audit(on._sched.running, on._reserved_pages()) == []
    finally:
        on.stop()


def test_rigged_drafter_with_mtp_width(files, llm, off_engine):
    """The block's chains replaced by the model's own greedy continuation (confidence 0.99 per token, padded
    to the cap where the continuation ends early): each step drafts exactly min(3, limit), nearly all of it
    is accepted, and the output is unchanged. The block's forwards keep their real (tiny-model) price, at
    which `mtp` (auto widths) would not draft past one token."""
    on = _engine(files["embedded"], "mtp:3", parallel=2)
    mtp = on._runner.mtp
    real = mtp.propose

    def rigged(caps, min_conf=0.0, floors=None):
        assert min_conf == 0.0 and not floors          # a fixed width: no confidence or cost floor
        real(caps, min_conf, floors)                     # keep the block's KV work as it is
        out = {}
        for seq, cap in caps.items():
            true = llm.generate(list(seq.tokens), max_tokens=cap).token_ids
            true = (true + [0] * cap)[:cap]
            out[seq] = Draft(true, [0.99 ** (i + 1) for i in range(cap)], 0)
        return out

    mtp.propose = rigged
    try:
        steps = _record_widths(on)
        prompts = [PROMPTS[0], list(range(40, 60))]
        assert _run_all(on, prompts, "r", max_tokens=40) == _run_all(off_engine, prompts, "q", max_tokens=40)
        _assert_fixed_widths(steps, 3)
        t = on._spec.totals
        assert t["drafted"] >= 40 and t["accepted"] >= 0.9 * t["drafted"]
        assert t["accepted"] / t["steps"] > 2
    finally:
        on.stop()


# ---------------------------------------------------------------- the Python API
@pytest.mark.parametrize("kw", [dict(max_tokens=40), dict(max_tokens=30, temperature=0.9, top_p=0.95, seed=7)],
                         ids=["greedy", "seeded-top-p"])
def test_llm_generate_with_mtp_width_equals_without(files, llm, kw):
    drafting = LLM(files["embedded"], backend="cpu", n_ctx=N_CTX, spec="mtp:3")
    assert drafting.spec == "mtp:3" and drafting.mtp is not None
    for prompt in ([5, 17, 200, 3, 99], list(range(60, 130))):
        assert drafting.generate(prompt, **kw) == llm.generate(prompt, **kw)


def test_llm_mtp_width_needs_a_block(files):
    with pytest.raises(NoMtpBlock, match="needs an MTP block"):
        LLM(files["plain"], backend="cpu", n_ctx=64, spec="mtp:2")
    assert LLM(files["plain"], backend="cpu", n_ctx=64, spec="mtp:2", mtp=files["sidecar"]).mtp is not None
    with pytest.raises(ValueError, match="spec must be"):
        LLM(files["plain"], backend="cpu", n_ctx=64, spec="mtp:33")
