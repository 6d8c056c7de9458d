"""Programmatic dependent launch (PDL; sm_90 and newer) for the decode graphs.

A kernel launched with the driver's programmatic-stream-serialization attribute may be scheduled while the
kernel before it in the stream is still running. Every kernel of ours calls grid_dependency_sync()
(common.cuh) before its first global memory access: `griddepcontrol.wait` blocks until the previous kernel
has finished and its writes are visible, then `griddepcontrol.launch_dependents` lets the next kernel be
scheduled. So results are those of ordinary launches (the same bits); what overlaps is a launch's latency
and the prologue before the wait (the mat-muls' shared lookup tables). Captured into a CUDA graph, the
programmatic edges stay in the graph, and every replay gets the overlap.

CuPy's kernel launcher takes no launch attributes, so these launches go through `cuLaunchKernelEx` of the
driver library CuPy itself uses, by ctypes. The host cost of that (a few tens of microseconds a launch) is
paid at capture only: graphs.py turns PDL on around the capture (runtime.programmatic_launches), never for
eager steps. STRATA_LITE_CUDA_PDL=0 turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CUlaunchAttributeID (cuda.h, CUDA 11.8 and newer)


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union (its first int is the flag used here)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def enabled_by_env() -> bool:
    return os.environ.get("STRATA_LITE_CUDA_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx, or None when the driver library or the entry point is missing."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def supported(compute_capability: int) -> bool:
    """PDL can be used: sm_90 or newer, the driver has cuLaunchKernelEx, and not turned off by the env."""
    return compute_capability >= 90 and enabled_by_env() and _launch_kernel_ex() is not None


def describe(compute_capability: int) -> str:
    """How decode graphs launch their kernels on a device of this compute capability (strata-lite info)."""
    if compute_capability < 90:
        return f"decode graphs with ordinary launches (programmatic dependent launch needs sm_90, this is sm_{compute_capability})"
    if not enabled_by_env():
        return "decode graphs with ordinary launches (STRATA_LITE_CUDA_PDL=0)"
    if _launch_kernel_ex() is None:
        return "decode graphs with ordinary launches (the driver has no cuLaunchKernelEx)"
    return "decode graphs with programmatic dependent launch"


def pack_args(args) -> list:
    """Kernel arguments as ctypes buffers holding their bytes: device arrays (anything with .data.ptr, i.e.
    cupy arrays and views) as their pointer, numpy scalars as their own bytes (np.int32 -> 4 bytes, ...).
    Anything else is refused: a Python int has no C type of its own."""
    out = []
    for i, a in enumerate(args):
        data = getattr(a, "data", None)
        ptr = getattr(data, "ptr", None)
        if ptr is not None:
            out.append(ctypes.c_void_p(int(ptr)))
        elif hasattr(a, "dtype") and getattr(a, "shape", None) == ():
            raw = a.tobytes()
            out.append((ctypes.c_byte * len(raw)).from_buffer_copy(raw))
        else:
            raise TypeError(f"kernel argument {i}: expected a device array or a numpy scalar, got {type(a).__name__}")
    return out


def launch(function_ptr: int, grid, block, args, shared_mem: int, stream_ptr: int) -> None:
    """Launch the CUfunction function_ptr with the programmatic-stream-serialization attribute on
    stream_ptr. RuntimeError with the driver's error code when the launch is refused."""
    fn = _launch_kernel_ex()
    if fn is None:
        raise RuntimeError("cuLaunchKernelEx is not available in this driver")
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    attr = _LaunchAttribute()
    attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1
    cfg = _LaunchConfig(*grid, *block, shared_mem, stream_ptr, ctypes.pointer(attr), 1)
    vals = pack_args(args)
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    rc = fn(ctypes.byref(cfg), ctypes.c_void_p(function_ptr), params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
