"""IQ3_XXS, Q4_K, Q5_K and Q6_K repacked for the AVX2 int8 kernel (iq3_int8.py, q4_k_int8.py, q5_k_int8.py,
q6_k_int8.py, nibble_int8.py), against gguf.quants and float64.

Tolerances: the repacking is exact in integers; a dequantized weight is a product of float32 scales
where gguf computes the same value in another order (IQ3_XXS: (d/4) * (2 ls + 1) * value vs
d * (ls + 0.5) * 0.5 * value; Q4_K, Q5_K: the same products), a couple of float32 roundings apart (rtol
2**-22, plus 2**-22 of the block's min term for Q4_K's and Q5_K's subtraction). The kernel's integer sums are
exact; its only error is float32 rounding of the per-block products and their sum (measured ~1e-7
of sum |W| |x|): 1e-5 of that sum catches any wrong code, scale, sign, min or offset term (each
moves results by O(1) of it).
"""
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from strata_lite.kernels.cpu import iq3_int8, nibble_int8, q4_k_int8, q5_k_int8, q6_k_int8
from strata_lite.kernels.cpu.act_quant import round_activations
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.dequant import F16_TABLE
from strata_lite.kernels.cpu.isa import host_has_avx2
from strata_lite.kernels.cpu.repack import GGML, IQ3_I8, Q4K_I8, Q5K_I8, Q6K_I8
from test_dequant import random_rows

needs_avx2 = pytest.mark.skipif(not host_has_avx2(), reason="the int8 kernels need an AVX2 CPU")
RTOL = 1e-5
LAYOUTS = {QType.IQ3_XXS: iq3_int8, QType.Q4_K: q4_k_int8, QType.Q5_K: q5_k_int8, QType.Q6_K: q6_k_int8}
by_layout = pytest.mark.parametrize("qtype", list(LAYOUTS), ids=[t.name for t in LAYOUTS])


def _reference(raw, x, qtype=QType.IQ3_XXS):
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    xr = round_activations(qtype, x).astype(np.float64)      # llama.cpp's Q8_K rounding
    return xr @ w.T, np.abs(xr) @ np.abs(w).T


def test_activation_quantization_is_llama_cpp_q8_k_rounding():
    x = np.random.default_rng(0).standard_normal((3, 768), dtype=np.float32) * 5
    x[1, 256:512] = 0                                             # an all-zero block
    q, d, bsums = nibble_int8.quantize_activations(x)
    q8 = q.astype(np.int32) - 128
    ours = (q8.astype(np.float32) * d[:, :, None]).reshape(x.shape)
    np.testing.assert_array_equal(ours, round_activations(QType.IQ3_XXS, x))
    np.testing.assert_array_equal(bsums, q8.reshape(3, 3, 8, 32).sum(axis=3))


@needs_avx2
@by_layout
@pytest.mark.parametrize("n_out", [1, 2, 3, 4, 5, 9])
def test_int8_kernel_every_row_tail_and_token_count(qtype, n_out):
    """Decode works on groups of 4 rows (a short last group repeats its last row), several tokens on
    chunks of 2..4: every row tail, token counts 1..9 and a prompt-sized 40."""
    mod = LAYOUTS[qtype]
    raw = random_rows(qtype, n_out, 768, seed=n_out)
    raw3 = mod.repack(raw, 768, F16_TABLE).reshape(n_out, 3, mod.BLOCK_BYTES)
    for n_tok in list(range(1, 10)) + [40]:
        x = np.random.default_rng(n_tok).standard_normal((n_tok, 768), dtype=np.float32)
        x[0, :256] = 0                                            # zero block: scale 0, offset term 0
        ref, scale = _reference(raw, x, qtype)
        out = np.full((n_tok, n_out), np.nan, np.float32)
        mod.matvec(raw3, x.reshape(n_tok, 3, 256), out)
        err = np.abs(out - ref)
        assert np.all(err <= RTOL * scale + 1e-30), f"n_tok {n_tok}: max rel err {np.max(err / scale):.3g}"


