"""The fused one-token mat-muls' host side, without a GPU (kernels/cuda/qmatmul_fused.py): the rmsnorm thread
count they repeat is the rmsnorm launch's, and every kernel the launcher may name is one qmatmul.cu builds
(nvcc's PTX lists the entries; skipped where nvcc is missing, as the other nvcc tests)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from strata_lite.kernels.cuda import elementwise as ew, qmatmul_fused as qf

CUDA_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cuda"


@pytest.mark.parametrize("d", [128, 256, 896, 1024, 1536, 2048, 3584, 4096, 5120, 8192, 4864, 14336])
def test_norm_threads_are_the_rmsnorm_launchs(d):
    assert qf.norm_threads(d) == ew._row_block(d // 4)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_every_fused_kernel_is_built(tmp_path):
    ptx = tmp_path / "qmatmul.ptx"
    cmd = ["nvcc", "-std=c++17", f"-I{CUDA_DIR}", "-arch=sm_90", "-ptx", str(CUDA_DIR / "qmatmul.cu"), "-o", str(ptx)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    entries = set(re.findall(r"\.entry (mm[nr]\w*)\(", ptx.read_text()))
    assert qf.FUSED_KERNELS == entries
