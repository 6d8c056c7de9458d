"""ModelRunner.forward's and LLM.forward's choice between a captured step and an eager forward, over stubs (no
GPU): with the backend reading prompt rows another way (`--prompt-attention f16`), a step that has prompt rows
runs eagerly even where a graph would take its shape, since the graphs run every row through the decode
kernels."""
import types

import numpy as np

from strata_lite.batch import Batch
from strata_lite.runner import ModelRunner


class _Graphs:
    def accepts(self, batch):
        return True                     # every step here has a graph's shape

    def run(self, batch):
        raise _Replayed


class _Replayed(Exception):
    pass


def _runner(prompt_attention):
    r = object.__new__(ModelRunner)
    r.graphs, r.mtp, r.n_vocab = _Graphs(), None, 100
    r.kv = types.SimpleNamespace(n_pages=8, page_size=16)
    r.backend = types.SimpleNamespace(prompt_attention=prompt_attention)
    r.model = types.SimpleNamespace(forward=lambda batch, kv: "eager")
    return r


def _step(decode_rows):
    """Two decode tokens (sequences 1 and 2), then a 3-token prompt read of sequence 0; every row a logit row."""
    return Batch(np.zeros(5, np.int32), np.array([20, 30, 40, 41, 42], np.int32), np.array([1, 2, 0, 0, 0], np.int32),
                 np.zeros((3, 4), np.int32), np.arange(5, dtype=np.int32), decode_rows=decode_rows)


def _path(runner, batch):
    try:
        return runner.forward(batch)
    except _Replayed:
        return "graph"


def test_f16_steps_with_prompt_rows_run_eagerly_and_the_rest_replay():
    assert _path(_runner("f16"), _step(2)) == "eager"
    assert _path(_runner("f16"), _step(5)) == "graph"          # decode rows only
    assert _path(_runner("exact"), _step(2)) == "graph"        # the decode kernels read prompts too
    assert _path(_runner("f16"), _step(-1)) == "graph"         # no plan: runs of <= 16 tokens count as decode


def test_the_llm_api_reads_a_long_run_eagerly_in_f16_mode():
    """LLM.forward (batches without a plan: a run of more than 16 tokens is a prompt run) likewise: a 20-token
    chunk with every row a logit row, which a 32-token graph would take, runs eagerly in f16 mode."""
    from strata_lite.api import LLM
    llm = object.__new__(LLM)
    llm.graphs, llm.mtp = _Graphs(), None
    llm.kv = types.SimpleNamespace(n_pages=8, page_size=16)
    llm.config = types.SimpleNamespace(n_vocab=100)
    llm.model = types.SimpleNamespace(forward=lambda batch, kv, observer=None: "eager")
    chunk = Batch.single(np.zeros(20, np.int32), 0, [0, 1])
    short = Batch.single(np.zeros(4, np.int32), 0, [0])
    for mode, want in (("f16", ["eager", "graph"]), ("exact", ["graph", "graph"])):
        llm.backend = types.SimpleNamespace(prompt_attention=mode)
        assert [_path(llm, b) for b in (chunk, short)] == want
