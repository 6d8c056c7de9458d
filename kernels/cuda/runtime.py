"""CuPy access for the CUDA launchers: lazy import, compile-once modules from the .cu files next to this
file, and the stream every launch goes to.

Host/device placement: launchers take cupy arrays (device) for data and Python ints/floats (host) for
sizes; they never copy to the host. Kernels run on CuPy's current stream, which the graph capture in
graphs.py swaps for its capturing stream.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os

from .. import BackendUnavailable
from . import pdl

HERE = os.path.dirname(os.path.abspath(__file__))
NVRTC_OPTIONS = ("--std=c++17", f"-I{HERE}")   # no --use_fast_math: the KV store must match the CPU bit for bit


@functools.lru_cache(maxsize=None)
def cupy():
    """The cupy module, or BackendUnavailable naming the install command."""
    try:
        import cupy as cp
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:   # ImportError, CUDARuntimeError (no driver), ...
        raise BackendUnavailable(
            f"the CUDA backend needs CuPy and an NVIDIA GPU ({type(e).__name__}: {e}); "
            "install with pip install -e \".[cuda12]\" or \".[cuda13]\" (see README)") from None
    if n < 1:
        raise BackendUnavailable("the CUDA backend found no NVIDIA GPU")
    return cp


def source(name: str) -> str:
    """A .cu file's text plus a digest of the headers it may include: CuPy keys its on-disk kernel cache by
    the source string alone, so a changed header must change the string too."""
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        text = f.read()
    return text + f"\n// headers {_headers_digest()}\n"


@functools.lru_cache(maxsize=None)
def _headers_digest() -> str:
    digest = hashlib.sha256()
    for header in sorted(n for n in os.listdir(HERE) if n.endswith(".cuh")):
        with open(os.path.join(HERE, header), "rb") as f:
            digest.update(header.encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def module(cu_file: str, options: tuple = ()):
    """The compiled RawModule of one .cu file (NVRTC; CuPy caches the binary on disk); options: extra
    NVRTC options such as -D defines (benchmarks build variants of a file this way)."""
    cp = cupy()
    return cp.RawModule(code=source(cu_file), options=NVRTC_OPTIONS + tuple(options))


@functools.lru_cache(maxsize=None)
def kernel(cu_file: str, name: str, options: tuple = ()):
    """An `extern "C"` kernel of one .cu file."""
    return module(cu_file, options).get_function(name)


_programmatic = [False]      # inside programmatic_launches(): launches go through pdl.launch
DEFAULT_DYNAMIC_SMEM = 48 * 1024 - 24 * 1024   # safe without opting in next to up to 24 KiB of static shared memory
_dynamic_smem_allowed: dict = {}               # kernel -> dynamic shared memory it was opted in to


def launch(cu_file: str, name: str, grid, block, args, shared_mem: int = 0, options: tuple = ()) -> None:
    """Launch on CuPy's current stream; grid/block are int tuples, args cupy arrays and numpy scalars;
    shared_mem: dynamic shared memory bytes (the kernel is opted in to more than 48 KiB where asked)."""
    k = kernel(cu_file, name, tuple(options))
    if shared_mem > _dynamic_smem_allowed.get(k, DEFAULT_DYNAMIC_SMEM):
        k.max_dynamic_shared_size_bytes = shared_mem
        _dynamic_smem_allowed[k] = shared_mem
    if _programmatic[0]:
        pdl.launch(k.kernel.ptr, grid, block, args, shared_mem, cupy().cuda.get_current_stream().ptr)
    else:
        k(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)


@functools.lru_cache(maxsize=None)
def programmatic_supported(device_id: int) -> bool:
    """Programmatic dependent launch on this device (pdl.supported: sm_90+, driver, env)."""
    return pdl.supported(int(cupy().cuda.Device(device_id).compute_capability))   # CuPy gives "90"


@contextlib.contextmanager
def programmatic_launches(on: bool = True):
    """Launches inside the block may overlap the previous kernel's tail (pdl.py); on=False: ordinary."""
    before = _programmatic[0]
    _programmatic[0] = bool(on)
    try:
        yield
    finally:
        _programmatic[0] = before


@contextlib.contextmanager
def tf32_matmuls():
    """CuPy's float32 mat-muls (cuBLAS) on the TF32 tensor cores inside the block: inputs rounded to 10-bit
    mantissas, products summed in float32; CuPy's own choice (its CUPY_TF32 variable) restored after.
    Uses CuPy's compute-type switch in cupy._core._routines_linalg, the one CUPY_TF32 sets."""
    import numpy as np
    cupy()
    from cupy._core import _routines_linalg as linalg
    before = linalg.get_compute_type(np.float32)
    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
    try:
        yield
    finally:
        linalg.set_compute_type(np.float32, before)


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """The device's streaming multiprocessors."""
    return int(cupy().cuda.Device(device_id).attributes["MultiProcessorCount"])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

