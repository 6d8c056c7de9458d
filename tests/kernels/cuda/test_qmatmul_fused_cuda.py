"""One-token mat-muls that round their own activations (kernels/cuda/qmatmul_fused.py) against the separate
launches they stand for: rmsnorm + rounding (elementwise.rmsnorm_round) or the rounding alone
(qmatmul.quantize_activations), then qmatmul.matmul_prequantized. Every output, normed float and rounded
activation must be the same bits (the fused kernels run the same device functions in the same order), for every
kernel qmatmul.cu builds, and through the CUDA backend with the fusion on and off."""
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/kernels: test_dequant.random_rows
from test_dequant import random_rows  # noqa: E402

pytestmark = pytest.mark.gpu

EPS = 1e-6


@pytest.fixture(scope="module")
def mods():
    import cupy as cp
    from strata_lite.kernels.cuda import elementwise as ew, qmatmul as qm, qmatmul_fused as qf
    return cp, ew, qm, qf


def _kernel_cases():
    """(kernel, qtype, n_out, n_in, glu, norm) for every fused kernel: 896 inputs (7 warps share the norm's sum of
    squares) for the 32-weight types, 2304 (a whole group of 8 IQ3_XXS blocks and one more) for all; rows that are
    not a multiple of a CTA's."""
    from strata_lite.kernels.cuda.qmatmul import _KNAME
    from strata_lite.kernels.cuda.qmatmul_fused import FUSED_KERNELS
    by_name = {v: k for k, v in _KNAME.items()}
    cases = []
    for name in sorted(FUSED_KERNELS):
        prefix, rest = name.split("_", 1)
        qtype = next(by_name[t] for t in sorted(by_name, key=len, reverse=True) if rest.startswith(t + "_"))
        glu, norm = prefix.endswith("glu"), prefix.startswith("mmn")
        inputs = (896, 2304) if qtype in (QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.IQ4_NL) else (2304,)
        cases += [(name, qtype, 2 * 45 if glu else 45, n_in, glu, norm) for n_in in inputs]
    return cases


CASES = _kernel_cases()


def _weight(qm, qtype, n_out, n_in, seed=3):
    raw = random_rows(qtype, n_out, n_in, seed=seed)
    return qm.upload(SimpleNamespace(name="w", qtype=qtype, n_out=n_out, n_in=n_in, raw=raw))


def _bits(a):
    return a.view(np.uint32) if a.dtype == np.float32 else a


@pytest.mark.parametrize("name,qtype,n_out,n_in,glu,norm", CASES,
                         ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_fused_kernel_gives_the_separate_launches_bits(mods, name, qtype, n_out, n_in, glu, norm):
    cp, ew, qm, qf = mods
    w = _weight(qm, qtype, n_out, n_in)
    rng = np.random.default_rng(n_in + n_out)
    x = cp.asarray((rng.standard_normal((1, n_in)) * 3).astype(np.float32))
    nw = cp.asarray(rng.uniform(0.5, 1.5, n_in).astype(np.float32))
    fmt = qm.act_format(qtype)
    rows = n_out // 2 if glu else n_out
    # the separate launches
    act_ref = qm.ActBuffers(1, n_in)
    xq_ref, xd_ref = act_ref.views(fmt, 1, n_in)
    normed_ref = cp.empty_like(x)
    if norm:
        ew.rmsnorm_round(x, nw, EPS, normed_ref, fmt, xq_ref, xd_ref)
    else:
        qm.quantize_activations(fmt, x, xq_ref, xd_ref)
    out_ref = cp.full((1, rows), np.nan, cp.float32)
    qm.matmul_prequantized(w, xq_ref, xd_ref, out_ref, glu=glu, kernel="dp4a")
    # the fused launch
    act = qm.ActBuffers(1, n_in)
    normed = cp.full_like(x, np.nan)
    out = cp.full((1, rows), np.nan, cp.float32)
    assert qf.matmul_fused(w, x, out, act, norm=(nw, EPS, normed) if norm else None, glu=glu, kernel=name)
    xq, xd = act.views(fmt, 1, n_in)
    np.testing.assert_array_equal(_bits(out.get()), _bits(out_ref.get()))
    np.testing.assert_array_equal(xq.get(), xq_ref.get())
    np.testing.assert_array_equal(_bits(xd.get()), _bits(xd_ref.get()))
    if norm:
        np.testing.assert_array_equal(_bits(normed.get()), _bits(normed_ref.get()))


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q4_K, QType.IQ3_XXS])
def test_fused_epilogues_bias_split_and_residual(mods, qtype):
    """The output epilogues (bias and split outputs after a norm, residual add after a rounding) as the
    separate launches give them."""
    cp, ew, qm, qf = mods
    n_in, widths = 2304, (64, 16, 16)
    w = _weight(qm, qtype, sum(widths), n_in, seed=5)
    rng = np.random.default_rng(9)
    x = cp.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
    nw = cp.asarray(rng.uniform(0.5, 1.5, n_in).astype(np.float32))
    bias = cp.asarray(rng.standard_normal(sum(widths)).astype(np.float32))
    fmt = qm.act_format(qtype)
    act_ref, act = qm.ActBuffers(1, n_in), qm.ActBuffers(1, n_in)
    xq_ref, xd_ref = act_ref.views(fmt, 1, n_in)
    ew.rmsnorm_round(x, nw, EPS, cp.empty_like(x), fmt, xq_ref, xd_ref)
    refs = [cp.empty((1, c), cp.float32) for c in widths]
    qm.matmul_prequantized(w, xq_ref, xd_ref, refs, bias=bias)
    outs = [cp.empty((1, c), cp.float32) for c in widths]
    assert qf.matmul_fused(w, x, outs, act, norm=(nw, EPS, cp.empty_like(x)), bias=bias)
    for got, ref in zip(outs, refs):
        np.testing.assert_array_equal(_bits(got.get()), _bits(ref.get()))
    resid = cp.asarray(rng.standard_normal((1, sum(widths))).astype(np.float32))
    ref, got = resid.copy(), resid.copy()
    qm.matmul(w, x, ref, act_ref, accumulate=True)
    assert qf.matmul_fused(w, x, got, act, accumulate=True, kernel=qf.fused_kernel(w, 1, False, False))
    np.testing.assert_array_equal(_bits(got.get()), _bits(ref.get()))


