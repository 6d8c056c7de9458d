"""Greedy output with suffix or MTP drafting equals greedy output without it, token for token, on the default
model: one slot, two slots decoding together, and a slot decoding while another reads a long prompt.
Exact because the forward (CPU and CUDA) is batch-invariant (docs/bounds.md): a token's logits do not depend on
the verify width, the other slots or the prompt chunks sharing its step."""
from pathlib import Path

import pytest

from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.engine_events import DoneEvent, TokenEvent
from strata_lite.sequence import Request

CODE = (Path(__file__).resolve().parent.parent / "data" / "heapq.py").read_text(encoding="utf-8")


def _engine(path, backend, spec):
    eng = Engine(EngineConfig(model=path, backend=backend, n_ctx=4096, parallel=2, step_tokens=128, spec=spec,
                              host_kv_gib=0.1))
    eng.start()
    assert eng.wait_ready(300)
    return eng


def _prompt(eng, text):
    return eng.tokenizer.encode(eng.chat_template.render([{"role": "user", "content": text}],
                                                          add_generation_prompt=True),
                                add_special=True, parse_special=True)


def _scenarios(eng):
    f1 = CODE[CODE.index("def heappush"):CODE.index("def heappop")]
    f2 = CODE[CODE.index("def heapreplace"):CODE.index("def heappushpop")]
    edit = _prompt(eng, "Rename the variable `heap` to `h` in this function and print the whole function:\n\n" + f1)
    repeat = _prompt(eng, "Print this function again, unchanged:\n\n" + f2)
    prose = _prompt(eng, "Write two sentences about the sea.")
    long_read = _prompt(eng, "Summarize this module in one sentence:\n\n" + CODE[:6000])
    return {"one slot": [(edit, 48)],
            "two slots": [(repeat, 40), (prose, 24)],
            "during a long read": [(long_read, 4), (edit, 40)]}


def _run(eng, requests, tag):
    handles = [eng.submit(Request(f"{tag}{i}", tuple(p), max_tokens=n)) for i, (p, n) in enumerate(requests)]
    outs = []
    for h in handles:
        events = list(h.events(timeout=600))
        assert isinstance(events[-1], DoneEvent), events[-1]
        outs.append([e.token_id for e in events if isinstance(e, TokenEvent)])
    return outs


@pytest.fixture(scope="module")
def reference(default_model_path, test_backend):
    eng = _engine(default_model_path, test_backend, "off")
    try:
        return {name: _run(eng, reqs, "ref") for name, reqs in _scenarios(eng).items()}
    finally:
        eng.stop()


@pytest.mark.parametrize("spec", [4, "auto", "mtp"])
def test_greedy_output_with_drafts_equals_without(default_model_path, test_backend, reference, spec):
    """mtp, and auto on the CPU backend, draft with the MTP block the package ships for the default model
    (loader/heads/); on CUDA auto leaves it out (it would turn off the captured decode graphs)."""
    eng = _engine(default_model_path, test_backend, spec)
    try:
        assert (eng._runner.mtp is not None) == (spec == "mtp" or (spec == "auto" and test_backend == "cpu"))
        for name, reqs in _scenarios(eng).items():
            assert _run(eng, reqs, name) == reference[name], name
        totals, by_source = eng._spec.totals, eng._spec.by_source
    finally:
        eng.stop()
    assert totals["accepted"] > 0 and totals["drafted"] > totals["accepted"] / 2
    if spec == "mtp":
        assert by_source["mtp"]["accepted"] > 0
