"""StepResults (strata_lite/step_results.py): a captured step's per-row results read back once, the greedy ids
answering plain greedy sampling of that step's logits only, the draft columns, and the validity of the
graph's buffers. Host-only (a backend whose arrays are numpy); the CUDA graphs that fill the buffer are
tested in tests/engine/test_mtp_cuda.py and tests/kernels/cuda/test_sampling_cuda.py."""
from types import SimpleNamespace

import numpy as np

from strata_lite.kernels.sample_rows import SampleRows
from strata_lite.step_results import StepResults


class _HostBackend:
    def __init__(self):
        self.copies = 0

    def to_host(self, a):
        self.copies += 1
        return np.array(a)


def _results(ids, columns, probs):
    dev = np.zeros((len(ids), 3), np.float32)
    dev.view(np.int32)[:, 0] = ids
    dev.view(np.int32)[:, 1] = columns
    dev[:, 2] = probs
    return dev


def test_greedy_ids_and_drafts_come_from_one_copy():
    be, graphs = _HostBackend(), SimpleNamespace(replays=7)
    logits = np.zeros((3, 10), np.float32)
    res = StepResults(be, logits, _results([4, 151935, 0], [9, 2, 32767], [0.5, 0.25, 1.0]), graphs)
    assert be.copies == 0                                   # nothing waits until someone asks
    np.testing.assert_array_equal(res.greedy_ids(), [4, 151935, 0])
    cols, probs = res.drafts()
    np.testing.assert_array_equal(cols, [9, 2, 32767])
    np.testing.assert_array_equal(probs, [0.5, 0.25, 1.0])
    assert res.greedy_ids().dtype == np.int64 and be.copies == 1


def test_sample_answers_plain_greedy_rows_of_the_same_logits_only():
    be, graphs = _HostBackend(), SimpleNamespace(replays=0)
    logits = np.zeros((2, 10), np.float32)
    res = StepResults(be, logits, _results([3, 8], [0, 0], [0, 0]), graphs)
    got = res.sample(logits, SampleRows.greedy(2))
    np.testing.assert_array_equal(got.ids, [3, 8])
    assert res.sample(logits.copy(), SampleRows.greedy(2)) is None              # another forward's logits
    assert res.sample(logits, SampleRows.from_rows([{}, {"temperature": 0.7}])) is None
    assert res.sample(logits, SampleRows.from_rows([{}, {"n_logprobs": 0}])) is None
    assert res.sample(logits, SampleRows.from_rows([{"count_rows": 0, "presence": 0.5}, {}])) is None
    assert res.sample(logits, SampleRows.greedy(1)) is None                     # rows must match


def test_current_until_the_graphs_replay_again():
    graphs = SimpleNamespace(replays=3)
    res = StepResults(_HostBackend(), np.zeros((1, 4), np.float32), _results([1], [0], [0]), graphs)
    assert res.current()
    graphs.replays += 1
    assert not res.current()
