"""CUDA elementwise kernels (kernels/cuda/elementwise.py) vs float64 references (tests/kernels/reference.py)
and vs the CPU kernels, on fresh random inputs with NaN-poisoned outputs.

Tolerances (float32 kernels, unit-scale random data):
  * rmsnorm: float32 sum of squares in a fixed tree of <= ~40 additions (~3e-7 relative), a double row
    scale, two float32 products -> rtol 2e-6 vs float64 and vs the CPU (float64 sum) kernel.
  * rope: cos/sin in double rounded to float (as the CPU kernel; CUDA's double sin/cos/pow are <= 2 ulp of
    double, so the float values agree but for rare 1-ulp flips), a 2-term float rotation that may contract
    to FMA on either side -> atol 1e-6 * max|x| vs float64, 3e-7 * max|x| (~2.5 float32 ulps) vs the CPU.
  * silu_mul: IEEE expf (<= 2 ulp), a divide, a product -> rtol 2e-6; the CPU's polynomial exp2 has ~2e-7.
  * add, take_rows, copy_cols: exact (a correctly rounded float32 add; copies move bytes).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_lite.kernels.cpu import elementwise as cpu_ew

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/kernels: the float64 references
import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ew():
    from strata_lite.kernels.cuda import elementwise
    return elementwise


def poisoned(cp, shape):
    """A float32 device array full of NaN (an output a kernel must overwrite everywhere)."""
    return cp.full(shape, np.nan, dtype=cp.float32)


def close(got, want, rtol):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol / 2 * np.abs(want).max())


# ----------------------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("shape", [(1, 896), (300, 896), (7, 64), (3, 130), (2, 4096), (5, 16, 128)])
def test_rmsnorm(cp, ew, shape):
    """(3, 130) takes the scalar kernel (d % 4 != 0); (5, 16, 128) is the per-head q/k norm."""
    rng = np.random.default_rng(10)
    d = shape[-1]
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 30, shape[:-1] + (1,))).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    out = poisoned(cp, shape)
    ew.rmsnorm(cp.asarray(x), cp.asarray(w), 1e-6, out)
    got = cp.asnumpy(out)
    close(got, ref.rmsnorm(x, w, 1e-6), 2e-6)
    want_cpu = np.empty_like(x)
    cpu_ew.rmsnorm(x, w, 1e-6, want_cpu)
    close(got, want_cpu, 2e-6)
    y = cp.asarray(x)
    ew.rmsnorm(y, cp.asarray(w), 1e-6, y)                    # in place (out aliases x)
    np.testing.assert_array_equal(cp.asnumpy(y), got)


def test_rmsnorm_batch_invariant_and_zero_rows(cp, ew):
    """A row's result is bit-identical whatever else shares the launch; eps keeps zero rows finite."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 1536)).astype(np.float32)
    w = cp.asarray(rng.standard_normal(1536).astype(np.float32))
    full = poisoned(cp, x.shape)
    ew.rmsnorm(cp.asarray(x), w, 1e-6, full)
    for lo, hi in [(0, 1), (17, 18), (5, 40)]:
        part = poisoned(cp, (hi - lo, 1536))
        ew.rmsnorm(cp.asarray(x[lo:hi]), w, 1e-6, part)
        np.testing.assert_array_equal(cp.asnumpy(part), cp.asnumpy(full)[lo:hi])
    z = cp.zeros((2, 1536), cp.float32)
    ew.rmsnorm(z, w, 1e-6, z)
    assert bool((z == 0).all())


# ----------------------------------------------------------------------------- rope

ROPE_CASES = [(1, 14, 64, 64), (300, 14, 64, 64), (40, 8, 128, 64), (3, 2, 128, 96), (5, 16, 128, 128)]


def _rope_inputs(n_tok, n_heads, hd, seed=12):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32)
    pos = rng.integers(0, 40000, n_tok).astype(np.int32)
    pos[0] = 0
    return x, pos, rng


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_tok,n_heads,hd,n_rot", ROPE_CASES)
def test_rope(cp, ew, neox, n_tok, n_heads, hd, n_rot):
    x, pos, _ = _rope_inputs(n_tok, n_heads, hd)
    base = 1e6 if n_rot == hd else 1e4
    y = cp.asarray(x)
    ew.rope(y, cp.asarray(pos), base, n_rot, neox)
    got = cp.asnumpy(y)
    np.testing.assert_allclose(got, ref.rope(x, pos, base, n_rot, neox), rtol=0, atol=1e-6 * np.abs(x).max())
    want_cpu = x.copy()
    cpu_ew.rope(want_cpu, pos, base, n_rot, neox)
    np.testing.assert_allclose(got, want_cpu, rtol=0, atol=3e-7 * np.abs(x).max())
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])     # dims rope leaves alone
    np.testing.assert_array_equal(got[pos == 0], x[pos == 0])           # position 0 = identity


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_tok,n_heads,hd,n_rot", [(7, 4, 128, 128), (3, 2, 128, 96)])
def test_rope_channel_scale(cp, ew, neox, n_tok, n_heads, hd, n_rot):
    """After the rotation every channel (rotated or not) is multiplied by channel_scale[head, channel]."""
    x, pos, rng = _rope_inputs(n_tok, n_heads, hd, seed=13)
    scale = rng.uniform(0.25, 4.0, (n_heads, hd)).astype(np.float32)
    y = cp.asarray(x)
    ew.rope(y, cp.asarray(pos), 1e6, n_rot, neox, channel_scale=cp.asarray(scale))
    got = cp.asnumpy(y)
    want = ref.rope(x, pos, 1e6, n_rot, neox) * scale.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    want_cpu = x.copy()
    cpu_ew.rope(want_cpu, pos, 1e6, n_rot, neox, channel_scale=scale)
    np.testing.assert_allclose(got, want_cpu, rtol=0, atol=3e-7 * np.abs(want).max())
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:] * scale[:, n_rot:])   # one float product


