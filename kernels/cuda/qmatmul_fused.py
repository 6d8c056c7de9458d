"""One-token mat-muls that round their own activations (qmatmul.cu act_prologue, kernels mm<n|r>[glu]_...).

A decode step of one sequence is bound by its launches (the 0.5B shape: ~10 a decoder block, each a few µs), and
two or three of a block's launches only prepare a mat-mul's input: rmsnorm + the int8 rounding before q/k/v and
before gate/up (elementwise.cu rmsnorm_q8_0 / _q8_k), the rounding alone before the attention output and the
down projection (qmatmul.cu quant_q8_0 / _q8_k). A fused launch does that work in every CTA of the mat-mul
itself (the token's activations into shared memory), then runs the one-token kernel's own body over them:

  * "n" (matmul_fused with norm=...): rmsnorm + rounding, as rmsnorm_round would, then the mat-mul;
  * "r" (norm=None): the rounding, as quantize_activations would, then the mat-mul.

Every output, and the rounded activations and normed floats that CTA 0 also writes where the separate launches
would have left them, are the separate launches' bits (the same device functions in the same order; GPU tests
compare them). The kernel is the one matmul_prequantized would take for that launch (dp4a_variant), so the
choice between the two paths never changes a result. Only one token: larger launches keep the separate rounding
(their CTAs would each round every token's row).

FUSED_ACT (env STRATA_LITE_CUDA_FUSED_ACT=0 turns it off; benchmarks switch it for A/B runs) says whether the CUDA
backend takes these launches (backend.py).
"""
from __future__ import annotations

import os
import re

import numpy as np
from gguf import GGMLQuantizationType as QType

from . import qmatmul as qm
from .runtime import cdiv, launch, sm_count

FUSED_ACT = os.environ.get("STRATA_LITE_CUDA_FUSED_ACT", "1") != "0"
# Each CTA of a fused launch reads the token's whole input row (k floats); a launch whose CTAs would read more
# than this in all (CTAs x 4k bytes: the 0.5B shape's output matrix, 19K CTAs over 896 inputs, ~68 MB) keeps
# the separate rounding, which reads the row once.
FUSED_MAX_BYTES = 4 << 20
NULL_PTR = np.uint64(0)
_TYPES = (QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.IQ4_NL, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ3_XXS)
# the kernels qmatmul.cu builds (MM_FUSED_KERNELS, MM_FUSED_Q, MM_FUSED_IQ3): one-token bodies of one or two rows
# a warp (dense, "n" and "r"), two-row GLU pairs ("n"), and IQ3_XXS's four-row GLU and group-loop kernels
FUSED_KERNELS = frozenset(
    [f"mm{mode}_{qm._KNAME[t]}_t1_r{rw}_g1" for t in _TYPES for mode in "nr" for rw in (1, 2)]
    + [f"mmnglu_{qm._KNAME[t]}_t1_r2_g1" for t in _TYPES]
    + ["mmnglu_iq3_xxs_t1_r4_g1"]
    + [f"mm{mode}_iq3_xxs_t1_r2_gw{mb}" for mode in "nr" for mb in ("", "_m4")]
    + [f"mmnglu_iq3_xxs_t1_r4_gw{mb}" for mb in ("", "_m4")])


def norm_threads(d: int) -> int:
    """Threads of the rmsnorm launch a fused "n" launch stands for (elementwise.py _row_block(d // 4)): its sum of
    squares is split over that many threads, whose order the fused kernel repeats."""
    return min(256, max(32, cdiv(d // 4, 32) * 32))


def fused_kernel(w: qm.DeviceWeight, n_tok: int, glu: bool, norm: bool) -> str | None:
    """The fused kernel standing for the launch matmul_prequantized makes for n_tok tokens of w (glu: a GLU
    launch; norm: an "n" kernel, else "r"), or None where there is none: more or fewer than one token, float
    weights, the split-K kernel, a GLU launch without a norm, a variant without a fused twin, or a grid whose CTAs
    would read more than FUSED_MAX_BYTES of input."""
    if n_tok != 1 or qm.act_format(w.qtype) is None or (glu and not norm):
        return None
    if qm.split_k(w.qtype, w.n_out, w.n_in, 1, glu):
        return None
    _, rw, g, *mb = qm.dp4a_variant(w.qtype, 1, glu, w.n_out, 1, sm_count(w.raw.device.id))
    name = (f"mm{'n' if norm else 'r'}{'glu' if glu else ''}_{qm._KNAME[QType(int(w.qtype))]}_t1_r{rw}_g{g}"
            + "".join(f"_m{b}" for b in mb))
    ctas = cdiv(qm._launch_warps(w.n_out, rw, glu), qm.WARPS_PER_CTA)
    return name if name in FUSED_KERNELS and ctas * 4 * w.n_in <= FUSED_MAX_BYTES else None


def matmul_fused(w: qm.DeviceWeight, x, out, act: qm.ActBuffers, norm=None, bias=None, accumulate: bool = False,
                 glu: bool = False, kernel: str | None = None) -> bool:
    """out = (x rounded, after rmsnorm if norm) @ W.T in one launch, x (1, w.n_in) float32 (16-byte aligned);
    out, bias, accumulate, glu as qm.matmul_prequantized. norm: (weight (n_in,), eps, normed (1, n_in)) whose
    normed floats are written as rmsnorm would (normed must not be x). The rounded activations are left in act's
    views as the separate launches leave them. kernel: the fused kernel's name (default: fused_kernel's choice).
    -> False, having launched nothing, where there is no fused kernel for this launch (the caller then takes the
    separate launches)."""
    n, k = qm._x_shape(x)
    name = kernel or fused_kernel(w, n, glu, norm is not None)
    if name is None:
        return False
    if name not in FUSED_KERNELS:
        raise ValueError(f"no fused kernel {name!r}")
    fmt = qm.act_format(w.qtype)
    pitch = qm._check_weight(w)
    qm._check("x", x, (1, w.n_in), np.float32, align=16)
    xq, xd = act.views(fmt, 1, w.n_in)
    outs = qm._out_args(w, 1, out, bias, accumulate, glu)
    if norm is None:
        nw, eps, nthr, xn = NULL_PTR, 0.0, 0, NULL_PTR
    else:
        nw, eps, xn = norm
        qm._check("norm weight", nw, (w.n_in,), np.float32, align=16)
        qm._check("normed", xn, (1, w.n_in), np.float32, align=16)
        if xn.data.ptr == x.data.ptr:
            raise ValueError("the normed output must not alias x (other CTAs still read x)")
        nthr = norm_threads(w.n_in)
    rw = int(re.search(r"_t1_r(\d+)_", name).group(1))
    warps = qm._launch_warps(w.n_out, rw, glu)
    launch(qm.CU, name, (cdiv(warps, qm.WARPS_PER_CTA), 1), (32, qm.WARPS_PER_CTA),
           (w.raw, np.int32(pitch), np.int32(w.n_out), np.int32(k), x, nw, np.float64(eps), np.int32(nthr), xn,
            xq, xd, *outs),
           shared_mem=k + 4 * (k // qm.XBLOCK[fmt]))
    return True
