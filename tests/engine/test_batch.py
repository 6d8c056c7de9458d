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
