"""Device sampling (kernels/cuda/sampling.py) against a float64 numpy implementation of the spec in
kernels/sample_rows.py and against the CPU sampler, with the same uniform draws: token ids must be equal
(random logits put float ties and uniforms within ~1e-12 of a CDF step out of reach).

Logprobs: the kernel sums float32 exps (<= 2 ulp each) in float64 and the result is rounded to float32
(ulp 1e-6 at |logprob| ~ 10) -> atol 2e-6 against the float64 log-softmax.

Tests without the gpu marker run the Numba kernels in numba-cuda's simulator on numpy arrays (tests/conftest.py
sets NUMBA_ENABLE_CUDASIM=1 when no GPU is seen), at tiny sizes: the simulator runs a Python thread per
CUDA thread. On a GPU machine the same tests run the real kernels on numpy arrays (Numba copies them).
"""
import numpy as np
import pytest

from strata_lite.kernels.cpu import sampling as cpu_sampling
from strata_lite.kernels.sample_rows import SampleRows

gpu = pytest.mark.gpu
BIG_VOCAB = 151936        # qwen2 / qwen3


# ----------------------------------------------------------------------------- float64 reference

def ref_ids(logits, rows, counts):
    """The spec of kernels/sample_rows.py in float64 numpy, written independently of both samplers."""
    ids = []
    for r in range(len(rows)):
        z = logits[r].astype(np.float64)
        if rows.count_rows[r] >= 0:
            c = counts[rows.count_rows[r]].astype(np.float64)
            z = z - (float(rows.frequency[r]) * c + float(rows.presence[r]) * (c > 0))
        if rows.temperature[r] == 0:
            ids.append(int(np.argmax(z)))                        # first maximum: lowest id on ties
            continue
        z = z / float(rows.temperature[r])
        order = np.lexsort((np.arange(len(z)), -z))              # descending, ties lower id first
        k = int(rows.top_k[r])
        cand = order[:k] if 0 < k < len(z) else order
        p = np.exp(z[cand] - z[cand[0]])
        p /= p.sum()
        keep = len(cand)
        if rows.top_p[r] < 1:
            keep = min(keep, int(np.searchsorted(np.cumsum(p), float(rows.top_p[r]), side="left")) + 1)
        if rows.min_p[r] > 0:
            keep = min(keep, max(1, int(np.count_nonzero(p >= float(rows.min_p[r]) * p[0]))))
        cum = np.cumsum(p[:keep] / p[:keep].sum())
        hit = np.flatnonzero(cum > float(rows.uniform[r]) * cum[-1])
        ids.append(int(cand[hit[0] if len(hit) else keep - 1]))
    return np.array(ids, np.int32)


def ref_log_softmax(logits):
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def random_logits(rng, m, n_vocab, spread=3.0):
    return (rng.standard_normal((m, n_vocab)) * spread).astype(np.float32)


def check_against_references(got, logits, rows, counts_host):
    np.testing.assert_array_equal(got.ids, ref_ids(logits, rows, counts_host))
    np.testing.assert_array_equal(got.ids, cpu_sampling.sample(logits, rows, counts_host).ids)


# ----------------------------------------------------------------------------- GPU

@pytest.fixture(scope="module")
def smp():
    from strata_lite.kernels.cuda import sampling
    return sampling


def run(cp, smp, logits, rows, counts=None):
    """sample() on the device with the workspace's result buffers poisoned first; checks that the
    logits are left unchanged."""
    ws = smp.sampling_workspace(8, logits.shape[1])
    ws.best.fill(-7)
    ws.stats.fill(np.nan)
    dev = cp.asarray(logits)
    got = smp.sample(dev, rows, None if counts is None else cp.asarray(counts), ws)
    np.testing.assert_array_equal(cp.asnumpy(dev), logits)
    assert got.ids.dtype == np.int32 and got.ids.shape == (len(rows),)
    return got


@gpu
@pytest.mark.parametrize("n_vocab", [BIG_VOCAB, 37])
@pytest.mark.parametrize("m", [1, 5])
def test_greedy_ties_lowest_id(cp, smp, n_vocab, m):
    rng = np.random.default_rng(20)
    logits = random_logits(rng, m, n_vocab)
    for r in range(m):                   # the maximum appears at 2-3 ids, none of them the first
        ties = rng.choice(np.arange(1, n_vocab), size=2 + r % 2, replace=False)
        logits[r, ties] = logits[r].max() + 1.0
    got = run(cp, smp, logits, SampleRows.greedy(m))
    np.testing.assert_array_equal(got.ids, ref_ids(logits, SampleRows.greedy(m), None))
    assert np.isnan(got.logprob).all() and got.top_ids.shape == (m, 0)


