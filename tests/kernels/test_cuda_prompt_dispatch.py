"""How the CUDA backend hands a step's attention to its kernels when prompt runs are read through the f16 path
(`--prompt-attention f16`): host logic, checked without a GPU by recording the launchers' calls over numpy
arrays. The kernels themselves: tests/kernels/cuda/test_attention_f16_cuda.py and test_attention_cuda.py."""
import numpy as np

from strata_lite.kernels.cuda import backend as cb


def _backend(mode):
    be = object.__new__(cb.CudaBackend)      # no device: only the dispatch runs
    be.cp, be._attn_ws, be.max_keys, be.prompt_attention = np, object(), 4096, mode
    return be


def _record(monkeypatch):
    calls = []
    monkeypatch.setattr(cb.attn_k, "attention",
                        lambda q, seq, pos, *rest, split_rows=0: calls.append(("exact", q.shape[0], int(pos[0]),
                                                                               split_rows)))
    monkeypatch.setattr(cb.attn_f16, "prompt_attention_f16",
                        lambda q, seq, pos, *rest: calls.append(("f16", q.shape[0], int(pos[0]), seq, rest[-1])))
    return calls


def _args(n):
    q = np.zeros((n, 4, 64), np.float32)
    cache = (np.zeros((2, 4), np.int32),) + tuple(np.zeros(1) for _ in range(4))
    return q, np.zeros(n, np.int32), np.arange(100, 100 + n, dtype=np.int32), cache


def test_f16_mode_sends_each_prompt_run_to_the_f16_path_and_the_short_rows_to_the_exact_kernels(monkeypatch):
    calls = _record(monkeypatch)
    q, seq, pos, cache = _args(30)
    runs = ((3, 23, 1, 123), (23, 30, 0, 130))          # Batch.prompt_runs of rows 3..29
    _backend("f16").attention(q, seq, pos, *cache, 0.125, out=np.empty_like(q), max_keys=130, split_rows=3,
                              runs=runs)
    assert calls == [("exact", 3, 100, 0), ("f16", 20, 103, 1, 123), ("f16", 7, 123, 0, 130)]


def test_f16_mode_takes_the_rows_before_the_first_prompt_run_to_the_exact_kernels(monkeypatch):
    """The exact launch is the rows before the first prompt run (the plan's decode rows), not split_rows: a verify
    run longer than Batch.SHORT_RUN leaves split_rows short of it, and a short prompt read after the decode rows
    leaves it past them."""
    calls = _record(monkeypatch)
    q, seq, pos, cache = _args(30)
    for split_rows in (1, 8):
        _backend("f16").attention(q, seq, pos, *cache, 0.125, out=np.empty_like(q), max_keys=130,
                                  split_rows=split_rows, runs=((3, 6, 1, 106), (6, 30, 2, 130)))
    assert calls == 2 * [("exact", 3, 100, 0), ("f16", 3, 103, 1, 106), ("f16", 24, 106, 2, 130)]


def test_exact_mode_and_steps_without_prompt_runs_take_one_exact_launch(monkeypatch):
    calls = _record(monkeypatch)
    q, seq, pos, cache = _args(30)
    _backend("exact").attention(q, seq, pos, *cache, 0.125, max_keys=130, split_rows=3, runs=((3, 30, 1, 130),))
    _backend("f16").attention(q, seq, pos, *cache, 0.125, max_keys=130, split_rows=30, runs=())
    assert calls == [("exact", 30, 100, 3), ("exact", 30, 100, 30)]
