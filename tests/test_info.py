"""`strata-lite info` and the CPU backend's start-up description name the kernels this machine runs."""
import os
import subprocess
import sys

import pytest

from strata_lite.kernels.cpu.isa import (HALF_NOTE, REPORTED, WIDE_BUILT, choose_gemm_lanes, choose_isa, host_cpu_name,
                                         host_features, kernel_family)


def test_info_command_reports_cpu_kernels_gpu_and_cache():
    r = subprocess.run([sys.executable, "-m", "strata_lite.cli", "info"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("strata_lite ")
    assert f"kernels: {kernel_family()}" in out
    have = [f for f, on in host_features().items() if on]
    assert "extensions: " + (", ".join(have) if have else "none of") in out
    assert "\nGPU: " in out and "model cache: " in out


def test_kernel_family_follows_the_environment(monkeypatch):
    monkeypatch.setenv("STRATA_LITE_INT8", "0")
    assert kernel_family() == ("float kernels (STRATA_LITE_INT8=0)" + HALF_NOTE if host_features()["avx2"]
                               else "float kernels (this CPU has no AVX2)")
    monkeypatch.delenv("STRATA_LITE_INT8")
    isa, int8 = choose_isa(host_features(), os.environ)      # AVX2 or VNNI: tests/kernels/test_cpu_isa.py
    lanes = choose_gemm_lanes(WIDE_BUILT, isa, host_cpu_name(), os.environ)[1]   # 512-bit prompt tiles, where taken
    assert kernel_family() == (int8 + lanes + HALF_NOTE if host_features()["avx2"]
                               else "float kernels (this CPU has no AVX2)")
    assert set(host_features()) == set(REPORTED)


def test_cpu_backend_description_names_threads_and_kernels():
    from strata_lite.kernels import get_backend
    assert get_backend("cpu", n_threads=1).describe() == f"cpu (1 thread; {kernel_family()})"


@pytest.mark.gpu
def test_info_lists_the_gpu():
    r = subprocess.run([sys.executable, "-m", "strata_lite.cli", "info"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "GPU: CuPy " in r.stdout and "  cuda:0 " in r.stdout
    assert "decode graphs with " in r.stdout              # how they launch (kernels/cuda/pdl.py describe)