@gpu
@pytest.mark.parametrize("n_vocab", [BIG_VOCAB, 37])
def test_penalties(cp, smp, n_vocab):
    """Greedy and sampled rows with penalties; the penalized top token must lose its place."""
    rng = np.random.default_rng(21)
    m = 5
    logits = random_logits(rng, m, n_vocab, spread=1.0)
    counts = rng.integers(0, 3, (3, n_vocab)).astype(np.int32)
    top = logits.argmax(axis=1)
    counts[0, top[0]] = 5                # frequency 0.5 * 5 + presence 1 pushes it ~3.5 down
    rows = SampleRows.from_rows([
        dict(count_rows=0, presence=1.0, frequency=0.5),
        dict(count_rows=1, presence=-0.5, frequency=0.25),
        dict(count_rows=2, frequency=2.0, temperature=0.7, uniform=0.41),
        dict(count_rows=0, presence=2.0, temperature=1.3, top_k=50, uniform=0.93),
        dict(),
    ])
    got = run(cp, smp, logits, rows, counts)
    check_against_references(got, logits, rows, counts)
    assert got.ids[0] != top[0]


@gpu
@pytest.mark.parametrize("n_vocab", [BIG_VOCAB, 37])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("mode", ["top_k", "top_p", "min_p", "all"])
def test_filters(cp, smp, n_vocab, m, mode):
    """Each filter with several uniforms (one per row and seed) against the float64 spec and the CPU."""
    for seed in range(4):
        rng = np.random.default_rng(100 + seed)
        logits = random_logits(rng, m, n_vocab)
        u = rng.random(m)
        t = rng.uniform(0.3, 1.5, m)
        settings = {"top_k": dict(top_k=int(rng.integers(1, 60))), "top_p": dict(top_p=float(rng.uniform(0.5, 0.95))),
                    "min_p": dict(min_p=float(rng.uniform(0.01, 0.3))),
                    "all": dict(top_k=40, top_p=0.9, min_p=0.05)}[mode]
        rows = SampleRows.from_rows([dict(temperature=t[r], uniform=u[r], **settings) for r in range(m)])
        got = run(cp, smp, logits, rows)
        check_against_references(got, logits, rows, None)


@gpu
def test_filters_bind(cp, smp):
    """Limits that leave one candidate pick the argmax whatever the uniform; top_k=3 stays in the top 3."""
    rng = np.random.default_rng(22)
    logits = random_logits(rng, 5, BIG_VOCAB, spread=0.5)
    rows = SampleRows.from_rows([dict(temperature=1.0, top_k=1, uniform=0.99),
                                 dict(temperature=1.0, top_p=1e-6, uniform=0.99),
                                 dict(temperature=1.0, min_p=1.0, uniform=0.99),
                                 dict(temperature=5.0, top_k=3, uniform=0.999999),
                                 dict(temperature=100.0, uniform=0.5)])
    got = run(cp, smp, logits, rows)
    best3 = np.argsort(-logits, axis=1, kind="stable")[:, :3]
    assert (got.ids[:3] == best3[:3, 0]).all() and got.ids[3] in best3[3]
    check_against_references(got, logits, rows, None)


@gpu
@pytest.mark.parametrize("n_vocab", [BIG_VOCAB, 37])
def test_logprobs(cp, smp, n_vocab):
    rng = np.random.default_rng(23)
    m = 5
    logits = random_logits(rng, m, n_vocab)
    logits[2, [5, 9]] = logits[2].max() + 0.5                    # tie among the best: lower id first
    rows = SampleRows.from_rows([dict(n_logprobs=0), dict(), dict(n_logprobs=4),
                                 dict(n_logprobs=2, temperature=0.8, uniform=0.3),
                                 dict(n_logprobs=0, count_rows=0, presence=2.0)])
    counts = np.zeros((1, n_vocab), np.int32)
    counts[0, logits[4].argmax()] = 1                            # logprobs stay those of the raw logits
    got = run(cp, smp, logits, rows, counts)
    check_against_references(got, logits, rows, counts)
    lsm = ref_log_softmax(logits)
    asked = rows.n_logprobs >= 0
    np.testing.assert_allclose(got.logprob[asked], lsm[asked, got.ids[asked]], rtol=0, atol=2e-6)
    assert np.isnan(got.logprob[~asked]).all()
    assert got.top_ids.shape == got.top_logprobs.shape == (m, 4)
    for r in range(m):
        n = max(0, int(rows.n_logprobs[r]))
        want = np.argsort(-logits[r], kind="stable")[:n]
        np.testing.assert_array_equal(got.top_ids[r, :n], want)
        np.testing.assert_allclose(got.top_logprobs[r, :n], lsm[r, want], rtol=0, atol=2e-6)
        assert (got.top_ids[r, n:] == -1).all() and np.isnan(got.top_logprobs[r, n:]).all()
    assert list(got.top_ids[2, :2]) == [5, 9]


