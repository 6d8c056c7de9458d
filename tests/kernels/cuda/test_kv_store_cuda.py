"""CUDA kv_store (kernels/cuda/kv_store.cu) against the CPU kv_store: bit-exact (same float32 division, same
rounding), so pages parked by either backend restore on the other."""
import numpy as np
import pytest

from strata_lite.kernels.cpu.attention import kv_store as cpu_kv_store
from strata_lite.kernels.kv_layout import kv_scale_groups

pytestmark = pytest.mark.gpu


def _case(rng, n_tok, n_kv, hd, n_seqs=2, page_size=4):
    """Random k, v with the corner cases planted, tokens scattered over non-contiguous pages, and a cache
    poisoned with 0x7f / NaN (slots not written must keep the poison on both backends)."""
    ng = kv_scale_groups(hd)
    gs = hd // ng
    max_pages = 4
    n_pages = n_seqs * max_pages + 3
    pt = rng.permutation(n_pages)[: n_seqs * max_pages].reshape(n_seqs, max_pages).astype(np.int32)
    seq = rng.integers(0, n_seqs, n_tok).astype(np.int32)
    pos = rng.permutation(max_pages * page_size)[:n_tok].astype(np.int32)     # distinct slots per sequence too
    k = (rng.standard_normal((n_tok, n_kv, hd)) * rng.uniform(0.01, 10, (n_tok, n_kv, 1))).astype(np.float32)
    v = rng.standard_normal((n_tok, n_kv, hd)).astype(np.float32)
    s = np.float32(0.25)                               # scale = (127 s) / 127 = s exactly: y = m + 0.5 exactly
    half = (rng.integers(-127, 127, gs) + 0.5).astype(np.float32) * s
    half[0] = 127 * s
    half[1], half[2] = -126.5 * s, 126.5 * s           # round away, then stay inside +-127
    k[0, 0, :gs] = half
    v[0, n_kv - 1, hd - gs:] = -half
    k[n_tok - 1, n_kv - 1, :gs] = 0.0                  # all-zero group: scale 0, q 0
    v[n_tok - 1, 0, hd - gs:] = 0.0
    if n_tok > 1:
        v[1, 0, :gs] *= np.float32(1e-37)              # denormal scale: no flush to zero on either side
    cache = [np.full((n_pages, page_size, n_kv, hd), 0x7F, np.int8),
             np.full((n_pages, page_size, n_kv, ng), np.nan, np.float32)]
    cache = cache + [c.copy() for c in cache]
    return k, v, seq, pos, pt, cache


def _check_store(cp, k, v, seq, pos, pt, cache):
    from strata_lite.kernels.cuda.kv_store import kv_store
    want = [c.copy() for c in cache]
    cpu_kv_store(k, v, seq, pos, pt, *want)
    dev = [cp.asarray(c) for c in cache]
    kv_store(cp.asarray(k), cp.asarray(v), cp.asarray(seq), cp.asarray(pos), cp.asarray(pt), *dev)
    for name, got, exp in zip(("k_pages", "k_scales", "v_pages", "v_scales"), dev, want):
        got = got.get()
        bits = np.uint8 if got.dtype == np.int8 else np.uint32      # NaN poison and -0 compared as bits
        np.testing.assert_array_equal(got.view(bits), exp.view(bits), err_msg=name)
    assert np.abs(want[0].astype(np.int32)).max() <= 127


@pytest.mark.parametrize("n_tok,n_kv,hd", [(3, 2, 64), (2, 1, 128), (3, 1, 40)])
def test_kv_store_bit_exact_small(cp, n_tok, n_kv, hd):
    """64 and 128 channels (2 and 4 scale groups) and 40 (one group of 40)."""
    _check_store(cp, *_case(np.random.default_rng(hd), n_tok, n_kv, hd))


def test_kv_store_validation(cp):
    from strata_lite.kernels.cuda.kv_store import kv_store
    k, v, seq, pos, pt, cache = _case(np.random.default_rng(0), 2, 1, 64)
    d = [cp.asarray(a) for a in (k, v, seq, pos, pt, *cache)]
    with pytest.raises(ValueError):
        kv_store(d[0], d[1][:, :, :32].copy(), *d[2:])                  # v shape != k shape
    with pytest.raises(ValueError):
        kv_store(d[0].astype(cp.float64), d[1], *d[2:])
    with pytest.raises(ValueError):
        kv_store(d[0], d[1], d[2].astype(cp.int64), *d[3:])
    with pytest.raises(ValueError):
        kv_store(d[0], d[1], d[2][:1].copy(), *d[3:])                     # token_seq too short
    with pytest.raises(ValueError):
        kv_store(d[0], d[1], *d[2:6], d[6][..., :1].copy(), *d[7:])       # k_scales: 1 group, need 2


@pytest.mark.parametrize("n_kv,hd", [(2, 64), (8, 128), (4, 40), (2, 256)])
def test_kv_store_bit_exact(cp, n_kv, hd):
    rng = np.random.default_rng(100 + hd)
    _check_store(cp, *_case(rng, 48, n_kv, hd, n_seqs=3, page_size=16))


