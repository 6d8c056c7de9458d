"""Helpers for kernels emitted as LLVM IR through Numba @intrinsic (iq3_int8.py, q8_0_int8.py, matvec.py).

They take the llvmlite IRBuilder of the intrinsic's codegen. Byte offsets are i64; loads are unaligned
unless an alignment is given.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils

from . import isa as _isa

F32 = ir.FloatType()
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
V8F = ir.VectorType(F32, 8)
V8I = ir.VectorType(I32, 8)
V32B = ir.VectorType(I8, 32)
V16W = ir.VectorType(I16, 16)
CONTRACT = ("contract",)


def c_arrays(*specs) -> bool:
    """True when every (numba type, dtype, ndim) spec is a C-contiguous array of that dtype and ndim
    (an intrinsic's typing step returns None otherwise)."""
    return all(isinstance(a, types.Array) and a.dtype == dt and a.ndim == nd and a.layout == "C"
               for a, dt, nd in specs)


def strided_array(a, dt, nd) -> bool:
    """a is an array of that dtype and ndim, contiguous or not (for outputs stored through their strides,
    as store_tile does: a column slice of a larger output)."""
    return isinstance(a, types.Array) and a.dtype == dt and a.ndim == nd and a.layout in ("C", "A")


def gemm_tile_signature(pw, i, a, g0, g1, out, r0):
    """The signature of a prompt GEMM tile intrinsic tile(pw, i, a, g0, g1, out, r0) (rows4_gemm, nibble_gemm:
    panel pw, its group i, packed activations a, token groups g0 / g1, output out, first row r0), or None
    (the intrinsic's typing step) when the arguments are not of those kinds."""
    if not (c_arrays((pw, types.uint8, 3), (a, types.uint8, 3)) and strided_array(out, types.float32, 2)
            and all(isinstance(v, types.Integer) for v in (i, g0, g1, r0))):
        return None
    return types.void(pw, types.intp, a, types.intp, types.intp, out, types.intp)


def gemm_tile_operands(context, builder, signature, args):
    """For such a tile's codegen: (w0 = panel group i's i8*, the panel's (strides, shape), [the two token groups'
    activation i8*], the activations' strides, (out's i8*, strides, shape))."""
    (ppw, wstr, wshape), (pa, astr, _), out = (array_arg(context, builder, signature.args[k], args[k])
                                               for k in (0, 2, 5))
    w0 = builder.gep(ppw, [builder.mul(args[1], wstr[0])])
    a0 = [builder.gep(pa, [builder.mul(g, astr[0])]) for g in (args[3], args[4])]
    return w0, (wstr, wshape), a0, astr, out


def tile_args(r0, t0, n_tok, max_tok) -> bool:
    """The (row, token, literal token count) arguments of a row-group x token-chunk kernel are valid."""
    return (isinstance(r0, types.Integer) and isinstance(t0, types.Integer)
            and isinstance(n_tok, types.IntegerLiteral) and 1 <= n_tok.literal_value <= max_tok)


_AVX2 = {   # name -> (result, operands) of the llvm.x86.avx2.* intrinsics the int8 kernels use
    "pshuf.b": (V32B, (V32B, V32B)),
    "psign.b": (V32B, (V32B, V32B)),
    "pmadd.ub.sw": (V16W, (V32B, V32B)),
    "pmadd.wd": (V8I, (V16W, V16W)),
}


def avx2(builder, name):
    """Declared llvm.x86.avx2.<name> (see _AVX2) in the builder's module."""
    res, ops = _AVX2[name]
    return builder.module.declare_intrinsic("llvm.x86.avx2." + name, (), ir.FunctionType(res, list(ops)))


def madd_i16(builder, a, b):
    """pmaddwd: <2n x i16> a, b -> <n x i32>, lane i = a[2i] b[2i] + a[2i + 1] b[2i + 1] (exact); n = 8 (AVX2) or
    16 (AVX-512 BW: llvm.x86.avx512.pmaddw.d.512)."""
    if a.type.count == 16:
        return builder.call(avx2(builder, "pmadd.wd"), [a, b])
    v32w, v16i = ir.VectorType(I16, 32), ir.VectorType(I32, 16)
    fn = builder.module.declare_intrinsic("llvm.x86.avx512.pmaddw.d.512", (), ir.FunctionType(v16i, [v32w, v32w]))
    return builder.call(fn, [a, b])


def _vpdpbusd(builder, lanes=8):
    """Declared llvm.x86.avx512.vpdpbusd.256: the 256-bit form of both AVX-512 VNNI + VL (EVEX) and AVX-VNNI
    (VEX), encoded by LLVM for the features it compiles for; lanes=16: llvm.x86.avx512.vpdpbusd.512 (AVX-512
    VNNI). <lanes x i32> operands: the form every LLVM version takes (LLVM 22 upgrades it to its byte one)."""
    if not (_isa.WIDE_BUILT if lanes == 16 else _isa.VNNI_BUILT):
        raise AssertionError(f"{32 * lanes}-bit vpdpbusd asked of a compile target without VNNI")  # LLVM aborts
    vi = ir.VectorType(I32, lanes)
    return builder.module.declare_intrinsic(f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", (),
                                            ir.FunctionType(vi, [vi] * 3))


def dot_u8s8(builder, isa, u, s, acc=None):
    """<8 x i32>, lane i = acc[i] (0 without acc) + sum over k < 4 of u[4i + k] s[4i + k]: u unsigned and s
    signed bytes (<32 x i8>; VNNI also <64 x i8> -> <16 x i32>). AVX2: pmaddwd(pmaddubsw(u, s), 1) + acc; VNNI:
    vpdpbusd(acc, u, s). pmaddubsw saturates its pair sums u0 s0 + u1 s1 to int16 and vpdpbusd does not, so the
    two are equal where no pair sum leaves int16: every caller's u is at most 128 (|w|, or 4- / 5-bit codes), so
    a pair is within [-32768, 32512] for any s."""
    lanes = u.type.count // 4
    if isa == _isa.VNNI:
        vi = ir.VectorType(I32, lanes)
        return builder.call(_vpdpbusd(builder, lanes), [ir.Constant(vi, None) if acc is None else acc,
                                                        builder.bitcast(u, vi), builder.bitcast(s, vi)])
    if lanes != 8:
        raise AssertionError("the AVX2 dot has 256-bit vectors only")
    return widen_add(builder, maddubs(builder, u, s), acc)


def maddubs(builder, u, s):
    """<16 x i16>, lane i = u[2i] s[2i] + u[2i + 1] s[2i + 1] (AVX2 pmaddubsw: u unsigned, s signed bytes; the
    pair sum saturates to int16, so callers keep it, and any sums of such vectors they add, within int16)."""
    return builder.call(avx2(builder, "pmadd.ub.sw"), [u, s])


def widen_add(builder, v16, acc=None):
    """<8 x i32>, lane i = v16[2i] + v16[2i + 1] (+ acc[i]): AVX2 pmaddwd by ones."""
    d = builder.call(avx2(builder, "pmadd.wd"), [v16, ir.Constant(V16W, [1] * 16)])
    return d if acc is None else builder.add(d, acc)


# pmaddubsw results of 5-bit codes (<= 31) against Q8_0-rounded activations (|x| <= 127) are at most 7,874 a lane,
# so this many of them add up within int16 (31,496) before one pmaddwd: the same integers as a pmaddwd each
CODE5_INT16_SUMS = 4


def const(v, ty=I64):
    return ir.Constant(ty, v)


def array_arg(context, builder, array_type, value):
    """(i8* data, strides, shape) of a Numba array argument."""
    a = cgutils.create_struct_proxy(array_type)(context, builder, value=value)
    return (builder.bitcast(a.data, I8.as_pointer()), cgutils.unpack_tuple(builder, a.strides),
            cgutils.unpack_tuple(builder, a.shape))


def load(builder, ptr, off, ty, align=1):
    """Load a ty at byte offset off (int or i64 value) from i8* ptr."""
    off = off if isinstance(off, ir.Value) else const(off)
    return builder.load(builder.bitcast(builder.gep(ptr, [off]), ty.as_pointer()), align=align)


def splat(builder, value, vty):
    """value broadcast to every lane of vector type vty."""
    undef = ir.Constant(vty, ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef, value, const(0, I32)), undef,
                                  ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count))


