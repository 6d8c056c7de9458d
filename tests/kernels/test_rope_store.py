"""The CPU backend's one-call rope + KV store (kernels/cpu/rope_store.py) against the three calls it replaces
(elementwise.rope of q and of k, attention.kv_store): the same bits, serial (decode) and token-parallel
(prompt chunks), with and without K smoothing's channel scales, neox and normal pairs. The three calls are
themselves tested against float64 (test_elementwise.py, test_attention.py)."""
import numpy as np
import pytest

from strata_lite.kernels.cpu.attention import kv_store
from strata_lite.kernels.cpu.elementwise import _PAR_MIN, rope
from strata_lite.kernels.cpu.rope_store import rope_kv_store
from strata_lite.kernels.kv_layout import kv_shapes


def _case(rng, n_tok, n_heads, n_kv, hd, n_pages=16, page_size=8):
    q = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32) * 3
    k = rng.standard_normal((n_tok, n_kv, hd)).astype(np.float32) * 3
    v = rng.standard_normal((n_tok, n_kv, hd)).astype(np.float32)
    # two sequences, positions in a scattered page table
    seq = (np.arange(n_tok) % 2).astype(np.int32)
    pos = (np.arange(n_tok) // 2 + 5).astype(np.int32)
    tables = rng.permutation(n_pages).astype(np.int32).reshape(2, n_pages // 2)
    pages, scales = kv_shapes(1, n_pages, page_size, n_kv, hd)
    cache = [np.zeros(pages[1:], np.int8), np.zeros(scales[1:], np.float32),
             np.zeros(pages[1:], np.int8), np.zeros(scales[1:], np.float32)]
    return q, k, v, seq, pos, tables, cache


@pytest.mark.parametrize("n_tok", [1, 3, 40])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("scaled", [False, True])
def test_rope_kv_store_equals_the_separate_calls(n_tok, neox, scaled):
    rng = np.random.default_rng(n_tok * 4 + 2 * neox + scaled)
    n_heads, n_kv, hd, n_rot = 14, 2, 64, 48
    q, k, v, seq, pos, tables, cache = _case(rng, n_tok, n_heads, n_kv, hd)
    qs = (rng.random((n_heads, hd)) + 0.5).astype(np.float32) if scaled else None
    ks = (rng.random((n_kv, hd)) + 0.5).astype(np.float32) if scaled else None
    q1, k1, v1, c1 = q.copy(), k.copy(), v.copy(), [c.copy() for c in cache]
    rope(q1, pos, 1e6, n_rot, neox, qs)
    rope(k1, pos, 1e6, n_rot, neox, ks)
    kv_store(k1, v1, seq, pos, tables, *c1)
    rope_kv_store(q, k, v, seq, pos, tables, *cache, 1e6, n_rot, neox, qs, ks)
    np.testing.assert_array_equal(q, q1)
    np.testing.assert_array_equal(k, k1)
    for got, want in zip(cache, c1):
        np.testing.assert_array_equal(got, want)
    assert np.count_nonzero(cache[0]) > 0


def test_the_parallel_path_is_taken_and_agrees():
    # 40 tokens x 14 heads x 64 < _PAR_MIN: the case above is serial; this one is not
    n_tok = _PAR_MIN // (14 * 64) + 2
    rng = np.random.default_rng(7)
    q, k, v, seq, pos, tables, cache = _case(rng, n_tok, 14, 2, 64, n_pages=32)
    assert q.size >= _PAR_MIN
    q1, k1, v1, c1 = q.copy(), k.copy(), v.copy(), [c.copy() for c in cache]
    rope(q1, pos, 1e4, 64, True)
    rope(k1, pos, 1e4, 64, True)
    kv_store(k1, v1, seq, pos, tables, *c1)
    rope_kv_store(q, k, v, seq, pos, tables, *cache, 1e4, 64, True)
    np.testing.assert_array_equal(q, q1)
    for got, want in zip(cache, c1):
        np.testing.assert_array_equal(got, want)