def test_rope_pairing(cp, ew):
    """neox pairs (i, i+n_rot/2); normal pairs (2i, 2i+1): one rotated pair by hand."""
    x = np.zeros((1, 1, 8), np.float32)
    x[0, 0, 0] = 1.0
    for neox, other in [(True, 4), (False, 1)]:
        y = cp.asarray(x)
        ew.rope(y, cp.asarray(np.array([1], np.int32)), 10000.0, 8, neox)
        y = cp.asnumpy(y)
        assert np.isclose(y[0, 0, 0], np.cos(1.0)) and np.isclose(y[0, 0, other], np.sin(1.0))


# ----------------------------------------------------------------------------- silu_mul, add

@pytest.mark.parametrize("n,f", [(1, 4864), (64, 4864), (3, 17)])
def test_silu_mul(cp, ew, n, f):
    """(3, 17) takes the scalar kernel; +-100 gates check exp overflow (silu -> -0) and saturation."""
    rng = np.random.default_rng(14)
    g = (rng.standard_normal((n, f)) * 4).astype(np.float32)
    g.flat[:2] = (-100.0, 100.0)
    u = rng.standard_normal((n, f)).astype(np.float32)
    out = poisoned(cp, (n, f))
    ew.silu_mul(cp.asarray(g), cp.asarray(u), out)
    got = cp.asnumpy(out)
    close(got, ref.silu_mul(g, u), 2e-6)
    want_cpu = np.empty_like(g)
    cpu_ew.silu_mul(g, u, want_cpu)
    close(got, want_cpu, 2e-6)
    gd = cp.asarray(g)
    ew.silu_mul(gd, cp.asarray(u), gd)                       # out aliases gate (as the model calls it)
    np.testing.assert_array_equal(cp.asnumpy(gd), got)


