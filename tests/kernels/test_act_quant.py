"""Activation rounding against a numpy transcription of ggml's quantize_row_q8_0 / q8_K."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite.kernels.cpu.act_quant import round_activations


def _ref_q8_0(x):
    b = x.reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * d.astype(np.float16).astype(np.float32)).reshape(x.shape)


def _ref_q8_k(x):
    b = x.reshape(x.shape[0], -1, 256)
    idx = np.abs(b).argmax(-1)[..., None]
    mx = np.take_along_axis(b, idx, -1)
    iscale = np.where(mx != 0, np.float32(-127) / np.where(mx != 0, mx, 1), 0).astype(np.float32)
    s = np.where(iscale != 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    return (np.minimum(127, np.rint(iscale * b)) * s).reshape(x.shape)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 3e-6, 1e3])
def test_q8_0_rounding_matches_ggml(scale):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 896)) * scale).astype(np.float32)
    x[0, :32] = 0                                  # an all-zero block
    np.testing.assert_array_equal(round_activations(QT.Q5_0, x), _ref_q8_0(x))


@pytest.mark.parametrize("scale", [1.0, 1e-4, 1e3])
def test_q8_k_rounding_matches_ggml(scale):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 1024)) * scale).astype(np.float32)
    x[1, 256:512] = 0
    np.testing.assert_array_equal(round_activations(QT.Q6_K, x), _ref_q8_k(x))


def test_rounding_error_is_small_and_float_types_pass_through():
    x = np.random.default_rng(2).standard_normal((2, 512)).astype(np.float32)
    y = round_activations(QT.Q8_0, x)
    assert 0 < np.abs(y - x).max() <= np.abs(x).max() / 127
    assert round_activations(QT.F16, x) is x
