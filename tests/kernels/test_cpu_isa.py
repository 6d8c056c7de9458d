"""Instruction-set dispatch of the int8 CPU kernels (kernels/cpu/isa.py) and the bits of the VNNI path.

* Everywhere: which path a CPU's features and STRATA_LITE_CPU_ISA choose (and the import-time choice, in a
  child process); that the features are those Numba compiles for; that no kernel asks LLVM for a VNNI
  instruction on a target without it (LLVM would abort the process); that the VNNI IR becomes vpdpbusd for
  AVX-512 VNNI and AVX-VNNI targets (assembly made for those targets in a child; nothing runs).
* Where the CPU has AVX-512 VNNI with VL or AVX-VNNI (skipped elsewhere, with that reason): every switched
  kernel (q8_0_int8.mv_avx2 and mv_avx2_serial, q8_0_gemm.matmul; Q8_0, Q5_0, Q4_0, IQ4_NL) gives the AVX2
  path's output bit for bit, on random data and at the largest pmaddubsw pair sums. There the import-time
  choice is VNNI (the default where the CPU has it), so the other kernel tests of this directory (float64 and gguf references, the vector kernels
  against the GEMMs, batch invariance) run the VNNI path too.
"""
import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from llvmlite import ir

from strata_lite.kernels.cpu import isa, llvm_ir as L, nibble_gemm, nibble_int8, q8_0_gemm, q8_0_int8, rows4_gemm
from test_dequant import random_rows
from test_prompt_gemm import Q8_KINDS, _q8_rows, _x

needs_vnni = pytest.mark.skipif(not isa.VNNI_BUILT, reason="this CPU has neither AVX-512 VNNI with VL nor AVX-VNNI "
                                "(as Numba compiles for it): the VNNI kernels cannot be compiled or run here")
AVX512_VNNI = ("avx512f", "avx512bw", "avx512vl", "avx512vnni")


def _features(*on):
    return {**dict.fromkeys(isa.REPORTED, False), "avx2": True, "fma": True, "f16c": True, **dict.fromkeys(on, True)}


# ------------------------------------------------------------------------------------ dispatch logic

