"""int8 paged KV store + causal GQA attention vs float64 references (tests/kernels/reference.py).

Tolerances: attention is compared against a float64 reference computed from the *same*
dequantized int8 cache, so the only differences are float32 rounding in the kernel: q.k over
head_dim terms (~sqrt(head_dim) * 6e-8 relative), the polynomial exp2 (< 2e-7 relative), the
online-softmax rescales and the p @ V accumulation over up to a few thousand positions. That
stays well under 1e-5 of the output scale, so we assert |out - ref| <= 1e-5 * max|ref| + 1e-5 * |ref|
(rtol 1e-5 with an absolute floor relative to the output magnitude, since individual outputs
can be near zero where relative error is meaningless).

The integer q.k paths (attention_int8.py) first round the query per 32 channels: to int8 as ggml
rounds activations to Q8_0, or to int16. Against the reference run on that rounded query
(reference.round_query) the same RTOL holds (the integer dots are exact; the float part is the same
few roundings). Against the unrounded query the rounding itself is the difference, and it has a bound:
per channel |q_r - q| <= d/2 + 127 |f16(d) - d| <= (0.5 + 127 * 2^-11) d with d = max|q_g| / 127 for
int8 (about 1/227 of the group's max), <= d/2 (+ float32 rounding) with d = max|q_g| / 32767 for int16,
so every score moves by at most eps = scale * sum_c |q_r,c - q_c| |k_c|, each softmax weight by a factor
within [e^-2eps, e^2eps], and the output by at most (e^(2 eps) - 1) * max|v|
(test_integer_qk_error_within_the_rounding_bound computes eps from the data and asserts that bound, plus
the float RTOL slack).
"""
import numpy as np
import pytest

from strata_lite.kernels.cpu.attention import attention, kv_store, qk_path
from strata_lite.kernels.cpu.isa import host_has_avx2
from strata_lite.kernels.kv_layout import KV_GROUP, kv_scale_groups

import reference as ref  # tests/kernels/reference.py (pytest puts this directory on sys.path)

RTOL = 1e-5
_AVX2 = pytest.mark.skipif(not host_has_avx2(), reason="the integer q.k paths need AVX2")
QK = ["float", pytest.param("int8", marks=_AVX2), pytest.param("int16", marks=_AVX2)]


def make_cache(n_pages, page_size, n_kv, hd):
    kp = np.zeros((n_pages, page_size, n_kv, hd), np.int8)
    ks = np.zeros((n_pages, page_size, n_kv, kv_scale_groups(hd)), np.float32)
    return kp, ks, kp.copy(), ks.copy()


def page_table(rng, n_seqs, max_pages, n_pages):
    """Non-contiguous, non-overlapping page assignment."""
    return rng.permutation(n_pages)[: n_seqs * max_pages].reshape(n_seqs, max_pages).astype(np.int32)


def store(rng, cache, pt, seq, pos, n_kv, hd, amp=1.0):
    k = (rng.standard_normal((len(seq), n_kv, hd)) * amp).astype(np.float32)
    v = rng.standard_normal((len(seq), n_kv, hd)).astype(np.float32)
    kv_store(k, v, np.asarray(seq, np.int32), np.asarray(pos, np.int32), pt, *cache)
    return k, v


def check(q, seq, pos, pt, cache, scale, qk="float"):
    """The kernel on path qk against the reference (on the query that path multiplies)."""
    seq = np.asarray(seq, np.int32)
    pos = np.asarray(pos, np.int32)
    out = np.full_like(q, np.nan)
    attention(q, seq, pos, pt, *cache, scale, out, qk=qk)
    want = ref.attention(ref.round_query(q, qk_path(q.shape[-1], qk)), seq, pos, pt, *cache, scale)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=RTOL * np.abs(want).max())
    return out


# ----------------------------------------------------------------------------- kv_store

