"""kernels/cuda/pdl.py without a GPU: how kernel arguments become the driver's parameter buffers, and when
programmatic dependent launch is used (the launches themselves: tests/engine/test_cuda_e2e.py on the GPU)."""
import ctypes

import numpy as np
import pytest

from strata_lite.kernels.cuda import pdl


class _FakeDeviceArray:
    """What pack_args reads from a cupy array: .data.ptr"""

    class _Mem:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, ptr):
        self.data = self._Mem(ptr)


def test_pack_args_keeps_each_scalar_bytes_and_array_pointers():
    args = (_FakeDeviceArray(0x7F0012345600), np.int32(-7), np.int64(1 << 40), np.float32(0.5), np.float64(1e-6),
            np.uint64(0))
    packed = pdl.pack_args(args)
    assert [ctypes.sizeof(p) for p in packed] == [8, 4, 8, 4, 8, 8]
    assert packed[0].value == 0x7F0012345600
    for buf, a in zip(packed[1:], args[1:]):
        assert bytes(buf) == a.tobytes()


@pytest.mark.parametrize("bad", [3, 2.5, None, np.zeros(3, np.int32)])
def test_pack_args_refuses_values_without_a_c_type(bad):
    with pytest.raises(TypeError, match="kernel argument 1"):
        pdl.pack_args((np.int32(1), bad))


def test_supported_needs_sm90_and_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: object())
    monkeypatch.delenv("STRATA_LITE_CUDA_PDL", raising=False)
    assert pdl.supported(90) and pdl.supported(120)
    assert not pdl.supported(89) and not pdl.supported(86)
    monkeypatch.setenv("STRATA_LITE_CUDA_PDL", "0")
    assert not pdl.supported(90)
    monkeypatch.delenv("STRATA_LITE_CUDA_PDL")
    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: None)
    assert not pdl.supported(90)


def test_launch_config_matches_the_driver_layout():
    # CUlaunchAttribute is 72 bytes (id, padding, 64-byte value); CUlaunchConfig 56 on 64-bit platforms
    assert ctypes.sizeof(pdl._LaunchAttribute) == 72
    assert ctypes.sizeof(pdl._LaunchConfig) == 56
    assert pdl._LaunchConfig.hStream.offset == 32 and pdl._LaunchConfig.attrs.offset == 40


def test_describe_says_how_decode_graphs_launch(monkeypatch):
    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: object())
    monkeypatch.delenv("STRATA_LITE_CUDA_PDL", raising=False)
    assert pdl.describe(90) == "decode graphs with programmatic dependent launch"
    assert "needs sm_90, this is sm_86" in pdl.describe(86)
    monkeypatch.setenv("STRATA_LITE_CUDA_PDL", "0")
    assert "STRATA_LITE_CUDA_PDL=0" in pdl.describe(90)
    monkeypatch.delenv("STRATA_LITE_CUDA_PDL")
    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: None)
    assert "no cuLaunchKernelEx" in pdl.describe(120)
