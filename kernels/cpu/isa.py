"""The x86 instruction-set extensions of this CPU, as Numba (LLVM) sees them when it compiles for the host,
and which CPU kernel family that selects (kernels/cpu/backend.py logs it once at start-up through
describe(); `strata-lite info` prints it)."""
from __future__ import annotations

import os

from llvmlite import binding as llvm_binding

# the extensions worth reporting: what the kernels use (avx2, fma, f16c) and what wider paths would use
REPORTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avxvnni", "amx-int8")


def host_features() -> dict[str, bool]:
    """{extension: present} for REPORTED; all False where LLVM cannot read the host's features."""
    try:
        feats = llvm_binding.get_host_cpu_features()
    except Exception:   # pragma: no cover - features cannot be read on some platforms
        return dict.fromkeys(REPORTED, False)
    return {f: bool(feats.get(f, False)) for f in REPORTED}


def host_has_avx2() -> bool:
    """True when the CPU Numba compiles for has AVX2 (needed by the llvm.x86.avx2.* intrinsics)."""
    return host_features()["avx2"]


def int8_enabled() -> bool:
    """The int8 kernels run: the CPU has AVX2 and STRATA_LITE_INT8 is not "0"."""
    return host_has_avx2() and os.environ.get("STRATA_LITE_INT8", "1") != "0"


def kernel_family() -> str:
    """One line naming the CPU kernels in use and why."""
    if int8_enabled():
        return "int8 AVX2 kernels"
    if not host_has_avx2():
        return "float kernels (this CPU has no AVX2)"
    return "float kernels (STRATA_LITE_INT8=0)"
