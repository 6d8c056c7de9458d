"""One suite every Backend passes: each method on small inputs against float64 numpy references (and the
sampling semantics of kernels/sample_rows.py), then a tiny model's logits against the CPU backend's.
Arrays cross only through backend.from_host / to_host (which may share memory on the CPU: in-place ops
get copies); outputs are poisoned (NaN) before each call.

Tolerances (float32 kernels vs float64 references):
  * qmatmul: activations rounded as ggml does (act_reference.py) on both sides; float32 accumulation
    error ~sqrt(n_in) * 2**-24 of sum|x W| -> 1e-4 of it (as test_repack.py / test_qmatmul.py).
  * rmsnorm, silu_mul: a few float32 roundings per element (+ the polynomial exp) -> rtol 2e-6.
  * rope: cos/sin of float64 angles rounded to float32, a 2-term rotation, one scale multiply -> 2e-6
    of the output scale (angles up to 40K rad: float32 angles would be off by ~1e-3).
  * add, take_rows, split_cols, embed (bit-exact dequantization), kv_store (the same float32 rounding
    rule on every backend: the KV layout is shared): exact.
  * attention: float64 reference over the same int8 cache, on the query as the backend's q.k path rounds
    it (the CPU's integer paths: reference.round_query) -> 1e-5 (as test_attention.py), plus on the GPU what
    the kernels' p.V weights in one f16 move an output by (reference.f16_rounding_bound).
  * sampling: ids exact, except rows whose outcome sits within 1e-5 of a boundary of the semantics
    (cdf vs uniform, cumsum vs top_p, p vs min_p * p0, near-equal logits), which are skipped and must
    be rare; logprobs: float64 log-softmax of float32 logits -> 2e-5 absolute.
  * tiny model: float32 summation order may flip an int8 KV rounding -> 2e-3 of the logits' spread
    (as tests/engine/test_engine.py), argmax equal where the top two are further apart than that.
"""
from types import SimpleNamespace

import gguf.quants
import numpy as np
import pytest

import reference as ref  # tests/kernels/reference.py
from act_reference import round_like_ggml
from strata_lite.kernels import get_backend
from strata_lite.kernels.cpu.attention import qk_path
from strata_lite.kernels.kv_layout import kv_scale_groups
from strata_lite.kernels.qtypes import SUPPORTED_QTYPES
from strata_lite.kernels.sample_rows import SampleRows
from test_dequant import random_rows

ALL_TYPES = sorted(SUPPORTED_QTYPES, key=lambda t: t.name)
NAMES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FRAGILE = 1e-5


@pytest.fixture(scope="module", params=NAMES)
def be(request):
    return get_backend(request.param)


def reserve(be, n_vocab=512, max_rows=16, n_heads=8, head_dim=128, max_keys=512):
    """Workspaces for this test's shapes (the CPU needs none)."""
    be.reserve(64, 1024, n_heads, head_dim, max_keys, n_vocab, max_rows)


def poisoned(be, shape):
    return be.from_host(np.full(shape, np.nan, np.float32))


def weight(qtype, raw, n_in, name="blk.0.ffn_up.weight"):
    return SimpleNamespace(name=name, qtype=qtype, n_out=raw.shape[0], n_in=n_in, raw=raw)


# ----------------------------------------------------------------------------- dense ops

def _bf16_chunk(be, n_tok: int, n_in: int) -> bool:
    """Whether a BF16 call of n_tok tokens takes the CPU's BF16 dot products (activations rounded to BF16)."""
    from strata_lite.kernels.cpu import half_gemm
    from strata_lite.kernels.cpu.backend import CpuBackend
    from strata_lite.kernels.cpu.qmatmul import MATVEC_MAX_TOK
    return isinstance(be, CpuBackend) and n_tok > MATVEC_MAX_TOK and half_gemm.takes(True, n_in)


@pytest.mark.parametrize("n_tok", [1, 5, 40])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_qmatmul(be, qtype, n_tok):
    reserve(be)
    raw = random_rows(qtype, 37, 512, seed=n_tok)
    x = np.random.default_rng(n_tok).standard_normal((n_tok, 512), dtype=np.float32)
    w64 = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    xr = round_like_ggml(qtype, x, bf16_chunk=_bf16_chunk(be, n_tok, 512)).astype(np.float64)
    want, scale = xr @ w64.T, np.abs(xr) @ np.abs(w64).T
    w = be.upload_weight(weight(qtype, raw, 512))
    out = poisoned(be, (n_tok, 37))
    assert be.qmatmul(w, be.from_host(x), out=out) is out
    got = be.to_host(out)
    assert np.all(np.abs(got - want) <= 1e-4 * scale + 1e-30), f"max rel err {np.max(np.abs(got - want) / scale):.3g}"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_embed(be, qtype):
    raw = random_rows(qtype, 50, 256, seed=3)
    w = be.upload_weight(weight(qtype, raw, 256, name="token_embd.weight"))
    ids = np.array([7, 0, 49, 7], np.int32)
    got = be.to_host(be.embed(w, be.from_host(ids)))
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw[ids], qtype))


