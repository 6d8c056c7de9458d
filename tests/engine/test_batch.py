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
