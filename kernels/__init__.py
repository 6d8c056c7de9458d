"""strata_lite.kernels: Backend implementations (cpu: Numba; cuda: CuPy RawKernels + Numba CUDA).

Nothing here imports from the engine, the loader or the server. cupy/numba.cuda are imported
only when the CUDA backend is asked for (or "auto" probes for a GPU), so CPU-only installs never need them.
"""
from .backend import Backend

BACKENDS = ("auto", "cpu", "cuda")


class BackendUnavailable(RuntimeError):
    """The asked-for backend cannot run on this machine."""


class DeviceFault(RuntimeError):
    """The device reported an error that leaves it unusable for this process (CUDA errors are sticky:
    after an illegal address every later call fails), so the engine stops instead of serving on."""


def cuda_unavailable_reason() -> str | None:
    """None when CuPy imports and sees a GPU, else why not (checked without raising)."""
    try:
        from .cuda.runtime import cupy
        cupy()
        return None
    except BackendUnavailable as e:
        return str(e)


def get_backend(name: str = "auto", n_threads: int | None = None, device: int = 0,
                vram_reserve_mib: int = 1024) -> Backend:
    """"auto" picks CUDA when CuPy imports and sees a GPU, else the CPU. "cuda" that cannot start raises
    BackendUnavailable with the reason and the install command."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (choose one of {', '.join(BACKENDS)})")
    why_not = cuda_unavailable_reason() if name == "auto" else None
    if name == "cuda" or (name == "auto" and why_not is None):
        from .cuda.backend import CudaBackend
        return CudaBackend(device=device, vram_reserve_mib=vram_reserve_mib)
    from .cpu.backend import CpuBackend
    be = CpuBackend(n_threads=n_threads)
    if name == "auto":
        be.auto_reason = f"auto: no usable GPU: {why_not.split(';')[0]}"
    return be
