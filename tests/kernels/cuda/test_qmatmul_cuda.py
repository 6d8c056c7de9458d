"""CUDA quantized mat-mul, activation rounding and row dequantization (kernels/cuda/qmatmul.py) against
float64 numpy references, gguf.quants and the CPU backend's activation rounding.

Mat-mul tolerance: the kernel rounds x exactly as tests/act_reference.py does (checked bit for bit below),
dots int8 weights with int8 activations exactly (integers), and rounds only when scaling each superblock's
integer sum (a couple of float32 products per 32-weight unit, or per 256-weight block for IQ3_XXS and Q6_K)
and adding the partial sums (at most n_in/32 + 5 additions). The float64 reference uses gguf's float32 weights, which round d*sc*q - dmin*m per weight in
another order. Both errors are ~2**-24 relative per term and add up like a random walk, so
|err| ~ sqrt(n_in) * 2**-24 * sum_k |x_k W_k| (~2e-6 of it at n_in = 1024); we allow 3e-5 of it (>10x
that; any indexing, nibble or scale bug gives errors of order 1 of it). Float weights: n_in float32 fmas
per output, the same bound.
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/kernels: test_dequant.random_rows
from act_reference import round_like_ggml  # noqa: E402
from test_dequant import random_rows  # noqa: E402

pytestmark = pytest.mark.gpu

QUANT_TYPES = [QType.IQ3_XXS, QType.IQ4_NL, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q4_0, QType.Q5_0, QType.Q8_0]
FLOAT_TYPES = [QType.F16, QType.BF16, QType.F32]
ALL_TYPES = QUANT_TYPES + FLOAT_TYPES
N_TOKENS = [1, 2, 3, 8, 9, 16, 17, 40]
RTOL = 3e-5


@pytest.fixture(scope="module")
def qm():
    from strata_lite.kernels.cuda import qmatmul
    return qmatmul


def _shapes(qtype):
    """(n_out, n_in): row counts that are not multiples of the CTA's 8 rows; for 32-blocks n_in not a
    multiple of 256; for float types n_in not a multiple of 32."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    if bs == 256:
        return [(37, 512), (6, 1280)]
    if bs == 32:
        return [(37, 160), (70, 1056)]
    return [(37, 168), (5, 1024)]


def _weight(qm, qtype, n_out, n_in, seed):
    raw = random_rows(qtype, n_out, n_in, seed=seed)
    w = qm.upload(SimpleNamespace(name=f"w{seed}", qtype=qtype, n_out=n_out, n_in=n_in, raw=raw))
    return w, raw


def _x(n, k, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal((n, k)) * scale).astype(np.float32)


