"""Every CUDA C source of the CUDA backend compiles, with nvcc and with NVRTC (no GPU needed), for the data-centre target
(sm_90, H100/H200) and the consumer ones (sm_86, sm_89, sm_120), warning-free. Users never need nvcc (CuPy
compiles the same files through NVRTC at run time); this catches errors before a GPU machine sees them."""
import shutil
import subprocess
from pathlib import Path

import pytest

from strata_lite.kernels.cuda.attention import BUILDS as ATTENTION_BUILDS, build_options
from strata_lite.kernels.cuda.qmatmul import BUILDS, MMA_BUILDS

CUDA_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
ARCHS = ("sm_90", "sm_86", "sm_89", "sm_120")


def test_there_are_cuda_sources():
    assert SOURCES, f"no .cu files in {CUDA_DIR}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("src", SOURCES, ids=[p.name for p in SOURCES])
def test_cu_compiles_with_nvcc(src, tmp_path):
    gencode = []
    for arch in ARCHS:
        gencode += ["-gencode", f"arch=compute_{arch[3:]},code={arch}"]
    cmd = ["nvcc", "-std=c++17", f"-I{CUDA_DIR}", "-Werror", "all-warnings", *gencode,
           "-c", str(src), "-o", str(tmp_path / "out.o")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"


# the other builds (perf/bench_gpu.py --explore / --gemm-explore / --build / --attn-ab: qmatmul.BUILDS, MMA_BUILDS,
# attention.BUILDS), for sm_90
EXPLORE_BUILDS = sorted({(name, " ".join(defines))
                         for name, builds in (("qmatmul.cu", BUILDS), ("qmatmul_mma.cu", MMA_BUILDS))
                         for defines in builds.values() if defines}
                        | {("attention.cu", " ".join(build_options(name)))
                           for name, over in ATTENTION_BUILDS.items() if over})


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("name,define", EXPLORE_BUILDS, ids=[f"{n}{d}" for n, d in EXPLORE_BUILDS])
def test_explore_builds_compile_with_nvcc(name, define, tmp_path):
    cmd = ["nvcc", "-std=c++17", f"-I{CUDA_DIR}", "-Werror", "all-warnings", *define.split(), "-gencode",
           "arch=compute_90,code=sm_90", "-c", str(CUDA_DIR / name), "-o", str(tmp_path / "out.o")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
        nvrtc.nvrtcVersion()                     # loads libnvrtc (the pip package of the test extra)
        return nvrtc
    except Exception:
        return None


NVRTC = _nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="NVRTC (cuda-bindings + nvidia-cuda-nvrtc) not installed")
@pytest.mark.parametrize("src", SOURCES, ids=[p.name for p in SOURCES])
@pytest.mark.parametrize("arch", ARCHS)
def test_cu_compiles_with_nvrtc(src, arch):
    """The run-time path: NVRTC, with the options the CUDA backend gives CuPy and no system headers."""
    from strata_lite.kernels.cuda.runtime import NVRTC_OPTIONS
    err, prog = NVRTC.nvrtcCreateProgram(src.read_bytes(), src.name.encode(), 0, [], [])
    assert err == NVRTC.nvrtcResult.NVRTC_SUCCESS
    opts = [o.encode() for o in NVRTC_OPTIONS] + [f"--gpu-architecture={arch}".encode()]
    (result,) = NVRTC.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = NVRTC.nvrtcGetProgramLogSize(prog)
    # NVRTC writes the log into the buffer it is given; a bytes object of length 1 is CPython's shared
    # singleton (b" " everywhere in the process would become b"\0"), so the buffer is never shorter than 2
    log = b" " * max(2, size)
    NVRTC.nvrtcGetProgramLog(prog, log)
    NVRTC.nvrtcDestroyProgram(prog)
    assert result == NVRTC.nvrtcResult.NVRTC_SUCCESS, log[:size].decode(errors="replace")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_tiled_attention_shared_memory_size(tmp_path):
    """attention.tiled_smem_bytes (the dynamic shared memory the tiled kernels are launched with) is
    sizeof(TSmem) of every instantiation: a host program built from attention.cu prints the sizes."""
    from strata_lite.kernels.cuda.attention import tiled_smem_bytes
    shapes = [(d, h, n) for d in (64, 128) for h in (1, 2, 4, 8) for n in (1, 2, 4)]
    prog = tmp_path / "sizes.cu"
    prog.write_text('#include "attention.cu"\n#include <cstdio>\nint main() {\n'
                    + "".join(f'    printf("%d\\n", (int)sizeof(TSmem<{d}, {h}, {n}>));\n' for d, h, n in shapes)
                    + "}\n")
    exe = tmp_path / "sizes"
    r = subprocess.run(["nvcc", "-std=c++17", f"-I{CUDA_DIR}", "-gencode", "arch=compute_90,code=sm_90",
                        "-o", str(exe), str(prog)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert got == [tiled_smem_bytes(d, h, n) for d, h, n in shapes]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_f16_prompt_attention_shared_memory_size(tmp_path):
    """attention_f16.fa_smem_bytes (the dynamic shared memory fa_f16_d<D> is launched with) is sizeof(FaSmem<D>)."""
    from strata_lite.kernels.cuda.attention_f16 import fa_smem_bytes
    prog = tmp_path / "sizes.cu"
    prog.write_text('#include "attention_f16.cu"\n#include <cstdio>\nint main() {\n'
                    + "".join(f'    printf("%d\\n", (int)sizeof(FaSmem<{d}>));\n' for d in (64, 128)) + "}\n")
    exe = tmp_path / "sizes"
    r = subprocess.run(["nvcc", "-std=c++17", f"-I{CUDA_DIR}", "-gencode", "arch=compute_90,code=sm_90",
                        "-o", str(exe), str(prog)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert got == [fa_smem_bytes(d) for d in (64, 128)]