@needs_avx2
@by_layout
@pytest.mark.parametrize("n_out", [1, 5])
def test_one_token_over_long_rows_takes_one_row_a_call_with_the_same_bits(qtype, n_out):
    """Rows of nibble_int8.ONE_ROW_MIN_BYTES and more (16 blocks: 2,304-3,456 bytes) take one row a call at one
    token: the reference within the tolerance, and the bits a two-token call gives the same token."""
    mod, n_in = LAYOUTS[qtype], 16 * 256
    raw = random_rows(qtype, n_out, n_in, seed=7 + n_out)
    raw3 = mod.repack(raw, n_in, F16_TABLE).reshape(n_out, 16, mod.BLOCK_BYTES)
    assert raw3.shape[1] * raw3.shape[2] >= nibble_int8.ONE_ROW_MIN_BYTES
    x = np.random.default_rng(n_out).standard_normal((2, n_in), dtype=np.float32)
    ref, scale = _reference(raw, x[:1], qtype)
    one = np.full((1, n_out), np.nan, np.float32)
    two = np.full((2, n_out), np.nan, np.float32)
    mod.matvec(raw3, x[:1].reshape(1, 16, 256), one)
    mod.matvec(raw3, x.reshape(2, 16, 256), two)
    assert np.all(np.abs(one - ref) <= RTOL * scale + 1e-30)
    np.testing.assert_array_equal(one[0], two[0])


@needs_avx2
def test_int8_kernel_extreme_values_do_not_saturate():
    """The largest grid levels and scale (31) against activations of +-127: pmaddubsw's int16 pair sums
    stay below 2**15 only because |value| <= 62, so this is the case that would overflow first."""
    raw = random_rows(QType.IQ3_XXS, 4, 256, seed=9).reshape(4, 98)
    raw[:, 2:66] = int(np.argmax(iq3_int8.IQ3XXS_GRID.sum(axis=1)))   # the grid row of largest levels
    raw[:, 66:98] = 0xFF                                               # scale 15 -> 31, sign index 127
    x = np.where(np.arange(256) % 2 == 0, 3.0, -3.0).astype(np.float32)[None, :]
    ref, scale = _reference(raw, x)
    q, _, _ = nibble_int8.quantize_activations(x)
    assert q.min() == 1 and q.max() == 255
    out = np.empty((1, 4), np.float32)
    iq3_int8.matvec(iq3_int8.repack(raw, 256, F16_TABLE).reshape(4, 1, -1), x.reshape(1, 1, 256), out)
    assert np.all(np.abs(out - ref) <= RTOL * scale)


@needs_avx2
def test_q4_k_kernel_extreme_values_do_not_saturate():
    """Codes 15 with scale and min 63 against activations of +-127: the largest pair sums and scaled
    sums the Q4_K layout can produce."""
    raw = random_rows(QType.Q4_K, 4, 512, seed=9).reshape(4, 2, 144)
    raw[:, :, 4:16] = 0xFF                                             # every 6-bit scale and min 63
    raw[:, :, 16:] = 0xFF                                              # every code 15
    raw = raw.reshape(4, 288)
    x = np.where(np.arange(512) % 2 == 0, 3.0, -3.0).astype(np.float32)[None, :]
    x[0, 256:] = np.abs(x[0, 256:])                                    # one block of all-positive activations
    ref, scale = _reference(raw, x, QType.Q4_K)
    out = np.empty((1, 4), np.float32)
    q4_k_int8.matvec(q4_k_int8.repack(raw, 512, F16_TABLE).reshape(4, 2, -1), x.reshape(1, 2, 256), out)
    assert np.all(np.abs(out - ref) <= RTOL * scale)


@needs_avx2
def test_q5_k_kernel_extreme_values_do_not_saturate():
    """Codes 31 (every fifth bit set) with scale and min 63 against activations of +-127: the largest pair
    sums (2 * 255 * 31) and scaled sums the Q5_K layout can produce; then every fifth bit clear."""
    raw = random_rows(QType.Q5_K, 4, 512, seed=9).reshape(4, 2, 176)
    raw[:, :, 4:16] = 0xFF                                             # every 6-bit scale and min 63
    raw[:, :, 16:] = 0xFF                                              # every fifth bit set, every low code 15
    x = np.where(np.arange(512) % 2 == 0, 3.0, -3.0).astype(np.float32)[None, :]
    x[0, 256:] = np.abs(x[0, 256:])                                    # one block of all-positive activations
    for fifth in (0xFF, 0x00):
        raw[:, :, 16:48] = fifth
        flat = raw.reshape(4, 352)
        ref, scale = _reference(flat, x, QType.Q5_K)
        out = np.empty((1, 4), np.float32)
        q5_k_int8.matvec(q5_k_int8.repack(flat, 512, F16_TABLE).reshape(4, 2, -1), x.reshape(1, 2, 256), out)
        assert np.all(np.abs(out - ref) <= RTOL * scale), fifth


