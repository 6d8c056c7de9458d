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
The prompt GEMMs (rows4_gemm.py, nibble_gemm.py) also come in 512-bit tiles of 16 tokens a vector (WIDE_BUILT: AVX-512
VNNI compiled in; the same operations per token, so the same bits), taken where the CPU runs 512-bit vectors whole
(GEMM_LANES, choose_gemm_lanes).
LLVM aborts the process when asked for vpdpbusd on a target without it, so the kernels compile their VNNI
branch only under `if VNNI_BUILT` (a constant Numba prunes): VNNI_BUILT depends only on the target Numba
compiles for, which is part of its cache key, so a cached kernel never holds code its host cannot run.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("strata_lite.cpu")

# the extensions worth reporting: what the kernels use (avx2, fma, f16c; VNNI where present) and wider ones
REPORTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512bf16", "avxvnni",
            "amx-int8")
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


LANES_ENV = "STRATA_LITE_GEMM_LANES"   # unset or "auto": by CPU (choose_gemm_lanes); "8" or "16"
SPLIT_512 = ("znver4",)   # CPUs that run a 512-bit vector op as two 256-bit halves: 16-token tiles measured no
                          # faster there (docs/cpu.md, "512-bit prompt tiles")


def choose_gemm_lanes(wide_built: bool, int8_isa: int, cpu_name: str, env) -> tuple[int, str]:
    """(tokens a vector of the prompt GEMMs' tiles, 8 or 16, and a note for kernel_family(), "" at 8 by default):
    16 (512-bit vectors) needs AVX-512 VNNI compiled in and the VNNI path, and is the default there except on
    the SPLIT_512 CPUs; STRATA_LITE_GEMM_LANES=8 or 16 chooses."""
    want = env.get(LANES_ENV, "auto").strip().lower()
    if want not in ("auto", "8", "16"):
        return choose_gemm_lanes(wide_built, int8_isa, cpu_name, {})[0], f"; {LANES_ENV}={want} not understood"
    if not (wide_built and int8_isa == VNNI):
        return 8, "" if want != "16" else f"; {LANES_ENV}=16, but there is no 512-bit VNNI path here"
    if want == "auto":
        want = "8" if cpu_name in SPLIT_512 else "16"
        return int(want), "; prompt GEMMs 512-bit" if want == "16" else ""
    return int(want), f"; prompt GEMMs {32 * int(want)}-bit ({LANES_ENV}={want})"


ROW_LOOP_CPUS = ("znver",)   # LLVM CPU name prefixes whose AVX2 sign-form prompt tiles run faster as a row loop


def sign_tile_row_loop(cpu_name: str) -> bool:
    """Whether the AVX2 prompt GEMM tiles of IQ4_NL and Q8_0 (the sign form) walk their 4 rows as a loop on this
    CPU: on AMD Zen (ROW_LOOP_CPUS), lane-major elsewhere (docs/cpu.md, "Prompt GEMM tiles and AVX2's
    registers"). Chosen by the CPU alone, which Numba's cache keys its compiled kernels on (an environment
    variable would not be: a cached kernel would keep the order it was compiled with)."""
    return cpu_name.startswith(ROW_LOOP_CPUS)


_FEATURES = host_features()
VNNI_BUILT = vnni_kind(_FEATURES) is not None    # the kernels' VNNI branch is compiled (see the docstring)
INT8_ISA, _INT8_NAME = choose_isa(_FEATURES, os.environ)
WIDE_BUILT = VNNI_BUILT and all(_FEATURES[f] for f in ("avx512f", "avx512bw", "avx512vnni"))   # 512-bit tiles compile
_CPU_NAME = host_cpu_name()
GEMM_LANES, _LANES_NOTE = choose_gemm_lanes(WIDE_BUILT, INT8_ISA, _CPU_NAME, os.environ)
SIGN_TILE_ROW_LOOP = sign_tile_row_loop(_CPU_NAME)


def tile_lanes(isa: int, lanes: int | None) -> int:
    """Tokens a vector of a prompt GEMM's tiles for a call on path isa: lanes as asked (None: GEMM_LANES on VNNI,
    else 8); 16 only where the 512-bit VNNI tiles are compiled and isa is VNNI (ValueError otherwise)."""
    if lanes is None:
        lanes = GEMM_LANES if isa == VNNI else 8
    if lanes == 16 and not (WIDE_BUILT and isa == VNNI):
        raise ValueError("16-lane tiles need AVX-512 VNNI and the VNNI path")
    return lanes


def host_has_avx2() -> bool:
    """True when the CPU Numba compiles for has AVX2 (needed by the llvm.x86.avx2.* intrinsics)."""
    return host_features()["avx2"]


def int8_enabled() -> bool:
    """The int8 kernels run: the CPU has AVX2 and STRATA_LITE_INT8 is not "0"."""
    return host_has_avx2() and os.environ.get("STRATA_LITE_INT8", "1") != "0"


BF16_ENV = "STRATA_LITE_BF16_GEMM"   # "0": BF16 prompt chunks keep the float32 tile path (A/B runs)
BF16_DOT = _FEATURES["avx512bf16"] and os.environ.get(BF16_ENV, "1") != "0"   # half_gemm.py takes BF16 chunks
F16_ENV = "STRATA_LITE_F16_GEMM"     # "0": F16 prompt chunks keep the float32 tile path (A/B runs)
F16_TILES = _FEATURES["avx512f"] and os.environ.get(F16_ENV, "1") != "0"      # half_gemm.py takes F16 chunks
HALF_NOTE = ("; BF16 prompt chunks by vdpbf16ps" if BF16_DOT else "") + (
    "; F16 prompt chunks by 16-token FMA tiles" if F16_TILES else "")


def kernel_family() -> str:
    """One line naming the CPU kernels in use and why."""
    if int8_enabled():
        return _INT8_NAME + _LANES_NOTE + HALF_NOTE
    if not host_has_avx2():
        return "float kernels (this CPU has no AVX2)"
    return "float kernels (STRATA_LITE_INT8=0)" + HALF_NOTE


_logged = False


def log_kernel_family() -> None:
    """Log kernel_family() the first time it is called in this process (CpuBackend's constructor calls it)."""
    global _logged
    if not _logged:
        _logged = True
        log.info("CPU kernels: %s", kernel_family())
