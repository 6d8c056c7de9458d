"""The x86 instruction-set extensions of this CPU, as Numba (LLVM) sees them when it compiles for the host,
and which CPU kernel family that selects (kernels/cpu/backend.py logs it once at start-up; `strata-lite info`
and the backend's describe() print it).

The int8 kernels of the Q8_0 family (q8_0_int8.py, q8_0_gemm.py: Q8_0, Q5_0, Q4_0, IQ4_NL) take an `isa`
argument: AVX2 forms a 4-byte dot with pmaddubsw + pmaddwd by ones, VNNI with one vpdpbusd on the same
256-bit lanes, from AVX-512 VNNI with AVX-512 VL (EVEX) or AVX-VNNI (VEX; LLVM picks the encoding from the
CPU's features). Both give the same integers (llvm_ir.dot_u8s8 says why), so the same bits. INT8_ISA is
chosen once at import; STRATA_LITE_CPU_ISA=avx2 keeps the AVX2 instructions on a VNNI CPU.
The K-quant / IQ3_XXS mat-vec kernel (nibble_int8.py) has no VNNI variant: its pmaddwd multiplies by the
sub-block scales, not by ones, so vpdpbusd cannot replace it; on a VNNI target LLVM itself turns its
pmaddwd + vpaddd into vpdpwssd (the same integers; seen with LLVM 22.1). Their prompt GEMM (nibble_gemm.py)
keeps the tokens in the lanes and takes the isa argument like the Q8_0 family.
LLVM aborts the process when asked for vpdpbusd on a target without it, so the kernels compile their VNNI
branch only under `if VNNI_BUILT` (a constant Numba prunes): VNNI_BUILT depends only on the target Numba
compiles for, which is part of its cache key, so a cached kernel never holds code its host cannot run.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("strata_lite.cpu")

# the extensions worth reporting: what the kernels use (avx2, fma, f16c; VNNI where present) and wider ones
REPORTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avxvnni", "amx-int8")
AVX2, VNNI = 0, 1                 # the int8 kernels' `isa` argument
ISA_ENV = "STRATA_LITE_CPU_ISA"   # unset, "auto" or "vnni": VNNI where the CPU has it; "avx2": the AVX2 path


def host_features() -> dict[str, bool]:
    """{extension: present} for REPORTED, in the target Numba compiles for (the host's features, or
    NUMBA_CPU_FEATURES, less AVX with NUMBA_ENABLE_AVX=0); all False where they cannot be read."""
    from numba.core import codegen, config
    try:
        flat = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    except Exception:   # pragma: no cover - features cannot be read on some platforms
        flat = ""
    on = {f[1:] for f in flat.split(",") if f.startswith("+")}
    return {f: f in on for f in REPORTED}


def host_cpu_name() -> str:
    """LLVM's name of the CPU Numba compiles for (NUMBA_CPU_NAME, or the host's: "znver4", "sapphirerapids", ...)."""
    from numba.core import config
    import llvmlite.binding as ll
    return config.CPU_NAME or ll.get_host_cpu_name()


def vnni_kind(feats: dict[str, bool]) -> str | None:
    """"AVX-512 VNNI" (with VL: the 256-bit form), "AVX-VNNI", or None: what a CPU with these features runs
    vpdpbusd on ymm registers with."""
    if feats["avx512vnni"] and feats["avx512vl"]:
        return "AVX-512 VNNI"
    return "AVX-VNNI" if feats["avxvnni"] else None


def choose_isa(feats: dict[str, bool], env) -> tuple[int, str]:
    """(AVX2 or VNNI, the kernel family's name) for a CPU with features feats and environment env (a mapping)."""
    kind = vnni_kind(feats)
    want = env.get(ISA_ENV, "auto").strip().lower()
    note = ""
    if want not in ("auto", "avx2", "vnni"):
        note, want = f" ({ISA_ENV}={want} not understood: auto)", "auto"
    if kind is None:
        if want == "vnni":
            note = f" ({ISA_ENV}=vnni, but the CPU has neither AVX-512 VNNI with VL nor AVX-VNNI)"
        return AVX2, "int8 AVX2 kernels" + note
    if want == "avx2":
        return AVX2, f"int8 AVX2 kernels ({ISA_ENV}=avx2; the CPU has {kind})"
    return VNNI, f"int8 {kind} kernels (vpdpbusd, 256-bit)" + note


_FEATURES = host_features()
VNNI_BUILT = vnni_kind(_FEATURES) is not None    # the kernels' VNNI branch is compiled (see the docstring)
INT8_ISA, _INT8_NAME = choose_isa(_FEATURES, os.environ)
WIDE_BUILT = VNNI_BUILT and _FEATURES["avx512f"] and _FEATURES["avx512vnni"]   # 512-bit vpdpbusd compiles
GEMM_LANES = 16 if WIDE_BUILT and INT8_ISA == VNNI else 8


def host_has_avx2() -> bool:
    """True when the CPU Numba compiles for has AVX2 (needed by the llvm.x86.avx2.* intrinsics)."""
    return host_features()["avx2"]


def int8_enabled() -> bool:
    """The int8 kernels run: the CPU has AVX2 and STRATA_LITE_INT8 is not "0"."""
    return host_has_avx2() and os.environ.get("STRATA_LITE_INT8", "1") != "0"


def kernel_family() -> str:
    """One line naming the CPU kernels in use and why."""
    if int8_enabled():
        return _INT8_NAME
    if not host_has_avx2():
        return "float kernels (this CPU has no AVX2)"
    return "float kernels (STRATA_LITE_INT8=0)"


_logged = False


def log_kernel_family() -> None:
    """Log kernel_family() the first time it is called in this process (CpuBackend's constructor calls it)."""
    global _logged
    if not _logged:
        _logged = True
        log.info("CPU kernels: %s", kernel_family())