@pytest.mark.parametrize("n,d", [(1, 896), (9, 64), (33, 128)])
def test_rmsnorm(be, n, d):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.01, 30, (n, 1))).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    out = poisoned(be, (n, d))
    be.rmsnorm(be.from_host(x), be.from_host(w), 1e-6, out=out)
    want = ref.rmsnorm(x, w, 1e-6)
    np.testing.assert_allclose(be.to_host(out), want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_tok,n_heads,hd,n_rot", [(1, 4, 64, 64), (7, 2, 128, 96), (40, 3, 128, 128)])
def test_rope(be, neox, scaled, n_tok, n_heads, hd, n_rot):
    rng = np.random.default_rng(n_tok + hd)
    x = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32)
    pos = rng.integers(0, 40000, n_tok).astype(np.int32)
    s = rng.uniform(0.01, 30, (n_heads, hd)).astype(np.float32)
    want = ref.rope(x, pos, 1e6, n_rot, neox) * (s if scaled else 1.0)
    xd = be.from_host(x.copy())                            # the CPU backend may share host memory
    be.rope(xd, be.from_host(pos), 1e6, n_rot, neox, channel_scale=be.from_host(s) if scaled else None)
    got = be.to_host(xd)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    np.testing.assert_array_equal(got[..., n_rot:], (x * s if scaled else x)[..., n_rot:])


@pytest.mark.parametrize("n,f", [(1, 4864), (6, 17), (40, 256)])
def test_silu_mul(be, n, f):
    rng = np.random.default_rng(f)
    g, u = (rng.standard_normal((2, n, f)) * 4).astype(np.float32)
    want = ref.silu_mul(g, u)
    out = poisoned(be, (n, f))
    be.silu_mul(be.from_host(g), be.from_host(u), out=out)
    np.testing.assert_allclose(be.to_host(out), want, rtol=2e-6, atol=1e-6 * np.abs(want).max())
    gd = be.from_host(g.copy())                            # in place, as the model calls it
    be.silu_mul(gd, be.from_host(u), out=gd)
    np.testing.assert_allclose(be.to_host(gd), want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


def test_add_take_split(be):
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2, 9, 48)).astype(np.float32)
    bias = rng.standard_normal(48).astype(np.float32)
    out = poisoned(be, a.shape)
    be.add(be.from_host(a), be.from_host(b), out=out)
    np.testing.assert_array_equal(be.to_host(out), a + b)
    ad = be.from_host(a.copy())
    be.add(ad, be.from_host(bias), out=ad)                 # bias over rows, in place
    np.testing.assert_array_equal(be.to_host(ad), a + bias)
    rows = np.array([8, 0, 3, 3], np.int32)
    np.testing.assert_array_equal(be.to_host(be.take_rows(be.from_host(a), be.from_host(rows))), a[rows])
    pieces = be.split_cols(be.from_host(a), (16, 8, 24))
    for got, want in zip(pieces, np.split(a, [16, 24], axis=1)):
        np.testing.assert_array_equal(be.to_host(got), want)


# ----------------------------------------------------------------------------- KV cache + attention

def attention_f16_rounding():
    """(P', q' in one f16) of the CUDA attention kernels (the build every launch takes)."""
    from strata_lite.kernels.cuda import attention as ak
    return ak.f16_rounding(ak.BUILD)