def test_the_models_one_token_launches_are_fused(mods):
    """The launches a decode step of the 0.5B shape makes (q/k/v, gate + up, attention output, down projection)
    find a fused kernel; more tokens, float weights and the large output matrix do not."""
    cp, ew, qm, qf = mods
    qkv = _weight(qm, QType.Q5_0, 1152, 896)
    gate_up = _weight(qm, QType.Q5_0, 2 * 4864, 896)
    out_proj = _weight(qm, QType.Q5_0, 896, 896)
    down = _weight(qm, QType.Q6_K, 896, 4864)
    assert qf.fused_kernel(qkv, 1, False, True) == "mmn_q5_0_t1_r1_g1"
    assert qf.fused_kernel(gate_up, 1, True, True) == "mmnglu_q5_0_t1_r2_g1"
    assert qf.fused_kernel(out_proj, 1, False, False) == "mmr_q5_0_t1_r1_g1"
    assert qf.fused_kernel(down, 1, False, False) == "mmr_q6_k_t1_r1_g1"
    assert qf.fused_kernel(qkv, 2, False, True) is None
    assert qf.fused_kernel(gate_up, 1, True, False) is None
    head = _weight(qm, QType.Q8_0, 151936, 896)
    assert qf.fused_kernel(head, 1, False, False) is None      # 19K CTAs would each read the row


@pytest.mark.parametrize("fused", [False, True])
def test_backend_defers_the_norm_and_flushes_it(mods, fused, monkeypatch):
    """Through CudaBackend: rmsnorm(round_for=) then the mat-mul, as a block does (one launch when fused), and a
    pending norm launched by any other call (here to_host of its output) give the unfused bits."""
    cp, ew, qm, qf = mods
    from strata_lite.kernels.cuda.backend import CudaBackend
    monkeypatch.setattr(qf, "FUSED_ACT", fused)
    be = CudaBackend()
    be.reserve(max_tokens=4, max_width=2304, n_heads=4, head_dim=64, max_keys=256, n_vocab=64, max_rows=4)
    w = _weight(qm, QType.Q4_K, 96, 2304)
    rng = np.random.default_rng(2)
    x = cp.asarray(rng.standard_normal((1, 2304)).astype(np.float32))
    nw = cp.asarray(rng.uniform(0.5, 1.5, 2304).astype(np.float32))
    fmt = qm.act_format(w.qtype)
    act = qm.ActBuffers(1, 2304)
    xq, xd = act.views(fmt, 1, 2304)
    h_ref = cp.empty_like(x)
    ew.rmsnorm_round(x, nw, EPS, h_ref, fmt, xq, xd)
    y_ref = cp.empty((1, 96), cp.float32)
    qm.matmul_prequantized(w, xq, xd, y_ref)

    h = be.rmsnorm(x, nw, EPS, round_for=w)
    assert (be._pending is not None) == fused
    y = be.qmatmul(w, h)
    assert be._pending is None
    np.testing.assert_array_equal(_bits(y.get()), _bits(y_ref.get()))
    np.testing.assert_array_equal(_bits(h.get()), _bits(h_ref.get()))
    h2 = be.rmsnorm(x, nw, EPS, round_for=w)
    np.testing.assert_array_equal(_bits(be.to_host(h2)), _bits(h_ref.get()))    # flushed first
    assert be._pending is None
