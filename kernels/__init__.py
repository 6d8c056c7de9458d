"""strata_lite.kernels: Backend implementations (cpu: Numba; cuda: CuPy RawKernels + Numba CUDA).

Nothing here imports from the engine, the loader or the server. cupy/numba.cuda are to be imported
only when the CUDA backend is asked for, so CPU-only installs never need them.
"""
from .backend import Backend

BACKENDS = ("auto", "cpu", "cuda")


class BackendUnavailable(RuntimeError):
    """The asked-for backend cannot run on this machine."""


def get_backend(name: str = "auto", n_threads: int | None = None) -> Backend:
    """"auto" picks CUDA when it is usable, else the CPU. The CUDA backend is not in this release,
    so "auto" means the CPU for now and "cuda" says so."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (choose one of {', '.join(BACKENDS)})")
    if name == "cuda":
        raise BackendUnavailable("the CUDA backend is not part of this release yet; use backend='cpu'")
    from .cpu.backend import CpuBackend
    return CpuBackend(n_threads=n_threads)
