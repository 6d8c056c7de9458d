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


def test_prompt_runs_start_at_the_plans_decode_rows():
    """Where the plan says which rows decode (StepPlan: the decoding sequences' tokens and drafts, then prompt
    reads), every read is a prompt run, however short, and a verify run longer than SHORT_RUN is not."""
    b = Batch(np.zeros(28, np.int32), np.arange(28, dtype=np.int32),
              np.asarray([0] + [1] * 20 + [2] * 2 + [3] * 5, np.int32), np.zeros((4, 1), np.int32),
              np.zeros(0, np.int32), decode_rows=21)
    assert b.short_run_rows == 1                                               # the 20-row verify run looks long
    assert b.prompt_runs == ((21, 23, 2, 23), (23, 28, 3, 28))
    assert Batch.single([5, 6], 40, [0]).prompt_runs == ()   # no plan: from short_run_rows, all 2 rows short
    assert Batch(*[getattr(b, f) for f in ("token_ids", "positions", "token_seq", "page_tables", "logit_rows")],
                 decode_rows=28).prompt_runs == ()


def test_a_plans_batch_marks_its_decode_rows():
    """build_plan: the decoding sequences (a token each, one with 20 drafted tokens) come first; a 3-token prompt
    read after them is one prompt run (under SHORT_RUN, so short_run_rows alone would have called it decode)."""
    from strata_lite.sequence import Request, Sequence
    from strata_lite.step_plan import build_plan
    seqs = [Sequence(Request(f"r{i}", tuple(range(1, 9)))) for i in range(3)]
    for s in seqs:
        s.pages = [0]
    seqs[0].n_computed = seqs[1].n_computed = 7                          # decoding: the last prompt token pending
    plan = build_plan({seqs[0]: 1, seqs[1]: 21, seqs[2]: 3}, 2, {seqs[1]: list(range(20))})
    assert plan.batch.decode_rows == 22
    assert plan.batch.prompt_runs == ((22, 25, 2, 3),)


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
