"""Activation rounding against a numpy transcription of ggml's quantize_row_q8_0 / q8_K."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from act_reference import ref_q8_0 as _ref_q8_0, ref_q8_k as _ref_q8_k
from strata_lite.kernels.cpu.act_quant import round_activations


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
