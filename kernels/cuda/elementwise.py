"""Launchers of elementwise.cu: rmsnorm (alone or with the activation rounding), rope (one tensor or q and k),
silu_mul, add, take_rows, copy_cols (CUDA, CuPy).

Every array is a device (cupy) float32 C-contiguous array unless said otherwise; outputs are caller-
allocated; sizes and scalars are host Python numbers. Shapes/dtypes are checked here once (ValueError);
nothing is allocated, synchronized or copied to the host, so every call can be captured into a graph.
Launch shapes depend only on the arrays' shapes. The 16-byte (_x4) kernels are used when the widths
(and addresses) are multiples of 4 floats, which every model dimension is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .qmatmul import XBLOCK
from .runtime import cdiv, cupy, launch

__all__ = ["rmsnorm", "rmsnorm_round", "can_round", "RopeTable", "rope_table", "rope", "rope_qk", "silu_mul", "add", "take_rows", "copy_cols"]

CU = "elementwise.cu"
BLOCK = 256            # threads per CTA of the flat kernels, and the most per row of the row kernels
ROPE_MAX_ROT = 512     # shared cos/sin table of elementwise.cu (ROPE_MAX_HALF)
NULL_PTR = np.uint64(0)   # a null pointer argument


def _req(arr, name, dtype=np.float32, ndim=None):
    if not isinstance(arr, cupy().ndarray):
        raise ValueError(f"{name} must be a cupy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _vec4(n_floats, *arrays):
    """True when n_floats and every array's address are multiples of 4 floats (16 bytes)."""
    return n_floats % 4 == 0 and all(a.data.ptr % 16 == 0 for a in arrays)


def _row_block(width):
    """Threads per CTA for a row of `width` elements: whole warps, at most BLOCK."""
    return min(BLOCK, max(32, cdiv(width, 32) * 32))