@gpu
def test_fewer_columns_than_the_workspace(cp, smp):
    """An MTP head cut to its draft vocabulary gives logits narrower than the model's vocabulary, sampled
    with the engine's workspace: the same ids and logprobs as a workspace of their own width; wider logits
    than the workspace are refused."""
    rng = np.random.default_rng(26)
    logits = random_logits(rng, 3, 32768)
    rows = SampleRows.from_rows([dict(n_logprobs=0)] * 3)
    ws = smp.sampling_workspace(8, BIG_VOCAB)
    got = smp.sample(cp.asarray(logits), rows, None, ws)
    want = run(cp, smp, logits, rows)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.logprob, want.logprob)
    check_against_references(got, logits, rows, None)
    with pytest.raises(ValueError, match="exceed the workspace"):
        smp.sample(cp.asarray(random_logits(rng, 1, BIG_VOCAB + 1)), SampleRows.greedy(1), None, ws)


@gpu
def test_rows_are_independent(cp, smp):
    """Batch invariance: each row's result equals that row sampled alone, bit for bit."""
    rng = np.random.default_rng(24)
    logits = random_logits(rng, 5, BIG_VOCAB)
    specs = [dict(n_logprobs=3), dict(temperature=0.9, top_p=0.8, uniform=0.6, n_logprobs=0),
             dict(temperature=1.1, top_k=20, uniform=0.2), dict(n_logprobs=1), dict(temperature=0.5, uniform=0.9)]
    full = run(cp, smp, logits, SampleRows.from_rows(specs))
    for r, spec in enumerate(specs):
        one = run(cp, smp, np.ascontiguousarray(logits[r:r + 1]), SampleRows.from_rows([spec]))
        assert one.ids[0] == full.ids[r]
        np.testing.assert_array_equal(one.logprob[0], full.logprob[r])
        n = one.top_ids.shape[1]
        np.testing.assert_array_equal(one.top_logprobs[0], full.top_logprobs[r, :n])


def first_max_ids(logits):
    """numpy spec of a plain greedy row: lowest id of the largest non-NaN value, 0 when none beats -inf."""
    ids = []
    for row in logits.astype(np.float64):
        ok = ~np.isnan(row) & (row > -np.inf)
        ids.append(int(np.flatnonzero(ok & (row == row[ok].max()))[0]) if ok.any() else 0)
    return np.array(ids, np.int32)