def hsum(builder, v):
    """Sum of the lanes of a float or integer vector (power-of-two width), as a scalar, halving the vector each
    step (integers: wrapping adds, exact while the sum fits the lane type)."""
    add = builder.fadd if isinstance(v.type.element, ir.FloatType) else builder.add
    n = v.type.count // 2
    while n >= 1:
        idx = ir.VectorType(I32, n)
        v = add(builder.shuffle_vector(v, v, ir.Constant(idx, list(range(n)))),
                builder.shuffle_vector(v, v, ir.Constant(idx, list(range(n, 2 * n)))))
        n //= 2
    return builder.extract_element(v, const(0, I32))


def clamped_rows(builder, r0, count, n_rows):
    """Row indices r0 .. r0 + count - 1, each clamped to n_rows - 1 (a short last group repeats its
    last row, so kernels never branch on the tail)."""
    last = builder.sub(n_rows, const(1))
    rows = []
    for k in range(count):
        r = builder.add(r0, const(k))
        rows.append(builder.select(builder.icmp_signed("<", r, last), r, last))
    return rows


def store_f32(builder, ptr, off, value):
    builder.store(value, builder.bitcast(builder.gep(ptr, [off]), F32.as_pointer()))


def store_tile(builder, pout, out_strides, t_idx, r_idx, value):
    """out[t, r] = value(k, j) (a float scalar) for every token t_idx[j] and row r_idx[k], token by token (each
    token's rows are adjacent: one or two cache lines). Row by row, a tile's tokens (n_out floats apart) fall in one
    L1 set where n_out is a multiple of 1,024 and the stores thrash it: 512-token prompt GEMMs over 2,048 or 4,096 rows
    ran at 0.67-0.72 of the GFLOP/s of 2,064 or 4,112 rows (Zen 5, 2026-12-07, docs/cpu.md)."""
    for j, t in enumerate(t_idx):
        row_out = builder.mul(t, out_strides[0])
        for k, r in enumerate(r_idx):
            store_f32(builder, pout, builder.add(row_out, builder.mul(r, out_strides[1])), value(k, j))
