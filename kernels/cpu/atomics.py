"""Atomic counters in compiled code (Numba @intrinsic over LLVM's atomic instructions), for the work sharing of
kernels/cpu/decode_block.py: threads claim work items by fetch-and-add on a counter and wait for a phase's
items by reading another with acquire order.

Counters live in an int64 array; each is used at index `slot * STRIDE` so that two counters never share a
64-byte cache line (a line bouncing between cores on every claim costs more than the items it hands out).
"""
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

STRIDE = 8        # int64 words between two counters: one cache line each


def _counter_array(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.int64 and a.ndim == 1 and a.layout == "C"


def _pointer(context, builder, aryty, ary, index):
    arr = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, arr, [index], wraparound=False)


@intrinsic
def fetch_add(typingctx, counters, index, value):
    """counters[index] += value atomically (sequentially consistent) -> the value before."""
    if not _counter_array(counters):
        return None
    sig = types.int64(counters, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        ptr = _pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")
    return sig, codegen


@intrinsic
def load_acquire(typingctx, counters, index):
    """counters[index], read with acquire order: what the writer stored before its release is visible after."""
    if not _counter_array(counters):
        return None
    sig = types.int64(counters, types.intp)

    def codegen(context, builder, signature, args):
        ptr = _pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)
    return sig, codegen


@intrinsic
def spin_pause(typingctx):
    """x86 `pause`: the polite spin-wait hint (the int8 kernels that use the counters are x86-only)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", (), ir.FunctionType(ir.VoidType(), []))
        builder.call(fn, [])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def yield_thread(typingctx):
    """Give the rest of this thread's time slice to another runnable thread (sched_yield; SwitchToThread on
    Windows), for a spin that has lasted: on a machine with more busy threads than cores the thread it waits
    for may not be running. Called by name: the symbol is resolved in the process when the code is loaded,
    so the function stays in Numba's cache."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        name = "SwitchToThread" if sys.platform == "win32" else "sched_yield"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), name)
        builder.call(fn, [])
        return context.get_dummy_value()
    return sig, codegen
