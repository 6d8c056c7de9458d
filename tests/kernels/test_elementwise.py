"""rmsnorm / rope / silu_mul / add vs float64 references (tests/kernels/reference.py).

Tolerances (float32 kernels vs float64 references, unit-scale random data):
  * rmsnorm: float64 sum of squares, then three float32 roundings per element -> rtol 2e-6
    plus atol 1e-6 * max|ref| for near-zero outputs.
  * rope: cos/sin computed in float64 (same formula as the reference) rounded to float32,
    then a 2-term float32 rotation -> ~3 ulp; atol 1e-6 * max|x| (positions up to 40K, where
    float32 angles would be off by ~1e-3: the kernel must not use them).
  * silu_mul: polynomial exp with ~2e-7 relative error, a float32 divide and multiply ->
    rtol 2e-6, atol 1e-6 * max|ref|.
  * add: float32 a+b is correctly rounded; float64 a+b rounded to float32 must match exactly.
"""
import numpy as np
import pytest

import reference as ref  # tests/kernels/reference.py (pytest puts this directory on sys.path)
from strata_lite.kernels.cpu import elementwise as ew
from strata_lite.kernels.cpu.elementwise import add, rmsnorm, rope, silu_mul


def close(got, want, rtol):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol / 2 * np.abs(want).max())


@pytest.mark.parametrize("n,d", [(1, 896), (300, 896), (7, 64)])   # serial and parallel paths
def test_rmsnorm(n, d):
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.01, 30, (n, 1))).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    out = np.empty_like(x)
    rmsnorm(x, w, 1e-6, out)
    close(out, ref.rmsnorm(x, w, 1e-6), 2e-6)
    y = x.copy()
    rmsnorm(y, w, 1e-6, y)                               # in place (out aliases x)
    np.testing.assert_array_equal(y, out)
    z = np.zeros((2, d), np.float32)
    rmsnorm(z, w, 1e-6, z)                               # eps keeps zero rows finite
    assert np.all(z == 0)


def test_rmsnorm_per_head():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 16, 128)).astype(np.float32)
    w = rng.standard_normal(128).astype(np.float32)
    out = np.empty_like(x)
    rmsnorm(x, w, 1e-6, out)
    close(out, ref.rmsnorm(x, w, 1e-6), 2e-6)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_tok,n_heads,hd,n_rot", [(1, 14, 64, 64), (300, 14, 64, 64), (40, 8, 128, 64), (3, 2, 128, 96)])
def test_rope(neox, n_tok, n_heads, hd, n_rot):
    rng = np.random.default_rng(12)
    x = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32)
    pos = rng.integers(0, 40000, n_tok).astype(np.int32)
    pos[0] = 0
    want = ref.rope(x, pos, 1e6 if n_rot == hd else 1e4, n_rot, neox)
    y = x.copy()
    rope(y, pos, 1e6 if n_rot == hd else 1e4, n_rot, neox)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-6 * np.abs(x).max())
    np.testing.assert_array_equal(y[..., n_rot:], x[..., n_rot:])     # untouched dims
    np.testing.assert_array_equal(y[pos == 0], x[pos == 0])            # position 0 = identity


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_tok", [1, 300])                         # serial and parallel paths
def test_rope_channel_scale(neox, n_tok):
    """rope then a per-(head, channel) factor, dims >= n_rot included: the rotation's ~3 ulp plus one
    float32 multiply."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal((n_tok, 4, 128)).astype(np.float32)
    s = rng.uniform(0.01, 30, (4, 128)).astype(np.float32)
    pos = rng.integers(0, 40000, n_tok).astype(np.int32)
    want = ref.rope(x, pos, 1e4, 96, neox) * s
    y = x.copy()
    rope(y, pos, 1e4, 96, neox, channel_scale=s)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(y[..., 96:], x[..., 96:] * s[:, 96:])
    with pytest.raises(ValueError, match="channel_scale"):
        rope(y, pos, 1e4, 96, neox, channel_scale=s[:2])


def test_rope_pairing():
    """neox pairs (i, i+n_rot/2); normal pairs (2i, 2i+1): check one rotated pair by hand."""
    x = np.zeros((1, 1, 8), np.float32)
    x[0, 0, 0] = 1.0
    y = x.copy()
    rope(y, np.array([1], np.int32), 10000.0, 8, True)
    assert np.isclose(y[0, 0, 0], np.cos(1.0)) and np.isclose(y[0, 0, 4], np.sin(1.0))
    y = x.copy()
    rope(y, np.array([1], np.int32), 10000.0, 8, False)
    assert np.isclose(y[0, 0, 0], np.cos(1.0)) and np.isclose(y[0, 0, 1], np.sin(1.0))


@pytest.mark.parametrize("n,f", [(1, 4864), (64, 4864), (3, 17)])
def test_silu_mul(n, f):
    rng = np.random.default_rng(13)
    g = (rng.standard_normal((n, f)) * 4).astype(np.float32)
    g[0, :6] = [0.0, -100.0, 100.0, -1e30, 1e30, -88.5]                  # saturation
    u = rng.standard_normal((n, f)).astype(np.float32)
    out = np.empty_like(g)
    silu_mul(g, u, out)
    assert np.all(np.isfinite(out))
    close(out, ref.silu_mul(g, u).astype(np.float64), 2e-6)
    assert out[0, 0] == 0.0 and abs(out[0, 1]) < 1e-30


def test_exp2_accuracy():
    x = np.linspace(-126, 126, 200001).astype(np.float32)
    e = x.copy()
    ew.exp2_inplace(e, np.empty(e.size, np.int32))
    want = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(e / want - 1)) < 3e-7


@pytest.mark.parametrize("shape", [(1, 896), (512, 896), (3, 4, 5)])
def test_add(shape):
    rng = np.random.default_rng(14)
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    out = np.empty_like(a)
    add(a, b, out)
    np.testing.assert_array_equal(out, (a.astype(np.float64) + b).astype(np.float32))
    add(a, b, a)                                                          # out aliases a
    np.testing.assert_array_equal(a, out)


def test_shape_dtype_errors():
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError):
        rmsnorm(x, np.ones(7, np.float32), 1e-6, np.empty_like(x))
    with pytest.raises(ValueError):
        rmsnorm(x, np.ones(8, np.float32), 1e-6, np.empty((4, 9), np.float32))
    with pytest.raises(ValueError):
        rmsnorm(x.astype(np.float64), np.ones(8), 1e-6, np.empty((4, 8)))
    with pytest.raises(ValueError):
        rmsnorm(np.zeros((8, 4), np.float32).T, np.ones(8, np.float32), 1e-6, np.empty_like(x))
    with pytest.raises(ValueError):
        silu_mul(x, np.zeros((4, 9), np.float32), np.empty_like(x))
    with pytest.raises(ValueError):
        silu_mul(x, x, np.empty((4, 8), np.float64))
    with pytest.raises(ValueError):
        add(x, np.zeros((1, 8), np.float32), np.empty_like(x))        # no broadcasting
    x3 = np.zeros((2, 2, 8), np.float32)
    with pytest.raises(ValueError):
        rope(x3, np.zeros(3, np.int32), 1e4, 8, True)
    with pytest.raises(ValueError):
        rope(x3, np.zeros(2, np.int64), 1e4, 8, True)
    with pytest.raises(ValueError):
        rope(x3, np.zeros(2, np.int32), 1e4, 10, True)                # n_rot > head_dim
    with pytest.raises(ValueError):
        rope(x3, np.zeros(2, np.int32), 1e4, 7, True)                 # odd n_rot
