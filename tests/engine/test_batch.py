"""Batch's derived host fields."""
import numpy as np

from strata_lite.batch import Batch


def _batch(token_seq):
    n = len(token_seq)
    return Batch(np.zeros(n, np.int32), np.arange(n, dtype=np.int32), np.asarray(token_seq, np.int32),
                 np.zeros((max(token_seq, default=0) + 1, 1), np.int32), np.zeros(0, np.int32))


def test_short_run_rows_counts_the_leading_decode_and_verify_tokens():
    """The tokens before the first run of more than SHORT_RUN tokens of one sequence (a mixed step: decoding
    sequences first, one token or a few to verify each, then prompt chunks)."""
    assert Batch.SHORT_RUN == 16
    assert _batch([]).short_run_rows == 0
    assert _batch([0, 1, 2, 3]).short_run_rows == 4                          # decode only
    assert _batch([0, 1, 1, 1] + [2] * 40).short_run_rows == 4               # decode, a verify run of 3, a chunk
    assert _batch([0] * 40 + [1, 2]).short_run_rows == 0                     # the chunk first
    assert _batch([0] * 16 + [1] * 17 + [2]).short_run_rows == 16            # 16 is short, 17 is not
    assert _batch([0, 1, 0] + [1] * 20).short_run_rows == 3                  # runs, not sequences


def test_prompt_runs_are_the_runs_after_the_short_ones():
    """(first row, end row, sequence, keys) of each run from short_run_rows on: what Backend.attention's `runs`
    hands a backend that reads prompt chunks another way (the CUDA backend's f16 prompt attention)."""
    assert _batch([0, 1, 2]).prompt_runs == ()                                  # decode only
    b = _batch([0, 1, 1] + [2] * 20 + [3] * 5)
    assert b.short_run_rows == 3
    assert b.prompt_runs == ((3, 23, 2, 23), (23, 28, 3, 28))                   # positions are row numbers here
    b = Batch(np.zeros(30, np.int32), np.arange(100, 130, dtype=np.int32), np.full(30, 1, np.int32),
              np.zeros((2, 4), np.int32), np.zeros(0, np.int32))
    assert b.prompt_runs == ((0, 30, 1, 130),)                                  # a chunk at depth: 130 keys


def test_the_model_reads_every_batch_shape_it_is_handed():
    """Besides Batch, a decoder block reads the CUDA step graphs' static batch (graphs._StaticBatch) and the MTP
    drafter's rows (mtp_drafter._NextTokenRows): each has every field BlockRows takes, short_run_rows 0 (their
    steps are decode and verify tokens only). Built here over numpy in place of CuPy, read by the CPU backend."""
    from strata_lite.kernels.cpu.backend import CpuBackend
    from strata_lite.kernels.cuda.graphs import _StaticBatch
    from strata_lite.models.transformer import BlockRows
    from strata_lite.spec.mtp_drafter import _NextTokenRows
    be = CpuBackend()
    static = _StaticBatch(np, 4, 3, 192, 0)
    rows = BlockRows(be, static)
    assert (rows.short_rows, rows.max_keys, rows.seq.shape, rows.tables.shape) == (0, 192, (4,), (4, 3))
    decode = _batch([0, 1, 1, 2])
    rows = BlockRows(be, _NextTokenRows(decode, np.zeros(4, np.int32)))
    assert (rows.short_rows, rows.max_keys) == (0, decode.max_pos)