@pytest.mark.parametrize("n_heads,n_kv,hd", [(4, 2, 64), (8, 2, 128)])
def test_kv_store_attention(be, n_heads, n_kv, hd):
    """A prompt step (37 tokens of sequence 0, 21 of sequence 1) then a decode step (one token each)."""
    reserve(be, n_heads=n_heads, head_dim=hd)
    rng = np.random.default_rng(hd)
    ps, n_pages = 16, 12
    cache = tuple(a[0] for a in be.kv_arrays(1, n_pages, ps, n_kv, hd))      # layer 0 (device views)
    tables = rng.permutation(n_pages)[:10].reshape(2, 5).astype(np.int32)    # scattered pages
    steps = [(np.array([0] * 37 + [1] * 21, np.int32), np.r_[0:37, 0:21].astype(np.int32)),
             (np.array([1, 0], np.int32), np.array([21, 37], np.int32))]
    for seq, pos in steps:
        n = len(seq)
        k = (rng.standard_normal((n, n_kv, hd)) * rng.uniform(0.01, 10, (n, n_kv, 1))).astype(np.float32)
        v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
        k[0, 1] = 0.0                                       # an all-zero row: scale 0
        dev = [be.from_host(a) for a in (seq, pos, tables)]
        be.kv_store(be.from_host(k), be.from_host(v), *dev, *cache)
        kp, ks, vp, vs = (be.to_host(a) for a in cache)
        pg, sl = tables[seq, pos // ps], pos % ps
        for x, pages, scales in ((k, kp, ks), (v, vp, vs)):
            q_want, s_want = ref.quantize_rows(x, kv_scale_groups(hd))
            np.testing.assert_array_equal(pages[pg, sl], q_want)
            np.testing.assert_array_equal(scales[pg, sl], s_want)
        q = rng.standard_normal((n, n_heads, hd)).astype(np.float32)
        scale = 1.0 / np.sqrt(hd)
        out = poisoned(be, q.shape)
        be.attention(be.from_host(q), *dev, *cache, scale, out=out, max_keys=int(pos.max()) + 1)
        q_used = ref.round_query(q, qk_path(hd)) if be.name == "cpu" else q     # the CPU's q.k path rounds q
        want = ref.attention(q_used, seq, pos, tables, kp, ks, vp, vs, scale)
        f16 = 0.0 if be.name == "cpu" else ref.f16_rounding_bound(*attention_f16_rounding(), q_used, seq, pos,
                                                                   tables, kp, ks, vp, vs, scale)
        ref.assert_within(be.to_host(out), want, 1e-5, 1e-5 * np.abs(want).max() + f16)


# ----------------------------------------------------------------------------- sampling

def ref_sample(logits, rows, counts):
    """float64 transcription of kernels/sample_rows.py -> (ids, fragile): fragile rows have an outcome
    within FRAGILE of a boundary, where float32 / float64 arithmetic may legitimately disagree."""
    m, n_vocab = logits.shape
    ids, fragile = np.zeros(m, np.int64), np.zeros(m, bool)
    for r in range(m):
        z = logits[r].astype(np.float64)
        if rows.count_rows[r] >= 0:
            c = counts[rows.count_rows[r]].astype(np.float64)
            z -= float(rows.frequency[r]) * c + float(rows.presence[r]) * (c > 0)
        order = np.lexsort((np.arange(n_vocab), -z))       # descending, ties lower id first
        if rows.temperature[r] == 0:
            ids[r] = order[0]
            fragile[r] = 0 < z[order[0]] - z[order[1]] < FRAGILE
            continue
        z /= float(rows.temperature[r])
        k = int(rows.top_k[r])
        cand = order[:k] if 0 < k < n_vocab else order
        p = np.exp(z[cand] - z[cand[0]])
        p /= p.sum()
        keep, cum = len(cand), np.cumsum(p)
        if rows.top_p[r] < 1:
            keep = min(keep, int(np.searchsorted(cum, float(rows.top_p[r]), "left")) + 1)
            fragile[r] |= np.any(np.abs(cum - float(rows.top_p[r])) < FRAGILE)
        if rows.min_p[r] > 0:
            keep = min(keep, max(1, int(np.count_nonzero(p >= float(rows.min_p[r]) * p[0]))))
            fragile[r] |= np.any(np.abs(p - float(rows.min_p[r]) * p[0]) < FRAGILE * p[0])
        cdf = np.cumsum(p[:keep]) / p[:keep].sum()
        u = float(rows.uniform[r])
        hit = np.flatnonzero(cdf > u)
        ids[r] = cand[hit[0] if len(hit) else keep - 1]
        fragile[r] |= np.any(np.abs(cdf[:-1] - u) < FRAGILE)
        if 0 < k < n_vocab:
            fragile[r] |= 0 < z[order[k - 1]] - z[order[k]] < FRAGILE
    return ids, fragile


def log_softmax(x):
    z = x.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def sample(be, logits, rows, counts=None):
    """backend.sample, checking that it leaves the device logits as they were."""
    d = be.from_host(logits.copy())
    got = be.sample(d, rows, counts)
    np.testing.assert_array_equal(be.to_host(d), logits)
    return got


def test_sample_hand_cases(be):
    """p = (0.5, 0.3, 0.2): the inverse cdf, top_k, top_p, min_p and greedy ties with fixed uniforms."""
    reserve(be, n_vocab=3)
    lg = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    cases = [  # (row, expected id)
        (dict(temperature=1.0, uniform=0.49), 0), (dict(temperature=1.0, uniform=0.51), 1),
        (dict(temperature=1.0, uniform=0.79), 1), (dict(temperature=1.0, uniform=0.81), 2),
        (dict(temperature=1.0, uniform=0.0), 0), (dict(temperature=1.0, uniform=0.9999999), 2),
        (dict(temperature=1.0, top_k=2, uniform=0.9), 1),       # p -> (0.625, 0.375)
        (dict(temperature=1.0, top_k=1, uniform=0.9), 0),
        (dict(temperature=1.0, top_p=0.6, uniform=0.9), 1),     # cumsum (0.5, 0.8, 1): keep 2
        (dict(temperature=1.0, top_p=0.45, uniform=0.9), 0),    # cumsum[0] >= 0.45: keep 1
        (dict(temperature=1.0, min_p=0.5, uniform=0.9), 1),     # p >= 0.25: keep 2
        (dict(temperature=1.0, min_p=1.0, uniform=0.9), 0),
        (dict(temperature=0.0, uniform=0.9), 0),
    ]
    logits = np.repeat(lg, len(cases), axis=0)
    got = sample(be, logits, SampleRows.from_rows([c for c, _ in cases]))
    assert got.ids.tolist() == [want for _, want in cases]
    assert got.top_ids.shape == (len(cases), 0) and np.all(np.isnan(got.logprob))
    ties = np.array([[1, 3, 0, 3, 3], [2, 2, 2, 2, 2], [0, 0, 1, 1, 0]], np.float32)
    reserve(be, n_vocab=5)
    got = sample(be, ties, SampleRows.from_rows([dict(n_logprobs=4)] * 3))
    assert got.ids.tolist() == [1, 0, 2]
    assert got.top_ids.tolist() == [[1, 3, 4, 0], [0, 1, 2, 3], [2, 3, 0, 1]]


def test_sample_penalties_and_counts(be):
    reserve(be, n_vocab=32)
    counts = be.token_counts(3, 32)
    be.add_counts(counts, np.array([0, 2, 0, -1, 0], np.int32), np.array([5, 7, 5, 9, 11], np.int32))
    want = np.zeros((3, 32), np.int32)
    want[0, 5], want[0, 11], want[2, 7] = 2, 1, 1
    np.testing.assert_array_equal(be.to_host(counts), want)
    be.add_counts(counts, np.array([2], np.int32), np.array([8], np.int32))
    be.reset_counts(counts, 2)
    want[2] = 0
    np.testing.assert_array_equal(be.to_host(counts), want)
    logits = np.zeros((5, 32), np.float32)
    logits[:, 5], logits[:, 11], logits[:, 20] = 3.0, 2.5, 2.0
    rows = SampleRows.from_rows([
        dict(count_rows=0, frequency=0.75),       # 5: 3 - 1.5, 11: 2.5 - 0.75, 20: 2 -> 20
        dict(count_rows=0, presence=1.0),         # 5: 2, 11: 1.5, 20: 2 -> tie, lower id 5
        dict(count_rows=-1, presence=2.0, frequency=2.0),   # no count row: no penalty -> 5
        dict(count_rows=2, frequency=2.0),        # the reset row -> 5
        dict(count_rows=0, frequency=-1.0, temperature=1e-3, uniform=0.5),   # 5 boosted to 5 -> 5
    ])
    assert sample(be, logits, rows, counts).ids.tolist() == [20, 5, 5, 5, 5]


@pytest.mark.parametrize("n_vocab", [300, 40000])
def test_sample_random_rows_and_logprobs(be, n_vocab):
    m = 48
    reserve(be, n_vocab=n_vocab, max_rows=m)
    rng = np.random.default_rng(n_vocab)
    logits = (rng.standard_normal((m, n_vocab)) * 3).astype(np.float32)
    counts_h = rng.integers(0, 3, (4, n_vocab)).astype(np.int32) * (rng.random((4, n_vocab)) < 0.05)
    counts = be.token_counts(4, n_vocab)
    be.add_counts(counts, *[a.astype(np.int32) for a in np.repeat(np.indices(counts_h.shape).reshape(2, -1),
                                                                   counts_h.ravel(), axis=1)])
    np.testing.assert_array_equal(be.to_host(counts), counts_h)
    rows = SampleRows.from_rows([dict(
        temperature=[0.0, 0.3, 1.0, 1.7][r % 4], top_k=[0, 1, 7, n_vocab, 50][r % 5],
        top_p=[1.0, 0.9, 0.4][r % 3], min_p=[0.0, 0.05, 0.2][(r // 3) % 3], presence=[0.0, 0.5][r % 2],
        frequency=[0.0, -0.4, 1.0][(r // 2) % 3], uniform=rng.random(), count_rows=[-1, 0, 1, 2, 3][r % 5],
        n_logprobs=[-1, 0, 3, 5][(r // 4) % 4]) for r in range(m)])
    got = sample(be, logits, rows, counts)
    want, fragile = ref_sample(logits, rows, counts_h)
    assert fragile.sum() <= 2
    np.testing.assert_array_equal(got.ids[~fragile], want[~fragile])
    lp = log_softmax(logits)
    n_top = 5
    assert got.top_ids.shape == got.top_logprobs.shape == (m, n_top) and got.top_ids.dtype == np.int32
    for r in range(m):
        n = int(rows.n_logprobs[r])
        if n < 0:
            assert np.isnan(got.logprob[r]) and np.all(got.top_ids[r] == -1)
            continue
        assert abs(got.logprob[r] - lp[r, got.ids[r]]) <= 2e-5
        best = np.lexsort((np.arange(n_vocab), -lp[r]))[:n]
        np.testing.assert_allclose(got.top_logprobs[r, :n], lp[r, best], rtol=0, atol=2e-5)
        np.testing.assert_array_equal(got.top_ids[r, :n], best)
        assert np.all(got.top_ids[r, n:] == -1) and np.all(np.isnan(got.top_logprobs[r, n:]))


def test_argmax_prob_is_greedy_sampling_with_its_logprob(be):
    """argmax_prob (an MTP draft's token and confidence): the ids greedy sampling with n_logprobs 0 gives (the lowest
    id of a tie) and exp of its logprob; on the CPU the same bits as that path (Backend.argmax_prob's default)."""
    from strata_lite.kernels.backend import Backend
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((6, 32768)) * np.arange(1, 7)[:, None]).astype(np.float32)
    logits[2, 9] = logits[2, 11] = logits[2].max() + 1.0          # a tie: the lower id
    ids, probs = be.argmax_prob(be.from_host(logits))
    want_ids, want_probs = Backend.argmax_prob(be, be.from_host(logits))
    np.testing.assert_array_equal(ids, want_ids)
    assert ids[2] == 9
    lp = log_softmax(logits)
    np.testing.assert_allclose(probs, np.exp(lp[np.arange(6), ids]), rtol=1e-5, atol=0)
    if be.name == "cpu":
        np.testing.assert_array_equal(probs, want_probs)


# ----------------------------------------------------------------------------- a whole model

@pytest.mark.parametrize("arch,qtype,tied", [("qwen2", "Q8_0", False), ("llama", "Q4_K", True),
                                              ("qwen3", "IQ3_XXS", False)])
def test_tiny_model_logits_match_the_cpu(be, tmp_path, arch, qtype, tied):
    from gguf import GGMLQuantizationType as QT
    from strata_lite import LLM
    from tiny_model import write_tiny_model
    path = str(write_tiny_model(tmp_path / "tiny.gguf", arch=arch, qtype=QT[qtype], n_embd=256, n_ff=512,
                                n_heads=4, n_kv_heads=2, tied_output=tied))
    prompt = [(7 * j + 3) % 250 for j in range(40)]
    llms = [LLM(path, backend="cpu", n_ctx=128, n_batch=32), LLM(path, backend=be.name, n_ctx=128, n_batch=32)]
    if tied:                                                # uploaded once, used for both
        assert llms[1].model.output is llms[1].model.token_embd
    # the prompt in chunks of 32 (a prompt step, then a short one), then one decode step
    # Backends differ in float summation order only, but a 1e-7-relative difference can move an activation
    # (or a KV value) across a rounding boundary, which shifts that token's logits, and later tokens' through
    # the KV cache, by up to ~4% of their range (measured on the H200: 0.7% for the qwen2 Q8_0 model, 3.5%
    # for qwen3 IQ3_XXS, 3.5-4.0% on the synthetic 0.5B/8B-layer models); so: within 5% of the range,
    # and the argmax equal wherever the top-2 margin is above 10% of it.
    cpu, got = ([llm.logits(prompt), llm.eval([5], len(prompt), [0])] for llm in llms)
    for want, have in zip(cpu, got):
        scale = np.abs(want).max()
        np.testing.assert_allclose(have, want, rtol=0, atol=0.05 * scale)
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.1 * scale
        np.testing.assert_array_equal(have.argmax(-1)[clear], want.argmax(-1)[clear])