@pytest.mark.parametrize("on,env,want,name", [
    ((), {}, isa.AVX2, "int8 AVX2 kernels"),
    (AVX512_VNNI, {}, isa.VNNI, "int8 AVX-512 VNNI kernels (vpdpbusd, 256-bit)"),
    (AVX512_VNNI, {isa.ISA_ENV: "vnni"}, isa.VNNI, "int8 AVX-512 VNNI kernels (vpdpbusd, 256-bit)"),
    (("avx512f", "avx512vnni"), {}, isa.AVX2, "int8 AVX2 kernels"),     # no VL: no 256-bit vpdpbusd
    (("avxvnni",), {}, isa.VNNI, "int8 AVX-VNNI kernels (vpdpbusd, 256-bit)"),
    (AVX512_VNNI + ("avxvnni",), {isa.ISA_ENV: "vnni"}, isa.VNNI, "int8 AVX-512 VNNI kernels (vpdpbusd, 256-bit)"),
    (AVX512_VNNI, {isa.ISA_ENV: "avx2"}, isa.AVX2, "int8 AVX2 kernels (STRATA_LITE_CPU_ISA=avx2; the CPU has "
                                                   "AVX-512 VNNI)"),
    (("avxvnni",), {isa.ISA_ENV: " AVX2 "}, isa.AVX2, "int8 AVX2 kernels (STRATA_LITE_CPU_ISA=avx2; the CPU has "
                                                      "AVX-VNNI)"),
    (("avxvnni",), {isa.ISA_ENV: "auto"}, isa.VNNI, "int8 AVX-VNNI kernels (vpdpbusd, 256-bit)"),
    (("avxvnni",), {isa.ISA_ENV: "vnni"}, isa.VNNI, "int8 AVX-VNNI kernels (vpdpbusd, 256-bit)"),
    ((), {isa.ISA_ENV: "vnni"}, isa.AVX2, "int8 AVX2 kernels (STRATA_LITE_CPU_ISA=vnni, but the CPU has neither "
                                          "AVX-512 VNNI with VL nor AVX-VNNI)"),
    (AVX512_VNNI, {isa.ISA_ENV: "sse"}, isa.VNNI, "int8 AVX-512 VNNI kernels (vpdpbusd, 256-bit) "
                                                  "(STRATA_LITE_CPU_ISA=sse not understood: auto)"),
], ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_choice_by_features_and_environment(on, env, want, name):
    assert isa.choose_isa(_features(*on), env) == (want, name)


@pytest.mark.parametrize("wide,which,cpu,env,want", [
    (True, isa.VNNI, "sapphirerapids", {}, (16, "; prompt GEMMs 512-bit")),
    (True, isa.VNNI, "icelake-server", {}, (16, "; prompt GEMMs 512-bit")),
    (True, isa.VNNI, "znver4", {}, (8, "")),                     # 512-bit ops split in halves: no gain measured
    (True, isa.VNNI, "znver4", {isa.LANES_ENV: "16"}, (16, "; prompt GEMMs 512-bit (STRATA_LITE_GEMM_LANES=16)")),
    (True, isa.VNNI, "sapphirerapids", {isa.LANES_ENV: " 8 "}, (8, "; prompt GEMMs 256-bit (STRATA_LITE_GEMM_LANES=8)")),
    (True, isa.AVX2, "sapphirerapids", {}, (8, "")),              # STRATA_LITE_CPU_ISA=avx2: no 512-bit dots
    (False, isa.VNNI, "alderlake", {}, (8, "")),                  # AVX-VNNI: 256-bit only
    (False, isa.VNNI, "alderlake", {isa.LANES_ENV: "16"},
     (8, "; STRATA_LITE_GEMM_LANES=16, but there is no 512-bit VNNI path here")),
    (True, isa.VNNI, "sapphirerapids", {isa.LANES_ENV: "32"}, (16, "; STRATA_LITE_GEMM_LANES=32 not understood")),
], ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_gemm_lanes_by_cpu_and_environment(wide, which, cpu, env, want):
    assert isa.choose_gemm_lanes(wide, which, cpu, env) == want


@pytest.mark.parametrize("cpu,want", [("znver3", True), ("znver2", True), ("znver4", True), ("skylake", False),
                                      ("emeraldrapids", False), ("generic", False)])
def test_sign_tile_order_by_cpu(cpu, want):
    """AMD Zen's sign-form AVX2 prompt tiles take the row loop, the others the lane-major order (as measured)."""
    assert isa.sign_tile_row_loop(cpu) is want


def test_features_are_those_numba_compiles_for(monkeypatch):
    from numba.core import config
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512vnni,+avxvnni,+avx512vl")
    f = isa.host_features()
    assert f["avx2"] and f["avxvnni"] and f["avx512vl"] and not f["avx512vnni"] and not f["f16c"]
    assert isa.vnni_kind(f) == "AVX-VNNI"
    monkeypatch.setattr(config, "CPU_FEATURES", "")            # NUMBA_CPU_NAME=generic: nothing
    assert not any(isa.host_features().values())


def _child_choice(value):
    env = {k: v for k, v in os.environ.items() if k not in (isa.ISA_ENV, isa.LANES_ENV)}
    if value is not None:
        env[isa.ISA_ENV] = value
    r = subprocess.run([sys.executable, "-c", "from strata_lite.kernels.cpu import isa; "
                        "print(isa.INT8_ISA, isa.VNNI_BUILT, isa.GEMM_LANES); print(isa.kernel_family())"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    first, family = r.stdout.splitlines()
    chosen, built, lanes = first.split()
    return int(chosen), built == "True", family, int(lanes)


@pytest.mark.parametrize("value", [None, "avx2", "vnni"])
def test_import_time_choice_and_override(value):
    """A fresh process chooses from its CPU and STRATA_LITE_CPU_ISA; the VNNI code is compiled where the CPU
    has it, whatever the override (it is a kernel argument, so both paths share the cache)."""
    chosen, built, family, lanes = _child_choice(value)
    env = {} if value is None else {isa.ISA_ENV: value}
    want = isa.choose_isa(isa.host_features(), env)
    want_lanes = isa.choose_gemm_lanes(isa.WIDE_BUILT, want[0], isa.host_cpu_name(), env)
    assert chosen == want[0] and built == (isa.vnni_kind(isa.host_features()) is not None)
    assert lanes == want_lanes[0]
    assert family == (want[1] + want_lanes[1] + isa.HALF_NOTE if isa.host_features()["avx2"] else
                      "float kernels (this CPU has no AVX2)")
    if value == "avx2":
        assert chosen == isa.AVX2


def test_no_vnni_instruction_is_asked_of_a_target_without_it(monkeypatch):
    """The kernels' VNNI branch is compiled only under isa.VNNI_BUILT (pruned otherwise); the emitter refuses
    with an exception where LLVM would abort."""
    monkeypatch.setattr(isa, "VNNI_BUILT", False)
    fn = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), []), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    u = ir.Constant(L.V32B, None)
    with pytest.raises(AssertionError, match="without VNNI"):
        L.dot_u8s8(b, isa.VNNI, u, u)
    assert L.dot_u8s8(b, isa.AVX2, u, u).type == L.V8I


@pytest.mark.skipif(not isa.host_has_avx2() or isa.VNNI_BUILT, reason="needs an AVX2 CPU without VNNI")
def test_vnni_argument_without_vnni_runs_avx2():
    """Asked for VNNI where it is not compiled, a kernel runs the AVX2 path (and compiles: the branch that
    would fail is pruned)."""
    raw3 = _q8_rows(QType.Q5_0, 5, 256, seed=1).reshape(5, 8, -1)
    x3 = _x(3, 256, seed=2).reshape(3, -1, 32)
    a, v = np.empty((3, 5), np.float32), np.empty((3, 5), np.float32)
    q8_0_gemm.matmul(raw3, x3, a, q8_0_int8.Q5_0_KIND, isa.AVX2)
    q8_0_gemm.matmul(raw3, x3, v, q8_0_int8.Q5_0_KIND, isa.VNNI)
    np.testing.assert_array_equal(v, a)


_ASM = """
import json
import llvmlite.binding as llvm
from llvmlite import ir
from strata_lite.kernels.cpu import isa, llvm_ir as L
isa.VNNI_BUILT = True       # only assembly for the VNNI targets below is made here; nothing runs
mod = ir.Module()
fn = ir.Function(mod, ir.FunctionType(L.V8I, [L.V32B, L.V32B]), "f")
b = ir.IRBuilder(fn.append_basic_block())
b.ret(L.dot_u8s8(b, isa.VNNI, *fn.args))
llvm.initialize_native_target()
llvm.initialize_native_asmprinter()
for feats in ("+avx2,+avx512f,+avx512bw,+avx512vl,+avx512vnni", "+avx2,+avxvnni"):
    m = llvm.parse_assembly(str(mod))
    m.verify()
    tm = llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(features=feats, opt=2)
    ops = [l.split() for l in tm.emit_assembly(m).splitlines() if "vpdp" in l or "pmadd" in l]
    print(json.dumps([" ".join(o[:2]) if o[0] == "{vex}" else o[0] for o in ops]))
"""


_ASM_512 = """
import llvmlite.binding as llvm
from llvmlite import ir
from strata_lite.kernels.cpu import isa, llvm_ir as L
isa.VNNI_BUILT = isa.WIDE_BUILT = True      # assembly for an AVX-512 VNNI target only; nothing runs
mod = ir.Module()
v64 = ir.VectorType(L.I8, 64)
fn = ir.Function(mod, ir.FunctionType(ir.VectorType(L.I32, 16), [v64, v64]), "f")
b = ir.IRBuilder(fn.append_basic_block())
b.ret(L.dot_u8s8(b, isa.VNNI, *fn.args))
llvm.initialize_native_target()
llvm.initialize_native_asmprinter()
m = llvm.parse_assembly(str(mod))
tm = llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(
    cpu="sapphirerapids", features="+avx2,+avx512f,+avx512bw,+avx512vl,+avx512vnni", opt=2)
print([l.strip() for l in tm.emit_assembly(m).splitlines() if "vpdp" in l])
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_512_bit_dot_is_one_zmm_vpdpbusd():
    """On a CPU that LLVM tunes for 256-bit vectors (Sapphire Rapids), the 16-lane dot stays one 512-bit
    instruction: Numba's functions carry no min-legal-vector-width, so 512-bit vectors stay legal."""
    r = subprocess.run([sys.executable, "-c", _ASM_512], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (line,) = eval(r.stdout.strip())
    assert line.startswith("vpdpbusd") and line.count("zmm") == 3


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_vnni_ir_selects_vpdpbusd():
    """AVX-512 VNNI: the EVEX form; AVX-VNNI: the VEX one. In a child: an abort of LLVM would end only it."""
    r = subprocess.run([sys.executable, "-c", _ASM], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    avx512, avxvnni = (json.loads(line) for line in r.stdout.splitlines())
    assert avx512 == ["vpdpbusd"]
    assert avxvnni == ["{vex} vpdpbusd"]


_COMPILE = """
import re
import numpy as np
from numba import types, typeof
from strata_lite.kernels.cpu import isa, q8_0_gemm, q8_0_int8
assert isa.VNNI_BUILT and isa.INT8_ISA == isa.VNNI          # VNNI compiled in and chosen by default
raw3, x3, out = np.zeros((4, 8, 34), np.uint8), np.zeros((2, 8, 32), np.float32), np.zeros((2, 4), np.float32)
i64 = types.int64
for f, sig in ((q8_0_int8.mv_avx2_serial, (typeof(raw3), typeof(x3), typeof(out), i64, i64)),
               (q8_0_gemm._gemm, (typeof(raw3), i64, typeof(x3), typeof(out), i64, i64, i64, i64, i64))):
    f.compile(sig)                      # compiled only: this CPU may not run it
    asm = f.inspect_asm(sig)
    print(*(len(re.findall(op, asm)) for op in ("vpdpbusd", "vpmaddubsw")))
"""
# Ice Lake server's vector features: AVX-512 VNNI with VL
_VNNI_TARGET = {"NUMBA_CPU_NAME": "icelake-server",
                "NUMBA_CPU_FEATURES": "+64bit,+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+avx,+avx2,+fma,+f16c,"
                                      "+bmi,+bmi2,+lzcnt,+movbe,+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512cd,"
                                      "+avx512vnni"}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_kernels_compile_both_paths_for_a_vnni_target(tmp_path):
    """Numba compiling (not running) mv_avx2_serial and the GEMM for a VNNI target, in a child with an empty
    cache (a kernel loaded from the cache has no assembly to inspect): both branches are there (vpdpbusd in
    the VNNI one, pmaddubsw in the AVX2 one). On an AVX2 host the same kernels have no VNNI branch (the other
    tests here run them)."""
    env = {k: v for k, v in os.environ.items() if k != isa.ISA_ENV}     # the child asserts the default choice
    r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600,
                       env={**env, **_VNNI_TARGET, "NUMBA_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    for line in r.stdout.splitlines():
        n_vnni, n_avx2 = map(int, line.split())
        assert n_vnni > 0 and n_avx2 > 0, line


# ------------------------------------------------------------------------------ VNNI bits = AVX2 bits

def _both(f, shape):
    """f(out, isa) run with AVX2 and VNNI into NaN-filled outputs: (avx2 out, vnni out)."""
    outs = []
    for which in (isa.AVX2, isa.VNNI):
        out = np.full(shape, np.nan, np.float32)
        f(out, which)
        outs.append(out)
    return outs


def _q8_kernels(raw3, x3, kind):
    return {"mv_avx2": lambda out, i: q8_0_int8.mv_avx2(raw3, x3, out, kind, i),
            "mv_avx2_serial": lambda out, i: q8_0_int8.mv_avx2_serial(raw3, x3, out, kind, i),
            "q8_0_gemm": lambda out, i: q8_0_gemm.matmul(raw3, x3, out, kind, i)}


@needs_vnni
@pytest.mark.parametrize("qtype", list(Q8_KINDS), ids=lambda t: t.name)
def test_q8_0_family_vnni_bits_equal_avx2(qtype):
    n_out, n_cols = 53, 896
    raw3 = _q8_rows(qtype, n_out, n_cols, seed=11).reshape(n_out, n_cols // 32, -1)
    for n_tok in (1, 2, 3, 5, 8, 9, 16, 23, 41):
        x3 = _x(n_tok, n_cols, seed=n_tok).reshape(n_tok, -1, 32)
        for name, f in _q8_kernels(raw3, x3, Q8_KINDS[qtype]).items():
            avx2, vnni = _both(f, (n_tok, n_out))
            np.testing.assert_array_equal(vnni, avx2, err_msg=f"{name}, {n_tok} tokens")


@needs_vnni
def test_q8_0_vnni_bits_at_the_largest_pair_sums():
    """Q8_0 weights of -128 against activations rounded to -127 (|w| = 128 and sign(w) a = 127: pair sums of
    2 x 128 x 127 = 32512, the largest the kernels form) and weights of 127 against 127."""
    n_out, n_cols = 4, 256
    raw = random_rows(QType.Q8_0, n_out, n_cols, seed=3).reshape(n_out, n_cols // 32, 34)
    raw[:2, :, 2:] = 0x80
    raw[2:, :, 2:] = 127
    x = np.ones((16, n_cols), np.float32)
    x[::2] = -1                                       # every block one value: rounded to +-127
    for name, f in _q8_kernels(raw, x.reshape(16, -1, 32), q8_0_int8.Q8_0_KIND).items():
        avx2, vnni = _both(f, (16, n_out))
        np.testing.assert_array_equal(vnni, avx2, err_msg=name)


@needs_vnni
def test_vnni_is_chosen_here():
    """The VNNI path is the default on this CPU, and STRATA_LITE_CPU_ISA=vnni keeps it (the rest of this
    directory's int8 tests, the float64 and gguf references included, run through it here)."""
    assert isa.INT8_ISA == isa.choose_isa(isa.host_features(), os.environ)[0]
    assert _child_choice(None)[0] == isa.VNNI and _child_choice("vnni")[0] == isa.VNNI


# ------------------------------------------------------------ 512-bit prompt tiles = 256-bit prompt tiles

needs_wide = pytest.mark.skipif(not isa.WIDE_BUILT, reason="this CPU has no AVX-512 VNNI (as Numba compiles for it): "
                                "the 512-bit prompt tiles cannot be compiled or run here")


@needs_wide
@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q4_0, QType.IQ4_NL, QType.Q8_0], ids=lambda t: t.name)
def test_rows4_gemm_16_lanes_equal_8(qtype):
    """rows4_gemm's tiles of 16 tokens a vector against those of 8 (each checked against the mat-vec kernel by
    test_rows4_int8 where it is the default): token counts around the 16- and 32-token tile edges."""
    from test_rows4_int8 import FORMATS, _rows
    fmt = FORMATS[qtype]
    for n_out, n_cols in ((36, 4864), (13 * 4, 896)):
        raw3 = fmt.repack(_rows(qtype, n_out, n_cols, seed=n_out), n_cols).reshape(n_out, n_cols // 32, -1)
        for n_tok in (16, 17, 31, 33, 70):
            x3 = _x(n_tok, n_cols, seed=n_tok).reshape(n_tok, -1, 32)
            outs = []
            for lanes in (8, 16):
                out = np.full((n_tok, n_out), np.nan, np.float32)
                rows4_gemm.matmul(raw3, x3, out, fmt.kind, isa.VNNI, lanes)
                outs.append(out)
            np.testing.assert_array_equal(outs[1], outs[0], err_msg=f"{n_out}x{n_cols}, {n_tok} tokens")


@needs_wide
@pytest.mark.parametrize("qtype", [QType.IQ3_XXS, QType.Q4_K, QType.Q5_K, QType.Q6_K], ids=lambda t: t.name)
def test_nibble_gemm_16_lanes_equal_the_vector_kernel(qtype):
    from test_prompt_gemm import F16_TABLE, NIBBLE
    mod, kind, table = NIBBLE[qtype]
    for n_out in (3, 33):
        n_cols = 768
        raw3 = mod.repack(random_rows(qtype, n_out, n_cols, seed=n_out), n_cols, F16_TABLE).reshape(
            n_out, n_cols // 256, mod.BLOCK_BYTES)
        for n_tok in (1, 17, 33, 77):
            x3 = _x(n_tok, n_cols, seed=n_tok).reshape(n_tok, -1, 256)
            ref = np.full((n_tok, n_out), np.nan, np.float32)
            nibble_int8.matvec(raw3, x3, ref, table, kind)
            out = np.full_like(ref, np.nan)
            nibble_gemm.matmul(raw3, x3, out, table, kind, isa.VNNI, 16)
            np.testing.assert_array_equal(out, ref, err_msg=f"{n_out} rows, {n_tok} tokens")


def test_16_lanes_refused_without_a_512_bit_path():
    raw3 = np.zeros((4, 2, 18), np.uint8)
    with pytest.raises(ValueError, match="16-lane"):
        rows4_gemm.matmul(raw3, np.zeros((16, 2, 32), np.float32), np.zeros((16, 4), np.float32), 0, isa.AVX2, 16)