def rmsnorm(x, weight, eps: float, out) -> None:
    """out = x / sqrt(mean(x**2, last axis) + eps) * weight.

    x (..., d) (leading dims flattened into rows, e.g. per-head q/k norm on (n * n_heads, head_dim)),
    weight (d,), out like x (may alias x). Sum of squares in float32, reduced in a fixed order per row
    (one CTA per row, block size from d only), the row scale 1/sqrt(.) in double."""
    _req(x, "x")
    _req(weight, "weight", ndim=1)
    _req(out, "out")
    if x.ndim < 1 or out.shape != x.shape:
        raise ValueError(f"out {out.shape} must match x {x.shape}")
    d = x.shape[-1]
    if d == 0 or weight.shape[0] != d:
        raise ValueError(f"weight {weight.shape} must be ({d},) matching x's last axis (d > 0)")
    n = x.size // d
    if n == 0:
        return
    if _vec4(d, x, weight, out):
        launch(CU, "rmsnorm_f32_x4", (n,), (_row_block(d // 4),), (x, weight, np.float64(eps), out, np.int32(d)))
    else:
        launch(CU, "rmsnorm_f32", (n,), (_row_block(d),), (x, weight, np.float64(eps), out, np.int32(d)))


ROUND_MAX_SHARED = 48 * 1024              # the fused kernel keeps a row in shared memory (no opt-in above)


def can_round(x, weight, out, fmt: str) -> bool:
    """Whether rmsnorm_round takes these arrays: 2-D rows of 16-byte aligned float4s that fit in shared
    memory and split into whole blocks of the format."""
    d = x.shape[-1]
    return (x.ndim == 2 and fmt in XBLOCK and d % XBLOCK[fmt] == 0 and 4 * d <= ROUND_MAX_SHARED
            and _vec4(d, x, weight, out))


def rmsnorm_round(x, weight, eps: float, out, fmt: str, xq, xd) -> None:
    """rmsnorm (as above) of x (n, d) into out, and out rounded for a quantized mat-mul in the same launch:
    xq (n, d) int8, xd (n, d / block) float32, the bits of qmatmul.quantize_activations(fmt, out, xq, xd).
    Needs can_round(x, weight, out, fmt)."""
    _req(x, "x")
    _req(weight, "weight", ndim=1)
    _req(out, "out")
    if not can_round(x, weight, out, fmt) or out.shape != x.shape or weight.shape[0] != x.shape[1]:
        raise ValueError(f"rmsnorm_round({fmt}) cannot take x {x.shape}, weight {weight.shape}, out {out.shape}")
    n, d = x.shape
    if xq.shape != (n, d) or xd.shape != (n, d // XBLOCK[fmt]):
        raise ValueError(f"xq {xq.shape} / xd {xd.shape} do not fit x {x.shape} in {fmt}")
    if n == 0:
        return
    launch(CU, f"rmsnorm_{fmt}", (n,), (_row_block(d // 4),), (x, weight, np.float64(eps), out, xq, xd, np.int32(d)),
           shared_mem=4 * d)


def check_rope_shape(x, name: str, positions, n_rot, channel_scale) -> tuple[int, int, int, int]:
    """Checks of a rope launch on x (n_tok, n_heads, head_dim) -> (n_tok, n_heads, head_dim, n_rot)."""
    _req(x, name, ndim=3)
    _req(positions, "positions", np.int32, ndim=1)
    n_tok, n_heads, hd = x.shape
    if positions.shape[0] != n_tok:
        raise ValueError(f"positions {positions.shape} must have length n_tok={n_tok}")
    n_rot = int(n_rot)
    if n_rot <= 0 or n_rot % 2 or n_rot > hd or n_rot > ROPE_MAX_ROT:
        raise ValueError(f"n_rot={n_rot} must be even and in (0, min(head_dim={hd}, {ROPE_MAX_ROT})]")
    if channel_scale is not None:
        _req(channel_scale, f"{name} channel_scale", ndim=2)
        if channel_scale.shape != (n_heads, hd):
            raise ValueError(f"{name} channel_scale {channel_scale.shape} must be (n_heads, head_dim) = {(n_heads, hd)}")
    return n_tok, n_heads, hd, n_rot


@dataclass(frozen=True)
class RopeTable:
    """cos / sin of rope's angles for positions 0..n_pos-1 (device (n_pos, n_rot // 2, 2) float32), computed
    once by the kernel code rope computes them with, so a table lookup gives the same bits."""
    values: object
    freq_base: float
    n_rot: int
    n_pos: int


def rope_table(freq_base: float, n_rot: int, n_pos: int) -> RopeTable:
    """The table of rope(.., freq_base, n_rot, ..)'s cos / sin for positions < n_pos (one launch)."""
    n_rot, n_pos = int(n_rot), int(n_pos)
    if n_rot <= 0 or n_rot % 2 or n_rot > ROPE_MAX_ROT or n_pos < 1:
        raise ValueError(f"rope_table: n_rot={n_rot} must be even in (0, {ROPE_MAX_ROT}], n_pos={n_pos} >= 1")
    values = cupy().empty((n_pos, n_rot // 2, 2), np.float32)
    launch(CU, "rope_table_f32", (n_pos,), (_row_block(n_rot // 2),),
           (values, np.float64(freq_base), np.int32(n_rot), np.int32(n_pos)))
    return RopeTable(values, float(freq_base), n_rot, n_pos)


def rope_table_args(table: RopeTable | None, freq_base: float, n_rot: int) -> tuple:
    if table is None:
        return NULL_PTR, np.int32(0)
    if (table.freq_base, table.n_rot) != (float(freq_base), n_rot):
        raise ValueError(f"rope table of freq_base={table.freq_base}, n_rot={table.n_rot} used for "
                         f"freq_base={freq_base}, n_rot={n_rot}")
    return table.values, np.int32(table.n_pos)


def rope(x, positions, freq_base: float, n_rot: int, neox: bool, channel_scale=None,
         table: RopeTable | None = None) -> None:
    """Rotary embedding in place on x (n_tok, n_heads, head_dim) at positions (n_tok,) int32 (device).

    theta_i = pos * freq_base**(-2i/n_rot), i < n_rot/2, and cos/sin in double (as the CPU kernel), rounded
    to float; neox pairs (i, i + n_rot/2), else (2i, 2i+1); dims >= n_rot are not rotated. channel_scale
    (n_heads, head_dim) float32 or None: then every channel is multiplied by its factor afterwards.
    table (rope_table of the same freq_base and n_rot) or None: its values for the positions it holds
    (the same bits, without the double-precision pow / cos / sin in the launch)."""
    n_tok, n_heads, hd, n_rot = check_rope_shape(x, "x", positions, n_rot, channel_scale)
    tab = rope_table_args(table, freq_base, n_rot)
    if n_tok == 0:
        return
    block = _row_block(n_heads * (n_rot // 2))
    scale = NULL_PTR if channel_scale is None else channel_scale
    launch(CU, "rope_f32", (n_tok,), (block,),
           (x, positions, np.float64(freq_base), np.int32(n_heads), np.int32(hd), np.int32(n_rot),
            np.int32(bool(neox)), scale, *tab))


def rope_qk(q, k, positions, freq_base: float, n_rot: int, neox: bool, q_scale=None, k_scale=None,
            table: RopeTable | None = None) -> None:
    """rope(q, ..., q_scale) and rope(k, ..., k_scale) of the same tokens in one launch (the same bits)."""
    n_tok, n_q, hd, n_rot = check_rope_shape(q, "q", positions, n_rot, q_scale)
    check_rope_shape(k, "k", positions, n_rot, k_scale)
    if k.shape[2] != hd:
        raise ValueError(f"q {q.shape} and k {k.shape} must share head_dim")
    tab = rope_table_args(table, freq_base, n_rot)
    if n_tok == 0:
        return
    block = _row_block(max(n_q, k.shape[1]) * (n_rot // 2))
    launch(CU, "rope_qk_f32", (n_tok,), (block,),
           (q, k, positions, np.float64(freq_base), np.int32(n_q), np.int32(k.shape[1]), np.int32(hd),
            np.int32(n_rot), np.int32(bool(neox)), NULL_PTR if q_scale is None else q_scale,
            NULL_PTR if k_scale is None else k_scale, *tab))


def silu_mul(gate, up, out) -> None:
    """out = silu(gate) * up = gate / (1 + exp(-gate)) * up; all the same shape; out may alias gate or up."""
    _req(gate, "gate")
    _req(up, "up")
    _req(out, "out")
    if up.shape != gate.shape or out.shape != gate.shape:
        raise ValueError(f"gate {gate.shape}, up {up.shape}, out {out.shape} must match")
    n = gate.size
    if n == 0:
        return
    if _vec4(n, gate, up, out):
        launch(CU, "silu_mul_f32_x4", (cdiv(n // 4, BLOCK),), (BLOCK,), (gate, up, out, np.int64(n // 4)))
    else:
        launch(CU, "silu_mul_f32", (cdiv(n, BLOCK),), (BLOCK,), (gate, up, out, np.int64(n)))


def add(a, b, out) -> None:
    """out = a + b; b is either a's shape or a vector (a.shape[-1],) added to every row (bias).
    out may alias a or b."""
    _req(a, "a")
    _req(b, "b")
    _req(out, "out")
    bias = b.ndim == 1 and a.ndim >= 1 and b.shape[0] == a.shape[-1]
    if (b.shape != a.shape and not bias) or out.shape != a.shape:
        raise ValueError(f"a {a.shape}, b {b.shape}, out {out.shape}: b must be a's shape or (a.shape[-1],)")
    n, nb = a.size, b.size
    if n == 0:
        return
    if _vec4(nb, a, b, out):
        launch(CU, "add_f32_x4", (cdiv(n // 4, BLOCK),), (BLOCK,), (a, b, out, np.int64(n // 4), np.int64(nb // 4)))
    else:
        launch(CU, "add_f32", (cdiv(n, BLOCK),), (BLOCK,), (a, b, out, np.int64(n), np.int64(nb)))


def _copy_rows(x, rows, start, width, out):
    """out[r, :] = x[rows[r] (or r when rows is None), start:start + width]."""
    m, x_cols = out.shape[0], x.shape[1]
    if m == 0 or width == 0:
        return
    src = NULL_PTR if rows is None else rows
    args = (x, src, np.int64(x_cols), np.int64(start), out, np.int32(width))
    if _vec4(x_cols, x, out) and start % 4 == 0 and width % 4 == 0:
        launch(CU, "copy_rows_f32_x4", (m,), (_row_block(width // 4),), args)
    else:
        launch(CU, "copy_rows_f32", (m,), (_row_block(width),), args)


def take_rows(x, rows, out) -> None:
    """out (m, d) = x (n, d)[rows]; rows (m,) int32 on the device, each in [0, n) (checked by the caller
    on the host: the kernel does not check)."""
    _req(x, "x", ndim=2)
    _req(rows, "rows", np.int32, ndim=1)
    _req(out, "out", ndim=2)
    if out.shape != (rows.shape[0], x.shape[1]):
        raise ValueError(f"out {out.shape} must be (len(rows), d) = {(rows.shape[0], x.shape[1])}")
    _copy_rows(x, rows, 0, x.shape[1], out)


def copy_cols(x, start: int, width: int, out) -> None:
    """out (n, width) = x (n, w_total)[:, start:start + width] (one piece of split_cols)."""
    _req(x, "x", ndim=2)
    _req(out, "out", ndim=2)
    start, width = int(start), int(width)
    if start < 0 or width < 0 or start + width > x.shape[1]:
        raise ValueError(f"columns [{start}, {start + width}) out of x's {x.shape[1]}")
    if out.shape != (x.shape[0], width):
        raise ValueError(f"out {out.shape} must be {(x.shape[0], width)}")
    _copy_rows(x, None, start, width, out)
