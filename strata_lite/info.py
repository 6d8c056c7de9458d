"""`strata-lite info`: what this installation will run on, for bug reports and for checking an install
(versions, the CPU's instruction-set extensions and the kernels they select, the GPU or why none is
usable, the model cache)."""
from __future__ import annotations

import os
import platform
import sys

from . import __version__
from .kernels import cuda_unavailable_reason
from .kernels.cpu.isa import host_features, kernel_family
from .loader.known_models import DEFAULT_MODEL, KNOWN_MODELS, cache_dir


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_lines() -> list[str]:
    why_not = cuda_unavailable_reason()
    if why_not is not None:
        return [f"GPU: none usable ({why_not})"]
    from .kernels.cuda import pdl
    from .kernels.cuda.runtime import cupy
    cp = cupy()
    lines = [f"GPU: CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}"]
    for i in range(cp.cuda.runtime.getDeviceCount()):
        props = cp.cuda.runtime.getDeviceProperties(i)
        with cp.cuda.Device(i):
            free, total = cp.cuda.runtime.memGetInfo()
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        cc = int(props["major"]) * 10 + int(props["minor"])
        lines.append(f"  cuda:{i} {name}, sm_{cc}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free; "
                     f"{pdl.describe(cc)}")
    return lines


def report() -> list[str]:
    import numba
    import numpy as np
    feats = host_features()
    have = [f for f, on in feats.items() if on]
    lines = [f"strata_lite {__version__}, Python {platform.python_version()} ({sys.platform}), "
             f"numpy {np.__version__}, numba {numba.__version__}",
             f"CPU: {_cpu_name()}, {os.cpu_count()} logical cores, Numba threads {numba.get_num_threads()}",
             f"  extensions: {', '.join(have) if have else 'none of ' + ', '.join(feats)}",
             f"  kernels: {kernel_family()}"]
    lines += _gpu_lines()
    model = KNOWN_MODELS[DEFAULT_MODEL]
    path = cache_dir() / model.file_name
    lines.append(f"model cache: {cache_dir()} (default model {'assembled' if path.is_file() else 'not assembled yet'})")
    return lines