def test_kv_store_roundtrip():
    rng = np.random.default_rng(1)
    n_kv, hd, ps = 2, 64, 16
    cache = make_cache(12, ps, n_kv, hd)
    pt = page_table(rng, 2, 5, 12)
    seq = np.array([0] * 40 + [1] * 30, np.int32)
    pos = np.concatenate([np.arange(40), np.arange(5, 35)]).astype(np.int32)
    k = rng.standard_normal((70, n_kv, hd)).astype(np.float32) * rng.uniform(0.01, 10, (70, n_kv, 1)).astype(np.float32)
    v = rng.standard_normal((70, n_kv, hd)).astype(np.float32)
    k[3, 1] = 0.0                                   # all-zero row -> scale 0, values 0
    v[7, 0, 5] = 1e-30                              # tiny values stay finite
    kv_store(k, v, seq, pos, pt, *cache)
    kp, ks, vp, vs = cache
    for x, pages, scales in ((k, kp, ks), (v, vp, vs)):
        pg = pt[seq, pos // ps]
        sl = pos % ps
        qv, sc = pages[pg, sl], scales[pg, sl]
        want_q, want_s = ref.quantize_rows(x, ks.shape[-1])
        np.testing.assert_array_equal(sc, want_s)
        np.testing.assert_array_equal(qv, want_q)
        assert np.abs(qv.astype(np.int32)).max() <= 127
        deq = ref.dequantize_groups(qv, sc)
        # round-to-nearest: error at most half a quantization step (+ float32 slack)
        step = np.repeat(sc, hd // sc.shape[-1], axis=-1)
        assert np.all(np.abs(deq - x) <= step * (0.5 + 1e-5))
    assert not ks[pt[0, 0], 3, 1].any() and not kp[pt[0, 0], 3, 1].any()
    # seq 1 positions 0..4 were never written
    assert not kp[pt[1, 0], :5].any() and not ks[pt[1, 0], :5].any()


def test_kv_store_round_half_away():
    cache = make_cache(1, 1, 1, 8)
    pt = np.zeros((1, 1), np.int32)
    # scale = 127/127 = 1 -> exact halves must round away from zero
    x = np.array([[[127.0, 0.5, -0.5, 1.5, -2.5, 0.49999997, -126.5, 3.0]]], np.float32)
    kv_store(x, x.copy(), np.zeros(1, np.int32), np.zeros(1, np.int32), pt, *cache)
    np.testing.assert_array_equal(cache[0][0, 0, 0], [127, 1, -1, 2, -3, 0, -127, 3])
    np.testing.assert_array_equal(cache[1][0, 0, 0], [1.0])     # 8 channels: one group


def test_kv_store_group_scales_keep_small_channels():
    """A group of channels 1000x smaller than its neighbours keeps its own scale (and precision)."""
    hd = 4 * KV_GROUP
    cache = make_cache(1, 1, 1, hd)
    x = np.random.default_rng(4).standard_normal((1, 1, hd)).astype(np.float32)
    x[..., :KV_GROUP] *= 1000.0
    kv_store(x, x.copy(), np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros((1, 1), np.int32), *cache)
    kp, ks = cache[0][0, 0, 0], cache[1][0, 0, 0]
    assert ks.shape == (4,) and ks[0] > 100 * ks[1:].max()
    small = ref.dequantize_groups(kp, ks)[KV_GROUP:]
    assert np.abs(small - x[0, 0, KV_GROUP:]).max() <= 0.5 * ks[1:].max() * (1 + 1e-5)
    assert np.abs(small - x[0, 0, KV_GROUP:]).max() < 0.02     # one row scale would round them to 0


# ----------------------------------------------------------------------------- attention

@pytest.mark.parametrize("n_heads,n_kv,hd", [(14, 2, 64), (8, 8, 64), (16, 2, 128), (4, 1, 128), (6, 2, 40)])
@pytest.mark.parametrize("qk", QK)
def test_prefill_full_causal(n_heads, n_kv, hd, qk):
    rng = np.random.default_rng(3)
    ps, n = 16, 150                                  # several key blocks, partial last block
    cache = make_cache(16, ps, n_kv, hd)
    pt = page_table(rng, 1, 10, 16)
    seq, pos = [0] * n, list(range(n))
    store(rng, cache, pt, seq, pos, n_kv, hd)
    q = rng.standard_normal((n, n_heads, hd)).astype(np.float32)
    check(q, seq, pos, pt, cache, hd ** -0.5, qk)


@pytest.mark.parametrize("qk", QK)
def test_chunk_over_cached_prefix(qk):
    rng = np.random.default_rng(4)
    n_heads, n_kv, hd, ps = 14, 2, 64, 16
    cache = make_cache(20, ps, n_kv, hd)
    pt = page_table(rng, 2, 8, 20)                    # seq 1 owns pages too (must not be read)
    store(rng, cache, pt, [0] * 37, range(37), n_kv, hd)          # cached prefix 0..36
    store(rng, cache, pt, [1] * 100, range(100), n_kv, hd)        # another sequence's data
    chunk = list(range(37, 37 + 53))
    store(rng, cache, pt, [0] * len(chunk), chunk, n_kv, hd)      # the chunk's own K/V
    q = rng.standard_normal((len(chunk), n_heads, hd)).astype(np.float32)
    check(q, [0] * len(chunk), chunk, pt, cache, hd ** -0.5, qk)
    perm = rng.permutation(len(chunk))                # token order within a call is free
    check(q[perm], [0] * len(chunk), np.asarray(chunk)[perm], pt, cache, hd ** -0.5, qk)


@pytest.mark.parametrize("qk", QK)
def test_decode_many_sequences_mixed(qk):
    rng = np.random.default_rng(5)
    n_heads, n_kv, hd, ps = 14, 2, 64, 16
    lens = [1, 17, 64, 65, 300, 129]
    cache = make_cache(130, ps, n_kv, hd)
    pt = page_table(rng, len(lens), 20, 130)
    for s, n in enumerate(lens):
        store(rng, cache, pt, [s] * n, range(n), n_kv, hd)
    order = [4, 0, 2, 5, 1, 3]
    seq = order
    pos = [lens[s] - 1 for s in order]
    q = rng.standard_normal((len(seq), n_heads, hd)).astype(np.float32)
    check(q, seq, pos, pt, cache, hd ** -0.5, qk)
    # decode tokens mixed with a prompt chunk of sequence 4 (positions 280..299) in one call
    seq2 = [1] + [4] * 20 + [3, 5]
    pos2 = [16] + list(range(280, 300)) + [64, 128]
    q2 = rng.standard_normal((len(seq2), n_heads, hd)).astype(np.float32)
    check(q2, seq2, pos2, pt, cache, hd ** -0.5, qk)


@pytest.mark.parametrize("qk", QK)
def test_long_context_sharp_softmax_and_key_split(qk):
    """Large scores (exercises online-softmax rescaling across blocks) and the flash-decoding
    split path (1 kv head x 1 token < 2 threads -> key range split, partials merged)."""
    rng = np.random.default_rng(6)
    n_heads, n_kv, hd, ps = 4, 1, 64, 32
    n = 2100
    cache = make_cache(80, ps, n_kv, hd)
    pt = page_table(rng, 1, 70, 80)
    store(rng, cache, pt, [0] * n, range(n), n_kv, hd, amp=3.0)
    q = (rng.standard_normal((3, n_heads, hd)) * 3).astype(np.float32)
    check(q[:1], [0], [n - 1], pt, cache, hd ** -0.5, qk)              # split path (if >1 thread)
    check(q, [0, 0, 0], [5, 1000, n - 1], pt, cache, hd ** -0.5, qk)



@_AVX2
@pytest.mark.parametrize("qk", ["int8", "int16"])
@pytest.mark.parametrize("n_heads,n_kv,hd", [(14, 2, 64), (32, 8, 128)])
def test_integer_qk_error_within_the_rounding_bound(n_heads, n_kv, hd, qk):
    """Against the unrounded query: |out - ref| <= (e^(2 eps) - 1) * max|v| + the float RTOL slack, eps the
    largest score change the query's rounding makes (module docstring)."""
    rng = np.random.default_rng(8)
    ps, n = 16, 700
    cache = make_cache(48, ps, n_kv, hd)
    pt = page_table(rng, 1, 44, 48)
    store(rng, cache, pt, [0] * n, range(n), n_kv, hd, amp=2.0)
    q = (rng.standard_normal((2, n_heads, hd)) * 2).astype(np.float32)
    seq, pos = np.zeros(2, np.int32), np.array([300, n - 1], np.int32)
    out = np.empty_like(q)
    attention(q, seq, pos, pt, *cache, hd ** -0.5, out, qk=qk)
    want = ref.attention(q, seq, pos, pt, *cache, hd ** -0.5)
    k = ref.gather_kv(cache[0], cache[1], pt[0], n)                  # (n, n_kv, hd) float64
    v = ref.gather_kv(cache[2], cache[3], pt[0], n)
    dq = np.abs(ref.round_query(q, qk).astype(np.float64) - q)     # (2, n_heads, hd)
    for h in range(n_heads):
        g = h // (n_heads // n_kv)
        eps = hd ** -0.5 * (dq[:, h] @ np.abs(k[:, g]).T).max()
        bound = np.expm1(2 * eps) * np.abs(v[:, g]).max() + RTOL * 2 * np.abs(want).max()
        err = np.abs(out[:, h] - want[:, h]).max()
        assert 0 < err <= bound, (h, err, bound)


def test_qk_path_choice(monkeypatch):
    monkeypatch.delenv("STRATA_LITE_ATTN_QK", raising=False)
    monkeypatch.setenv("STRATA_LITE_INT8", "1")
    integer = host_has_avx2()
    assert qk_path(64, "float") == "float"
    assert qk_path(64, "int8") == ("int8" if integer else "float")
    assert qk_path(48, "int16") == "float"                          # groups of 32 channels only
    assert qk_path(128) == "float"                                  # the default
    monkeypatch.setenv("STRATA_LITE_ATTN_QK", "int16")
    assert qk_path(128) == ("int16" if integer else "float")
    monkeypatch.setenv("STRATA_LITE_ATTN_QK", "int8")
    assert qk_path(128) == ("int8" if integer else "float")
    monkeypatch.setenv("STRATA_LITE_ATTN_QK", "float")
    assert qk_path(128) == "float"
    monkeypatch.setenv("STRATA_LITE_ATTN_QK", "int16")
    monkeypatch.setenv("STRATA_LITE_INT8", "0")                     # no int8 kernels: float
    assert qk_path(128) == "float" and qk_path(128, "int8") == "float"
    with pytest.raises(ValueError):
        qk_path(64, "int4")
    rng = np.random.default_rng(9)                                  # head_dim 48 asked for int8: the float path
    cache = make_cache(4, 16, 1, 48)
    pt = page_table(rng, 1, 4, 4)
    store(rng, cache, pt, [0] * 40, range(40), 1, 48)
    q = rng.standard_normal((40, 2, 48)).astype(np.float32)
    check(q, [0] * 40, range(40), pt, cache, 48 ** -0.5, "int8")

def test_attention_validation():
    rng = np.random.default_rng(7)
    n_heads, n_kv, hd, ps = 4, 2, 64, 16
    cache = make_cache(4, ps, n_kv, hd)
    pt = np.array([[0, 1]], np.int32)
    seq = np.zeros(3, np.int32)
    pos = np.arange(3, dtype=np.int32)
    q = rng.standard_normal((3, n_heads, hd)).astype(np.float32)
    out = np.empty_like(q)
    attention(q, seq, pos, pt, *cache, 0.125, out)                 # valid call
    with pytest.raises(ValueError):
        attention(q, seq, pos, pt, *cache, 0.125, np.empty((3, n_heads, hd + 1), np.float32))
    with pytest.raises(ValueError):
        attention(q.astype(np.float64), seq, pos, pt, *cache, 0.125, out)
    with pytest.raises(ValueError):
        attention(np.ascontiguousarray(q[:, :3]), seq, pos, pt, *cache, 0.125, np.empty((3, 3, hd), np.float32))
    with pytest.raises(ValueError):                               # wrong head_dim vs cache
        q2 = np.zeros((3, n_heads, 32), np.float32)
        attention(q2, seq, pos, pt, *cache, 0.125, q2.copy())
    with pytest.raises(ValueError):
        attention(q, seq[:2], pos, pt, *cache, 0.125, out)
    with pytest.raises(ValueError):
        attention(q, seq.astype(np.int64), pos, pt, *cache, 0.125, out)
    with pytest.raises(ValueError):                               # position beyond page table
        attention(q, seq, np.array([0, 1, 32], np.int32), pt, *cache, 0.125, out)
    with pytest.raises(ValueError):                               # page index out of range
        attention(q, seq, pos, np.array([[9, 1]], np.int32), *cache, 0.125, out)
    with pytest.raises(ValueError):
        attention(q, np.array([0, 0, 1], np.int32), pos, pt, *cache, 0.125, out)
    kp, ks, vp, vs = cache
    with pytest.raises(ValueError):
        attention(q, seq, pos, pt, kp, ks, vp[:3], vs, 0.125, out)
    with pytest.raises(ValueError):
        kv_store(np.zeros((3, n_kv, hd), np.float32), np.zeros((3, n_kv, hd + 1), np.float32), seq, pos, pt, *cache)
    with pytest.raises(ValueError):
        kv_store(np.zeros((3, n_kv + 1, hd), np.float32), np.zeros((3, n_kv + 1, hd), np.float32), seq, pos, pt, *cache)