@needs_avx2
def test_q5_k_repack_keeps_every_code():
    """The layout's codes with their fifth bits are the file's 5-bit codes, weight by weight, and C is the
    scale-weighted code sum (the kernel's offset term)."""
    from strata_lite.kernels.cpu.dequant import k_scale_min
    raw = random_rows(QType.Q5_K, 3, 512, seed=4)
    src = raw.reshape(-1, 176)
    dst = q5_k_int8.repack(raw, 512, F16_TABLE).reshape(-1, 192)
    for b in range(src.shape[0]):
        ql, qh = src[b, 48:176].astype(np.int32), src[b, 16:48].astype(np.int32)
        want = np.empty(256, np.int32)      # ggml's dequantize_row_q5_K order
        for p in range(4):
            want[64 * p:64 * p + 32] = (ql[32 * p:32 * p + 32] & 15) | (((qh >> (2 * p)) & 1) << 4)
            want[64 * p + 32:64 * p + 64] = (ql[32 * p:32 * p + 32] >> 4) | (((qh >> (2 * p + 1)) & 1) << 4)
        got_lo, got_hi = dst[b, :128].astype(np.int32) & 15, dst[b, :128].astype(np.int32) >> 4
        plane = dst[b, 128:160].astype(np.int32)
        got = np.empty(256, np.int32)
        for p in range(4):
            got[64 * p:64 * p + 32] = got_lo[32 * p:32 * p + 32] | (((plane >> (2 * p)) & 1) << 4)
            got[64 * p + 32:64 * p + 64] = got_hi[32 * p:32 * p + 32] | (((plane >> (2 * p + 1)) & 1) << 4)
        np.testing.assert_array_equal(got, want)
        scales = [k_scale_min(src, b, s) for s in range(8)]
        np.testing.assert_array_equal(dst[b, 160:168], [sc for sc, _ in scales])
        np.testing.assert_array_equal(dst[b, 176:184], [m for _, m in scales])
        c = sum(sc * int(want[32 * s:32 * s + 32].sum()) for s, (sc, _) in enumerate(scales))
        assert dst[b, 172:176].view(np.int32)[0] == c


