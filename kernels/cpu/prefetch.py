"""prefetch_row(a, r): ask the CPU to bring row r of a C-contiguous 2-D+ array into cache (a hint: never
faults, no effect on results). For matvec kernels whose rows are too short (< ~1 KB) for the hardware
prefetcher to lock on while the weights stream from DRAM."""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_LINE = 64


def emit_prefetch(builder, ptr, locality=3):
    """LLVM IR: prefetch the cache line at i8* ptr (read, data); locality 3 = into L1 (prefetcht0),
    2 = into L2 (prefetcht1)."""
    fn = builder.module.declare_intrinsic("llvm.prefetch", [_I8P],
                                          ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32]))
    builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, locality), ir.Constant(_I32, 1)])


@intrinsic
def prefetch_row(typingctx, a, r):
    if not (isinstance(a, types.Array) and a.layout == "C" and a.ndim >= 2 and isinstance(r, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        arr = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0])
        row_bytes = cgutils.unpack_tuple(builder, arr.strides)[0]
        r64 = context.cast(builder, args[1], signature.args[1], types.intp)
        base = builder.gep(builder.bitcast(arr.data, _I8P), [builder.mul(r64, row_bytes)])
        with cgutils.for_range_slice(builder, ir.Constant(row_bytes.type, 0), row_bytes,
                                     ir.Constant(row_bytes.type, _LINE)) as (off, _):
            emit_prefetch(builder, builder.gep(base, [off]))
        return context.get_dummy_value()

    return types.void(a, r), codegen
