"""act_quant_ir.py's vector Q8_0 and Q8_K rounding of activation blocks and the 4-row layout's copy of them,
against numpy float32 forms of the same formulas (llama.cpp's Q8_0 rounding: amax / 127, its f16 rounding,
rint of x / scale; Q8_K: -127 / the first value of the largest magnitude, rint, at most 127): equal bit for
bit, including all-zero blocks, scales that are f16 subnormals and scales past f16's range, and largest
magnitudes held by several values of both signs."""
import numpy as np
import pytest
from numba import njit

from strata_lite.kernels.cpu.act_quant_ir import q8_0_block, q8_k_block, rows4_copy
from strata_lite.kernels.cpu.isa import host_has_avx2

pytestmark = pytest.mark.skipif(not host_has_avx2(), reason="the int8 kernels (their only user) need an AVX2 CPU")


@njit(cache=True)
def _quantize_all(x3, q, d, tq_of):
    for t in range(x3.shape[0]):
        for b in range(x3.shape[1]):
            q8_0_block(x3, t, b, q, d, tq_of[t])


@njit(cache=True)
def _quantize_all_k(x3, q, d, bs, tq_of):
    for t in range(x3.shape[0]):
        for b in range(x3.shape[1]):
            q8_k_block(x3, t, b, q, d, bs, tq_of[t])


@njit(cache=True)
def _copy_all(q, xp, xc, offset):
    for t in range(q.shape[0]):
        for b in range(q.shape[1]):
            rows4_copy(q, xp, xc, t, b, offset)


def _reference(x3):
    """(q int8, d float32) by numpy in float32."""
    amax = np.abs(x3).max(axis=-1)
    s = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(s != 0, np.float32(1.0) / s, np.float32(0.0)).astype(np.float32)
        d = s.astype(np.float16).astype(np.float32)       # round to nearest even; past 65504: inf
    return np.rint(x3 * inv[..., None]).astype(np.int8), d


def _blocks(seed):
    rng = np.random.default_rng(seed)
    x3 = rng.standard_normal((6, 9, 32)).astype(np.float32)
    x3 *= (10.0 ** rng.uniform(-9, 5, size=(6, 9, 1))).astype(np.float32)   # scales from f16 subnormals up
    x3[0, 2] = 0                                                            # an all-zero block
    x3[1, 4, 7] = np.float32(65530.0 * 127)                                 # a scale past f16's range: inf
    x3[2, 1, :] = np.float32(1e-3)                                          # a scale in f16's subnormals
    return x3


@pytest.mark.parametrize("seed", range(5))
def test_quantize_q8_0_is_the_formula_bit_for_bit(seed):
    x3 = _blocks(seed)
    q = np.zeros((8, 9, 32), np.int8)
    d = np.zeros((8, 9), np.float32)
    tq_of = np.array([7, 0, 3, 1, 2, 5])          # the output row of each input row differs from it
    _quantize_all(x3, q, d, tq_of)
    rq, rd = _reference(x3)
    np.testing.assert_array_equal(q[tq_of], rq)
    np.testing.assert_array_equal(d[tq_of].view(np.uint32), rd.view(np.uint32))
    assert np.isinf(d[tq_of[1], 4]) and d[tq_of[0], 2] == 0 and (q[tq_of[0], 2] == 0).all()
    assert 0 < d[tq_of[2], 1] < 6.2e-5             # an f16 subnormal, kept as one


def test_ties_round_half_to_even():
    x3 = np.zeros((1, 1, 32), np.float32)
    x3[0, 0, 0] = 127.0                            # scale exactly 1: x / scale = x
    x3[0, 0, 1:6] = [0.5, 1.5, 2.5, -0.5, -2.5]
    q = np.zeros((1, 1, 32), np.int8)
    d = np.zeros((1, 1), np.float32)
    _quantize_all(x3, q, d, np.array([0]))
    assert d[0, 0] == 1.0 and list(q[0, 0, :6]) == [127, 0, 2, 2, 0, -2]


@pytest.mark.parametrize("offset", [0, 8, 16, 128])
def test_rows4_copy_repeats_each_dword_four_times_and_sums(offset):
    rng = np.random.default_rng(offset)
    q = rng.integers(-127, 128, size=(3, 5, 32), dtype=np.int8)
    xp = np.zeros((3, 5, 128), np.int8)
    xc = np.zeros((3, 5), np.int32)
    _copy_all(q, xp, xc, offset)
    words = q.view(np.int32)                                  # (3, 5, 8): a0 .. a7
    want = np.stack([np.repeat(words[..., 2 * v:2 * v + 2], 4, axis=-1) for v in range(4)], axis=2)
    np.testing.assert_array_equal(xp.view(np.int32).reshape(3, 5, 4, 8), want)
    np.testing.assert_array_equal(xc, offset * q.astype(np.int32).sum(axis=-1))


def _reference_k(x3):
    """(q uint8 = int8 + 128, d float32, sums int32 (..., 8)) by numpy in float32."""
    a = np.abs(x3)
    first = a.argmax(axis=-1)                                   # the first index of the largest magnitude
    mx = np.take_along_axis(x3, first[..., None], axis=-1)[..., 0]
    zero = a.max(axis=-1) == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = (np.float32(-127.0) / mx).astype(np.float32)
        d = np.where(zero, np.float32(0), (np.float32(1.0) / iscale).astype(np.float32))
        v = np.minimum(np.float32(127.0), np.rint(iscale[..., None] * x3)).astype(np.float32)
    v = np.where(zero[..., None], 0, v).astype(np.int32)
    return (v + 128).astype(np.uint8), d, v.reshape(*v.shape[:-1], 8, 32).sum(axis=-1)


@pytest.mark.parametrize("seed", range(4))
def test_quantize_q8_k_is_the_formula_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    x3 = rng.standard_normal((4, 3, 256)).astype(np.float32)
    x3 *= (10.0 ** rng.uniform(-6, 6, size=(4, 3, 1))).astype(np.float32)
    x3[0, 1] = 0                                                # an all-zero block
    x3[1, 2, [40, 200]] = [-9.0, 9.0]                           # the largest magnitude twice: the first (negative)
    x3[1, 2, 7] = 3.0
    x3[2, 0, [3, 250]] = [50.0, -50.0]                          # ... and the other way round
    x3[3, 2, 255] = -1e6                                        # in the last of the 256
    q = np.zeros((5, 3, 256), np.uint8)
    d = np.zeros((5, 3), np.float32)
    bs = np.zeros((5, 3, 8), np.int32)
    tq_of = np.array([4, 0, 2, 1])
    _quantize_all_k(x3, q, d, bs, tq_of)
    rq, rd, rb = _reference_k(x3)
    np.testing.assert_array_equal(q[tq_of], rq)
    np.testing.assert_array_equal(d[tq_of].view(np.uint32), rd.view(np.uint32))
    np.testing.assert_array_equal(bs[tq_of], rb)
    # the first of the two largest sets iscale = -127 / mx: its own code is -127 (+ 128), the other's 127
    assert q[tq_of[1], 2, 40] == 128 - 127 and q[tq_of[1], 2, 200] == 128 + 127 and d[tq_of[1], 2] > 0
    assert q[tq_of[2], 0, 3] == 128 - 127 and q[tq_of[2], 0, 250] == 128 + 127 and d[tq_of[2], 0] < 0
    assert (q[tq_of[0], 1] == 128).all() and d[tq_of[0], 1] == 0 and (bs[tq_of[0], 1] == 0).all()