@gpu
@pytest.mark.parametrize("n_vocab", [BIG_VOCAB, 32001, 37, 4])
def test_plain_greedy_kernel(cp, smp, n_vocab):
    """argmax.cu against the numpy spec and against the Numba kernel it stands in for (rows without
    penalties): ties at several ids, NaN entries, rows of NaN, of -inf, and with +inf."""
    rng = np.random.default_rng(25)
    m = 7
    logits = random_logits(rng, m, n_vocab)
    logits[0, rng.choice(n_vocab, size=min(3, n_vocab), replace=False)] = 50.0       # ties
    logits[1, ::3] = np.nan                                                           # NaN never wins
    logits[2] = np.nan
    logits[3] = -np.inf
    logits[4, [n_vocab - 1, n_vocab // 2]] = np.inf                                  # lowest +inf id
    logits[5, -1] = 99.0                                                              # last id
    want = first_max_ids(logits)
    assert want[2] == want[3] == 0 and want[4] == n_vocab // 2 and want[5] == n_vocab - 1
    dev = cp.asarray(logits)
    best = cp.full(m, -7, cp.int32)
    np.testing.assert_array_equal(cp.asnumpy(smp.greedy_ids(dev, best)), want)
    k = smp._kernels()
    params = np.zeros((m, k.N_PARAMS))
    params[:, [k.P_COUNT_ROW, k.P_N_LOGPROBS, k.P_SLOT]] = -1
    nb = cp.full(m, -7, cp.int32)
    k.penalize_argmax[m, k.BLOCK](smp._view(dev), smp._view(cp.zeros((1, 1), cp.int32)), smp._view(cp.asarray(params)),
                                  smp._view(cp.zeros((1, 1), cp.float64)), smp._view(nb),
                                  smp._view(cp.zeros((m, 2), cp.float64)))
    np.testing.assert_array_equal(cp.asnumpy(nb), want)
    if n_vocab > 4:                  # an odd row start (misaligned rows) takes the scalar loads
        odd = cp.ascontiguousarray(dev[:, 1:])
        np.testing.assert_array_equal(cp.asnumpy(smp.greedy_ids(odd, best)), first_max_ids(logits[:, 1:]))


@gpu
@pytest.mark.parametrize("n_vocab", [BIG_VOCAB, 37])
def test_greedy_with_prob(cp, smp, n_vocab):
    """argmax_prob_rows (an MTP drafter's draft and confidence): greedy_ids' ids, and the softmax probability
    of each against float64 (float32 sums of exp over the row: relative 1e-5 at 151936 terms), the same as
    the logprob path's exp(logprob); a row without a finite maximum gives id 0, probability 0."""
    rng = np.random.default_rng(26)
    m = 5
    logits = random_logits(rng, m, n_vocab)
    logits[1, 3] = 40.0                                                             # a sharp row: p ~ 1
    logits[2, :3] = 7.5                                                             # ties: lowest id
    logits[4] = -np.inf
    dev = cp.asarray(logits)
    ids, probs = smp.greedy_with_prob(dev)
    want = first_max_ids(logits)
    np.testing.assert_array_equal(ids, want)
    z = logits[:4].astype(np.float64)
    p = 1.0 / np.exp(z - z.max(1, keepdims=True)).sum(1)
    np.testing.assert_allclose(probs[:4], p, rtol=1e-5)
    assert probs[4] == 0.0 and ids[4] == 0
    from strata_lite.kernels.sample_rows import SampleRows
    ws = smp.sampling_workspace(m, n_vocab)
    s = smp.sample(dev[:4], SampleRows.from_rows([{"n_logprobs": 0}] * 4), None, ws)
    np.testing.assert_array_equal(ids[:4], s.ids[:4])
    np.testing.assert_allclose(probs[:4], np.exp(s.logprob[:4]), rtol=1e-5)


def test_plain_greedy_rule():
    """Which rows the one-kernel path (and a captured step's own greedy ids) takes: greedy, no penalty that
    changes a logit, no logprobs."""
    assert SampleRows.greedy(3).plain_greedy()
    assert SampleRows.greedy(0).plain_greedy()
    assert SampleRows.from_rows([dict(count_rows=0), dict()]).plain_greedy()              # zero penalties
    assert not SampleRows.from_rows([dict(), dict(count_rows=0, presence=0.5)]).plain_greedy()
    assert not SampleRows.from_rows([dict(count_rows=1, frequency=0.1)]).plain_greedy()
    assert not SampleRows.from_rows([dict(n_logprobs=0)]).plain_greedy()
    assert not SampleRows.from_rows([dict(temperature=0.7)]).plain_greedy()


@gpu
def test_step_results_columns(cp, smp):
    """step_results / draft_results (a captured step's per-row results, one host copy): column 0 greedy_ids'
    ids (computed, or copied from given ids), columns 1-2 the draft head's argmax_prob_rows pair, written
    through the strided kernels; the same values as the contiguous calls."""
    rng = np.random.default_rng(27)
    m = 6
    main, draft = cp.asarray(random_logits(rng, m, BIG_VOCAB)), cp.asarray(random_logits(rng, m, 4099))
    res = smp.step_results(main)
    smp.draft_results(draft, res)
    host = cp.asnumpy(res)
    np.testing.assert_array_equal(host[:, 0].view(np.int32), cp.asnumpy(smp.greedy_ids(main, cp.empty(m, cp.int32))))
    pair = cp.empty((m, 2), cp.float32)
    smp.argmax_prob_rows(draft, pair)
    np.testing.assert_array_equal(host[:, 1:], cp.asnumpy(pair))
    given = smp.step_results(main, cp.arange(m, dtype=cp.int32))
    np.testing.assert_array_equal(cp.asnumpy(given)[:, 0].view(np.int32), np.arange(m))
    assert not cp.asnumpy(given)[:, 1:].any()


@gpu
def test_add_counts(cp, smp):
    counts = cp.zeros((3, 37), cp.int32)
    smp.add_counts(counts, np.array([0, -1, 0, 2, 0], np.int32), np.array([5, 6, 5, 36, 7], np.int32))
    want = np.zeros((3, 37), np.int32)
    want[0, 5], want[0, 7], want[2, 36] = 2, 1, 1                # repeats add up; row -1 is skipped
    np.testing.assert_array_equal(cp.asnumpy(counts), want)
    with pytest.raises(ValueError):
        smp.add_counts(counts, np.array([3], np.int32), np.array([0], np.int32))
    with pytest.raises(ValueError):
        smp.sample(cp.zeros((1, 37), cp.float32), SampleRows.from_rows([dict(count_rows=0)]), None,
                   smp.sampling_workspace(1, 37))                  # penalties without a count table


# ----------------------------------------------------------------------------- simulator (CI)

@pytest.fixture
def sim():
    from strata_lite.kernels.cuda import sampling
    return sampling


def test_sim_penalize_argmax_kernel(sim):
    """The kernel alone on numpy arrays: argmax (ties -> lowest id) of the penalized logits, the
    penalized row written to its slot, the raw log-sum-exp where logprobs are asked."""
    k = sim._kernels()
    rng = np.random.default_rng(30)
    m, n_vocab = 3, 45
    logits = random_logits(rng, m, n_vocab)
    logits[0, [4, 30]] = 9.0                                     # tie
    counts = rng.integers(0, 3, (2, n_vocab)).astype(np.int32)
    params = np.zeros((m, k.N_PARAMS))
    params[:, k.P_COUNT_ROW] = (-1, 1, 0)
    params[:, k.P_PRESENCE] = (0.0, 0.5, 1.0)
    params[:, k.P_FREQUENCY] = (0.0, 0.25, 3.0)
    params[:, k.P_N_LOGPROBS] = (0, -1, 2)
    params[:, k.P_SLOT] = (-1, 0, -1)
    z = np.full((1, n_vocab), np.nan)
    best = np.full(m, -7, np.int32)
    stats = np.full((m, 2), np.nan)
    k.penalize_argmax[m, k.BLOCK](logits, counts, params, z, best, stats)
    pen = logits.astype(np.float64)
    for r in (1, 2):
        c = counts[int(params[r, k.P_COUNT_ROW])]
        pen[r] -= params[r, k.P_FREQUENCY] * c + params[r, k.P_PRESENCE] * (c > 0)
    np.testing.assert_array_equal(best, pen.argmax(axis=1))
    assert best[0] == 4
    np.testing.assert_array_equal(z[0], pen[1])
    for r in (0, 2):
        lse = np.log(np.exp(logits[r].astype(np.float64) - logits[r].max()).sum())
        assert stats[r, 0] == logits[r].max() and abs(stats[r, 1] - lse) < 1e-6
    assert np.isnan(stats[1]).all()


def test_sim_sample_matches_references(sim):
    """sample() end to end on numpy arrays (the simulator path of every step) vs the spec and the CPU."""
    rng = np.random.default_rng(31)
    m, n_vocab = 4, 40
    logits = random_logits(rng, m, n_vocab, spread=1.5)
    logits[0, [3, 11]] = logits[0].max() + 1.0
    counts = rng.integers(0, 2, (2, n_vocab)).astype(np.int32)
    rows = SampleRows.from_rows([dict(n_logprobs=2),
                                 dict(temperature=0.8, top_k=10, uniform=rng.random(), n_logprobs=0),
                                 dict(temperature=1.2, top_p=0.85, min_p=0.05, count_rows=1, presence=0.4,
                                      frequency=0.2, uniform=rng.random()),
                                 dict(count_rows=0, frequency=1.5)])
    ws = sim.sampling_workspace(6, n_vocab, xp=np)
    got = sim.sample(logits, rows, counts, ws)
    check_against_references(got, logits, rows, counts)
    want = cpu_sampling.sample(logits, rows, counts)
    assert got.ids[0] == 3
    np.testing.assert_allclose(got.logprob, want.logprob, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=0, atol=2e-6)


def test_sim_add_counts(sim):
    counts = np.zeros((2, 9), np.int32)
    sim.add_counts(counts, np.array([1, 1, -1, 0], np.int32), np.array([8, 8, 0, 2], np.int32))
    want = np.zeros((2, 9), np.int32)
    want[1, 8], want[0, 2] = 2, 1
    np.testing.assert_array_equal(counts, want)