@pytest.mark.parametrize("shape", [(1, 896), (37, 896), (5, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_add(cp, ew, shape, bias):
    """Exact: float32 a + b is correctly rounded, so it equals float64 a + b rounded to float32."""
    rng = np.random.default_rng(15)
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape[-1:] if bias else shape).astype(np.float32)
    want = (a.astype(np.float64) + b.astype(np.float64)).astype(np.float32)
    out = poisoned(cp, shape)
    ew.add(cp.asarray(a), cp.asarray(b), out)
    np.testing.assert_array_equal(cp.asnumpy(out), want)
    ad = cp.asarray(a)
    ew.add(ad, cp.asarray(b), ad)                            # out aliases a (the residual stream)
    np.testing.assert_array_equal(cp.asnumpy(ad), want)


# ----------------------------------------------------------------------------- take_rows, copy_cols

@pytest.mark.parametrize("d", [896, 17])
def test_take_rows(cp, ew, d):
    rng = np.random.default_rng(16)
    x = rng.standard_normal((50, d)).astype(np.float32)
    for rows in (np.array([49], np.int32), np.array([3, 0, 3, 49, 7], np.int32)):
        out = poisoned(cp, (len(rows), d))
        ew.take_rows(cp.asarray(x), cp.asarray(rows), out)
        np.testing.assert_array_equal(cp.asnumpy(out), x[rows])


@pytest.mark.parametrize("widths", [(896, 128, 128), (3, 5, 9), (8, 4, 12)])
def test_copy_cols(cp, ew, widths):
    """(896, 128, 128) is split_cols of a fused qkv; (3, 5, 9) takes the scalar kernel."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((9, sum(widths))).astype(np.float32)
    xd, at = cp.asarray(x), 0
    for w in widths:
        out = poisoned(cp, (9, w))
        ew.copy_cols(xd, at, w, out)
        np.testing.assert_array_equal(cp.asnumpy(out), x[:, at:at + w])
        at += w


def test_bad_arguments(cp, ew):
    x = cp.zeros((4, 8), cp.float32)
    with pytest.raises(ValueError):
        ew.rmsnorm(x, cp.zeros(7, cp.float32), 1e-6, x)                     # weight length
    with pytest.raises(ValueError):
        ew.add(x, cp.zeros(8, cp.float64), x)                               # dtype
    with pytest.raises(ValueError):
        ew.silu_mul(np.zeros((4, 8), np.float32), x, x)                     # host array
    with pytest.raises(ValueError):
        ew.rope(x.reshape(4, 1, 8), cp.zeros(4, cp.int32), 1e4, 6, True,
                channel_scale=cp.ones((2, 8), cp.float32))                  # scale shape
    with pytest.raises(ValueError):
        ew.copy_cols(x, 6, 4, cp.zeros((4, 4), cp.float32))                 # past the last column
    with pytest.raises(ValueError):
        ew.take_rows(x, cp.zeros(2, cp.int64), cp.zeros((2, 8), cp.float32))   # index dtype


@pytest.mark.parametrize("fmt,d", [("q8_0", 896), ("q8_0", 4096), ("q8_k", 1024), ("q8_k", 4096)])
@pytest.mark.parametrize("n", [1, 5])
def test_rmsnorm_round_equals_rmsnorm_then_rounding(cp, ew, fmt, d, n):
    """The fused kernel's output and rounding are the bits of rmsnorm, then quantize_activations."""
    from strata_lite.kernels.cuda import qmatmul as qm
    rng = np.random.default_rng(d + n)
    x = cp.asarray(rng.standard_normal((n, d), dtype=np.float32) * 3)
    x[0, :256] = 0                                   # all-zero rounding blocks
    w = cp.asarray(rng.standard_normal(d, dtype=np.float32))
    want = poisoned(cp, (n, d))
    ew.rmsnorm(x, w, 1e-6, want)
    xb = qm.XBLOCK[fmt]
    want_q, want_d = cp.zeros((n, d), cp.int8), poisoned(cp, (n, d // xb))
    qm.quantize_activations(fmt, want, want_q, want_d)
    assert ew.can_round(x, w, want, fmt)
    out, xq, xd = poisoned(cp, (n, d)), cp.full((n, d), 99, cp.int8), poisoned(cp, (n, d // xb))
    ew.rmsnorm_round(x, w, 1e-6, out, fmt, xq, xd)
    assert np.array_equal(out.get().view(np.uint32), want.get().view(np.uint32))
    assert np.array_equal(xq.get(), want_q.get())
    assert np.array_equal(xd.get().view(np.uint32), want_d.get().view(np.uint32))
    assert not ew.can_round(x[:, :d - 4], w[:d - 4], want[:, :d - 4], fmt)   # rows not whole blocks


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 48])
def test_rope_qk_equals_two_ropes(cp, ew, neox, n_rot):
    rng = np.random.default_rng(n_rot)
    q = rng.standard_normal((3, 14, 64), dtype=np.float32)
    k = rng.standard_normal((3, 2, 64), dtype=np.float32)
    qs = cp.asarray(rng.random((14, 64), dtype=np.float32) + 0.5)
    ks = cp.asarray(rng.random((2, 64), dtype=np.float32) + 0.5)
    pos = cp.asarray(np.array([0, 17, 40000], np.int32))
    q1, k1, q2, k2 = cp.asarray(q), cp.asarray(k), cp.asarray(q), cp.asarray(k)
    ew.rope(q1, pos, 1e6, n_rot, neox, qs)
    ew.rope(k1, pos, 1e6, n_rot, neox, ks)
    ew.rope_qk(q2, k2, pos, 1e6, n_rot, neox, qs, ks)
    assert np.array_equal(q1.get().view(np.uint32), q2.get().view(np.uint32))
    assert np.array_equal(k1.get().view(np.uint32), k2.get().view(np.uint32))


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_rot,base", [(64, 1e6), (32, 1e4)])
def test_rope_table_same_bits(cp, ew, neox, n_rot, base):
    """The cos/sin table gives the bits rope computes in the launch, for positions inside it; positions past
    it (here 5000 and 40000 of a 4096-row table) fall back to the computation in the same launch."""
    rng = np.random.default_rng(n_rot + 1)
    q = rng.standard_normal((6, 14, 64), dtype=np.float32)
    k = rng.standard_normal((6, 2, 64), dtype=np.float32)
    pos = cp.asarray(np.array([0, 1, 4095, 4096, 5000, 40000], np.int32))
    table = ew.rope_table(base, n_rot, 4096)
    q1, k1, q2, k2 = cp.asarray(q), cp.asarray(k), cp.asarray(q), cp.asarray(k)
    ew.rope_qk(q1, k1, pos, base, n_rot, neox)
    ew.rope_qk(q2, k2, pos, base, n_rot, neox, table=table)
    assert np.array_equal(q1.get().view(np.uint32), q2.get().view(np.uint32))
    assert np.array_equal(k1.get().view(np.uint32), k2.get().view(np.uint32))
    x1, x2 = cp.asarray(q), cp.asarray(q)
    ew.rope(x1, pos, base, n_rot, neox)
    ew.rope(x2, pos, base, n_rot, neox, table=table)
    assert np.array_equal(x1.get().view(np.uint32), x2.get().view(np.uint32))
    with pytest.raises(ValueError, match="rope table"):
        ew.rope(x2, pos, base * 2, n_rot, neox, table=table)