def test_kv_store_in_cuda_graph():
    """Captured on a non-default stream and replayed with new rows and new positions (the decode step)."""
    import cupy
    from strata_lite.kernels.cuda.kv_store import kv_store
    rng = np.random.default_rng(7)
    k, v, seq, pos, pt, cache = _case(rng, 4, 2, 128, n_seqs=2, page_size=16)
    dk, dv, dseq, dpos, dpt = (cupy.asarray(a) for a in (k, v, seq, pos, pt))
    dev = [cupy.asarray(c) for c in cache]
    want = [c.copy() for c in cache]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        kv_store(dk, dv, dseq, dpos, dpt, *dev)          # compile / warm up outside the capture
        stream.begin_capture()
        kv_store(dk, dv, dseq, dpos, dpt, *dev)
        graph = stream.end_capture()
    cpu_kv_store(k, v, seq, pos, pt, *want)
    for step in range(2):
        k2 = rng.standard_normal(k.shape).astype(np.float32)
        v2 = rng.standard_normal(v.shape).astype(np.float32)
        pos2 = ((pos + 17 * (step + 1)) % (pt.shape[1] * 16)).astype(np.int32)   # still distinct slots
        with stream:                                     # inputs change in place, ordered before the replay
            dk.set(k2)
            dv.set(v2)
            dpos.set(pos2)
            graph.launch(stream)
        stream.synchronize()
        cpu_kv_store(k2, v2, seq, pos2, pt, *want)
        for got, exp in zip(dev, want):
            bits = np.uint8 if exp.dtype == np.int8 else np.uint32
            np.testing.assert_array_equal(got.get().view(bits), exp.view(bits))


@pytest.mark.parametrize("n_q,n_kv,hd,n_rot,neox,scaled,tabled", [
    (14, 2, 64, 64, True, True, True),       # the 0.5B shape with K smoothing and the rope table
    (32, 8, 128, 128, True, False, True),    # the 8B shape
    (4, 1, 128, 64, False, True, False),     # partial rotation, adjacent pairs, angles computed in the kernel
    (3, 1, 40, 40, True, False, True)])      # one scale group of 40 channels
def test_rope_kv_store_gives_the_bits_of_rope_qk_then_kv_store(cp, n_q, n_kv, hd, n_rot, neox, scaled, tabled):
    """The fused launch the decoder block uses: q, k rotated in place and the cache the same bits as
    elementwise.rope_qk followed by kv_store (positions past the table computed in the kernel)."""
    from strata_lite.kernels.cuda import elementwise as ew
    from strata_lite.kernels.cuda.kv_store import kv_store, rope_kv_store
    rng = np.random.default_rng(n_q * hd + n_rot)
    k, v, seq, pos, pt, cache = _case(rng, 5, n_kv, hd)
    q = rng.standard_normal((5, n_q, hd)).astype(np.float32) * 3
    qs = cp.asarray(rng.uniform(0.5, 2, (n_q, hd)).astype(np.float32)) if scaled else None
    ks = cp.asarray(rng.uniform(0.5, 2, (n_kv, hd)).astype(np.float32)) if scaled else None
    table = ew.rope_table(1e6, n_rot, 10) if tabled else None      # positions >= 10 computed in the kernel
    d_pos, d_seq, d_pt = cp.asarray(pos), cp.asarray(seq), cp.asarray(pt)
    ref_q, ref_k, ref_v = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    ref_cache = [cp.asarray(c) for c in cache]
    ew.rope_qk(ref_q, ref_k, d_pos, 1e6, n_rot, neox, qs, ks, table=table)
    kv_store(ref_k, ref_v, d_seq, d_pos, d_pt, *ref_cache)
    got_q, got_k, got_v = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    got_cache = [cp.asarray(c) for c in cache]
    rope_kv_store(got_q, got_k, got_v, d_seq, d_pos, d_pt, *got_cache, 1e6, n_rot, neox, qs, ks, table=table)
    for name, got, exp in zip(("q", "k", "v", "k_pages", "k_scales", "v_pages", "v_scales"),
                              (got_q, got_k, got_v, *got_cache), (ref_q, ref_k, ref_v, *ref_cache)):
        got, exp = got.get(), exp.get()
        bits = np.uint8 if got.dtype == np.int8 else np.uint32
        np.testing.assert_array_equal(got.view(bits), exp.view(bits), err_msg=name)
    assert not np.array_equal(got_q.get(), q)                     # rope did rotate


def test_rope_kv_store_validation(cp):
    from strata_lite.kernels.cuda.kv_store import rope_kv_store
    k, v, seq, pos, pt, cache = _case(np.random.default_rng(0), 2, 2, 64)
    args = [cp.asarray(a) for a in (k, v, seq, pos, pt)] + [cp.asarray(c) for c in cache]
    with pytest.raises(ValueError, match="multiple of its heads"):
        rope_kv_store(cp.zeros((2, 3, 64), cp.float32), *args, 1e4, 64, True)
    with pytest.raises(ValueError, match="n_rot"):
        rope_kv_store(cp.zeros((2, 4, 64), cp.float32), *args, 1e4, 66, True)