def _rounded(cp, qm, qtype, x_host):
    """x (n, k) host float32 -> (xq, xd): on the device, rounded for a qtype mat-mul."""
    fmt = qm.act_format(qtype)
    n, k = x_host.shape
    xq = cp.empty((n, k), cp.int8)
    xd = cp.empty((n, k // qm.XBLOCK[fmt]), cp.float32)
    qm.quantize_activations(fmt, cp.asarray(x_host), xq, xd)
    return xq, xd


def _run(cp, qm, w, x_host, act):
    x = cp.asarray(x_host)
    out = cp.full((x_host.shape[0], w.n_out), np.nan, dtype=cp.float32)
    qm.matmul(w, x, out, act)
    return out.get()


def _check_vs_float64(qtype, raw, x_host, got):
    w64 = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    xr = round_like_ggml(qtype, x_host).astype(np.float64)
    ref = xr @ w64.T
    scale = np.abs(xr) @ np.abs(w64).T
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(np.isfinite(got))
    assert np.all(err <= RTOL * scale + 1e-30), f"max err / scale {np.max(err / (scale + 1e-300)):.3g}"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64(cp, qm, qtype):
    act = qm.ActBuffers(40, 1280)
    for si, (n_out, n_in) in enumerate(_shapes(qtype)):
        w, raw = _weight(qm, qtype, n_out, n_in, seed=10 * si + int(qtype))
        for n in N_TOKENS:
            x = _x(n, n_in, seed=1000 * si + n)
            _check_vs_float64(qtype, raw, x, _run(cp, qm, w, x, act))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_batch_invariant(cp, qm, qtype):
    """Each token of a 40-token launch is bit-equal to a launch with that token alone, and to 3-token
    launches (other token tile sizes and slots; the tensor-core kernel's equality with these is
    test_tensor_core_kernel_equals_dp4a_bit_for_bit)."""
    n_out, n_in = _shapes(qtype)[1]
    w, _ = _weight(qm, qtype, n_out, n_in, seed=3)
    act = qm.ActBuffers(40, n_in)
    x = _x(40, n_in, seed=4)
    x[5] *= 1e3                                     # neighbours of very different size must not matter
    full = _run(cp, qm, w, x, act)
    for i in range(40):
        assert np.array_equal(full[i], _run(cp, qm, w, x[i:i + 1], act)[0]), f"token {i}"
    for i in range(0, 38, 7):
        assert np.array_equal(full[i:i + 3], _run(cp, qm, w, x[i:i + 3], act))


def _assert_equals_dp4a(cp, qm, qtype, w, raw, x, launch):
    """The launch (matmul_prequantized keywords naming a kernel) gives the dp4a kernel's bits on x, plain and
    GLU; its plain outputs also pass the float64 check."""
    xq, xd = _rounded(cp, qm, qtype, x)
    n = x.shape[0]
    for glu in (False, True):
        got = {}
        for name, kw in (("dp4a", dict(kernel="dp4a")), ("other", launch)):
            out = cp.full((n, w.n_out // 2 if glu else w.n_out), np.nan, dtype=cp.float32)
            qm.matmul_prequantized(w, xq, xd, out, glu=glu, **kw)
            got[name] = out.get()
        differ = np.count_nonzero(got["other"].view(np.uint32) != got["dp4a"].view(np.uint32))
        assert differ == 0, f"{launch} {w.n_out}x{w.n_in} n={n} glu={glu}: {differ} outputs differ"
        if not glu:
            _check_vs_float64(qtype, raw, x, got["other"])


def _tile_edge_cases(qm, qtype, seed):
    """(w, raw, x) on two shapes that do not fill the tensor-core kernels' tiles: rows that do not fill a CTA,
    several units per lane class (n_in / unit > 32) and fewer; 37 tokens, token 3 1e3 times larger than its
    neighbours. Weights seeded seed + i, activations seed + 1 + i for shape i."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    shapes = [(70, 4608), (46, 256)] if bs == 256 else [(70, 2400), (46, 896)]
    for si, (n_out, n_in) in enumerate(shapes):
        w, raw = _weight(qm, qtype, n_out, n_in, seed=seed + si)
        x = _x(37, n_in, seed=seed + 1 + si)
        x[3] *= 1e3
        yield w, raw, x


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("mma", [(4, 1), (2, 4), (4, 4)], ids=lambda v: f"w{v[0]}n{v[1]}")
def test_tensor_core_kernel_equals_dp4a_bit_for_bit(cp, qm, qtype, mma):
    """The tensor-core kernel replays the dp4a kernel's order of float operations exactly, plain and GLU, in
    every variant (warps per CTA, token tiles per warp): rows and tokens that do not fill its tiles (whole
    warps past the last token), several units per lane class (n_in / unit > 32) and fewer (28 of 32 classes
    used; 4 of 32 for the 256-weight types: steps with fewer units than warps), a token 1e3 times larger
    than its neighbours."""
    assert mma in qm.MMA_VARIANTS
    for w, raw, x in _tile_edge_cases(qm, qtype, seed=40):
        _assert_equals_dp4a(cp, qm, qtype, w, raw, x, dict(kernel="mma", mma=mma))


@pytest.mark.parametrize("qtype", [QType.IQ3_XXS, QType.Q4_K, QType.Q5_K], ids=lambda t: t.name)
def test_64_token_candidates_equal_dp4a_bit_for_bit(cp, qm, qtype):
    """The 64-token candidates (qmatmul.MMA_64_CANDIDATES: IQ3_XXS's 2 x 4 under a minimum of 6 CTAs an SM, Q4_K
    and Q5_K's 4 x 2 variant) give the dp4a kernel's bits, plain and GLU, on the tensor-core test's shapes."""
    for mma in qm.MMA_64_CANDIDATES[qtype].values():
        for w, raw, x in _tile_edge_cases(qm, qtype, seed=60):
            _assert_equals_dp4a(cp, qm, qtype, w, raw, x, dict(kernel="mma", mma=mma))


# (type, warps, build) of the small-token kernels compiled (qmatmul.SMALL_TYPES, SMALL_WARPS; the explore build's
# SMALL_EXPLORE_WARPS)
SMALL_CASES = [(qt, nk, "default") for qt in (QType.Q4_K, QType.Q5_K, QType.Q8_0) for nk in (4, 8)] + \
    [(qt, nk, "explore") for qt, nk in ((QType.Q6_K, 4), (QType.IQ3_XXS, 4))]


@pytest.mark.parametrize("qtype,nk,build", SMALL_CASES, ids=[f"{qt.name}-w{nk}-{b}" for qt, nk, b in SMALL_CASES])
def test_small_token_kernel_equals_dp4a_bit_for_bit(cp, qm, qtype, nk, build):
    """The small-token tensor-core kernel (warps splitting the unit groups, group sums folded in order)
    gives the dp4a kernel's bits, plain and GLU: one token, a partial tile (9), three tiles with a partial
    last one (37), rows that do not fill the CTA, several units per group and groups without units (the
    shapes of the tensor-core test), a token 1e3 times larger than its neighbours."""
    for w, raw, x in _tile_edge_cases(qm, qtype, seed=50):
        for n in (1, 9, 37):
            _assert_equals_dp4a(cp, qm, qtype, w, raw, x[:n], dict(kernel="small", small=nk, build=build))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_extreme_activations(cp, qm, qtype):
    """Large magnitudes, tiny ones, all-zero quantization blocks and an all-zero token."""
    n_out, n_in = _shapes(qtype)[1]
    w, raw = _weight(qm, qtype, n_out, n_in, seed=7)
    x = _x(6, n_in, seed=8)
    x[0] *= 1e4
    x[1] *= 1e-5
    x[2, :256] = 0                                  # zero blocks of both activation formats
    x[3] = 0
    x[4, 37] = 3e4                                  # one outlier dominating its blocks' scales
    got = _run(cp, qm, w, x, qm.ActBuffers(8, n_in))
    assert np.all(got[3] == 0)
    _check_vs_float64(qtype, raw, x, got)


@pytest.mark.parametrize("fmt,qtype", [("q8_0", QType.Q8_0), ("q8_k", QType.Q4_K)])
@pytest.mark.parametrize("scale", [1.0, 1e-5, 3e-6, 1e3])
def test_quantize_activations_bit_exact(cp, qm, fmt, qtype, scale):
    from strata_lite.kernels.cpu.act_quant import round_activations
    xb = qm.XBLOCK[fmt]
    x = _x(7, 1024, seed=int(scale * 1e6) % 1000) * np.float32(scale)
    x[0, :256] = 0                                  # all-zero blocks
    x[1, 10], x[1, 100] = -5 * scale, 5 * scale     # ties of |x|: the first (negative) one sets the q8_k scale
    x[1, 11:100] = 0
    x[2, 3] = 0.5 * np.float32(scale)               # values near rounding ties
    xq = cp.full((7, 1024), 0x7f, dtype=cp.int8)
    xd = cp.full((7, 1024 // xb), np.nan, dtype=cp.float32)
    qm.quantize_activations(fmt, cp.asarray(x), xq, xd)
    q, d = xq.get(), xd.get()
    values = q.astype(np.float32) * np.repeat(d, xb, axis=1)
    want = round_activations(qtype, x)
    assert np.array_equal(values.view(np.uint32), want.view(np.uint32)) or np.array_equal(values, want)
    # the scales themselves, as ggml computes them
    b = x.reshape(7, -1, xb)
    if fmt == "q8_0":
        want_d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float16).astype(np.float32)
    else:
        mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0]
        with np.errstate(divide="ignore"):
            want_d = np.where(mx != 0, np.float32(1) / (np.float32(-127) / mx), 0).astype(np.float32)
        assert d[1, 0] > 0                          # mx = -5 * scale: iscale > 0
    assert np.array_equal(d, want_d)
    assert np.abs(q.astype(np.int32)).max() <= 127


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_prequantized_reuses_one_quantization(cp, qm, qtype):
    fmt = qm.act_format(qtype)
    n_out, n_in = _shapes(qtype)[0]
    w, raw = _weight(qm, qtype, n_out, n_in, seed=11)
    if fmt is None:
        assert qtype in FLOAT_TYPES
        with pytest.raises(ValueError):
            qm.matmul_prequantized(w, cp.zeros((1, n_in), cp.int8), cp.zeros((1, n_in // 32), cp.float32),
                                   cp.zeros((1, n_out), cp.float32))
        return
    x = _x(5, n_in, seed=12)
    xq, xd = qm.ActBuffers(5, n_in).views(fmt, 5, n_in)
    qm.quantize_activations(fmt, cp.asarray(x), xq, xd)
    out = cp.full((5, n_out), np.nan, dtype=cp.float32)
    qm.matmul_prequantized(w, xq, xd, out)
    assert np.array_equal(out.get(), _run(cp, qm, w, x, qm.ActBuffers(5, n_in)))
    _check_vs_float64(qtype, raw, x, out.get())


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequant_rows_bit_exact(cp, qm, qtype):
    for si, (n_out, n_in) in enumerate(_shapes(qtype)):
        w, raw = _weight(qm, qtype, n_out, n_in, seed=20 + si)
        ids = np.array([3, 0, 3, n_out - 1, 1, 2], dtype=np.int32)
        out = cp.full((ids.size, n_in), np.nan, dtype=cp.float32)
        qm.dequant_rows(w, cp.asarray(ids), out)
        want = gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False)[ids]
        assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32))


def test_dequant_rows_bad_id_gives_nan(cp, qm):
    w, raw = _weight(qm, QType.Q6_K, 4, 256, seed=1)
    out = cp.zeros((2, 256), dtype=cp.float32)
    qm.dequant_rows(w, cp.asarray(np.array([1, 4], dtype=np.int32)), out)
    got = out.get()
    assert np.array_equal(got[0], gguf.quants.dequantize(raw, QType.Q6_K)[1]) and np.all(np.isnan(got[1]))


def test_concat_rows(cp, qm):
    qtype, n_in = QType.Q4_K, 512
    (a, _), (b, _) = _weight(qm, qtype, 5, n_in, seed=1), _weight(qm, qtype, 7, n_in, seed=2)
    ab = qm.concat_rows([a, b])
    assert (ab.n_out, ab.n_in, ab.qtype) == (12, n_in, qtype)
    act = qm.ActBuffers(3, n_in)
    x = _x(3, n_in, seed=5)
    assert np.array_equal(_run(cp, qm, ab, x, act), np.concatenate([_run(cp, qm, a, x, act), _run(cp, qm, b, x, act)], 1))
    c, _ = _weight(qm, QType.Q6_K, 5, n_in, seed=3)
    d, _ = _weight(qm, qtype, 5, 2 * n_in, seed=4)
    assert qm.concat_rows([a, c]) is None and qm.concat_rows([a, d]) is None and qm.concat_rows([]) is None


@pytest.mark.parametrize("qtype", [QType.Q6_K, QType.Q8_0, QType.Q5_0, QType.Q4_0, QType.IQ4_NL, QType.IQ3_XXS],
                         ids=lambda t: t.name)
def test_repacked_types_upload_in_their_device_layout(cp, qm, monkeypatch, qtype):
    """upload converts the rows on the device in chunks (layouts.to_device with cupy) to the bytes the numpy
    conversion gives (tests/kernels/test_cuda_layouts.py checks those against gguf), rows padded to 16 bytes,
    and from_device on the device gives the file's rows back."""
    from strata_lite.kernels.cuda import layouts
    n_in = 4864 if qtype != QType.IQ3_XXS else 256 * 19        # 19 blocks of 256 weights (a short last group), 152 of 32
    raw = random_rows(qtype, 29, n_in, seed=8)
    monkeypatch.setattr(layouts, "CHUNK_BYTES", 4 * raw.shape[1])     # 8 chunks, the last one short
    w = qm.upload(SimpleNamespace(name="w", qtype=qtype, n_out=29, n_in=n_in, raw=raw))
    assert w.raw.shape == (29, layouts.device_row_bytes(qtype, n_in)) and w.raw.shape[1] % 16 == 0
    assert np.array_equal(w.raw.get(), layouts.to_device(qtype, raw))
    assert np.array_equal(layouts.from_device(qtype, w.raw, n_in, cp).get(), raw)


def test_act_format(qm):
    assert [qm.act_format(t) for t in (QType.Q8_0, QType.IQ4_NL, QType.Q6_K, QType.IQ3_XXS, QType.F16)] == \
        ["q8_0", "q8_0", "q8_k", "q8_k", None]


def test_upload_readonly_and_bad_shapes(cp, qm):
    from strata_lite.kernels.cuda import layouts
    raw = random_rows(QType.Q8_0, 3, 64)
    raw.flags.writeable = False
    w = qm.upload(SimpleNamespace(name="w", qtype=QType.Q8_0, n_out=3, n_in=64, raw=raw))
    assert w.raw.shape == (3, 80) and np.array_equal(w.raw.get(), layouts.to_device(QType.Q8_0, raw))
    with pytest.raises(ValueError):
        qm.upload(SimpleNamespace(name="w", qtype=QType.Q8_0, n_out=3, n_in=96, raw=raw))
    act = qm.ActBuffers(4, 64)
    out = cp.zeros((2, 3), cp.float32)
    for x, o in [(cp.zeros((2, 96), cp.float32), out), (cp.zeros((2, 64), cp.float64), out),
                 (cp.zeros((2, 64), cp.float32), cp.zeros((2, 4), cp.float32)),
                 (cp.zeros((5, 64), cp.float32), cp.zeros((5, 3), cp.float32)),     # more tokens than act holds
                 (cp.zeros((64, 2), cp.float32).T, out)]:
        with pytest.raises(ValueError):
            qm.matmul(w, x, o, act)


# ---------------------------------------------------------------------------- fused output epilogues
# The mat-mul can write its rows split into pieces with a bias, add them to what the output holds (the
# residual) or, for a gate+up weight, write silu(gate) * up; the bits must be those of the separate ops
# (mat-mul, then the element-wise kernels), on both kernels, for any token count.

def _unfused(cp, qm, w, x, act):
    from strata_lite.kernels.cuda import elementwise as ew
    y = cp.asarray(_run(cp, qm, w, x, act))
    return y, ew


@pytest.mark.parametrize("qtype", [QType.IQ3_XXS, QType.Q4_K, QType.Q6_K, QType.Q5_0, QType.Q8_0, QType.F16],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 8, 70])
def test_fused_outputs_equal_separate_ops(cp, qm, qtype, n):
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    n_in = 512 if bs == 256 else 896
    n_out = 432                                     # split 3 ways / halved for GLU; 70 tokens: tensor cores
    w, _ = _weight(qm, qtype, n_out, n_in, seed=50)
    act = qm.ActBuffers(70, n_in)
    x = _x(n, n_in, seed=51)
    y, ew = _unfused(cp, qm, w, x, act)
    xd = cp.asarray(x)
    # split + bias: the separate path adds the bias, then copies the column pieces
    bias = cp.asarray(_x(1, n_out, seed=52)[0])
    ref = cp.empty_like(y)
    ew.add(y, bias, ref)
    widths = (216, 72, 144)
    outs = [cp.full((n, c), np.nan, cp.float32) for c in widths]
    qm.matmul(w, xd, outs, act, bias=bias)
    assert np.array_equal(np.concatenate([o.get() for o in outs], 1).view(np.uint32), ref.get().view(np.uint32))
    # residual add in place
    resid = cp.asarray(_x(n, n_out, seed=53))
    ref = cp.empty_like(y)
    ew.add(resid, y, ref)
    qm.matmul(w, xd, resid, act, accumulate=True)
    assert np.array_equal(resid.get().view(np.uint32), ref.get().view(np.uint32))
    # GLU: silu(gate) * up of the row halves
    half = n_out // 2
    g, u = cp.ascontiguousarray(y[:, :half]), cp.ascontiguousarray(y[:, half:])
    ref = cp.empty_like(g)
    ew.silu_mul(g, u, ref)
    out = cp.full((n, half), np.nan, cp.float32)
    qm.matmul(w, xd, out, act, glu=True)
    assert np.array_equal(out.get().view(np.uint32), ref.get().view(np.uint32))


@pytest.mark.parametrize("qtype", [QType.IQ3_XXS, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q5_0, QType.Q8_0],
                         ids=lambda t: t.name)
def test_every_dp4a_variant_gives_the_same_bits(cp, qm, qtype):
    """Rows per warp, units in flight and warps per row (split-K) change the work split, never an output:
    every compiled variant (the benchmark build's included) equals the default launch bit for bit."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    n_out, n_in = (37, 4608) if bs == 256 else (37, 2400)   # odd rows; lane classes with 4-5 units
    w, _ = _weight(qm, qtype, n_out, n_in, seed=60)
    xq, xd = _rounded(cp, qm, qtype, _x(16, n_in, seed=61))
    ref = cp.full((16, n_out), np.nan, cp.float32)
    qm.matmul_prequantized(w, xq, xd, ref, kernel="dp4a")
    ref = ref.get()
    default = {qm.dp4a_variant(t, tile, n_out=rows) for t in QUANT_TYPES for tile in qm.TOKEN_TILES
               for rows in (None, n_out)}                  # over few rows: one row a warp at 1-2 tokens
    default = sorted({v for v in default if v[2] != qm.PER_TOKEN}
                     | set(qm.PER_TOKEN_VARIANTS if qtype in qm.PER_TOKEN_TYPES else ()), key=str)
    for build, variants in (("default", default), ("explore", qm.EXPLORE_VARIANTS + qm.EXPLORE_MB_VARIANTS)):
        for variant in variants:
            for n in sorted({1, variant[0], 8, 16}):
                out = cp.full((n, n_out), np.nan, cp.float32)
                qm.matmul_prequantized(w, xq[:n], xd[:n], out, variant=variant, build=build)
                assert np.array_equal(out.get().view(np.uint32), ref[:n].view(np.uint32)), (build, variant, n)
    for n in range(1, qm.SPLIT_K_MAX_TOKENS + 1):     # the split-K kernel (up to 4 tokens)
        out = cp.full((n, n_out), np.nan, cp.float32)
        qm.matmul_prequantized(w, xq[:n], xd[:n], out, variant="sk")
        assert np.array_equal(out.get().view(np.uint32), ref[:n].view(np.uint32)), ("sk", n)


@pytest.mark.parametrize("qtype", [QType.IQ3_XXS, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q5_0],
                         ids=lambda t: t.name)
def test_every_glu_variant_gives_the_same_bits(cp, qm, qtype):
    """GLU warps of one gate-up row pair or two (the default build's, the benchmark build's) give the default
    launch's bits, with an odd number of gate rows (the second pair of the last warp has no gate row)."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    n_out, n_in = (2 * 37, 4608) if bs == 256 else (2 * 37, 2400)
    w, _ = _weight(qm, qtype, n_out, n_in, seed=66)
    xq, xd = _rounded(cp, qm, qtype, _x(16, n_in, seed=67))
    ref = cp.full((16, n_out // 2), np.nan, cp.float32)
    qm.matmul_prequantized(w, xq, xd, ref, kernel="dp4a", glu=True)
    ref = ref.get()
    default = sorted({qm.dp4a_variant(qtype, tile, glu=True) for tile in qm.TOKEN_TILES}
                     | set(qm.PER_TOKEN_GLU_VARIANTS if qtype in qm.PER_TOKEN_TYPES else ()), key=str)
    for build, variants in (("default", default), ("explore", qm.EXPLORE_GLU_VARIANTS + qm.EXPLORE_MB_VARIANTS)):
        for variant in variants:
            for n in sorted({1, variant[0], 8, 16}):
                out = cp.full((n, n_out // 2), np.nan, cp.float32)
                qm.matmul_prequantized(w, xq[:n], xd[:n], out, glu=True, variant=variant, build=build)
                assert np.array_equal(out.get().view(np.uint32), ref[:n].view(np.uint32)), (build, variant, n)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_warps_per_cta_give_the_same_bits(cp, qm, monkeypatch, qtype):
    """Every warp keeps its rows' sums to itself, so 4 warps a CTA give the bits of 8 (dense and GLU, 1, 2, 4, 8
    and 13 tokens, the one-token loops, IQ3_XXS's group loop on a grid that fits one wave included)."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    n_out, n_in = (2 * 37, 4608) if bs == 256 else (2 * 37, 2400) if bs == 32 else (2 * 37, 1032)
    w, _ = _weight(qm, qtype, n_out, n_in, seed=70)
    act = qm.ActBuffers(13, n_in)
    for glu in (False, True):
        width = n_out // 2 if glu else n_out
        for n in (1, 2, 4, 8, 13):
            x = cp.asarray(_x(n, n_in, seed=71 + n))
            got = {}
            for warps in (8, 4):
                monkeypatch.setattr(qm, "WARPS_PER_CTA", warps)
                monkeypatch.setattr(qm, "GRID_TABLE_TILE1_WARPS", warps)
                out = cp.full((n, width), np.nan, cp.float32)
                qm.matmul(w, x, out, act, glu=glu)
                got[warps] = out.get()
            assert np.all(np.isfinite(got[8])), (glu, n)
            assert np.array_equal(got[4].view(np.uint32), got[8].view(np.uint32)), (glu, n)


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_row_tiles_give_the_same_bits(cp, qm, qtype):
    """The explore build's float kernels over 4 or 8 rows a warp (dense and GLU, the last warp's rows past the
    matrix clamped) equal the default launch bit for bit, at 1, 8 and 13 tokens (a partial second tile)."""
    n_out, n_in = 2 * 37, 1032                      # 37 gate rows: the last GLU warps hold rows past the end
    w, _ = _weight(qm, qtype, n_out, n_in, seed=68)
    act = qm.ActBuffers(13, n_in)
    for glu in (False, True):
        width = n_out // 2 if glu else n_out
        for n in (1, 8, 13):
            x = cp.asarray(_x(n, n_in, seed=69 + n))
            ref = cp.full((n, width), np.nan, cp.float32)
            qm.matmul(w, x, ref, act, glu=glu)
            for rows in qm.EXPLORE_FLOAT_ROWS:
                out = cp.full((n, width), np.nan, cp.float32)
                qm.matmul(w, x, out, act, glu=glu, rows=rows, build="explore")
                assert np.array_equal(out.get().view(np.uint32), ref.get().view(np.uint32)), (glu, n, rows)
    with pytest.raises(ValueError, match="rows takes float weights"):
        qm.matmul(w, x, out, act, rows=4)           # the default build has no such kernel


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_out,n_in", [(37, 2304), (10, 14336)])
@pytest.mark.parametrize("n_tok", [1, 3, 4])
def test_split_k_equals_one_warp_per_row(cp, qm, qtype, n_out, n_in, n_tok):
    """The split-K kernel (every type, 1-4 tokens) against mm_q's kernel of one token a tile, bit for bit,
    with the fused bias and residual add: rows of 72 and 448 32-weight units (rounds not a multiple of 8
    warps); more than 4 tokens and GLU are refused."""
    w, _ = _weight(qm, qtype, n_out, n_in, seed=62)
    xq, xd = _rounded(cp, qm, qtype, _x(n_tok, n_in, seed=63))
    bias = cp.asarray(_x(1, n_out, seed=64)[0])
    resid = _x(n_tok, n_out, seed=65)
    ref, out = cp.asarray(resid), cp.asarray(resid)
    qm.matmul_prequantized(w, xq, xd, ref, bias=bias, accumulate=True, variant=(1, 1, 1))
    qm.matmul_prequantized(w, xq, xd, out, bias=bias, accumulate=True, variant="sk")
    assert np.array_equal(out.get().view(np.uint32), ref.get().view(np.uint32))
    if n_out % 2 == 0:
        with pytest.raises(ValueError, match="split-K"):
            qm.matmul_prequantized(w, xq, xd, cp.empty((n_tok, n_out // 2), cp.float32), glu=True, variant="sk")
    if n_tok == 4:
        x5q, x5d = _rounded(cp, qm, qtype, _x(5, n_in, seed=66))
        with pytest.raises(ValueError, match="split-K"):
            qm.matmul_prequantized(w, x5q, x5d, cp.empty((5, n_out), cp.float32), variant="sk")



@pytest.mark.parametrize("build", ["default", "unit_tails"])
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q5_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_out,n_in", [(37, 2304), (6, 4864), (2 * 19, 4096)])
def test_q4_k_builds_give_one_set_of_bits_each(cp, qm, qtype, n_out, n_in, build):
    """Each build's Q4_K / Q5_K kernels (the default: blocks summed as integers before one float tail;
    unit_tails: each 64-weight unit its own tail): every token of 16-token launches through its dp4a, small-token
    and tensor-core kernels, and its one-token launches (dp4a and split-K), give one set of bits; rows not a
    multiple of the CTA's rows (dense) or of 2 gate rows (GLU: 19 gate rows), rows of 9, 19 (lanes without a block
    in the last round) and 16 blocks, with the fused bias and residual add (mm_q_tok's 4- and 8-token kernels too,
    and for the default build mm_q1's one-token kernels of the explore build); and each matches float64."""
    w, raw = _weight(qm, qtype, n_out, n_in, seed=70)
    x_host = _x(16, n_in, seed=71)
    xq, xd = _rounded(cp, qm, qtype, x_host)
    bias = cp.asarray(_x(1, n_out, seed=72)[0])
    resid = cp.asarray(_x(1, n_out, seed=73))
    for glu in (False, True):
        if glu and n_out % 2:
            continue
        width = n_out // 2 if glu else n_out
        many = {}
        for kernel in ("dp4a", "small", "mma"):
            many[kernel] = cp.full((16, width), np.nan, cp.float32)
            qm.matmul_prequantized(w, xq, xd, many[kernel], glu=glu, kernel=kernel, build=build)
        for kernel in ("small", "mma"):
            assert np.array_equal(many[kernel].get().view(np.uint32), many["dp4a"].get().view(np.uint32)), kernel
        for variant in (qm.PER_TOKEN_GLU_VARIANTS if glu else qm.PER_TOKEN_VARIANTS):   # integer parts token by token
            tok = cp.full((16, width), np.nan, cp.float32)
            qm.matmul_prequantized(w, xq, xd, tok, glu=glu, variant=variant, build=build)
            assert np.array_equal(tok.get().view(np.uint32), many["dp4a"].get().view(np.uint32)), (variant, glu)
        if not glu:
            _check_vs_float64(qtype, raw, x_host, many["dp4a"].get())
        one = cp.full((1, width), np.nan, cp.float32)
        qm.matmul_prequantized(w, xq[:1], xd[:1], one, glu=glu, build=build)
        assert np.array_equal(one.get().view(np.uint32), many["dp4a"][:1].get().view(np.uint32)), glu
        for rw in (2, 4) if glu and build == "default" else (1, 2) if build == "default" else ():
            for g in (qm.PIPE, qm.ONE_LOOP):       # mm_q1's one-token kernels of the explore build (the same bits)
                out = cp.full((1, width), np.nan, cp.float32)
                qm.matmul_prequantized(w, xq[:1], xd[:1], out, glu=glu, variant=(1, rw, g), build="explore")
                assert np.array_equal(out.get().view(np.uint32), one.get().view(np.uint32)), (glu, rw, g)
        if not glu:                                # fused bias and residual add, the dp4a and split-K kernels
            for variant in ((1, 2, 1), "sk"):
                out = resid.copy()
                qm.matmul_prequantized(w, xq[:1], xd[:1], out, bias=bias, accumulate=True, variant=variant,
                                       build=build)
                ref = resid.copy()
                qm.matmul_prequantized(w, xq[:1], xd[:1], ref, bias=bias, accumulate=True, variant=(1, 1, 1),
                                       build=build)
                assert np.array_equal(out.get().view(np.uint32), ref.get().view(np.uint32)), variant


@pytest.mark.parametrize("n_out,n_in", [(37, 2048), (2 * 19, 4096), (37, 4352), (6, 1792), (2 * 5, 14336)])
def test_iq3_xxs_group_loop(cp, qm, n_out, n_in):
    """IQ3_XXS's loop over whole groups (qmatmul.cu mm_q_iq3, kernels ..._gw: full groups of 8 blocks at fixed
    offsets, a last group of fewer through TIQ3_XXS::decode; one token by iq3_dot, more by iq3_weights) gives
    mm_q1's / mm_q's bits: every ..._gw kernel (one token: two rows, two GLU row pairs; 2-, 4- and 8-token tiles;
    the explore build's under launch bounds) at 1, its tile, 8 and 16 tokens, against the default dp4a kernels,
    and single tokens against mm_q's own one-token loop (the mmq_one_token build); rows of exactly one group, two,
    two and one block, fewer than 8 blocks, seven groups; with the fused bias and residual add."""
    w, raw = _weight(qm, QType.IQ3_XXS, n_out, n_in, seed=80)
    x_host = _x(16, n_in, seed=81)
    xq, xd = _rounded(cp, qm, QType.IQ3_XXS, x_host)
    groups = qm.IQ3_GROUPS
    for glu in (False, True):
        if glu and n_out % 2:
            continue
        width = n_out // 2 if glu else n_out
        ref = cp.full((16, width), np.nan, cp.float32)
        qm.matmul_prequantized(w, xq, xd, ref, glu=glu, kernel="dp4a", variant=(8, 4, 1))
        ref = ref.get()
        if not glu:
            _check_vs_float64(QType.IQ3_XXS, raw, x_host, ref)
        variants = [(1, 4, groups), (1, 4, groups, 4), (2, 4, groups), (4, 4, groups), (8, 4, groups)] if glu else \
            [(1, 2, groups), (1, 2, groups, 4), (2, 2, groups), (4, 2, groups), (8, 4, groups)]
        builds = [(v, "default") for v in variants] + [(v, "explore") for v in qm.EXPLORE_IQ3_GROUPS_MB[glu]]
        for variant, build in builds:
            for n in sorted({1, variant[0], 8, 16}):
                out = cp.full((n, width), np.nan, cp.float32)
                qm.matmul_prequantized(w, xq[:n], xd[:n], out, glu=glu, variant=variant, build=build)
                assert np.array_equal(out.get().view(np.uint32), ref[:n].view(np.uint32)), (glu, variant, build, n)
        for t in (0, 7, 15):
            for kw in (dict(build="mmq_one_token", variant=qm.dp4a_variant(QType.IQ3_XXS, 1, glu)),
                       dict(variant=(1, 4 if glu else 2, groups))):
                one = cp.full((1, width), np.nan, cp.float32)
                qm.matmul_prequantized(w, xq[t:t + 1], xd[t:t + 1], one, glu=glu, **kw)
                assert np.array_equal(one.get().view(np.uint32), ref[t:t + 1].view(np.uint32)), (glu, t, kw)
    bias = cp.asarray(_x(1, n_out, seed=82)[0])
    resid = cp.asarray(_x(3, n_out, seed=83))
    for n in (1, 3):
        out, want = resid[:n].copy(), resid[:n].copy()
        qm.matmul_prequantized(w, xq[:n], xd[:n], out, bias=bias, accumulate=True, variant=(qm._tile(n), 2, groups))
        qm.matmul_prequantized(w, xq[:n], xd[:n], want, bias=bias, accumulate=True, build="mmq_one_token",
                               variant=(qm._tile(n), 2, 1))
        assert np.array_equal(out.get().view(np.uint32), want.get().view(np.uint32)), n


def test_iq3_xxs_auto_takes_the_group_loop_on_one_wave(cp, qm):
    """`auto` sends an IQ3_XXS launch of one token over 4,096 rows to the group loop (unbounded where its CTAs fit
    one wave, as on the H100 / H200's 132 SMs; else under a minimum of 4 CTAs an SM) and gives the bits of mm_q1's
    loop."""
    n_out, n_in = 4096, 2048
    w, _ = _weight(qm, QType.IQ3_XXS, n_out, n_in, seed=84)
    xq, xd = _rounded(cp, qm, QType.IQ3_XXS, _x(1, n_in, seed=85))
    n_sm = qm.sm_count(w.raw.device.id)
    (_, one_wave), (bound, _) = qm.IQ3_GROUPS_CHOICES[(1, False)]
    rows_a_cta = 2 * qm.IQ3_GROUPS_CTA_WARPS           # two rows a warp, the CTAs the choices count
    expect = (1, 2, qm.IQ3_GROUPS) if n_sm * one_wave * rows_a_cta >= n_out else (1, 2, qm.IQ3_GROUPS, bound)
    assert qm.dp4a_variant(QType.IQ3_XXS, 1, False, n_out, 1, n_sm) == expect
    out, ref = (cp.full((1, n_out), np.nan, cp.float32) for _ in range(2))
    qm.matmul_prequantized(w, xq, xd, out)
    qm.matmul_prequantized(w, xq, xd, ref, variant=(1, 2, 1))
    assert np.array_equal(out.get().view(np.uint32), ref.get().view(np.uint32))
