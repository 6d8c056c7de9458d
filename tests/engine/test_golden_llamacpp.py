"""The default model's outputs against llama.cpp's (tests/data/, copied from the golden set computed
with llama.cpp on the same GGUF file). llama.cpp itself moves by up to 0.58 logits between its own
correct code paths (llamacpp_self_variation.json: GEMV vs GEMM, flash attention); we quantize the KV
cache to int8 where it keeps f16. Each bound's measured value, margin and reason: docs/bounds.md."""
import json
from pathlib import Path

import numpy as np
import pytest

from strata_lite.perplexity import log_softmax, perplexity

DATA = Path(__file__).resolve().parent.parent / "data"
MAX_ABS_DLOGIT = 1.2       # measured 1.00; 2x llama.cpp's own worst variation between its paths (0.58)
MEAN_KL_MAX = 0.003        # nats, mean over the 16 positions with full logits; measured 0.00111
ARGMAX_CLEAR = 0.25        # llama.cpp top-1/top-2 margin above which argmax must agree; misses measured at 0.052, 0.189
ARGMAX_MIN_SHARE = 0.97    # of all 108 positions: at most 3 misses, measured 2 (106/108)
PPL_REL = 0.005            # heapq.py perplexity vs llama.cpp's; measured -0.05%, llama.cpp itself moves 0.23% across CPUs

pytestmark = pytest.mark.slow


def _inputs():
    return json.loads((DATA / "logits.json").read_text())["inputs"]


@pytest.fixture(scope="module")
def golden():
    return np.load(DATA / "logits.npz")


@pytest.fixture(scope="module")
def comparison(default_llm, golden):
    """Per input: our logits at the stored positions, compared with llama.cpp's."""
    rows = []
    for inp in _inputs():
        name, ids = inp["name"], golden[inp["name"] + "__ids"].tolist()
        if name + "__logits_all" in golden:
            ref_full = golden[name + "__logits_all"]
            pos = np.arange(len(ids))
        else:
            ref_full = golden[name + "__logits_last"][None]
            pos = np.array([len(ids) - 1])
        top_pos = golden[name + "__topk_pos"] if name + "__topk_pos" in golden else np.zeros(0, int)
        want = np.union1d(pos, top_pos)
        ours = default_llm.eval(ids, 0, want)
        ours_full = ours[np.searchsorted(want, pos)]
        rows.append(dict(name=name, ref_full=ref_full, ours_full=ours_full,
                         top_ids=golden.get(name + "__topk_ids"), top_vals=golden.get(name + "__topk_vals"),
                         ours_top=ours[np.searchsorted(want, top_pos)] if len(top_pos) else None))
    return rows


def test_argmax_agrees_wherever_llamacpp_is_not_at_a_near_tie(comparison):
    """Every stored position whose llama.cpp top-1/top-2 margin is >= ARGMAX_CLEAR must agree, and
    ARGMAX_MIN_SHARE of all positions. Measured 106/108: the 2 misses are at llama.cpp margins of 0.052
    and 0.189 logits, where the int8 rounding of K (float64 reference: K in int8 alone moves such
    margins by -0.12..-0.24) decides the order."""
    agree = total = 0
    missed_clear = []
    for r in comparison:
        rows = [(o, ref) for o, ref in zip(r["ours_full"], r["ref_full"])]
        if r["ours_top"] is not None:
            rows += [(o, (ids, vals)) for o, ids, vals in zip(r["ours_top"], r["top_ids"], r["top_vals"])]
        for ours, ref in rows:
            if isinstance(ref, tuple):
                ids, vals = ref
                top, margin = int(ids[0]), float(vals[0] - vals[1])
            else:
                top2 = np.argsort(-ref)[:2]
                top, margin = int(top2[0]), float(ref[top2[0]] - ref[top2[1]])
            ok = int(np.argmax(ours)) == top
            agree, total = agree + ok, total + 1
            if not ok and margin >= ARGMAX_CLEAR:
                missed_clear.append(f"{r['name']}: margin {margin:.3f}")
    assert not missed_clear, missed_clear
    assert agree / total >= ARGMAX_MIN_SHARE, f"argmax agrees on {agree}/{total}"


def test_mean_kl_below_bound(comparison):
    kls = []
    for r in comparison:
        lp, lq = log_softmax(r["ref_full"]), log_softmax(r["ours_full"])
        kls += list((np.exp(lp) * (lp - lq)).sum(-1))
    assert np.mean(kls) <= MEAN_KL_MAX, f"mean KL {np.mean(kls):.5f} over {len(kls)} positions"


def test_max_logit_difference_within_llamacpp_variation(comparison):
    worst = 0.0
    for r in comparison:
        worst = max(worst, float(np.abs(r["ours_full"] - r["ref_full"]).max()))
        if r["ours_top"] is not None:   # llama.cpp's 100 largest logits at every 16th position
            ours = np.take_along_axis(r["ours_top"], r["top_ids"].astype(np.int64), axis=1)
            worst = max(worst, float(np.abs(ours - r["top_vals"]).max()))
    assert worst <= MAX_ABS_DLOGIT, f"max |dlogit| {worst:.3f}"


def test_greedy_continuations(default_llm):
    """Until the first divergence the contexts are equal, so a divergence is an argmax miss: allowed
    only below ARGMAX_CLEAR (measured at margins 0.046 and 0.078); at least 6 of 8 equal (measured 6)."""
    cases = json.loads((DATA / "greedy.json").read_text())["cases"]
    equal, report = 0, []
    for c in cases:
        out = default_llm.generate(c["prompt_ids"], max_tokens=len(c["output_ids"]), temperature=0.0)
        ref, ours = c["output_ids"][:32], out.token_ids[:32]
        if ours == ref:
            equal += 1
            continue
        k = next(i for i in range(min(len(ref), len(ours))) if ref[i] != ours[i])
        margin = c["top1_minus_top2_logit"][k]
        report.append(f"{c['name']}: diverges at step {k}, llama.cpp margin {margin:.3f}")
        assert margin < ARGMAX_CLEAR, report[-1]
    assert equal >= 6, f"{equal}/8 equal over 32 tokens; " + "; ".join(report)


def test_perplexity_on_heapq_within_half_a_percent(default_llm):
    ref = json.loads((DATA / "perplexity.json").read_text())
    r = perplexity(default_llm, (DATA / "heapq.py").read_text(encoding="utf-8"), ctx=512, progress=False)
    assert (r.n_chunks, r.n_scored) == (ref["n_chunks"], ref["n_scored_tokens"])
    assert abs(r.ppl / ref["ppl"] - 1) <= PPL_REL, f"PPL {r.ppl:.4f} vs llama.cpp {ref['ppl']}"