def test_q6_k_repack_keeps_every_code():
    """The layout's low nibbles with their two high bits are the file's 6-bit codes, weight by weight (ggml's
    dequantize_row_q6_K order), the scales are the file's, and C is the scale-weighted sum of the values q - 32."""
    raw = random_rows(QType.Q6_K, 3, 512, seed=5)
    src = raw.reshape(-1, 210)
    dst = q6_k_int8.repack(raw, 512, F16_TABLE).reshape(-1, 216)
    for b in range(src.shape[0]):
        ql, qh = src[b, 0:128].astype(np.int32), src[b, 128:192].astype(np.int32)
        want = np.empty(256, np.int32)
        for n in range(2):
            l0, l1, h = ql[64 * n:64 * n + 32], ql[64 * n + 32:64 * n + 64], qh[32 * n:32 * n + 32]
            want[128 * n:128 * n + 32] = (l0 & 15) | ((h & 3) << 4)
            want[128 * n + 32:128 * n + 64] = (l1 & 15) | (((h >> 2) & 3) << 4)
            want[128 * n + 64:128 * n + 96] = (l0 >> 4) | (((h >> 4) & 3) << 4)
            want[128 * n + 96:128 * n + 128] = (l1 >> 4) | (((h >> 6) & 3) << 4)
        codes, plane = dst[b, :128].astype(np.int32), dst[b, 128:192].astype(np.int32)
        got = np.empty(256, np.int32)
        for p in range(4):
            bits = plane[32 * (p // 2):32 * (p // 2) + 32] >> (4 * (p % 2))
            got[64 * p:64 * p + 32] = (codes[32 * p:32 * p + 32] & 15) | ((bits & 3) << 4)
            got[64 * p + 32:64 * p + 64] = (codes[32 * p:32 * p + 32] >> 4) | (((bits >> 2) & 3) << 4)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(dst[b, 192:208], src[b, 192:208])
        scales = src[b, 192:208].view(np.int8).astype(np.int64)
        c = int(sum(scales[k] * (want[16 * k:16 * k + 16] - 32).sum() for k in range(16)))
        assert dst[b, 212:216].view(np.int32)[0] == c
        assert dst[b, 208:212].view(np.float32)[0] == np.float32(src[b, 208:210].view(np.float16)[0])


@needs_avx2
def test_q6_k_kernel_extreme_values_do_not_saturate():
    """Values -32 (the largest magnitude) with scales -128 and 127 against activations of +-127."""
    raw = random_rows(QType.Q6_K, 4, 256, seed=9).reshape(4, 210)
    raw[:, 0:192] = 0                                                  # every code 0: value -32
    raw[:, 192:208] = np.array([0x80, 0x7F] * 8, dtype=np.uint8)       # scales -128, 127, ...
    x = np.where(np.arange(256) % 2 == 0, 3.0, -3.0).astype(np.float32)[None, :]
    ref, scale = _reference(raw, x, QType.Q6_K)
    out = np.empty((1, 4), np.float32)
    q6_k_int8.matvec(q6_k_int8.repack(raw, 256, F16_TABLE).reshape(4, 1, -1), x.reshape(1, 1, 256), out)
    assert np.all(np.abs(out - ref) <= RTOL * scale)


@needs_avx2
@by_layout
def test_backend_uploads_in_the_int8_layout_and_fuses_it(qtype, monkeypatch):
    class W:
        def __init__(self, name, raw, n_in):
            self.name, self.qtype, self.n_out, self.n_in, self.raw = name, qtype, raw.shape[0], n_in, raw

    mod, layout = LAYOUTS[qtype], {QType.IQ3_XXS: IQ3_I8, QType.Q4_K: Q4K_I8, QType.Q5_K: Q5K_I8,
                                   QType.Q6_K: Q6K_I8}[qtype]
    a, b = random_rows(qtype, 6, 512, seed=1), random_rows(qtype, 3, 512, seed=2)
    be = CpuBackend()
    wa, wb = be.upload_weight(W("a", a, 512)), be.upload_weight(W("b", b, 512))
    assert wa.layout == layout and wa.qtype == qtype and wa.nbytes == 6 * 2 * mod.BLOCK_BYTES
    fused = be.fuse_rows([wa, wb])
    assert fused.layout == layout and fused.n_out == 9
    # decode, speculative verification, prompt chunks (one int8 kernel for every token count)
    for n_tok in (1, 2, 12, 130):
        x = np.random.default_rng(n_tok).standard_normal((n_tok, 512), dtype=np.float32)
        ref, scale = _reference(np.concatenate([a, b]), x, qtype)
        assert np.all(np.abs(be.qmatmul(fused, x) - ref) <= RTOL * scale)

    monkeypatch.setenv("STRATA_LITE_INT8", "0")        # opt out: the file's layout, the float kernel
    plain = CpuBackend().upload_weight(W("a", a, 512))
    assert plain.layout == GGML and plain.nbytes == a.nbytes


def test_layout_rejects_wrong_row_bytes():
    from strata_lite.kernels.cpu.repack import PackedWeight
    with pytest.raises(ValueError, match="not repacked IQ3_XXS"):
        PackedWeight("w", QType.IQ3_XXS, 2, 512, np.zeros((2, 196), np.uint8), layout=IQ3_I8)
    with pytest.raises(ValueError, match="not repacked Q4_K"):
        PackedWeight("w", QType.Q4_K, 2, 512, np.zeros((2, 288), np.uint8), layout=Q4K_I8)
    with pytest.raises(ValueError, match="not repacked Q5_K"):
        PackedWeight("w", QType.Q5_K, 2, 512, np.zeros((2, 352), np.uint8), layout=Q5K_I8)
    with pytest.raises(ValueError, match="not repacked Q6_K"):
        PackedWeight("w", QType.Q6_K, 2, 512, np.zeros((2, 420), np.uint8), layout=Q6K_I8)
