"""Where MTP training's arrays live: numpy on the host (`--device cpu`) or CuPy on the GPU (`--device cuda`).

The training math (mtp_train_math, mtp_train_model, mtp_train_fit) is written once against an array module
`xp`, found from its inputs with array_module(); this module picks the module for a device and moves
arrays across explicitly. Nothing here imports cupy itself: device_module() asks kernels/cuda for it (the
project keeps cupy imports inside kernels/cuda), and array_module() looks in sys.modules, since a CuPy
array can only exist once cupy is imported.
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np

DEVICES = ("cpu", "cuda")


def array_module(a):
    """numpy, or cupy when a is a CuPy array."""
    cp = sys.modules.get("cupy")
    return np if cp is None or not isinstance(a, cp.ndarray) else cp


def device_module(device: str):
    """The array module of a device name: numpy for "cpu", cupy for "cuda" (BackendUnavailable, with the
    reason and the install command, where CuPy or a GPU is missing)."""
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, not {device!r}")
    if device == "cpu":
        return np
    from .kernels.cuda.runtime import cupy
    return cupy()


def to_host(a) -> np.ndarray:
    """A numpy copy of a CuPy array (an explicit device -> host copy), a numpy array as it is."""
    xp = array_module(a)
    return a if xp is np else xp.asnumpy(a)


def to_device(xp, a):
    """a as an array of module xp: an explicit copy when it lives on the other device, else a itself."""
    if array_module(a) is xp:
        return a
    return to_host(a) if xp is np else xp.asarray(a)


def tree_to(xp, d: dict) -> dict:
    """{name: array} with every array moved to xp's device (to_device)."""
    return {k: to_device(xp, a) for k, a in d.items()}


def matmul_precision(device: str, tf32: bool):
    """A context in which the device's float32 mat-muls run as asked: on "cuda" with tf32, CuPy's on the
    TF32 tensor cores (kernels/cuda runtime.tf32_matmuls); else plain float32 (ValueError for tf32 on the
    CPU, where numpy has no such mode)."""
    if not tf32:
        return contextlib.nullcontext()
    if device != "cuda":
        raise ValueError("--tf32 needs --device cuda (numpy's float32 mat-muls have no TF32 mode)")
    from .kernels.cuda.runtime import tf32_matmuls
    return tf32_matmuls()
